"""The Gemma family's checkpoints (Gemma 2, Gemma 3 text): its HF ``config.json`` parser
(``gemma2``, ``gemma3_text``; RoPE per layer type) and GGUF (``gemma3`` architecture)
metadata parser, its tables from each format's tensor names to ours (norm gains kept as the
multiplier ``1 + w``), and its registration (``families.register_family``)."""

from __future__ import annotations

import dataclasses

from specjax.models.base import RopeScaling
from specjax.models.families import Family, model_class, register_family
from specjax.models.gemma import GemmaConfig, gemma3_layer_types
from specjax.models.gguf_file import GGUFFile
from specjax.models.gguf_source import GGUFFields
from specjax.models.hf_config import ConfigFields, config_fields, hf_rope, rope_block
from specjax.models.llama_load import GGUF_TOP, HF_PROJECTIONS, HF_TOP
from specjax.models.streaming import WeightLoadError, weight_table


# norm gains are stored as the multiplier (1 + w), as we keep them
GGUF_GEMMA_KEYS = weight_table(GGUF_TOP, {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
    "attn_v.weight": "v", "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "o", "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "gate", "ffn_up.weight": "up",
    "ffn_down.weight": "down", "post_ffw_norm.weight": "post_mlp_norm",
}, "blk.{i}.")

_gain = lambda w, cfg: w + 1.0  # noqa: E731  -- HF Gemma stores w and multiplies by 1 + w

HF_GEMMA_KEYS = weight_table(HF_TOP, {
    "input_layernorm.weight": "attn_norm", **HF_PROJECTIONS,
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}, "model.layers.{i}.", dict.fromkeys(
    ("final_norm", "attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm",
     "post_mlp_norm"), _gain))


def _gemma3_rope(f: ConfigFields) -> tuple[float, float, RopeScaling]:
    """Global base, local base and global scaling of a Gemma 3 config, read as transformers
    5.24 reads them (``Gemma3TextConfig.convert_rope_params_to_dict``): ``rope_parameters``
    nested by layer type, where a v4 ``rope_scaling`` updates the ``full_attention`` entry
    key by key; bases default to ``rope_theta`` (else 1e6) and ``rope_local_base_freq``
    (else 1e4). The sliding layers' RoPE must be unscaled, as specjax computes it."""
    rp = f.obj("rope_parameters")
    flat = sorted(set(rp.d) - {"full_attention", "sliding_attention"})
    if flat:
        f.fail(f"'rope_parameters' holds {flat}, which transformers does not read for "
               "gemma3_text (nest them under full_attention and sliding_attention)")
    full = rp.obj("full_attention")
    if f.d.get("rope_scaling") is not None:
        if rp.d and "full_attention" not in rp.d:
            f.fail("'rope_scaling' updates 'rope_parameters.full_attention', which is missing")
        full = dataclasses.replace(full, d={**full.d, **f.obj("rope_scaling").d},
                                   prefix="rope_scaling.")
    theta, scaling = rope_block(full, f.number("rope_theta", 1e6, positive=True),
                                f.integer("max_position_embeddings", None))
    local = rp.obj("sliding_attention")
    local_theta, local_scaling = rope_block(
        local, f.number("rope_local_base_freq", 1e4, positive=True))
    if local_scaling != RopeScaling():
        f.fail(f"'rope_parameters.sliding_attention' scaling {local_scaling.rope_type!r} is not "
               "supported (the sliding layers' RoPE is unscaled)")
    return theta, local_theta, scaling


def _gemma_rope(f: ConfigFields, kind: str) -> tuple[float, float, RopeScaling]:
    """(global base, local base, global scaling): Gemma 3's per layer type; Gemma 2's one
    flat RoPE for every layer (as transformers computes it), which must be unscaled."""
    if kind != "gemma2":
        return _gemma3_rope(f)
    theta, scaling = hf_rope(f)
    if scaling != RopeScaling():
        f.fail(f"gemma2 RoPE scaling {scaling.rope_type!r} is not supported (transformers "
               "scales the sliding layers too)")
    return theta, theta, scaling


