"""Random draft heads in the exact layouts SafeAILab/EAGLE publishes, and independent
pure-PyTorch reference forwards of them.

This module is an *independent* check of specjax's EAGLE loader and JAX head: it is written
from the published format (SafeAILab/EAGLE ``eagle/model/cnets1.py`` for EAGLE-1/2,
``eagle/model/cnets.py`` for EAGLE-3, and the config files under ``eagle/train`` and
``eagle/traineagle3``), never from specjax's code, and it imports nothing from specjax.

Layouts written (``config.json`` plus ``pytorch_model.bin`` — a ``torch.save`` of a flat
state dict, which is what EAGLE's loader tries first — or ``model.safetensors``):

EAGLE-1/2 (``write_eagle1_head``): ``fc.weight`` [h, 2h] (+ ``fc.bias`` [h] unless the
config says ``"bias": false``), ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (+ q/k/v biases
for Qwen2 heads, config ``"qkv_bias": true``), ``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.post_attention_layernorm.weight``. No input_layernorm on layer 0, no final norm,
no lm_head, no embedding: the target's embedding and LM head are used.

EAGLE-3 (``write_eagle3_head``): ``fc.weight`` [h, 3*th] (th = target_hidden_size or h, no
bias), ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`` [h],
``midlayer.self_attn.{q,k,v}_proj.weight`` [n*hd, 2h], ``o_proj`` [h, nq*hd],
``midlayer.mlp.*``, ``norm.weight`` [h], ``lm_head.weight`` [draft_vocab, h], ``d2t`` int64
[draft_vocab] (offsets: target id = draft id + d2t[draft id]), ``t2d`` bool [vocab], and
optionally ``embed_tokens.weight`` [vocab, h].

SpecForge EAGLE-3 (``write_specforge_eagle3_head``): the layout sgl-project/SpecForge's
``LlamaForCausalLMEagle3`` (``specforge/modeling/draft/llama3_eagle.py`` at commit
``SPECFORGE_COMMIT``) saves with ``save_pretrained``: the EAGLE-3 tensors above plus
``embed_tokens.weight`` always, ``fc.weight`` [h, 3*th] with ``target_hidden_size`` in the
config, q/k/v of ``head_dim`` (the config's, else h // heads), bfloat16 ``model.safetensors``
and a transformers-5 ``config.json`` (``dtype``, ``rope_parameters`` and a top-level
``rope_theta``). ``specforge_eagle3_expected_shapes`` is that model's whole state dict and
``torch_specforge_eagle3_logits`` its forward (``backbone`` then ``compute_logits``).

Reference forwards run a whole causal sequence at positions 0..T-1 (no KV cache), in float32,
with HF-style RoPE (rotate_half, inv_freq = 1/theta^(2i/hd)), GQA by repeating each KV head
nq//nkv times (query head j uses KV head j // (nq//nkv)), scale 1/sqrt(hd), and RMSNorm
x * rsqrt(mean(x^2) + eps) * w. head_dim is hidden // num_attention_heads (EAGLE's code has
no separate head_dim field).
"""

from __future__ import annotations

import json
import math
import os

import torch

__all__ = [
    "write_eagle1_head",
    "write_eagle3_head",
    "torch_eagle1_logits",
    "torch_eagle3_logits",
    "d2t_target_ids",
    "d2t_absolute",
    "eagle1_expected_shapes",
    "eagle3_expected_shapes",
    "edit_state_dict",
    "SPECFORGE_COMMIT",
    "SPECFORGE_CONFIG_KEYS",
    "SPECFORGE_OPTIONAL_CONFIG_KEYS",
    "specforge_eagle3_expected_shapes",
    "specforge_serving_names",
    "write_specforge_eagle3_head",
    "torch_specforge_eagle3_logits",
]

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


# ----------------------------------------------------------------------------- writing


def _std(fan_in: int) -> float:
    """A weight scale that keeps activations O(1): 1/sqrt(fan_in), clipped to [0.05, 0.2]."""
    return min(0.2, max(0.05, 1.0 / math.sqrt(fan_in)))


