"""specjax: lossless speculative decoding in JAX.

Layout: ``specjax.core`` (trees, sampling, verification, the decoder protocol and loops),
``specjax.drafters`` (one file per drafter, EAGLE-2 included), ``specjax.hsd`` (the
hierarchy recursion, latency model, optimisers and calibration), ``specjax.methods`` (every
method as a typed spec, built into a decoder), ``specjax.models`` (the
model contract and the ports) and ``specjax.train`` (Optax training of the draft heads).

Importing specjax changes neither ``os.environ`` nor ``jax.config``; ``setup_jax()`` sets
what the ``specjax`` commands run with (XLA:CPU's in-place cache flag, the persistent
compilation cache), explicitly.
"""

from specjax import core, drafters, hsd, methods, models, sharding
from specjax.core import sampling, tree
from specjax.core.decoder import (PAD, Batch, DecodeOutput, Decoder, Request, Stats, decode,
                                  prepare)
from specjax.core.decoding import AR, DecodeState, GenerateOutput, generate
from specjax.core.sampling import Greedy, Sample
from specjax.core.speculative import SpecOutput, Speculative, SpecState, speculative_generate
from specjax.core.verify import Draft, Rejection, Typical, VerifyResult, verify
from specjax.drafters import EarlyExitDrafter, ModelDrafter, NGramDrafter
from specjax.hsd import HSD, Hierarchy, hsd_generate
from specjax.jax_setup import JaxSetup, setup_jax

__version__ = "0.1.0"
__all__ = ["core", "methods", "models", "sampling", "sharding", "tree", "drafters", "hsd", "generate",
           "GenerateOutput", "PAD", "Greedy", "Sample", "speculative_generate", "SpecOutput",
           "verify", "Draft", "VerifyResult", "Rejection", "Typical", "ModelDrafter",
           "EarlyExitDrafter", "NGramDrafter", "Hierarchy", "hsd_generate",
           # the jittable pieces behind the host wrappers: init / step / loop / output
           # one decoder protocol: any Decoder runs through decode(), or inside your own jit
           # as init / step / done / output over a prepare()d Batch
           "Decoder", "decode", "Batch", "prepare", "DecodeOutput", "Request", "Stats",
           "AR", "DecodeState", "Speculative", "SpecState", "HSD",
           # what the specjax commands run with, set explicitly (importing sets nothing)
           "setup_jax", "JaxSetup"]