def hf_gemma_config(d: dict | ConfigFields) -> GemmaConfig:
    """A GemmaConfig from an HF ``config.json`` of ``gemma2`` or ``gemma3_text``;
    ``WeightLoadError`` naming the file and key for a missing key, a value of the wrong
    type, or what the port does not compute."""
    f = config_fields(d)
    kind = f.text("model_type")
    n, heads = f.integer("num_hidden_layers"), f.integer("num_attention_heads")
    types = f.texts("layer_types", None)
    if types is None:
        pattern = f.integer("sliding_window_pattern", f.integer(
            "_sliding_window_pattern", 2 if kind == "gemma2" else 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n)]
    theta, local_theta, scaling = _gemma_rope(f, kind)
    act = f.text("hidden_activation", None) or f.text("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        f.fail(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    hidden = f.integer("hidden_size")
    return GemmaConfig(
        vocab_size=f.integer("vocab_size"), hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size"), num_layers=n, num_heads=heads,
        num_kv_heads=f.integer("num_key_value_heads", heads),
        head_dim=f.integer("head_dim", hidden // heads),
        layer_types=tuple("full" if t == "full_attention" else "sliding" for t in types),
        sliding_window=f.integer("sliding_window", 4096), rope_theta=theta,
        rope_local_theta=local_theta, rope_scaling=scaling,
        query_pre_attn_scalar=f.number("query_pre_attn_scalar", 256.0, positive=True),
        qk_norm=kind != "gemma2",
        attn_logit_softcapping=f.number("attn_logit_softcapping", None, positive=True),
        final_logit_softcapping=f.number("final_logit_softcapping", None, positive=True),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6, positive=True),
        tie_embeddings=f.flag("tie_word_embeddings", True),
        max_position_embeddings=f.integer("max_position_embeddings", 8192))


def gguf_gemma3_config(reader: GGUFFile) -> GemmaConfig:
    """Gemma 3 from GGUF metadata. The local RoPE base, the 5-local-1-global layer pattern
    and ``query_pre_attn_scalar`` are not recorded in the file; transformers' Gemma 3
    defaults apply (10000, 6, 256), as in the reference it loads from the same file."""
    g = GGUFFields(reader, "gemma3")
    heads, n = g.integer("attention.head_count"), g.integer("block_count")
    names = {t.name for t in reader.tensors}
    vocab = len(reader.get("tokenizer.ggml.tokens", ()))
    if vocab < 1:
        raise WeightLoadError(f"{reader.path or 'GGUF file'}: metadata key "
                              "'tokenizer.ggml.tokens' is missing or empty (the vocabulary)")
    return GemmaConfig(
        vocab_size=vocab,
        hidden_size=g.integer("embedding_length"),
        intermediate_size=g.integer("feed_forward_length"),
        num_layers=n, num_heads=heads,
        num_kv_heads=g.integer("attention.head_count_kv", heads),
        head_dim=g.integer("attention.key_length"), layer_types=gemma3_layer_types(n),
        sliding_window=g.integer("attention.sliding_window", 512),
        rope_theta=g.number("rope.freq_base", 1_000_000.0),
        rope_local_theta=g.number("rope.freq_base_swa", 10_000.0),
        rope_scaling=g.rope_scaling(), query_pre_attn_scalar=256.0, qk_norm=True,
        rms_norm_eps=g.number("attention.layer_norm_rms_epsilon", 1e-6),
        tie_embeddings="output.weight" not in names,
        max_position_embeddings=g.integer("context_length", 32768))


FAMILY = register_family(Family(
    "Gemma", GemmaConfig, model_class("gemma", "Gemma"), hf_gemma_config,
    ("gemma2", "gemma3_text"), ("gemma3",), gguf_config=gguf_gemma3_config,
    hf_keys=tuple(HF_GEMMA_KEYS), gguf_keys=tuple(GGUF_GEMMA_KEYS),
    layer_norms=("post_attn_norm", "post_mlp_norm")))