def _linear(g: torch.Generator, out: int, inp: int) -> torch.Tensor:
    return torch.randn(out, inp, generator=g) * _std(inp)


def _norm_weight(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=g)


def _bias(g: torch.Generator, n: int) -> torch.Tensor:
    return 0.1 * torch.randn(n, generator=g)


def _save(path, sd: dict, cfg: dict, weights: str, dtype: torch.dtype) -> dict:
    """Writes config.json and the weights file; returns the stored tensors as float32
    (floating tensors) or unchanged (integer/bool buffers), i.e. exactly what is on disk."""
    if weights not in ("pytorch_model.bin", "model.safetensors"):
        raise ValueError(f"weights must be pytorch_model.bin or model.safetensors, got {weights!r}")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    stored = {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()
    }
    target = os.path.join(path, weights)
    if weights == "pytorch_model.bin":
        torch.save(stored, target)
    else:
        from safetensors.torch import save_file

        save_file(stored, target, metadata={"format": "pt"})
    return {k: (v.float() if v.is_floating_point() else v.clone()) for k, v in stored.items()}


def eagle1_expected_shapes(cfg: dict) -> dict:
    """{tensor name: shape} that an EAGLE-1/2 head with this config.json must contain."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nq = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nq)
    hd = h // nq
    p = "layers.0."
    shapes = {
        "fc.weight": (h, 2 * h),
        p + "self_attn.q_proj.weight": (nq * hd, h),
        p + "self_attn.k_proj.weight": (nkv * hd, h),
        p + "self_attn.v_proj.weight": (nkv * hd, h),
        p + "self_attn.o_proj.weight": (h, nq * hd),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        p + "post_attention_layernorm.weight": (h,),
    }
    if cfg.get("bias", True):
        shapes["fc.bias"] = (h,)
    if cfg.get("qkv_bias", False):
        shapes[p + "self_attn.q_proj.bias"] = (nq * hd,)
        shapes[p + "self_attn.k_proj.bias"] = (nkv * hd,)
        shapes[p + "self_attn.v_proj.bias"] = (nkv * hd,)
    return shapes


def _eagle3_shapes(h, th, inter, nq, nkv, hd, v, dv) -> dict:
    """{name: shape} of the tensors every EAGLE-3 head has (SafeAILab's and SpecForge's):
    ``fc`` over three target states of width ``th``, the ``midlayer`` of width ``h`` with
    ``nq``/``nkv`` heads of ``hd``, ``norm``, ``lm_head`` over ``dv`` draft ids, ``d2t``, ``t2d``."""
    p = "midlayer."
    return {
        "fc.weight": (h, 3 * th),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "self_attn.q_proj.weight": (nq * hd, 2 * h),
        p + "self_attn.k_proj.weight": (nkv * hd, 2 * h),
        p + "self_attn.v_proj.weight": (nkv * hd, 2 * h),
        p + "self_attn.o_proj.weight": (h, nq * hd),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (dv, h),
        "d2t": (dv,),
        "t2d": (v,),
    }


def eagle3_expected_shapes(cfg: dict, own_embedding: bool = False) -> dict:
    """{tensor name: shape} that an EAGLE-3 head with this config.json must contain."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    dv = cfg["draft_vocab_size"]
    th = cfg.get("target_hidden_size", h)
    nq = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nq)
    hd = h // nq
    shapes = _eagle3_shapes(h, th, inter, nq, nkv, hd, v, dv)
    if own_embedding:
        shapes["embed_tokens.weight"] = (v, h)
    return shapes


