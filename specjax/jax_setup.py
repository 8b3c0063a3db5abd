"""The JAX settings specjax's own commands run with, in one explicit call.

Importing ``specjax`` changes neither ``os.environ`` nor ``jax.config``: research code
that imports one function keeps its JAX as it configured it. The ``specjax`` CLI, the
benchmarks and the scripts call :func:`setup_jax` first; call it yourself, before JAX
starts a backend, to run as they do.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specjax import _cache, _xla_flags


@dataclasses.dataclass(frozen=True)
class JaxSetup:
    """What :func:`setup_jax` left in place: whether ``XLA_FLAGS`` holds XLA:CPU's in-place
    cache flag, and the persistent compilation cache's directory (None: off, or the
    user's own ``jax_compilation_cache_dir``)."""

    cpu_in_place_flag: bool
    compilation_cache: Path | None


def setup_jax(cpu_flags: bool = True, compilation_cache: bool = True) -> JaxSetup:
    """Sets what specjax's commands run with, leaving every setting the user made alone.

    - ``cpu_flags``: adds ``--xla_cpu_copy_insertion_use_region_analysis=true`` to
      ``XLA_FLAGS`` (the KV cache updated in place in XLA:CPU decode loops; CPU only) where
      the user set no value for it and no backend has started (``specjax._xla_flags``).
    - ``compilation_cache``: points JAX's persistent compilation cache at
      ``$SPECJAX_CACHE/jax`` (``SPECJAX_COMPILATION_CACHE=0`` or a directory overrides it;
      a ``jax_compilation_cache_dir`` already set wins; ``specjax._cache``).

    Idempotent: a second call changes nothing."""
    flag = _xla_flags.apply() if cpu_flags else False
    cache = _cache.configure() if compilation_cache else None
    return JaxSetup(flag, cache)


__all__ = ["JaxSetup", "setup_jax"]
