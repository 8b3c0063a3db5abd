"""Every notebook runs headless, top to bottom, in one namespace, at small settings.

A notebook is what a researcher opens in Colab: a markdown title, the install cell
(IPython magics such as ``%pip install``), a cell tagged ``parameters`` holding the size
knobs at their real values, then the walkthrough, ending with explicit ``assert``s.

Here each code cell is executed in-process, with lines that are IPython magics or shell
escapes (``%``, ``!``) skipped; right after the parameters cell, the values in ``SMALL``
replace the notebook's own, so the test runs small while the notebook keeps its real
settings. ``specjax.models.load`` returns the session's SmolLM2-135M (``smollm``), loaded
once. After the last cell, ``CHECKS`` asserts each notebook's key result by name.
A notebook about weights this machine cannot download (``STANDINS``: 07_published_heads,
a target and its EAGLE-3 head from the hub) runs instead on random stand-ins the test
writes first in the same layouts; it loads no real weights, so it is not marked slow.
The runner, ``SMALL``, ``CHECKS`` and ``STANDINS`` live in tests/notebook_run.py.
"""

import re
from pathlib import Path

import pytest

from notebook_run import (CHECKS, ELSEWHERE, NOTEBOOKS, SMALL, STANDINS, cells, check,
                          execute, is_parameters, source)


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_layout(path):
    """Title first, then the install cell; one parameters cell if the test overrides it;
    a final code cell that asserts; outputs cleared; every notebook checked by name."""
    cs = cells(path)
    assert cs[0]["cell_type"] == "markdown" and source(cs[0]).lstrip().startswith("# "), \
        f"{path.name}: the first cell must be a markdown title"
    code = [c for c in cs if c["cell_type"] == "code"]
    assert re.search(r"^%pip install", source(code[0]), re.M), \
        f"{path.name}: the first code cell must install specjax (%pip install ...)"
    params = [c for c in code if is_parameters(c)]
    if SMALL.get(path.name):
        assert len(params) == 1, f"{path.name}: needs one code cell tagged 'parameters'"
        names = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*=", source(params[0]), re.M))
        missing = set(SMALL[path.name]) - names
        assert not missing, f"{path.name}: the parameters cell does not set {sorted(missing)}"
    assert re.search(r"^assert ", source(code[-1]), re.M), \
        f"{path.name}: the last code cell must state the notebook's checks as asserts"
    assert all(not c.get("outputs") for c in code), f"{path.name}: commit it with outputs cleared"
    assert CHECKS.get(path.name), f"{path.name}: add its key results to CHECKS in tests/notebook_run.py"


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS
                                  if p.name not in ELSEWHERE and p.name not in STANDINS],
                         ids=lambda p: p.name)
def test_notebook_executes(path: Path, request, monkeypatch):
    text = "".join(source(c) for c in cells(path) if c["cell_type"] == "code")
    if re.search(r"\bload\(", text):  # reuse the session's loaded weights
        smollm = request.getfixturevalue("smollm")
        monkeypatch.setattr("specjax.models.load", lambda *a, **k: smollm)
    check(path, execute(path))


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name in STANDINS],
                         ids=lambda p: p.name)
def test_notebook_executes_on_standins(path: Path, tmp_path):
    """The notebook, its downloads replaced by random stand-ins in the same layouts (written
    under ``tmp_path`` first): ``specjax.models.load`` reads them as it would the real
    directories."""
    check(path, execute(path, STANDINS[path.name](tmp_path)))
