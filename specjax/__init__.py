"""specjax: lossless speculative decoding in JAX."""

from specjax import _xla_flags  # noqa: F401  (must run before JAX picks a backend)

from specjax import drafters, models, sampling, tree
from specjax.decoding import PAD, GenerateOutput, generate
from specjax.drafters import EarlyExitDrafter, ModelDrafter, NGramDrafter
from specjax.sampling import Greedy, Sample
from specjax.speculative import SpecOutput, speculative_generate
from specjax.verify import Draft, Rejection, Typical, VerifyResult, verify

__version__ = "0.1.0"
__all__ = ["models", "sampling", "tree", "drafters", "generate", "GenerateOutput", "PAD",
           "Greedy", "Sample", "speculative_generate", "SpecOutput", "verify", "Draft",
           "VerifyResult", "Rejection", "Typical", "ModelDrafter", "EarlyExitDrafter",
           "NGramDrafter"]