def write_eagle1_head(
    path,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    style: str = "vicuna",
    weights: str = "pytorch_model.bin",
    dtype: torch.dtype = torch.bfloat16,
    rope_theta: float | None = None,
    seed: int = 0,
    layers: int = 1,
) -> tuple[dict, dict]:
    """Writes a random EAGLE-1/2 draft head to directory ``path``; returns (state dict as
    float32 torch tensors — the values as stored, after rounding to ``dtype`` —, config dict).
    ``layers`` > 1: ``num_hidden_layers`` decoder layers, ``layers.i`` for ``i > 0`` with an
    ``input_layernorm`` (cnets1.py's ``LlamaDecoderLayer(config, index)``).

    ``style`` mirrors the published configs (eagle/train/*_config.json and HF heads):
      * "vicuna": fc carries a bias, config has no "bias" key, no "rope_theta" key unless
        ``rope_theta`` is given (RoPE base 10000), rms_norm_eps 1e-6, and no
        "num_key_value_heads" key when kv_heads == heads (EAGLE's EConfig defaults it to
        num_attention_heads).
      * "llama3": config "bias": false and no fc.bias, rope_theta 500000 by default,
        rms_norm_eps 1e-5 (eagle/train/EAGLE-LLaMA3-Instruct-8B).
      * "qwen2": "qkv_bias": true with q/k/v biases, fc bias, rope_theta 1e6 by default.
    """
    if style not in ("vicuna", "llama3", "qwen2"):
        raise ValueError(f"unknown style {style!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads and heads by kv_heads")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float16"),
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": vocab,
    }
    if style != "vicuna" or kv_heads != heads:
        cfg["num_key_value_heads"] = kv_heads
    if style == "llama3":
        cfg.update(bos_token_id=128000, eos_token_id=128001, rms_norm_eps=1e-5)
        cfg["rope_theta"] = 500000.0 if rope_theta is None else float(rope_theta)
        cfg["bias"] = False
    elif style == "qwen2":
        cfg.update(bos_token_id=151643, eos_token_id=151645)
        cfg["rope_theta"] = 1000000.0 if rope_theta is None else float(rope_theta)
        cfg["qkv_bias"] = True
    elif rope_theta is not None:
        cfg["rope_theta"] = float(rope_theta)

    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads
    sd = {"fc.weight": _linear(g, hidden, 2 * hidden)}
    if style != "llama3":
        sd["fc.bias"] = _bias(g, hidden)
    for i in range(layers):
        p = f"layers.{i}."
        if i:
            sd[p + "input_layernorm.weight"] = _norm_weight(g, hidden)
        sd[p + "self_attn.q_proj.weight"] = _linear(g, heads * hd, hidden)
        sd[p + "self_attn.k_proj.weight"] = _linear(g, kv_heads * hd, hidden)
        sd[p + "self_attn.v_proj.weight"] = _linear(g, kv_heads * hd, hidden)
        sd[p + "self_attn.o_proj.weight"] = _linear(g, hidden, heads * hd)
        if style == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = _bias(g, heads * hd)
            sd[p + "self_attn.k_proj.bias"] = _bias(g, kv_heads * hd)
            sd[p + "self_attn.v_proj.bias"] = _bias(g, kv_heads * hd)
        sd[p + "mlp.gate_proj.weight"] = _linear(g, intermediate, hidden)
        sd[p + "mlp.up_proj.weight"] = _linear(g, intermediate, hidden)
        sd[p + "mlp.down_proj.weight"] = _linear(g, hidden, intermediate)
        sd[p + "post_attention_layernorm.weight"] = _norm_weight(g, hidden)
    return _save(path, sd, cfg, weights, dtype), cfg


def _eagle3_layer(g: torch.Generator, hidden, th, heads, kv_heads, hd, intermediate,
                  draft_vocab) -> dict:
    """An EAGLE-3 head's ``fc``, ``midlayer.*``, ``norm`` and ``lm_head`` weights, drawn from
    ``g`` in this order (the published layout; SpecForge's names are the same)."""
    p = "midlayer."
    return {
        "fc.weight": _linear(g, hidden, 3 * th),
        p + "input_layernorm.weight": _norm_weight(g, hidden),
        p + "hidden_norm.weight": _norm_weight(g, hidden),
        p + "self_attn.q_proj.weight": _linear(g, heads * hd, 2 * hidden),
        p + "self_attn.k_proj.weight": _linear(g, kv_heads * hd, 2 * hidden),
        p + "self_attn.v_proj.weight": _linear(g, kv_heads * hd, 2 * hidden),
        p + "self_attn.o_proj.weight": _linear(g, hidden, heads * hd),
        p + "post_attention_layernorm.weight": _norm_weight(g, hidden),
        p + "mlp.gate_proj.weight": _linear(g, intermediate, hidden),
        p + "mlp.up_proj.weight": _linear(g, intermediate, hidden),
        p + "mlp.down_proj.weight": _linear(g, hidden, intermediate),
        "norm.weight": _norm_weight(g, hidden),
        "lm_head.weight": _linear(g, draft_vocab, hidden),
    }


