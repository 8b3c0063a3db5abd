"""Importing specjax leaves JAX alone: every module of the package imports without changing
``os.environ`` or any ``jax.config`` value, and ``specjax.setup_jax()`` is what sets the
CLI's XLA:CPU flag and compilation cache (each case in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, os, pkgutil, importlib, sys
import jax
env, conf = dict(os.environ), {k: repr(v) for k, v in jax.config.values.items()}
import specjax, specjax.models, specjax.train
names = [m.name for pkg in (specjax, specjax.models, specjax.train)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
env_diff = sorted(k for k in env.keys() | os.environ.keys() if env.get(k) != os.environ.get(k))
conf_now = {k: repr(v) for k, v in jax.config.values.items()}
conf_diff = sorted(k for k in conf.keys() | conf_now.keys() if conf.get(k) != conf_now.get(k))
out = {"modules": names, "env": env_diff, "config": conf_diff}
if sys.argv[1] == "setup":
    got = specjax.setup_jax()
    again = specjax.setup_jax()
    out.update(flags=os.environ.get("XLA_FLAGS", ""), cache=str(got.compilation_cache),
               jax_dir=jax.config.jax_compilation_cache_dir, same=got == again,
               flag=got.cpu_in_place_flag)
print(json.dumps(out))
"""


def _child(mode: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "SPECJAX_", "XLA_FLAGS"))}
    env.update(SPECJAX_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_module_changes_no_environment_variable_or_jax_setting(tmp_path):
    got = _child("import", tmp_path)
    assert {"specjax.cli", "specjax.train.dflash", "specjax.models.gemma",
            "specjax.commands.train"} <= set(got["modules"]), got["modules"]
    assert got["env"] == [] and got["config"] == [], got


def test_setup_jax_sets_the_clis_flag_and_cache_once(tmp_path):
    got = _child("setup", tmp_path)
    assert "--xla_cpu_copy_insertion_use_region_analysis=true" in got["flags"], got
    assert got["flag"] and got["same"], got
    assert got["cache"] == got["jax_dir"] == str(tmp_path / "jax"), got
