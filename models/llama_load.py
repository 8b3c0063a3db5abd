"""The Llama family's checkpoints (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral): its HF
``config.json`` parser and GGUF (``llama`` architecture) metadata parser, its tables from
each format's tensor names to ours, and its registration (``families.register_family``).
Another ``model_type`` this port computes is one more name in ``FAMILY.hf_model_types``
(and, where its config differs, a rule in ``hf_config``), as ``mistral`` is."""

from __future__ import annotations

from typing import Callable

from specjax.models.families import Family, model_class, register_family
from specjax.models.gguf_file import GGUFFile
from specjax.models.gguf_source import GGUFFields
from specjax.models.hf_config import ABSENT, ConfigFields, config_fields, hf_rope
from specjax.models.llama import LlamaConfig
from specjax.models.streaming import Transform, weight_table


def _unpermute(n_heads: Callable[[LlamaConfig], int]) -> Transform:
    """Undoes llama.cpp's row permutation of Q/K (interleaved -> half-split RoPE)."""
    def f(w, cfg):
        n = n_heads(cfg)
        return w.reshape(n, cfg.head_dim // 2, 2, w.shape[-1]).swapaxes(1, 2).reshape(w.shape)
    return f


# Each format's table maps its tensor names to ours ({source name: ours}, per layer after
# "blk.{i}." or "model.layers.{i}."), read as stored where no transform is named.

#: the tensors outside the layers, as GGUF and HF Llama-style checkpoints name them (Gemma's too)
GGUF_TOP = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
            "output.weight": "lm_head"}
HF_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
          "lm_head.weight": "lm_head"}
#: the projections of an HF Llama-style layer (Gemma's too)
HF_PROJECTIONS = {"self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
                  "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o",
                  "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up",
                  "mlp.down_proj.weight": "down"}

GGUF_KEYS = weight_table(GGUF_TOP, {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
    "attn_v.weight": "v", "attn_output.weight": "o", "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
}, "blk.{i}.", {"q": _unpermute(lambda c: c.num_heads), "k": _unpermute(lambda c: c.num_kv_heads)})

HF_KEYS = weight_table(HF_TOP, {
    "input_layernorm.weight": "attn_norm", **HF_PROJECTIONS,
    "post_attention_layernorm.weight": "mlp_norm",
    # present only where the config asks (LlamaConfig.attention_bias, o_bias, qk_norm):
    # Qwen2's q/k/v biases, Llama's and Qwen3's attention_bias, Qwen3's per-head norms
    "self_attn.q_proj.bias": "q_b", "self_attn.k_proj.bias": "k_b",
    "self_attn.v_proj.bias": "v_b", "self_attn.o_proj.bias": "o_b",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
}, "model.layers.{i}.")


def _hf_sliding_check(f: ConfigFields, kind: str) -> None:
    """``WeightLoadError`` if any layer of a Qwen2/Qwen3/Mistral config attends through a sliding
    window shorter than its context (the Llama port attends to every cached position). As
    transformers reads the config: the window applies only with ``use_sliding_window``, to
    the layers ``layer_types`` marks ``sliding_attention`` (default: layers from
    ``max_window_layers`` on)."""
    # Mistral's window applies to every layer whenever it is set (transformers reads no
    # use_sliding_window flag for it): v0.1 sets 4096, v0.2 and later null
    if kind != "mistral" and not f.flag("use_sliding_window", False):
        return
    window = f.integer("sliding_window", None)
    if window is None:
        return
    n = f.integer("num_hidden_layers")
    first = f.integer("max_window_layers", n, minimum=0)
    types = f.texts("layer_types", None) or [
        "sliding_attention" if i >= first or kind == "mistral" else "full_attention"
        for i in range(n)]
    context = f.integer("max_position_embeddings", 4096)
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and window < context:
        f.fail(f"{kind}: a sliding window (sliding_window={window} < "
               f"max_position_embeddings={context}) on layers {sliding[:8]} is not supported "
               "(the Llama-family port attends to every position); Qwen checkpoints ship "
               "use_sliding_window: false, Mistral's from v0.2 sliding_window: null")


def hf_config(d: dict | ConfigFields) -> LlamaConfig:
    """A LlamaConfig from an HF ``config.json`` of ``model_type`` ``llama`` (Llama 2/3.x,
    SmolLM2), ``qwen2`` (Qwen2/2.5), ``qwen3`` or ``mistral`` (Mistral-7B v0.2 and later,
    without a sliding window; transformers v4 or v5 RoPE fields, read by :func:`hf_rope`).

    Qwen2 always has q/k/v biases and no ``o`` bias; Llama's and Qwen3's ``attention_bias``
    (default false) biases q, k, v and o; Qwen3 norms each query and key head
    (``qk_norm``). ``WeightLoadError`` naming the file and key for a missing key, a value of
    the wrong type, or what the port does not compute: another activation than SiLU, MLP
    biases, an unsupported RoPE, or a sliding window shorter than the context."""
    f = config_fields(d)
    kind = f.text("model_type", "llama")
    kinds = FAMILY.hf_model_types
    if kind not in kinds:
        f.fail(f"model_type {kind!r} is not a Llama-family config ({', '.join(kinds)})")
    act = f.text("hidden_act", "silu")
    if act != "silu":
        f.fail(f"{kind}: hidden_act {act!r} is not supported (silu)")
    if f.flag("mlp_bias", False):
        f.fail(f"{kind}: mlp_bias is not supported (bias-free MLP)")
    if kind != "llama":
        _hf_sliding_check(f, kind)
    theta, scaling = hf_rope(f)
    bias = f.flag("attention_bias", False)
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    return LlamaConfig(
        vocab_size=f.integer("vocab_size"), hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size"),
        num_layers=f.integer("num_hidden_layers"), num_heads=heads,
        num_kv_heads=f.integer("num_key_value_heads", heads),
        head_dim=f.integer("head_dim", hidden // heads), rope_theta=theta,
        rope_scaling=scaling, rms_norm_eps=f.number("rms_norm_eps", 1e-6, positive=True),
        tie_embeddings=f.flag("tie_word_embeddings", False),
        max_position_embeddings=f.integer("max_position_embeddings", 4096),
        attention_bias=True if kind == "qwen2" else bias,
        o_bias=False if kind == "qwen2" else bias, qk_norm=kind == "qwen3")


def gguf_llama_config(reader: GGUFFile) -> LlamaConfig:
    """A LlamaConfig from the metadata of a GGUF file of architecture ``llama``."""
    g = GGUFFields(reader, "llama")
    heads = g.integer("attention.head_count")
    hidden = g.integer("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = g.integer("vocab_size", len(reader.get("tokenizer.ggml.tokens", ())) or ABSENT)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=g.integer("feed_forward_length"),
        num_layers=g.integer("block_count"),
        num_heads=heads, num_kv_heads=g.integer("attention.head_count_kv", heads),
        head_dim=g.integer("rope.dimension_count", hidden // heads),
        rope_theta=g.number("rope.freq_base", 10000.0), rope_scaling=g.rope_scaling(),
        rms_norm_eps=g.number("attention.layer_norm_rms_epsilon", 1e-5),
        tie_embeddings="output.weight" not in names,
        max_position_embeddings=g.integer("context_length", 4096))


FAMILY = register_family(Family(
    "Llama", LlamaConfig, model_class("llama", "Llama"), hf_config,
    ("llama", "qwen2", "qwen3", "mistral"), ("llama",), gguf_config=gguf_llama_config,
    hf_keys=tuple(HF_KEYS), gguf_keys=tuple(GGUF_KEYS)))