def _vocab_map(g: torch.Generator, vocab: int, draft_vocab: int) -> dict:
    """``d2t``/``t2d`` as EAGLE's trainer builds them (eagle/traineagle3/cnets.py): a sorted
    subset ``ids`` of draft_vocab target ids, d2t[i] = ids[i] - i, t2d[ids] = True."""
    ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values.to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(draft_vocab, dtype=torch.int64), "t2d": t2d}


def write_eagle3_head(
    path,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    draft_vocab: int,
    target_hidden: int | None = None,
    own_embedding: bool = False,
    weights: str = "pytorch_model.bin",
    dtype: torch.dtype = torch.bfloat16,
    rope_theta: float | None = None,
    seed: int = 0,
) -> tuple[dict, dict]:
    """Writes a random EAGLE-3 draft head to directory ``path``; returns (state dict as
    float32 torch tensors for float entries — values as stored —, config dict).

    The config mirrors yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (architectures
    ["LlamaForCausalLMEagle3"], no rope_theta key so RoPE base is 10000, rms_norm_eps 1e-5);
    "target_hidden_size" and "rope_theta" appear only when given. ``d2t`` holds offsets built
    the way EAGLE's trainer does (eagle/traineagle3/cnets.py): a sorted subset ``ids`` of
    draft_vocab target ids, d2t[i] = ids[i] - i, t2d[ids] = True. ``own_embedding`` adds
    ``embed_tokens.weight`` [vocab, hidden] (EAGLE's trainer omits the frozen embedding).
    """
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads and heads by kv_heads")
    if not 0 < draft_vocab <= vocab:
        raise ValueError("need 0 < draft_vocab <= vocab")
    th = hidden if target_hidden is None else target_hidden
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float16"),
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
    }
    if target_hidden is not None:
        cfg["target_hidden_size"] = target_hidden
    if rope_theta is not None:
        cfg["rope_theta"] = float(rope_theta)

    g = torch.Generator().manual_seed(seed)
    sd = _eagle3_layer(g, hidden, th, heads, kv_heads, hidden // heads, intermediate,
                       draft_vocab)
    sd.update(_vocab_map(g, vocab, draft_vocab))
    if own_embedding:
        sd["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)
    return _save(path, sd, cfg, weights, dtype), cfg


# ----------------------------------------------------------------------------- SpecForge

#: The sgl-project/SpecForge commit the SpecForge layout below was read from
#: (specforge/modeling/draft/llama3_eagle.py, specforge/modeling/auto.py,
#: specforge/export/to_hf.py, to_sglang.py and checkpoint_io.py).
SPECFORGE_COMMIT = "a6b6b0230009d15ec2a97a57384e6f53f0f96946"

#: config.json keys SpecForge reads to build ``LlamaForCausalLMEagle3`` whose LlamaConfig
#: default (a 4096-wide Llama-2 layer) would build another head, so an export must carry
#: them: ``AutoDraftModelConfig.from_file`` needs exactly one registered ``architectures``
#: entry, ``AutoConfig`` needs ``model_type`` "llama", ``__init__`` / ``LlamaAttention`` /
#: ``LlamaMLP`` read the sizes, eps, activation and ``max_position_embeddings`` (RoPE cache).
SPECFORGE_CONFIG_KEYS = (
    "architectures", "model_type", "vocab_size", "draft_vocab_size", "hidden_size",
    "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "rms_norm_eps", "hidden_act")

#: Keys SpecForge also reads, with defaults: ``head_dim`` (hidden // heads), ``target_hidden_size``
#: (hidden_size), ``pad_token_id`` (the embedding's padding row), RoPE from ``rope_parameters``
#: else ``rope_theta`` (10000) and ``rope_scaling`` (default/linear/dynamic/llama3/yarn/mrope),
#: ``pretraining_tp`` (1), ``tie_word_embeddings`` (forced false), ``fc_norm`` (false: no
#: RMSNorm per fused chunk), ``norm_output`` (true: logits = lm_head(norm(x))) and
#: ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's convention: layer *outputs*,
#: i.e. the states entering layer id + 1; default [1, L//2 - 1, L - 4], which is the states
#: entering layers 2, L//2 and L - 3, EAGLE's).
SPECFORGE_OPTIONAL_CONFIG_KEYS = (
    "head_dim", "target_hidden_size", "pad_token_id", "rope_parameters", "rope_theta",
    "rope_scaling", "pretraining_tp", "tie_word_embeddings", "fc_norm", "norm_output",
    "eagle_config")


def specforge_eagle3_expected_shapes(cfg: dict) -> dict:
    """{name: shape} of ``LlamaForCausalLMEagle3(config).state_dict()`` at ``SPECFORGE_COMMIT``
    for this config.json: every parameter and persistent buffer (``t2d`` bool [vocab], ``d2t``
    int64 [draft_vocab]; the RoPE caches are non-persistent), ``embed_tokens.weight``
    included. What SpecForge's HF export (``export/to_hf.py``) writes, and what
    ``load_state_dict(strict=True)`` on that model requires."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    dv = cfg.get("draft_vocab_size") or v  # AutoDraftModelConfig.from_file's default
    th = cfg.get("target_hidden_size", h)
    nq = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nq
    hd = cfg.get("head_dim") or h // nq
    shapes = {"embed_tokens.weight": (v, h), **_eagle3_shapes(h, th, inter, nq, nkv, hd, v, dv)}
    if cfg.get("fc_norm", False):
        shapes.update({f"fc_norm.{i}.weight": (th,) for i in range(3)})
    return shapes


def specforge_serving_names(cfg: dict) -> set:
    """The tensor names SpecForge's SGLang export (``export/to_sglang.py``) writes for this
    config: the state dict without any key containing "embed" (SGLang's EAGLE-3 loader takes
    the embedding from the target). ``fc.weight``, ``norm.weight``, ``lm_head.weight``,
    ``t2d`` and ``d2t`` are the keys it requires."""
    return {k for k in specforge_eagle3_expected_shapes(cfg) if "embed" not in k.lower()}


def write_specforge_eagle3_head(
    path,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    draft_vocab: int,
    target_hidden: int | None = None,
    head_dim: int | None = None,
    rope_theta: float = 10000.0,
    fc_norm: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[dict, dict]:
    """Writes a random EAGLE-3 head as SpecForge's HF export does (``export/to_hf.py`` at
    ``SPECFORGE_COMMIT``: ``model.save_pretrained(out, state_dict=...)`` of a bfloat16
    ``LlamaForCausalLMEagle3``, then ``apply_legacy_rope_scaling``) to directory ``path``;
    returns (the tensors as stored, floating ones as float32; the config dict).

    ``model.safetensors`` holds exactly ``specforge_eagle3_expected_shapes(cfg)``:
    ``embed_tokens.weight`` always (the export refuses to ship without it), ``t2d`` bool and
    ``d2t`` int64 (offsets, built as in ``write_eagle3_head``), ``fc_norm.{0,1,2}.weight``
    only with ``fc_norm``. ``config.json`` is what transformers 5's ``LlamaConfig.save_pretrained``
    (keys taken from 5.24's output; SpecForge pins 5.8.1, the version recorded)
    writes for SpecForge's ``configs/llama3-8B-eagle3.json`` at these sizes (sorted keys,
    ``dtype`` not ``torch_dtype``, explicit ``head_dim``, ``rope_parameters``) plus the
    top-level ``rope_theta`` ``apply_legacy_rope_scaling`` adds; ``target_hidden_size`` only
    when given (SpecForge's configs omit it for a head as wide as its target).
    """
    hd = hidden // heads if head_dim is None else head_dim
    if heads % kv_heads:
        raise ValueError("heads must divide by kv_heads")
    if head_dim is None and hidden % heads:
        raise ValueError("hidden must divide by heads, or give head_dim")
    if not 0 < draft_vocab <= vocab:
        raise ValueError("need 0 < draft_vocab <= vocab")
    th = hidden if target_hidden is None else target_hidden
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "draft_vocab_size": draft_vocab,
        "dtype": _DTYPE_NAMES[dtype],
        "eos_token_id": 128001,
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": kv_heads,
        "pad_token_id": 0,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": float(rope_theta), "rope_type": "default"},
        "rope_theta": float(rope_theta),
        "tie_word_embeddings": False,
        "transformers_version": "5.8.1",
        "use_cache": True,
        "vocab_size": vocab,
    }
    if fc_norm:
        cfg["fc_norm"] = True
    if target_hidden is not None:
        cfg["target_hidden_size"] = target_hidden
    cfg = dict(sorted(cfg.items()))

    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, hidden, generator=g)  # drawn first, stored first
    sd = {"embed_tokens.weight": embed,
          **_eagle3_layer(g, hidden, th, heads, kv_heads, hd, intermediate, draft_vocab)}
    if fc_norm:
        sd.update({f"fc_norm.{i}.weight": _norm_weight(g, th) for i in range(3)})
    sd.update(_vocab_map(g, vocab, draft_vocab))
    return _save(path, sd, cfg, "model.safetensors", dtype), cfg


# ----------------------------------------------------------------------------- reference


def _f32(t) -> torch.Tensor:
    return torch.as_tensor(t).to(torch.float32)


def _rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * _f32(w)


def _inv_freq(cfg: dict, hd: int) -> torch.Tensor:
    """HF RoPE frequencies: 1/theta^(arange(0,hd,2)/hd); theta = cfg rope_theta or 10000.
    Supports rope_scaling "linear", "llama3" and "dynamic" (dynamic is a no-op while the
    sequence is within max_position_embeddings, which is all a reference here runs)."""
    theta = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "dynamic":
        return inv
    if kind == "llama3":
        factor = float(rs["factor"])
        lo, hi = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"unsupported rope_scaling {rs}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _linear_apply(x, sd, name):
    y = x @ _f32(sd[name + ".weight"]).T
    if name + ".bias" in sd:
        y = y + _f32(sd[name + ".bias"])
    return y


def _attention(a_in, sd, prefix, cfg, positions, head_dim=None):
    """Causal GQA self-attention with RoPE over a whole sequence. a_in [B,T,d] -> [B,T,h].
    Heads of ``head_dim`` (default hidden // heads, as EAGLE's code)."""
    B, T, _ = a_in.shape
    h = cfg["hidden_size"]
    nq = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nq)
    hd = h // nq if head_dim is None else head_dim
    q = _linear_apply(a_in, sd, prefix + "q_proj").view(B, T, nq, hd).transpose(1, 2)
    k = _linear_apply(a_in, sd, prefix + "k_proj").view(B, T, nkv, hd).transpose(1, 2)
    v = _linear_apply(a_in, sd, prefix + "v_proj").view(B, T, nkv, hd).transpose(1, 2)
    freqs = positions.to(torch.float32)[:, None] * _inv_freq(cfg, hd)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
    cos, sin = emb.cos(), emb.sin()
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    rep = nq // nkv
    k = k.repeat_interleave(rep, dim=1)  # query head j reads kv head j // rep
    v = v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [B,nq,T,hd]
    out = out.transpose(1, 2).reshape(B, T, nq * hd)
    return _linear_apply(out, sd, prefix + "o_proj")


def _mlp(x, sd, prefix):
    gate = _linear_apply(x, sd, prefix + "gate_proj")
    up = _linear_apply(x, sd, prefix + "up_proj")
    return _linear_apply(torch.nn.functional.silu(gate) * up, sd, prefix + "down_proj")


def _positions(T, positions):
    if positions is None:
        return torch.arange(T, dtype=torch.int64)
    return torch.as_tensor(positions, dtype=torch.int64).reshape(T)


@torch.no_grad()
def torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats, *, wrong=None, positions=None,
                        return_hidden=False):
    """EAGLE-1/2 head forward over a causal sequence, float32.

    embed, lm_head: the target's [V, h] embedding and LM head; tokens [B,T] int; feats
    [B,T,h] target features (EAGLE pairs feature t with token t+1; the caller aligns them).
    x = fc(concat([embed(tokens), feats])); x += o(attn(x)) (no input norm on layer 0);
    x += mlp(post_attention_layernorm(x)); each further layer of ``num_hidden_layers`` (default
    1) the same with ``input_layernorm`` before its attention; logits = x @ lm_head.T (no
    final norm).
    positions: [T] RoPE positions, default 0..T-1.
    wrong: None | "swap_concat" (concat [feats, emb]) | "input_norm" (an RMSNorm with unit
    weight before attention) — deliberately wrong variants a checker must tell apart.
    Returns logits [B,T,V] (and the head output x [B,T,h] if return_hidden).
    """
    if wrong not in (None, "swap_concat", "input_norm"):
        raise ValueError(f"unknown wrong variant {wrong!r}")
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    emb = _f32(embed)[tokens]
    f = _f32(feats)
    eps = float(cfg["rms_norm_eps"])
    pieces = [f, emb] if wrong == "swap_concat" else [emb, f]
    x = _linear_apply(torch.cat(pieces, dim=-1), sd, "fc")
    pos = _positions(x.shape[1], positions)
    for i in range(int(cfg.get("num_hidden_layers", 1))):
        p = f"layers.{i}."
        if i:
            a_in = _rms_norm(x, sd[p + "input_layernorm.weight"], eps)
        else:
            a_in = _rms_norm(x, None, eps) if wrong == "input_norm" else x
        x = x + _attention(a_in, sd, p + "self_attn.", cfg, pos)
        n = _rms_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        x = x + _mlp(n, sd, p + "mlp.")
    logits = x @ _f32(lm_head).T
    return (logits, x) if return_hidden else logits


@torch.no_grad()
def torch_eagle3_logits(sd, cfg, embed, tokens, hidden, *, wrong=None, positions=None):
    """EAGLE-3 head forward over a causal sequence, float32.

    embed: the target's [V, h] embedding (ignored when sd has "embed_tokens.weight");
    tokens [B,T]; hidden: [B,T,3*th] fused target states (low, mid, high concatenated) ->
    fc is applied, or [B,T,h] (the head's own earlier output, pre-norm) -> fc is skipped
    (EAGLE skips fc when the width differs from the embedding width).
    x = fc(fused); a = concat([input_layernorm(emb), hidden_norm(x)]);
    x = x + o(attn(a)); x = x + mlp(post_attention_layernorm(x));
    logits = lm_head(norm(x)) over the draft vocabulary.
    wrong: None | "swap_concat" (concat [hidden_norm(x), input_layernorm(emb)]).
    Returns (draft logits [B,T,draft_vocab] float32, out hidden x [B,T,h] pre-norm).
    """
    if wrong not in (None, "swap_concat"):
        raise ValueError(f"unknown wrong variant {wrong!r}")
    h = cfg["hidden_size"]
    eps = float(cfg["rms_norm_eps"])
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    table = sd["embed_tokens.weight"] if "embed_tokens.weight" in sd else embed
    emb = _f32(table)[tokens]
    x = _f32(hidden)
    if x.shape[-1] != h:
        x = _linear_apply(x, sd, "fc")
    e_n = _rms_norm(emb, sd["midlayer.input_layernorm.weight"], eps)
    x_n = _rms_norm(x, sd["midlayer.hidden_norm.weight"], eps)
    a_in = torch.cat([x_n, e_n] if wrong == "swap_concat" else [e_n, x_n], dim=-1)
    pos = _positions(x.shape[1], positions)
    x = x + _attention(a_in, sd, "midlayer.self_attn.", cfg, pos)
    n = _rms_norm(x, sd["midlayer.post_attention_layernorm.weight"], eps)
    x = x + _mlp(n, sd, "midlayer.mlp.")
    logits = _rms_norm(x, sd["norm.weight"], eps) @ _f32(sd["lm_head.weight"]).T
    return logits, x


@torch.no_grad()
def torch_specforge_eagle3_logits(sd, cfg, tokens, hidden, *, norm_output=None):
    """SpecForge's ``LlamaForCausalLMEagle3`` over a causal sequence at positions 0..T-1,
    float32, as its trainer runs it (``algorithms/eagle3/model.py``: ``project_hidden_states``,
    ``embed_input_ids``, ``backbone``, ``compute_logits``; ``SPECFORGE_COMMIT``).

    tokens [B,T]; hidden [B,T,3*th] fused target states. emb = embed_tokens(tokens) (the
    head's own table); x = fc(concat(fc_norm_i(chunk_i))) (fc_norm only when the config says
    so); a = concat([input_layernorm(emb), hidden_norm(x)]); x = x + o(attn(a)) with heads of
    the config's ``head_dim``; x = x + mlp(post_attention_layernorm(x)); logits =
    lm_head(norm(x)) when ``norm_output`` (the config's, default true), else lm_head(x).
    ``norm_output`` given here overrides the config (a wrong variant for negative checks).
    Returns (draft logits [B,T,draft_vocab], x [B,T,h] before the final norm).
    """
    h = cfg["hidden_size"]
    eps = float(cfg["rms_norm_eps"])
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    if norm_output is None:
        norm_output = cfg.get("norm_output", True)
    tokens = torch.as_tensor(tokens, dtype=torch.int64)
    emb = _f32(sd["embed_tokens.weight"])[tokens]
    x = _f32(hidden)
    if cfg.get("fc_norm", False):
        x = torch.cat([_rms_norm(c, sd[f"fc_norm.{i}.weight"], eps)
                       for i, c in enumerate(x.chunk(3, dim=-1))], dim=-1)
    x = _linear_apply(x, sd, "fc")
    e_n = _rms_norm(emb, sd["midlayer.input_layernorm.weight"], eps)
    x_n = _rms_norm(x, sd["midlayer.hidden_norm.weight"], eps)
    pos = _positions(x.shape[1], None)
    x = x + _attention(torch.cat([e_n, x_n], dim=-1), sd, "midlayer.self_attn.", cfg, pos,
                       head_dim=hd)
    n = _rms_norm(x, sd["midlayer.post_attention_layernorm.weight"], eps)
    x = x + _mlp(n, sd, "midlayer.mlp.")
    out = _rms_norm(x, sd["norm.weight"], eps) if norm_output else x
    return out @ _f32(sd["lm_head.weight"]).T, x


def d2t_target_ids(d2t, draft_ids):
    """Target-vocabulary ids of draft ids: draft_id + d2t[draft_id] (d2t holds offsets)."""
    d2t = torch.as_tensor(d2t, dtype=torch.int64)
    draft_ids = torch.as_tensor(draft_ids, dtype=torch.int64)
    return draft_ids + d2t[draft_ids]


def d2t_absolute(d2t, draft_ids):
    """The WRONG reading of d2t, as absolute ids: d2t[draft_id]. For negative checks."""
    d2t = torch.as_tensor(d2t, dtype=torch.int64)
    return d2t[torch.as_tensor(draft_ids, dtype=torch.int64)]


def edit_state_dict(path, fn) -> None:
    """Applies ``fn`` to the state dict in ``path/pytorch_model.bin`` and saves it back
    (tests corrupt a written head this way)."""
    f = os.path.join(path, "pytorch_model.bin")
    sd = torch.load(f, weights_only=True)
    fn(sd)
    torch.save(sd, f)
