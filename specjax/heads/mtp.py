"""Gemma 4 assistants (MTP drafters) as Google publishes them: a directory in transformers'
``Gemma4AssistantForCausalLM`` layout, ``config.json`` (``model_type`` ``gemma4_assistant``:
``backbone_hidden_size``, ``use_ordered_embeddings``, ``num_centroids``,
``centroid_intermediate_top_k`` and a ``gemma4_text`` ``text_config`` whose every layer
shares the target's keys and values) and safetensors weights (one file or an index):
``pre_projection``, ``post_projection``, ``model.embed_tokens`` (the tied LM head),
``model.norm``, ``model.layers.{i}.*`` and, with ordered embeddings,
``masked_embedding.centroids`` and ``masked_embedding.token_ordering``.

``read_spec`` reads the config and the weights' headers (no tensor), so every name, shape
and dtype is checked before any weight loads; ``check_target`` checks the assistant
against a target's config; ``load`` reads the tensors; ``save`` writes the layout back
(transformers' ``from_pretrained`` reads it). Each problem is one ``CheckpointError`` line
naming the file and the field or tensor.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from specjax.heads.exported import CheckpointError
from specjax.models.gemma4_load import hf_gemma4_config
from specjax.models.hf_config import read_config_json
from specjax.models.safetensors_file import (FLOAT_DTYPES, SafetensorsSource, hf_weight_table)
from specjax.models.streaming import WeightLoadError

MODEL_TYPE = "gemma4_assistant"
TOP = {"pre_proj": "pre_projection.weight", "post_proj": "post_projection.weight",
       "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
       "centroids": "masked_embedding.centroids.weight",
       "token_ordering": "masked_embedding.token_ordering"}
LAYER = {"attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
         "q_norm": "self_attn.q_norm.weight", "o": "self_attn.o_proj.weight",
         "post_attn_norm": "post_attention_layernorm.weight",
         "mlp_norm": "pre_feedforward_layernorm.weight", "gate": "mlp.gate_proj.weight",
         "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
         "post_mlp_norm": "post_feedforward_layernorm.weight", "layer_scalar": "layer_scalar"}


def is_assistant(path: str | Path) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` says ``gemma4_assistant``."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get("model_type") == MODEL_TYPE


def _names(spec) -> dict[str, tuple[tuple, tuple]]:
    """transformers' tensor name -> (our path, shape)."""
    from specjax.drafters.mtp import param_shapes

    shapes = param_shapes(spec)
    out = {TOP[k]: ((k,), s) for k, s in shapes.items() if k != "layers"}
    for i, ls in enumerate(shapes["layers"]):
        out.update({f"model.layers.{i}.{LAYER[k]}": (("layers", i, k), s)
                    for k, s in ls.items()})
    return out


def read_spec(path: str | Path):
    """The ``MTPSpec`` of the assistant in ``path``, from its ``config.json`` and the
    headers of its weights (every tensor named, shaped and typed as the spec needs; a
    ``masked_embedding.token_ordering`` where ``use_ordered_embeddings`` is set), before
    any tensor is read."""
    from specjax.drafters.mtp import MTPSpec

    p = Path(path)
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{p} has no config.json: not a Gemma 4 assistant directory")
    f = read_config_json(p / "config.json", CheckpointError)
    kind = f.d.get("model_type")
    if kind != MODEL_TYPE:
        f.fail(f"model_type {kind!r}: an mtp drafter is a Gemma 4 assistant "
               f"({MODEL_TYPE!r}, transformers' Gemma4AssistantForCausalLM)")
    tc = f.obj("text_config")
    n = tc.integer("num_hidden_layers")
    if tc.integer("num_kv_shared_layers", n, minimum=0) != n:
        tc.fail("'text_config.num_kv_shared_layers' must equal num_hidden_layers (an "
                "assistant's layers all read the target's keys and values)")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if tc.d.get(key):
            tc.fail(f"'text_config.{key}' must be 0 for an assistant")
    if tc.d.get("enable_moe_block") or tc.d.get("use_double_wide_mlp"):
        tc.fail("an assistant's text_config has no MoE block or double-wide MLP")
    d = {**tc.d, "model_type": "gemma4_text", "num_kv_shared_layers": 0,
         "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    try:
        text = hf_gemma4_config(dataclasses.replace(tc, d=d))
        if not f.flag("tie_word_embeddings", True) or not text.tie_embeddings:
            f.fail("'tie_word_embeddings' false: an untied assistant LM head is not supported")
        spec = MTPSpec(dataclasses.replace(text, final_logit_softcapping=None),
                       f.integer("backbone_hidden_size"),
                       f.flag("use_ordered_embeddings", False),
                       f.integer("num_centroids", 2048),
                       f.integer("centroid_intermediate_top_k", 32))
    except (ValueError, WeightLoadError) as e:
        raise CheckpointError(str(e) if str(e).startswith(str(p)) else
                              f"{p / 'config.json'}: {e}") from None
    _check_headers(p, spec)
    return spec


def _table(p: Path):
    try:
        return hf_weight_table(p)
    except (WeightLoadError, FileNotFoundError) as e:
        raise CheckpointError(str(e)) from None


def _check_headers(p: Path, spec) -> None:
    """``CheckpointError`` naming a tensor missing, unexpected, misshapen or of the wrong
    dtype (``token_ordering`` integers, every other one floating point)."""
    table = _table(p)
    names = _names(spec)
    tied = {"lm_head.weight"}  # a saved copy of the tied embedding
    extra = sorted(set(table) - set(names) - tied)
    if extra:
        hint = (" (use_ordered_embeddings is false in config.json)"
                if any(e.startswith("masked_embedding.") for e in extra) else "")
        raise CheckpointError(f"{p}: unexpected tensors {extra[:4]}{hint}")
    missing = [k for k in names if k not in table]
    if missing:
        hint = (" (use_ordered_embeddings is set: the assistant needs its centroids and "
                "token_ordering)" if any(m.startswith("masked_embedding.") for m in missing)
                else "")
        raise CheckpointError(f"{p}: missing tensors {missing[:4]}{hint}")
    for name, (_, shape) in names.items():
        t = table[name]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{t.file}: tensor {name!r} has shape {tuple(t.shape)}; "
                                  f"expected {tuple(shape)}")
        ints = name == TOP["token_ordering"]
        if (np.dtype(t.dtype).kind in "iu") != ints or (not ints and np.dtype(t.dtype)
                                                         not in FLOAT_DTYPES):
            raise CheckpointError(f"{t.file}: tensor {name!r} is stored as "
                                  f"{np.dtype(t.dtype).name}; it must hold "
                                  f"{'integers' if ints else 'floating-point weights'}")


