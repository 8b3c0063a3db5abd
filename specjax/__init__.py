"""specjax: lossless speculative decoding in JAX."""

from specjax import _xla_flags  # noqa: F401  (must run before JAX picks a backend)

from specjax import models, sampling
from specjax.decoding import PAD, GenerateOutput, generate
from specjax.sampling import Greedy, Sample

__version__ = "0.1.0"
__all__ = ["models", "sampling", "generate", "GenerateOutput", "PAD", "Greedy", "Sample"]
