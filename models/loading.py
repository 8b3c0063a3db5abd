"""Weight loading: GGUF (llama.cpp) files and local HF directories, into the params pytree
of a Llama, Gemma or T5 model (``model_for`` builds the model class for the config).

This module is the entry point: it registers the built-in families and dispatches through
the family registry (``families``). What each family reads is its own module's:
``llama_load``, ``gemma_load``, ``t5_load`` hold its ``config.json`` and GGUF metadata
parsers, its tables from each format's tensor names to ours, and its ``Family``. What each
format holds is read by ``hf_config`` (``config.json`` fields, RoPE), ``safetensors_file``
and ``gguf_file`` / ``gguf_source``; ``streaming`` turns named tensors into the pytree.

Each source format has an explicit table from its tensor names to ours. Loading fails with a
message naming the tensor or path when a tensor is missing, unexpected, or of the wrong
shape, or stored as integers, booleans or complex numbers; it never fills in or drops
weights silently. ``config.json`` values are read with their types checked
(``ConfigFields``), and RoPE fields as transformers 5 reads them (``hf_rope``): a missing
key or a value of the wrong type is one line naming the file and the key.

Llama-family and Gemma weights stream (``stream_params``): names and shapes are checked from
the file headers first, then each leaf of the pytree is read tensor by tensor in its stored
dtype (bfloat16 stays bfloat16), fused, cast to the requested dtype and placed on its
device(s) at once, optionally straight onto a mesh's shardings. Host memory thus stays near
the weights' own size (``docs/results/load_memory_cpu.json``). An HF directory's weights are
the files transformers reads (``hf_weight_table``).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

# the built-in families, registered in this order (each module registers its own)
from specjax.models import llama_load, gemma_load, gemma4_load, t5_load  # noqa: F401, I001
from specjax.models.families import (FAMILIES, Family, family, family_of, gguf_family,
                                     hf_family, model_for, register_family)
from specjax.models.gemma import GemmaConfig
from specjax.models.gemma_load import hf_gemma_config
from specjax.models.gguf_file import GGUFFile
from specjax.models.gguf_source import GGUFSource, open_gguf
from specjax.models.hf_config import ConfigFields, hf_rope, read_config_json
from specjax.models.llama import LlamaConfig
from specjax.models.llama_load import GGUF_KEYS, HF_KEYS, hf_config
from specjax.models.safetensors_file import (SafetensorsSource, check_floating,
                                             hf_weight_table, safetensors_header)
from specjax.models.streaming import (TensorSource, WeightLoadError, check_names, local_region,
                                      placer, same_tensor, stream_params, unfused_shapes)
from specjax.models.t5 import T5Config
from specjax.models.t5_load import hf_t5_config

Config = LlamaConfig | GemmaConfig | T5Config

__all__ = [
    "Config", "load_gguf", "load_hf_dir", "gguf_file_config", "hf_dir_config", "gguf_config",
    # the family registry
    "Family", "FAMILIES", "register_family", "family_of", "family", "model_for",
    # each built-in family's config.json parser and tables
    "hf_config", "hf_gemma_config", "hf_t5_config", "HF_KEYS", "GGUF_KEYS",
    # the readers
    "WeightLoadError", "ConfigFields", "read_config_json", "hf_rope", "check_floating",
    "safetensors_header", "hf_weight_table", "SafetensorsSource", "GGUFSource",
    "TensorSource", "check_names", "unfused_shapes", "local_region", "placer",
    "stream_params",
]


# --------------------------------------------------------------------------- GGUF

def gguf_config(reader: GGUFFile) -> Config:
    """The model config recorded in a GGUF file's metadata, parsed by the family registered
    for its ``general.architecture`` (``llama``, ``gemma3``)."""
    arch = reader.get("general.architecture")
    fam = gguf_family(arch)
    if fam is None:
        archs = [a for fam in FAMILIES.values() for a in fam.gguf_architectures]
        raise WeightLoadError(f"GGUF architecture {arch!r} is not supported "
                              f"({', '.join(archs)})")
    return fam.gguf_config(reader)


def gguf_file_config(path: str | Path) -> Config:
    """The model config of a GGUF file, from its metadata alone (no tensor is read)."""
    return gguf_config(open_gguf(path))


def load_gguf(path: str | Path, dtype=jnp.float32, mesh=None,
              stacked: bool = False) -> tuple[Config, dict]:
    """Reads a llama- or gemma3-architecture GGUF file (any ggml quantization), dequantizing
    one tensor at a time and placing each leaf as it is made (:func:`stream_params`: with
    ``mesh``, sharded as ``specjax.sharding.shard_params`` would; ``stacked`` for
    ``scan_layers``)."""
    reader = open_gguf(path)
    cfg = gguf_config(reader)
    for t in reader.tensors:  # unquantized integer tensors hold no weights
        if t.qtype.name in ("I8", "I16", "I32", "I64"):
            check_floating(t.name, t.data.dtype, path)
    keys = family_of(cfg).gguf_keys
    return cfg, stream_params(cfg, GGUFSource(reader), keys, str(path), dtype, mesh, stacked)


# --------------------------------------------------------------------------- HF directory

def hf_dir_config(path: str | Path) -> Config:
    """The model config of a local HF directory, from its ``config.json``;
    ``WeightLoadError`` naming the file (and the key) for a file that is not a JSON object,
    a missing or unsupported ``model_type``, a missing key or a value of the wrong type."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    f = read_config_json(cfg_file)
    kinds = [t for fam in FAMILIES.values() for t in fam.hf_model_types]
    if f.d.get("model_type") is None:
        f.fail("'model_type' is missing: it names the architecture, as transformers "
               f"requires ({', '.join(kinds)})")
    kind = f.text("model_type")
    fam = hf_family(kind)
    if fam is None:
        f.fail(f"model_type {kind!r} is not supported ({', '.join(kinds)})")
    return fam.hf_config(f)


