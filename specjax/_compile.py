"""Ahead-of-time compilation with a per-shape cache, so callers can report compile time."""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import jax


_CACHES: "weakref.WeakSet[AotCache]" = weakref.WeakSet()


def clear_all() -> None:
    """Drops every ``AotCache``'s executables and JAX's own caches, freeing their code."""
    for c in list(_CACHES):
        c.clear()
    jax.clear_caches()


class AotCache:
    """Calls ``jax.jit(fn)`` through explicitly compiled executables.

    ``__call__`` returns ``(result, compile_s)``: ``compile_s`` is the lowering plus XLA
    compilation time of this call, ``0.0`` when an executable for the same static arguments
    and argument shapes, dtypes, shardings and tree structure was already compiled.
    """

    def __init__(self, fn: Callable, static_argnames: tuple[str, ...]):
        self._jit = jax.jit(fn, static_argnames=static_argnames)
        self._static = static_argnames
        self._exes: dict[Any, Any] = {}
        _CACHES.add(self)

    def clear(self) -> None:
        """Drops the compiled executables (the next call compiles again)."""
        self._exes.clear()

    def __call__(self, *args, **kwargs):
        """Static arguments must be passed by keyword."""
        statics = tuple((k, kwargs[k]) for k in self._static)
        dynamic = {k: v for k, v in kwargs.items() if k not in self._static}
        leaves, tree = jax.tree.flatten((args, dynamic))
        key = (statics, tree, tuple((jax.typeof(x).shape, jax.typeof(x).dtype,
                                     getattr(x, "sharding", None)) for x in leaves))
        compile_s = 0.0
        if key not in self._exes:
            t = time.perf_counter()
            self._exes[key] = self._jit.lower(*args, **kwargs).compile()
            compile_s = time.perf_counter() - t
        return self._exes[key](*args, **dynamic), compile_s
