"""Every Python block of the README runs as written, in order, in one namespace (as a reader
pastes them into one session), on real SmolLM2-135M weights and 8 simulated CPU devices
(the sharding block asks for 6). Blocks whose first line says ``# sketch`` are pseudo-code
and are only checked to be marked; the others must run, and the research-code example's
tokens must equal ``speculative_generate``'s."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import re, sys, traceback
from pathlib import Path
blocks = re.findall(r"```python\n(.*?)```", Path(sys.argv[1]).read_text(), re.S)
ns = {"__name__": "__readme__"}
for i, code in enumerate(blocks):
    if code.startswith("# sketch"):
        print(f"SKETCH {i}", flush=True)
        continue
    try:
        exec(compile(code, f"README.md python block {i}", "exec"), ns)
    except Exception:
        traceback.print_exc()
        print(f"FAILED {i}", flush=True)
        sys.exit(1)
    print(f"RAN {i}", flush=True)
import specjax
ref = specjax.speculative_generate(ns["lm"].model, ns["lm"].params,
                                   specjax.NGramDrafter(depth=4), None, [ns["ids"]],
                                   max_new_tokens=64)
print("SCAN_EQUAL", ns["scan_tokens"] == ref.to_lists()[0], flush=True)
"""


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_python_blocks_run(tmp_path):
    blocks = _blocks()
    sketches = [i for i, b in enumerate(blocks) if b.startswith("# sketch")]
    assert len(blocks) - len(sketches) >= 6, "the README lost its runnable examples"
    # the research-code block's result, kept before later blocks rebind ``out``
    readme = (ROOT / "README.md").read_text().replace(
        "out, emitted = my_decode((lm.params, None), x)",
        "out, emitted = my_decode((lm.params, None), x); scan_tokens = out.to_lists()[0]")
    assert "scan_tokens" in readme, "the research-code example changed: update this test"
    (tmp_path / "README.md").write_text(readme)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "README.md")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    ran = [int(m) for m in re.findall(r"^RAN (\d+)$", proc.stdout, re.M)]
    assert ran == [i for i in range(len(blocks)) if i not in sketches], out[-2000:]
    assert "SCAN_EQUAL True" in proc.stdout, out[-2000:]
