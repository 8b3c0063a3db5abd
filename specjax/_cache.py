"""JAX's persistent compilation cache, on in the CLI: a program compiles once per machine.

``specjax.setup_jax()`` (which every ``specjax`` command calls first; importing specjax
changes nothing) points JAX's persistent compilation cache at ``$SPECJAX_CACHE/jax``
(``SPECJAX_CACHE`` defaults to ``~/.cache/specjax``, as ``specjax.models.registry.cache_dir``),
so a later process that builds the same decoding program (same model shapes, method,
widths, jax/jaxlib version, XLA flags and device) reads the compiled executable from disk
instead of compiling it again. XLA:CPU, GPU and TPU executables are all cached.

``SPECJAX_COMPILATION_CACHE`` controls it, read by the first :func:`configure` call:

- unset, empty, ``1``, ``true``, ``yes`` or ``on``: the cache is on, in ``$SPECJAX_CACHE/jax``;
- ``0``, ``false``, ``no``, ``off``, ``disable``, ``disabled`` or ``none`` (any case):
  specjax leaves JAX's cache settings untouched (JAX caches nothing unless told to by the
  user);
- anything else is a directory: the cache is on, there.

A directory that cannot hold the cache (the path is a file, lies below a file, or is not
writable) turns the cache off with one line on stderr saying which path and why, instead
of JAX's warning at the first compile.

A cache directory the user chose wins: when ``jax_compilation_cache_dir`` is already set
(``jax.config.update`` before ``setup_jax``, or the ``JAX_COMPILATION_CACHE_DIR``
environment variable), specjax changes none of JAX's cache settings.

Otherwise specjax also sets what is written, each setting unless its own JAX environment
variable is set: programs that took at least ``MIN_COMPILE_S`` to compile, of any size
(``jax_persistent_cache_min_compile_time_secs``, ``..._min_entry_size_bytes``). Throwaway
jits (a ``jnp`` operation outside ``jit``, a reshape) compile in milliseconds and are not
written; decoding programs take seconds. The directory is capped at ``MAX_BYTES``, least
recently used entries evicted first (``jax_compilation_cache_max_size``; JAX needs the
``filelock`` package for that, and without it the directory is not capped).

The cache holds machine code that JAX runs: like JAX's own, it must not live in a
directory that users you do not trust can write to.

``enabled()`` says whether specjax turned the cache on, ``directory()`` where.
"""

from __future__ import annotations

import os
from pathlib import Path

MIN_COMPILE_S = 0.2
"""Programs that compile faster than this are not written. On 2 CPU cores a ``jnp``
operation outside ``jit`` compiles in about 0.01-0.05 s, a tiny test model's decode loop
in 1-5 s, SmolLM2-135M's in 3-30 s."""

MAX_BYTES = 4 << 30
"""Cap of the cache directory (4 GiB): least recently used entries are evicted past it."""

_OFF = ("0", "false", "no", "off", "disable", "disabled", "none")
_ON = ("", "1", "true", "yes", "on")
_enabled = False
_directory: Path | None = None
_configured = False


def default_directory() -> Path:
    """``$SPECJAX_CACHE/jax``; ``SPECJAX_CACHE`` defaults to ``~/.cache/specjax``."""
    root = os.environ.get("SPECJAX_CACHE") or Path.home() / ".cache" / "specjax"
    return Path(root).expanduser() / "jax"


def enabled() -> bool:
    """True when :func:`configure` turned JAX's persistent compilation cache on."""
    return _enabled


def directory() -> Path | None:
    """The directory specjax gave JAX's persistent cache; None when it set none (switched
    off, or the user's own ``jax_compilation_cache_dir`` is in use)."""
    return _directory


def unusable(path: Path) -> str | None:
    """Why the directory ``path`` cannot hold the cache (a file, below a file, not
    writable), or None. Missing directories are fine: JAX creates them."""
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        return f"{p} is a file, not a directory"
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def configure() -> Path | None:
    """Turns the cache on as the module's docstring says, once per process (later calls
    change nothing); the directory it uses, or None where it is off or the user's own."""
    global _configured
    if not _configured:
        _configured = True
        _configure()
    return _directory


def _configure() -> None:
    global _enabled, _directory
    switch = os.environ.get("SPECJAX_COMPILATION_CACHE", "").strip()
    if switch.lower() in _OFF:
        return
    import jax

    if jax.config.jax_compilation_cache_dir:  # the user's own (config or environment)
        return
    path = default_directory() if switch.lower() in _ON else Path(switch).expanduser()
    problem = unusable(path)
    if problem:
        import sys

        source = (f"SPECJAX_COMPILATION_CACHE={switch}" if switch.lower() not in _ON
                  else f"the default cache directory {path}")
        print(f"specjax: warning: compilation cache off: {source}: {problem} (set "
              f"SPECJAX_COMPILATION_CACHE to a writable directory, or 0 to turn it off)",
              file=sys.stderr, flush=True)
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        try:
            import filelock  # noqa: F401  (JAX's least-recently-used eviction needs it)
        except ImportError:
            pass
        else:
            jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    _enabled, _directory = True, path
