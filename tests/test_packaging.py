"""A regular (non-editable) install carries the whole library: every module of ``specjax/``,
``models/`` (as ``specjax.models``) and ``train/`` (as ``specjax.train``), the packaged
prompts and the shipped heads, and the ``specjax`` command runs from it.

The wheel is built from a copy of the sources (an in-tree build would leave ``build/`` in
the working tree, and a stale ``build/lib`` can put deleted modules back into a wheel),
installed with ``pip --target`` and imported by ``python -S`` with only the install and the
venv's site-packages on the path: no ``.pth`` file (the editable install's finder) and no
source tree can stand in for a missing file."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = {"specjax": ROOT / "specjax", "specjax.models": ROOT / "models",
         "specjax.train": ROOT / "train"}
_JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def _source_files() -> dict[str, Path]:
    """Every file the wheel must hold, by its path inside the wheel: the modules of the
    three trees and the package data (``specjax/data``, ``specjax/heads``)."""
    out = {}
    for pkg, root in TREES.items():
        base = pkg.replace(".", "/")
        for f in root.rglob("*"):
            rel = f.relative_to(root)
            if not f.is_file() or "__pycache__" in rel.parts or f.suffix == ".pyc":
                continue
            if f.suffix == ".py" or (pkg == "specjax" and rel.parts[0] in ("data", "heads")):
                out[f"{base}/{rel.as_posix()}"] = f
    return out


def _packages_in_trees() -> set[str]:
    """Every directory of the three trees with an ``__init__.py``, as a package name."""
    out = set()
    for pkg, root in TREES.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            out.add(".".join((pkg, *rel)))
    return out


def test_pyproject_lists_every_package():
    """pyproject's package list (setuptools cannot discover ``models/`` under another
    name) names every package directory of the trees, and nothing else."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    missing, extra = _packages_in_trees() - listed, listed - _packages_in_trees()
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    assert not extra, f"listed in pyproject.toml but not a package directory: {sorted(extra)}"
    assert cfg["package-dir"] == {"specjax": "specjax", "specjax.models": "models",
                                  "specjax.train": "train"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """``(wheel, target)``: the wheel built from a copy of the sources, and the directory
    ``pip install --target`` put it in."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("specjax", "models", "train"):
        shutil.copytree(ROOT / name, src / name, ignore=_JUNK)
    dist, target = tmp / "dist", tmp / "target"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    out = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (wheel,) = dist.glob("specjax-*.whl")
    out = subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", "--target",
                          str(target), str(wheel)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return wheel, target


def _isolated(target: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -S args`` seeing only ``target`` and the venv's site-packages."""
    paths = dict.fromkeys([str(target), sysconfig.get_paths()["purelib"],
                           sysconfig.get_paths()["platlib"]])
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PYTHONPATH": ":".join(paths),
           "SPECJAX_COMPILATION_CACHE": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_wheel_holds_every_module_and_the_data(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    want = _source_files()
    missing = sorted(set(want) - names)
    assert not missing, f"not in the wheel: {missing}"
    assert "specjax/data/prompts.jsonl" in names
    heads = {n.split("/")[2] for n in names if n.startswith("specjax/heads/")}
    assert {"smollm2-135m-eagle", "smollm2-135m-exits", "gemma3-270m-eagle"} <= heads
    for n in (n for n in want if n.startswith("specjax/heads/")):
        with zipfile.ZipFile(wheel) as z:
            assert z.getinfo(n).file_size == want[n].stat().st_size, n


_IMPORT_ALL = """
import importlib, json, pkgutil, sys
import specjax
failed, seen = {}, []
def onerror(name):
    failed[name] = repr(sys.exc_info()[1])
for m in pkgutil.walk_packages(specjax.__path__, "specjax.", onerror=onerror):
    try:
        mod = importlib.import_module(m.name)
        seen.append([m.name, mod.__file__])
    except BaseException as e:
        failed[m.name] = f"{type(e).__name__}: {e}"
print(json.dumps({"file": specjax.__file__, "seen": seen, "failed": failed,
                  "path": sys.path}))
"""


def test_every_module_imports_from_the_install(installed, tmp_path):
    _, target = installed
    out = _isolated(target, ["-c", _IMPORT_ALL], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    import json

    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["failed"] == {}, res["failed"]
    assert Path(res["file"]).is_relative_to(target), res["file"]
    assert all(Path(f).is_relative_to(target) for _, f in res["seen"]), res["seen"]
    names = {n for n, _ in res["seen"]}
    expected = {p.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                for p in _source_files() if p.endswith(".py")}
    assert names == expected - {"specjax"}, sorted(expected ^ (names | {"specjax"}))


def test_console_script_runs_from_the_install(installed, tmp_path):
    """The ``specjax`` script pip wrote (entry point ``specjax.cli:main``) prints its usage
    and exits 0."""
    _, target = installed
    script = target / "bin" / "specjax"
    assert script.is_file()
    out = _isolated(target, [str(script), "--help"], tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith("usage: specjax"), out.stdout[:500]
    for cmd in ("generate", "bench", "tune", "train"):
        assert cmd in out.stdout
