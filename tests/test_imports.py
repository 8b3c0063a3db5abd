"""The library's imports run one way: each layer imports only the layers before it, at
module level and inside functions alike (read from the source, nothing imported).

    base (sharding, distributed, private helpers) -> models -> core -> drafters -> hsd
    -> heads -> methods, divergence -> the package's API (specjax/__init__) -> bench, demo, train
    -> commands -> cli
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [("_atomic", "_cache", "_compile", "_errors", "_optional", "_timing", "_xla_flags",
           "jax_setup",
           "sharding", "distributed", "hlo"),
          ("models",), ("core",), ("drafters",), ("hsd",), ("heads",),
          ("methods", "divergence"), ("__init__",), ("bench", "demo", "train"), ("commands",),
          ("cli",)]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _part(module: str) -> str:
    """The layer a ``specjax...`` module belongs to (``__init__``: the package's API)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else "__init__"


def _sources():
    """``(file, its layer)`` for every module of the package (``models/`` and ``train/``
    install as ``specjax.models`` and ``specjax.train``)."""
    for f in sorted((ROOT / "specjax").rglob("*.py")):
        rel = f.relative_to(ROOT / "specjax").with_suffix("").parts
        yield f, "__init__" if rel == ("__init__",) else rel[0]
    for pkg in ("models", "train"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            yield f, pkg


def _imports(f: Path):
    """Every absolute ``specjax`` module ``f`` imports (``from specjax import x``: ``x``)."""
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = ([f"specjax.{a.name}" for a in node.names] if node.module == "specjax"
                     else [node.module])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "specjax" or name.startswith("specjax."):
                yield node.lineno, name


def test_every_module_has_a_layer():
    layers = {layer for _, layer in _sources()}
    assert layers <= set(RANK), f"modules outside the layering: {layers - set(RANK)}"


def test_imports_run_one_way():
    wrong = [f"{f.relative_to(ROOT)}:{line}: {layer} imports {name}"
             for f, layer in _sources() for line, name in _imports(f)
             if RANK[_part(name)] > RANK[layer]]
    assert wrong == [], "\n".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def f():\n    from specjax.drafters.base import Context\n")
    assert [RANK[_part(n)] > RANK["core"] for _, n in _imports(f)] == [True]
    f.write_text("from specjax.heads.published import load\n")
    assert [RANK[_part(n)] > RANK["drafters"] for _, n in _imports(f)] == [True]


def test_the_old_module_names_are_gone():
    """The re-export shims of earlier releases are removed (CHANGELOG): ``specjax.export``,
    ``specjax.drafters.published`` and ``specjax.device_check``."""
    import importlib.util

    for name in ("specjax.export", "specjax.drafters.published", "specjax.device_check"):
        assert importlib.util.find_spec(name) is None, name


def test_no_test_file_imports_another():
    """Shared test code lives in helper modules (tests/toys.py, tests/laws.py,
    tests/published.py, tests/notebook_run.py), never in another test file."""
    wrong = []
    for f in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                    else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            wrong += [f"{f.name}:{node.lineno}: {m}" for m in mods
                      if m.split(".")[0].startswith("test_")]
    assert wrong == [], "\n".join(wrong)


def test_every_slow_test_named_in_conftest_exists():
    """tests/conftest.py's SLOW_TESTS names tests by file and function: a renamed test
    would silently join the fast tier."""
    import conftest

    defined = {f"{f.name}::{n.name}" for f in (ROOT / "tests").glob("test_*.py")
               for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.FunctionDef)}
    missing = sorted(conftest._SLOW_NAMES - defined)
    assert missing == [], missing


def test_sharding_knows_no_family():
    """``specjax/sharding.py`` (the lowest layer) names no family's parameters: each
    family's config declares them (``partitioning``: logical axes and fused weights)."""
    from specjax import sharding
    from specjax.models.gemma import GemmaConfig
    from specjax.models.llama import LlamaConfig
    from specjax.models.t5 import T5Config
    from toys import GEMMA, LLAMA

    t5 = T5Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_encoder_layers=1, num_heads=4, head_dim=8)
    names = set()
    for cfg in (LLAMA, GEMMA, t5):
        part = sharding.partitioning(cfg)
        names |= set(part.axes) | {n for f, (parts, _) in part.fused(cfg).items()
                                   for n in (f, *parts)}
    assert {"qkv", "gate_up", "cross_kv", "wi", "wo"} <= names
    assert all(c.partitioning is not sharding.REPLICATED
               for c in (LlamaConfig, GemmaConfig, T5Config))
    tree = ast.parse((ROOT / "specjax" / "sharding.py").read_text())
    consts = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
              and isinstance(n.value, str)}
    assert not consts & names, f"specjax/sharding.py names {sorted(consts & names)}"
