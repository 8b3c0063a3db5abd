"""The documentation's Python blocks run as written: those of README.md, then those of every
Markdown file under docs/ that has any, each file in order and in its own fresh namespace
(as a reader pastes one page into one session), all in one child process (so later files'
compiles are cache hits, and a model an earlier page loaded with the same arguments is not
loaded again), on real SmolLM2-135M weights and 8 simulated CPU
devices (the sharding block asks for 6). Blocks whose first line says ``# sketch`` are
pseudo-code and are only checked to be marked; the others must run, so every page is
self-contained, and the research-code example's tokens must equal
``speculative_generate``'s wherever that example lives. Also: README.md stays an entry page
(at most 200 lines, the two set-up commands), and every relative Markdown link resolves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
# the research-code example: its result is kept before later blocks rebind ``out``
SCAN_LINE = "out, emitted = my_decode((lm.params, None), x)"
SCAN_KEEP = SCAN_LINE + "; scan_tokens = out.to_lists()[0]"

_CHILD = r"""
import re, sys, traceback
from pathlib import Path
import specjax.models
_load, _loaded = specjax.models.load, {}
def _load_once(*a, **k):  # a page loading what an earlier page loaded gets that object
    key = (a, tuple(sorted(k.items())))
    if key not in _loaded:
        _loaded[key] = _load(*a, **k)
    return _loaded[key]
specjax.models.load = _load_once
for label, path in zip(sys.argv[1::2], sys.argv[2::2]):
    blocks = re.findall(r"```python\n(.*?)```", Path(path).read_text(), re.S)
    ns = {"__name__": "__readme__"}
    for i, code in enumerate(blocks):
        if code.startswith("# sketch"):
            print(f"SKETCH {label} {i}", flush=True)
            continue
        try:
            exec(compile(code, f"{label} python block {i}", "exec"), ns)
        except Exception:
            traceback.print_exc()
            print(f"FAILED {label} {i}", flush=True)
            sys.exit(1)
        print(f"RAN {label} {i}", flush=True)
    if "scan_tokens" in ns:
        import specjax
        ref = specjax.speculative_generate(ns["lm"].model, ns["lm"].params,
                                           specjax.NGramDrafter(depth=4), None, [ns["ids"]],
                                           max_new_tokens=64)
        print(f"SCAN_EQUAL {label}", ns["scan_tokens"] == ref.to_lists()[0], flush=True)
"""


def _pages() -> list[Path]:
    """README.md, then every Markdown file under docs/, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_is_an_entry_page():
    text = (ROOT / "README.md").read_text()
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/"
    for cmd in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert cmd in text, f"README.md lost its set-up command {cmd!r}"
    assert any(not b.startswith("# sketch") for b in _blocks(text)), \
        "README.md lost its runnable quickstart"


def test_readme_python_blocks_run(tmp_path):
    pages = []  # (label, original text, blocks) of each page with a runnable block
    for path in _pages():
        text = path.read_text()
        blocks = _blocks(text)
        if any(not b.startswith("# sketch") for b in blocks):
            pages.append((str(path.relative_to(ROOT)), text, blocks))
    runnable = sum(not b.startswith("# sketch") for _, _, bs in pages for b in bs)
    assert runnable >= 6, "README and docs lost their runnable examples"
    scan_pages = [label for label, text, _ in pages if SCAN_LINE in text]
    assert len(scan_pages) == 1, \
        f"the research-code example ({SCAN_LINE!r}) is in {scan_pages}: update this test"

    args = []
    for k, (label, text, _) in enumerate(pages):
        copy = tmp_path / f"{k}.md"
        copy.write_text(text.replace(SCAN_LINE, SCAN_KEEP))
        args += [label, str(copy)]
    flags = os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for label, _, blocks in pages:
        ran = [int(m) for m in re.findall(rf"^RAN {re.escape(label)} (\d+)$", proc.stdout,
                                          re.M)]
        want = [i for i, b in enumerate(blocks) if not b.startswith("# sketch")]
        assert ran == want, f"{label}: ran {ran}, expected {want}\n" + out[-2000:]
    assert f"SCAN_EQUAL {scan_pages[0]} True" in proc.stdout, out[-2000:]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: link and code markup dropped, lower case,
    punctuation other than ``-`` and ``_`` removed, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (a repeated heading gets ``-1``, ``-2``, ...)."""
    anchors, counts = set(), {}
    for m in re.finditer(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M):
        slug = _slug(m.group(1))
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_relative_links_resolve():
    """Every relative link ``](path)`` or ``](path#anchor)`` of README.md, CHANGELOG.md and
    the Markdown under docs/ names a file or folder that exists, and an anchor (``#anchor``
    alone: into the same page) names a heading of that Markdown file; web links are not
    checked."""
    bad = []
    for page in [*_pages(), ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)
