"""JAX's persistent compilation cache (``specjax._cache``): a decode program compiled in one
process is read from disk by the next one, not compiled again; ``SPECJAX_COMPILATION_CACHE=0``
writes nothing; a cache directory the user set is left alone.

Each case runs in a fresh interpreter (``specjax.setup_jax()`` configures the cache once),
with its own temporary ``SPECJAX_CACHE`` and the test session's cache variables removed.
Cache reads and writes are counted with ``jax.monitoring`` events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import toys

ROOT = Path(__file__).resolve().parents[1]

# Compiles and runs greedy speculative decoding (an n-gram drafter) and ar on a
# tiny random Llama, and prints what the persistent cache did.
_CHILD = """
import json, sys
import jax
_BEFORE = jax.config.jax_compilation_cache_dir
counts = {}
EVENTS = {"/jax/compilation_cache/cache_hits": "hits",
          "/jax/compilation_cache/cache_misses": "writes"}
jax.monitoring.register_event_listener(
    lambda e, **kw: e in EVENTS and counts.__setitem__(EVENTS[e], counts.get(EVENTS[e], 0) + 1))
import specjax
assert jax.config.jax_compilation_cache_dir == _BEFORE  # importing specjax sets nothing
specjax.setup_jax()
jax_dir = jax.config.jax_compilation_cache_dir  # what setup_jax set
from specjax import _cache
from specjax.drafters import NGramDrafter
from specjax.models.llama import Llama, LlamaConfig, init_params
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
model, params = Llama(cfg), init_params(cfg, jax.random.key(0))
prompt = [[5, 6, 7, 5, 6, 7, 5, 6]]
ar = specjax.generate(model, params, prompt, max_new_tokens=8, eos_ids=(), cache_size=64)
sd = specjax.speculative_generate(model, params, NGramDrafter(depth=3), None, prompt,
                                  max_new_tokens=8, eos_ids=(), cache_size=64)
assert sd.to_lists() == ar.to_lists()
print(json.dumps({"compile_s": ar.compile_s + sd.compile_s, "enabled": _cache.enabled(),
                  "directory": str(_cache.directory()),
                  "jax_dir": jax_dir,
                  "min_compile_s": jax.config.jax_persistent_cache_min_compile_time_secs,
                  **{v: counts.get(v, 0) for v in EVENTS.values()}}))
"""


def _run(tmp: Path, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                                "SPECJAX_COMPILATION_CACHE", "SPECJAX_CACHE"))}
    env = toys.toy_process_env({**env, "SPECJAX_CACHE": str(tmp), **env_extra})
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def _decode_programs(path: Path) -> set[str]:
    """The cache entries of decode loops (``specjax.core.decoder._run``, one per decoder
    and shape). Which small programs get written depends on how long they took to compile
    (``specjax._cache.MIN_COMPILE_S``), so on the machine's load: they are not counted."""
    return {p.name for p in _files(path) if p.name.startswith("jit__run-")
            and p.name.endswith("-cache")}


def test_second_process_reads_the_decode_programs_from_the_cache(tmp_path):
    first = _run(tmp_path)
    assert first["enabled"] and first["jax_dir"] == first["directory"] == str(tmp_path / "jax")
    assert first["hits"] == 0, first
    programs = _decode_programs(tmp_path / "jax")
    assert len(programs) == 2, programs  # ar's loop and speculative decoding's
    second = _run(tmp_path)
    assert second["hits"] >= 2, (first, second)
    assert _decode_programs(tmp_path / "jax") == programs  # read, not compiled and written
    assert second["compile_s"] < 0.6 * first["compile_s"], (first, second)


def test_switched_off_nothing_is_written(tmp_path):
    off = _run(tmp_path, SPECJAX_COMPILATION_CACHE="0")
    assert not off["enabled"] and off["jax_dir"] is None
    assert off["writes"] == off["hits"] == 0, off
    assert _files(tmp_path) == []


def test_a_directory_in_the_switch_and_the_users_own_directory(tmp_path):
    there = _run(tmp_path / "home", SPECJAX_COMPILATION_CACHE=str(tmp_path / "here"))
    assert there["enabled"] and there["jax_dir"] == str(tmp_path / "here")
    assert len(_decode_programs(tmp_path / "here")) == 2
    assert not (tmp_path / "home" / "jax").exists()
    mine = _run(tmp_path / "home", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"))
    assert not mine["enabled"] and mine["jax_dir"] == str(tmp_path / "mine")
    assert mine["min_compile_s"] == 1.0  # JAX's default: specjax changed nothing
    assert not (tmp_path / "home" / "jax").exists()
