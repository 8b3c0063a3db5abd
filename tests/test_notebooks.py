"""Every notebook runs headless, top to bottom, in one namespace, at small settings.

A notebook is what a researcher opens in Colab: a markdown title, the install cell
(IPython magics such as ``%pip install``), a cell tagged ``parameters`` holding the size
knobs at their real values, then the walkthrough, ending with explicit ``assert``s.

Here each code cell is executed in-process, with lines that are IPython magics or shell
escapes (``%``, ``!``) skipped; right after the parameters cell, the values in ``SMALL``
replace the notebook's own, so the test runs small while the notebook keeps its real
settings. ``specjax.models.load`` returns the session's SmolLM2-135M (``smollm``), loaded
once. After the last cell, ``CHECKS`` asserts each notebook's key result by name.
"""

import json
import re
import warnings
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# Notebooks that need a process of their own, and the test that executes them there.
ELSEWHERE = {"06_sharding.ipynb": "tests/test_sharding.py (8 simulated CPU devices)"}

# Test-size overrides of each notebook's parameters cell (its defaults are the real run).
# Widths, capacities and output sizes are chosen so that notebooks share compiled code:
# one prompt of under 64 tokens and 16 new tokens decode in a cache of 128 entries, as in
# 01_quickstart, so `generate` compiles once for the whole module.
SMALL: dict[str, dict] = {
    "01_quickstart.ipynb": {"MAX_NEW_TOKENS": 16, "CATEGORIES": ("summarization",)},
    "02_verify_your_logits.ipynb": {"ROWS": 20_000},
    "03_eagle2.ipynb": {"N_TRAIN_PROMPTS": 2, "DISTILL_NEW_TOKENS": 16, "TRAIN_STEPS": 3,
                        "BATCH_TOKENS": 128, "VAL_EXAMPLES": 0, "N_PROMPTS": 1,
                        "MAX_NEW_TOKENS": 16},
    "04_redrafter.ipynb": {"N_TRAIN_PROMPTS": 2, "DISTILL_NEW_TOKENS": 16, "TRAIN_STEPS": 3,
                           "BATCH_TOKENS": 128, "DRAFT_VOCAB": 1024, "BEAMS": 2, "BEAM_LEN": 2,
                           "VERIFY_WIDTHS": (5,), "N_PROMPTS": 1, "MAX_NEW_TOKENS": 16},
    "05_hsd.ipynb": {"N_CALIB_PROMPTS": 1, "CALIB_NEW_TOKENS": 8, "EXIT_LAYERS": (4,),
                     "WIDTHS": (1,), "REPEATS": 1, "T_MAX": 4, "MAX_LEVELS": 3,
                     "N_PROMPTS": 1, "MAX_NEW_TOKENS": 16, "N_COMPARE": 1},
    "06_sharding.ipynb": {"N_PROMPTS": 2, "MAX_NEW_TOKENS": 16},
}

# What each notebook establishes, as expressions over its namespace after the last cell.
CHECKS: dict[str, list[str]] = {
    "01_quickstart.ipynb": ["len(out.to_lists()[0]) >= 1", "same_key_same_sample is True",
                            "greedy_equal is True", "tau[EAGLE] > 1.0",
                            "set(speedup) == {'ar', f'sd-ngram:{NGRAM_DEPTH}', EAGLE}"],
    "02_verify_your_logits.ipynb": ["greedy_exact is True", "p_value > 1e-3",
                                    "p_wrong_q < 1e-6", "p_typical < 1e-6"],
    "03_eagle2.ipynb": ["greedy_equal is True", "loss_decreased",
                        "len(train_log) == TRAIN_STEPS", "shipped_tau > 1.0"],
    "04_redrafter.ipynb": ["greedy_equal is True", "loss_decreased",
                           "len(train_log) == TRAIN_STEPS", "1.0 <= tau <= BEAM_LEN + 1"],
    "05_hsd.ipynb": ["greedy_equal is True", "len(sigma) >= 2",
                     "all(r['measured_ms'] > 0 for r in compare)"],
    "06_sharding.ipynb": ["greedy_equal is True"],
}

_MAGIC = re.compile(r"^(\s*)[%!].*$", re.M)


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def _headless(src: str) -> str:
    """The cell with IPython magic and shell lines (``%pip``, ``!ls``) made no-ops."""
    return _MAGIC.sub(r"\1pass  # IPython magic: skipped headless", src)


def _is_parameters(cell: dict) -> bool:
    return "parameters" in cell.get("metadata", {}).get("tags", [])


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_layout(path):
    """Title first, then the install cell; one parameters cell if the test overrides it;
    a final code cell that asserts; outputs cleared; every notebook checked by name."""
    cells = _cells(path)
    assert cells[0]["cell_type"] == "markdown" and _source(cells[0]).lstrip().startswith("# "), \
        f"{path.name}: the first cell must be a markdown title"
    code = [c for c in cells if c["cell_type"] == "code"]
    assert re.search(r"^%pip install", _source(code[0]), re.M), \
        f"{path.name}: the first code cell must install specjax (%pip install ...)"
    params = [c for c in code if _is_parameters(c)]
    if SMALL.get(path.name):
        assert len(params) == 1, f"{path.name}: needs one code cell tagged 'parameters'"
        names = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*=", _source(params[0]), re.M))
        missing = set(SMALL[path.name]) - names
        assert not missing, f"{path.name}: the parameters cell does not set {sorted(missing)}"
    assert re.search(r"^assert ", _source(code[-1]), re.M), \
        f"{path.name}: the last code cell must state the notebook's checks as asserts"
    assert all(not c.get("outputs") for c in code), f"{path.name}: commit it with outputs cleared"
    assert CHECKS.get(path.name), f"{path.name}: add its key results to CHECKS in this file"


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name not in ELSEWHERE],
                         ids=lambda p: p.name)
def test_notebook_executes(path, request, monkeypatch):
    cells = _cells(path)
    text = "".join(_source(c) for c in cells if c["cell_type"] == "code")
    if re.search(r"\bload\(", text):  # reuse the session's loaded weights
        smollm = request.getfixturevalue("smollm")
        monkeypatch.setattr("specjax.models.load", lambda *a, **k: smollm)
    small = SMALL.get(path.name, {})
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "FigureCanvasAgg is non-interactive")
        for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
            src = _headless(_source(cell))
            exec(compile(src, f"{path.name}[cell {i}]", "exec"), ns)  # noqa: S102
            if _is_parameters(cell):
                unknown = set(small) - set(ns)
                assert not unknown, f"{path.name}: no parameters {sorted(unknown)}"
                ns.update(small)
    for expr in CHECKS.get(path.name, []):
        assert eval(expr, ns), f"{path.name}: {expr}"  # noqa: S307
