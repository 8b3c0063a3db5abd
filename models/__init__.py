"""Model ports and weight loading. Every model follows the contract ``specjax.models.Model``
(``base.py``); ``Llama``, ``Gemma``, ``Gemma4`` and the decoder of the encoder-decoder ``T5``
implement it. ``LanguageModel`` is any of them as a Flax
NNX module (``module.py``); ``load(name).module`` gives one with real weights."""

from specjax.models.base import Model, ModelConfig
from specjax.models.gemma import GEMMA3_270M, Gemma, GemmaConfig
from specjax.models.gemma4 import Gemma4, Gemma4Config
from specjax.models.kv_cache import KVCache
from specjax.models.llama import SMOLLM2_135M, Llama, LlamaConfig, RopeScaling
from specjax.models.module import LanguageModel
from specjax.models.t5 import FLAN_T5_BASE, T5, T5_SMALL, T5_V1_1_SMALL, EncodedSource, T5Config
from specjax.models.loading import WeightLoadError, load_gguf, load_hf_dir
from specjax.models.registry import REGISTRY, LoadedModel, check_finite, config, load

__all__ = ["Model", "ModelConfig", "KVCache", "Llama", "LlamaConfig", "RopeScaling",
           "SMOLLM2_135M", "Gemma", "GemmaConfig", "GEMMA3_270M", "Gemma4", "Gemma4Config", "WeightLoadError",
           "load_gguf", "load_hf_dir", "REGISTRY", "LoadedModel", "load", "config",
           "check_finite", "LanguageModel",
           "T5", "T5Config", "EncodedSource", "T5_SMALL", "T5_V1_1_SMALL", "FLAN_T5_BASE"]
