"""Every script in ``scripts/`` (the user's tools) and ``benchmarks/`` (what regenerates the
figures in docs/results/) imports as a module (its imports resolve, nothing runs at
import time but definitions), so a renamed module cannot leave a script stale unnoticed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

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


def _script(name: str):
    """``scripts/NAME.py`` imported as a module (its main block does not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{name}",
                                                  ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_eagle_context_reports_a_tie_between_sibling_leaves_apart():
    """``scripts/check_eagle_context.py``: two sibling leaves whose logits tie exactly in
    float32 (hence their path values too) at the edge of the nodes EAGLE's tree keeps make
    the kept tree a matter of tie-breaking; a tree differing there is ``tie_broken`` (its
    own count and line), not ``differ`` (which fails the check). The same tie below the
    kept nodes' values changes no tree and is not named; without a tie a difference is
    real."""
    m = _script("check_eagle_context")
    f32 = lambda rows: np.asarray(rows, np.float32)  # noqa: E731
    root = f32([[4.0, 2.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]])
    step1 = f32([[0.0, 1.3, 3.0, -1.0, -2.0, -3.0, -4.0, -5.0],
                 [2.1, 0.0, -1.0, 0.7, -2.0, -3.0, -4.0, -5.0]])
    tied = f32([[3.0, 3.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0],  # node 0's two children tie
                [1.0, 2.7, -0.4, -1.0, -2.0, -3.0, -4.0, -5.0]])
    calls, top_k = [root, step1, tied], 2
    named = {n: m.selection_ties(calls, top_k, n) for n in range(1, 10)}
    edge = [n for n, ties in named.items() if ties]
    assert len(edge) == 1, named  # only where the kept nodes end between the two leaves
    assert "the tree's kept nodes" in named[edge[0]][0], named
    a, b = named[edge[0]][0].rsplit("(", 1)[1].rstrip(")").split(" and ")
    assert a == b  # an exact tie, gap 0
    assert m.classify_tree(False, named[edge[0]]) == "tie_broken"
    assert m.classify_tree(True, named[edge[0]]) == "equal"
    apart = [calls[0], calls[1], f32([[3.0, 2.5, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0],
                                      calls[2][1]])]
    assert all(m.selection_ties(apart, top_k, n) == [] for n in range(1, 10))
    assert m.classify_tree(False, m.selection_ties(apart, top_k, edge[0])) == "differ"
    assert m.TREE_KINDS == ("equal", "tie_broken", "differ")
