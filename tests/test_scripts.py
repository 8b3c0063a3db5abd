"""Every script in ``scripts/`` (the user's tools) and ``benchmarks/`` (what regenerates the
figures in docs/results/) imports as a module (its imports resolve, nothing runs at
import time but definitions), so a renamed module cannot leave a script stale unnoticed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])

# Imports each script by path under a module name other than "__main__" (so its main
# block does not run), in one fresh interpreter isolated from the test session (scripts
# may set environment variables or matplotlib backends at import), and prints the
# failures as {script: error}.
_IMPORT_ALL = """
import importlib.util, json, sys, traceback
failed = {}
for path in sys.argv[1:]:
    name = "script_" + path.rsplit("/", 1)[-1][:-3]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        failed[path.rsplit("/", 1)[-1]] = traceback.format_exc(limit=3)
print(json.dumps(failed))
"""


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10, SCRIPTS
    tools = {p.name for p in (ROOT / "scripts").iterdir()}
    assert {"env.sh", "demo.sh", "test.sh", "device_check.sh", "device_check.py"} <= tools


def test_every_script_guards_its_work_under_main():
    unguarded = [p.name for p in SCRIPTS
                 if 'if __name__ == "__main__":' not in p.read_text()]
    assert unguarded == [], f"scripts that run on import: {unguarded}"


def test_every_script_imports():
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *map(str, SCRIPTS)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert failed == {}, "scripts that do not import:\n" + "\n".join(
        f"--- {name}\n{err}" for name, err in failed.items())
