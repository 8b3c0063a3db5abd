"""Optional dependencies (``specjax._optional``): with the module missing, each feature that
needs it fails with one line naming the extra to install, and pyproject declares each
extra. A missing module is simulated with ``sys.modules[name] = None`` (what makes
``import name`` raise ``ModuleNotFoundError``), restored after each test."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from specjax import _optional
from specjax._optional import MissingExtra

ROOT = Path(__file__).resolve().parents[1]


def _missing(monkeypatch, name: str) -> None:
    monkeypatch.setitem(sys.modules, name, None)
    for mod in [m for m in sys.modules if m.startswith(name + ".")]:
        monkeypatch.setitem(sys.modules, mod, None)


def test_pyproject_declares_each_extra():
    """Each extra ``_optional`` names exists and installs its module; ``dev`` has them all."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for module, extra in _optional.EXTRAS.items():
        assert extra in extras, f"pyproject.toml has no extra {extra!r}"
        assert any(r.split("=")[0].split(">")[0].split("<")[0].strip() == module
                   for r in extras[extra]), extras[extra]
        assert any(r.startswith(module) for r in extras["dev"]), (module, extras["dev"])


def test_hsd_lp_solver_without_scipy(monkeypatch):
    from specjax.hsd import hierarchy as H

    costs, alpha = [0.1, 0.3, 1.0], np.array([[1, .8, .6], [.8, 1, .7], [.6, .7, 1]])
    _missing(monkeypatch, "scipy")
    with pytest.raises(MissingExtra) as e:
        H.optimal_hierarchy(costs, alpha, 3, method="lp")
    assert str(e.value) == ("the HSD LP solver (method='lp') needs scipy, which is not "
                            "installed: pip install 'specjax[scipy]'")
    assert H.optimal_hierarchy(costs, alpha, 3, method="dp")[1][-1] == 2  # dp needs none


def test_published_bin_head_without_torch(monkeypatch, tmp_path):
    from specjax.heads import CheckpointError, published

    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    if "pytorch_model.bin" not in published.WEIGHT_FILES:
        pytest.skip(f"no .bin name among {published.WEIGHT_FILES}")
    _missing(monkeypatch, "torch")
    with pytest.raises(CheckpointError) as e:
        published._read_bin(tmp_path / "pytorch_model.bin")
    msg = str(e.value)
    assert "\n" not in msg and "pip install 'specjax[torch]'" in msg, msg
    assert msg.startswith(f"{tmp_path / 'pytorch_model.bin'} is a PyTorch file"), msg


def test_random_t5_checkpoint_without_torch(monkeypatch, tmp_path):
    from specjax.models import t5_random

    _missing(monkeypatch, "torch")
    with pytest.raises(MissingExtra, match=r"^writing a random T5 checkpoint needs torch, "
                                           r"which is not installed: pip install "
                                           r"'specjax\[torch\]'$"):
        t5_random.save_random(tmp_path, "t5-small")


def test_cli_bench_hf_peer_without_torch(monkeypatch, capsys):
    """``specjax bench`` with a transformers peer says what to install before it loads a
    model: one line on stderr, exit status 1."""
    from specjax import cli

    _missing(monkeypatch, "torch")
    code = cli.main(["bench", "--model", "no-such-model", "--methods", "ar,hf,hf-pld",
                     "--random-prompts", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert err == ("specjax: error: benchmarking hf, hf-pld (transformers) needs torch, "
                   "which is not installed: pip install 'specjax[torch]'\n")


def test_require_does_not_mask_errors_of_an_installed_package():
    with pytest.raises(ModuleNotFoundError, match="scipy.no_such_submodule"):
        _optional.require("scipy.no_such_submodule", "x")
