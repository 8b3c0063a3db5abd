"""Model ports and weight loading. Every model follows the contract of ``Llama.forward``."""

from specjax.models.kv_cache import KVCache
from specjax.models.llama import SMOLLM2_135M, Llama, LlamaConfig, RopeScaling
from specjax.models.loading import WeightLoadError, load_gguf, load_hf_dir
from specjax.models.registry import REGISTRY, LoadedModel, load

__all__ = ["KVCache", "Llama", "LlamaConfig", "RopeScaling", "SMOLLM2_135M", "WeightLoadError",
           "load_gguf", "load_hf_dir", "REGISTRY", "LoadedModel", "load"]