def load_hf_dir(path: str | Path, dtype=jnp.float32, mesh=None,
                stacked: bool = False) -> tuple[Config, dict]:
    """Loads ``config.json`` and the weights of a local HF directory (the files
    :func:`hf_weight_table` picks), tensor by tensor in their stored dtype, each leaf placed
    as it is made (:func:`stream_params`: with ``mesh``, sharded as
    ``specjax.sharding.shard_params`` would; ``stacked`` for ``scan_layers``). Peak host
    memory is the placed weights plus about one leaf. A family that maps its tensors whole
    (``Family.hf_params``: T5) reads them in float32, then places them (``stacked`` is a
    ``ValueError`` for it)."""
    path = Path(path)
    cfg = hf_dir_config(path)
    table = hf_weight_table(path)
    src = SafetensorsSource(table)
    fam = family_of(cfg)
    if fam.hf_stream is not None:  # checks the dtypes of the tensors it reads itself
        if stacked:
            raise ValueError("stacked layers (scan_layers) are for Llama-family models only")
        if mesh is not None:
            from specjax import sharding

            sharding.check_model(cfg, mesh)
        return cfg, fam.hf_stream(cfg, src, path, dtype, mesh)
    for name, t in table.items():
        check_floating(name, t.dtype, t.file)
    if fam.hf_params is not None:
        if stacked:
            raise ValueError("stacked layers (scan_layers) are for Llama-family models only")
        tensors = {k: src.read(k).astype(np.float32) for k in src.shapes}
        cfg, params = fam.hf_params(cfg, tensors, path, dtype)
        if mesh is not None:
            from specjax import sharding

            params = sharding.shard_params(cfg, params, mesh)
        return cfg, params
    ignore = ()
    if cfg.tie_embeddings and "lm_head.weight" in src.shapes:
        emb = "model.embed_tokens.weight"
        if emb not in src.shapes or not same_tensor(src, emb, "lm_head.weight"):
            raise WeightLoadError(f"{path}: config.json ties the embeddings, but "
                                  "'lm_head.weight' differs from 'model.embed_tokens.weight'")
        ignore = ("lm_head.weight",)  # a saved copy of the tied embedding
    return cfg, stream_params(cfg, src, fam.hf_keys, str(path), dtype, mesh, stacked, ignore)
