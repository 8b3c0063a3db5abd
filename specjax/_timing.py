"""Wall-clock timing of jitted functions, for calibrations and profiling scripts."""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np


def median_ms(fn: Callable, *args, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``fn(*args)``, in milliseconds, each waited
    for with ``jax.block_until_ready``; one untimed call first (compilation, warm-up)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))
