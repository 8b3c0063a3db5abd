"""How the tests run a notebook headless: its test-size parameters (``SMALL``), the results
each one establishes (``CHECKS``), and ``execute``, which runs the code cells top to bottom
in one namespace (IPython magics and shell escapes made no-ops, ``SMALL`` applied right after
the parameters cell). Used by tests/test_notebooks.py and, for the notebook that needs 8
simulated devices, tests/test_sharding.py."""

import json
import re
import warnings
from pathlib import Path

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


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def headless(src: str) -> str:
    """The cell with IPython magic and shell lines (``%pip``, ``!ls``) made no-ops."""
    return _MAGIC.sub(r"\1pass  # IPython magic: skipped headless", src)


def is_parameters(cell: dict) -> bool:
    return "parameters" in cell.get("metadata", {}).get("tags", [])




def execute(path: Path) -> dict:
    """Runs ``path``'s code cells headless with ``SMALL[path.name]`` applied; returns the
    namespace after the last cell."""
    small = SMALL.get(path.name, {})
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "FigureCanvasAgg is non-interactive")
        for i, cell in enumerate(c for c in cells(path) if c["cell_type"] == "code"):
            exec(compile(headless(source(cell)), f"{path.name}[cell {i}]", "exec"), ns)  # noqa: S102
            if is_parameters(cell):
                unknown = set(small) - set(ns)
                assert not unknown, f"{path.name}: no parameters {sorted(unknown)}"
                ns.update(small)
    return ns


def check(path: Path, ns: dict) -> None:
    """Asserts each of ``CHECKS[path.name]`` over the notebook's final namespace."""
    for expr in CHECKS.get(path.name, []):
        assert eval(expr, ns), f"{path.name}: {expr}"  # noqa: S307
