"""XLA:CPU flag that lets a decode loop update its KV cache in place.

Without region analysis in copy insertion, XLA:CPU copies every loop-carried cache buffer
once per decoding step (measured: 2 copies per layer per token). :func:`apply` (called by
``specjax.setup_jax``, which the CLI calls; importing specjax does not) appends the flag
to ``XLA_FLAGS`` when the user has not set it and JAX has not initialized a backend yet;
it affects CPU compilation only. ``SPECJAX_KEEP_XLA_FLAGS=1`` leaves XLA_FLAGS alone.
"""

import os

FLAG = "--xla_cpu_copy_insertion_use_region_analysis=true"


def apply() -> bool:
    """Whether ``XLA_FLAGS`` holds the flag once this returns (set by the user, or added
    here). Adds nothing once a JAX backend exists (XLA reads the variable when the backend
    starts), or with ``SPECJAX_KEEP_XLA_FLAGS`` set."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_copy_insertion_use_region_analysis" in flags:
        return True
    if os.environ.get("SPECJAX_KEEP_XLA_FLAGS"):
        return False
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
    return True
