"""Every notebook runs headless, top to bottom, in one namespace."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, smollm, monkeypatch):
    monkeypatch.setattr("specjax.models.load", lambda *a, **k: smollm)  # reuse loaded weights
    nb = json.loads(path.read_text())
    ns: dict = {}
    for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
        src = "".join(cell["source"])
        exec(compile(src, f"{path.name}[cell {i}]", "exec"), ns)  # noqa: S102
    assert "out" in ns