def check_target(spec, target_cfg, path) -> None:
    """``CheckpointError`` unless the assistant in ``path`` fits ``target_cfg``: a Gemma 4
    target of its backbone width and vocabulary, with the K/V geometry it reads."""
    from specjax.drafters.mtp import check_target as fits
    from specjax.models.gemma4 import Gemma4Config

    if not isinstance(target_cfg, Gemma4Config):
        raise CheckpointError(f"{path}: a Gemma 4 assistant drafts for a Gemma 4 target, "
                              f"not a {type(target_cfg).__name__.removesuffix('Config')} "
                              "model")
    try:
        fits(spec, target_cfg, f"{path}/config.json")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def load(path: str | Path, target_cfg) -> tuple:
    """``(spec, params)``: the assistant in ``path`` checked against ``target_cfg``, its
    weights as float32 numpy (``token_ordering`` int32, checked to be a permutation of
    the vocabulary) in ``specjax.drafters.mtp``'s pytree."""
    p = Path(path)
    spec = read_spec(p)
    check_target(spec, target_cfg, p)
    src = SafetensorsSource(_table(p))
    names = _names(spec)
    ap: dict = {"layers": [{} for _ in spec.text.layer_types]}
    for name, (where, _) in names.items():
        w = src.read(name)
        w = w.astype(np.int32) if where == ("token_ordering",) else w.astype(np.float32)
        node = ap if len(where) == 1 else ap["layers"][where[1]]
        node[where[-1]] = w
    if spec.ordered:
        order = ap["token_ordering"]
        if order.min() < 0 or len(np.unique(order)) != order.shape[0] or \
                order.max() >= spec.text.vocab_size:
            raise CheckpointError(f"{p}: masked_embedding.token_ordering is not a "
                                  f"permutation of the {spec.text.vocab_size} token ids")
    return spec, ap


def config(spec) -> dict:
    """The ``config.json`` of ``spec`` in transformers' layout."""
    t = spec.text
    full = [i for i, k in enumerate(t.layer_types) if k == "full"]
    nk, hd = t.geometry("full")
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": t.rope_local_theta},
            "full_attention": {"rope_type": "proportional", "rope_theta": t.rope_theta,
                               "partial_rotary_factor": t.partial_rotary_factor}}
    text = {"model_type": "gemma4_text", "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
            "layer_types": [f"{k}_attention" for k in t.layer_types],
            "per_layer_config": {str(i): {"head_dim": hd, "num_key_value_heads": nk}
                                 for i in full},
            "attention_k_eq_v": t.attention_k_eq_v, "sliding_window": t.sliding_window,
            "rope_parameters": rope, "rms_norm_eps": t.rms_norm_eps,
            "num_kv_shared_layers": t.num_layers, "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0, "tie_word_embeddings": True,
            "max_position_embeddings": t.max_position_embeddings,
            "hidden_activation": "gelu_pytorch_tanh"}
    return {"model_type": MODEL_TYPE, "architectures": ["Gemma4AssistantForCausalLM"],
            "backbone_hidden_size": spec.backbone_hidden_size,
            "use_ordered_embeddings": spec.ordered, "num_centroids": spec.num_centroids,
            "centroid_intermediate_top_k": spec.centroid_top_k, "tie_word_embeddings": True,
            "text_config": text}


def save(spec, ap, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Writes the assistant's weights ``ap`` as an assistant directory (``config.json``,
    ``model.safetensors``) that ``load`` and transformers read; returns the directory."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    import ml_dtypes

    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    tensors = {}
    for name, (where, _) in _names(spec).items():
        node = ap if len(where) == 1 else ap["layers"][where[1]]
        w = np.asarray(node[where[-1]])
        tensors[name] = w.astype(np.int64) if where == ("token_ordering",) else w.astype(dt)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config(spec), indent=2))
    return out
