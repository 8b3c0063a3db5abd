"""Weight loading: GGUF (llama.cpp) files and local HF directories, into the params pytree
of a Llama, Gemma or T5 model (``model_for`` builds the model class for the config).

Each source format has an explicit table from its tensor names to ours. Loading fails with a
message naming the tensor or path when a tensor is missing, unexpected, or of the wrong
shape; it never fills in or drops weights silently.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from specjax.models.gemma import GemmaConfig, gemma3_layer_types
from specjax.models.llama import LlamaConfig, RopeScaling, top_shapes

Transform = Callable[[np.ndarray, LlamaConfig], np.ndarray]
Config = LlamaConfig | GemmaConfig


def family(cfg: Config) -> str:
    if type(cfg).__name__ == "T5Config":
        return "T5"
    return "Gemma" if isinstance(cfg, GemmaConfig) else "Llama"


def model_for(cfg: Config, compute_dtype=jnp.float32):
    """The model class instance for a config: ``Llama``, ``Gemma`` or ``T5``, multiplying
    in ``compute_dtype``."""
    from specjax.models.gemma import Gemma
    from specjax.models.llama import Llama
    from specjax.models.t5 import T5

    return {"T5": T5, "Gemma": Gemma, "Llama": Llama}[family(cfg)](cfg, compute_dtype)


class WeightLoadError(ValueError):
    """A checkpoint that does not match the architecture it claims."""


def _unpermute(n_heads: Callable[[LlamaConfig], int]) -> Transform:
    """Undoes llama.cpp's row permutation of Q/K (interleaved -> half-split RoPE)."""
    def f(w, cfg):
        n = n_heads(cfg)
        return w.reshape(n, cfg.head_dim // 2, 2, w.shape[-1]).swapaxes(1, 2).reshape(w.shape)
    return f


_same = lambda w, cfg: w  # noqa: E731

# (source name pattern with {i} for the layer, our unfused name, transform to our layout)
GGUF_KEYS = [
    ("token_embd.weight", "embed", _same),
    ("output_norm.weight", "final_norm", _same),
    ("output.weight", "lm_head", _same),
    ("blk.{i}.attn_norm.weight", "layers/attn_norm", _same),
    ("blk.{i}.attn_q.weight", "layers/q", _unpermute(lambda c: c.num_heads)),
    ("blk.{i}.attn_k.weight", "layers/k", _unpermute(lambda c: c.num_kv_heads)),
    ("blk.{i}.attn_v.weight", "layers/v", _same),
    ("blk.{i}.attn_output.weight", "layers/o", _same),
    ("blk.{i}.ffn_norm.weight", "layers/mlp_norm", _same),
    ("blk.{i}.ffn_gate.weight", "layers/gate", _same),
    ("blk.{i}.ffn_up.weight", "layers/up", _same),
    ("blk.{i}.ffn_down.weight", "layers/down", _same),
]

HF_KEYS = [
    ("model.embed_tokens.weight", "embed", _same),
    ("model.norm.weight", "final_norm", _same),
    ("lm_head.weight", "lm_head", _same),
    ("model.layers.{i}.input_layernorm.weight", "layers/attn_norm", _same),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers/q", _same),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers/k", _same),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers/v", _same),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers/o", _same),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers/mlp_norm", _same),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers/gate", _same),
    ("model.layers.{i}.mlp.up_proj.weight", "layers/up", _same),
    ("model.layers.{i}.mlp.down_proj.weight", "layers/down", _same),
    # present only where the config asks (LlamaConfig.attention_bias, o_bias, qk_norm):
    # Qwen2's q/k/v biases, Llama's and Qwen3's attention_bias, Qwen3's per-head norms
    ("model.layers.{i}.self_attn.q_proj.bias", "layers/q_b", _same),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers/k_b", _same),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers/v_b", _same),
    ("model.layers.{i}.self_attn.o_proj.bias", "layers/o_b", _same),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers/q_norm", _same),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers/k_norm", _same),
]


GGUF_GEMMA_KEYS = [  # norm gains are stored as the multiplier (1 + w), as we keep them
    ("token_embd.weight", "embed", _same),
    ("output_norm.weight", "final_norm", _same),
    ("output.weight", "lm_head", _same),
    ("blk.{i}.attn_norm.weight", "layers/attn_norm", _same),
    ("blk.{i}.attn_q.weight", "layers/q", _same),
    ("blk.{i}.attn_k.weight", "layers/k", _same),
    ("blk.{i}.attn_v.weight", "layers/v", _same),
    ("blk.{i}.attn_q_norm.weight", "layers/q_norm", _same),
    ("blk.{i}.attn_k_norm.weight", "layers/k_norm", _same),
    ("blk.{i}.attn_output.weight", "layers/o", _same),
    ("blk.{i}.post_attention_norm.weight", "layers/post_attn_norm", _same),
    ("blk.{i}.ffn_norm.weight", "layers/mlp_norm", _same),
    ("blk.{i}.ffn_gate.weight", "layers/gate", _same),
    ("blk.{i}.ffn_up.weight", "layers/up", _same),
    ("blk.{i}.ffn_down.weight", "layers/down", _same),
    ("blk.{i}.post_ffw_norm.weight", "layers/post_mlp_norm", _same),
]

_gain = lambda w, cfg: w + 1.0  # noqa: E731  -- HF Gemma stores w and multiplies by 1 + w

HF_GEMMA_KEYS = [
    ("model.embed_tokens.weight", "embed", _same),
    ("model.norm.weight", "final_norm", _gain),
    ("lm_head.weight", "lm_head", _same),
    ("model.layers.{i}.input_layernorm.weight", "layers/attn_norm", _gain),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers/q", _same),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers/k", _same),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers/v", _same),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers/q_norm", _gain),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers/k_norm", _gain),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers/o", _same),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers/post_attn_norm", _gain),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", "layers/mlp_norm", _gain),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers/gate", _same),
    ("model.layers.{i}.mlp.up_proj.weight", "layers/up", _same),
    ("model.layers.{i}.mlp.down_proj.weight", "layers/down", _same),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "layers/post_mlp_norm", _gain),
]


def unfused_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Shapes of the per-matrix weights that source formats store, all [out, in]; the
    optional ones (biases ``q_b``, ``k_b``, ``v_b``, ``o_b``; head norms ``q_norm``,
    ``k_norm``) exactly where the config asks for them, so a checkpoint with more or fewer
    tensors than its config fails to load."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = {"attn_norm": (d,), "q": (nq, d), "k": (nk, d), "v": (nk, d), "o": (d, nq),
             "mlp_norm": (d,), "gate": (f, d), "up": (f, d), "down": (d, f)}
    if isinstance(cfg, GemmaConfig):
        layer.update(post_attn_norm=(d,), post_mlp_norm=(d,))
    if getattr(cfg, "attention_bias", False):
        layer.update(q_b=(nq,), k_b=(nk,), v_b=(nk,))
    if getattr(cfg, "o_bias", False):
        layer.update(o_b=(d,))
    if getattr(cfg, "qk_norm", False):
        layer.update(q_norm=(hd,), k_norm=(hd,))
    return {**top_shapes(cfg), **{f"layers/{k}": v for k, v in layer.items()}}


def pack_layer(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fuses one layer's separate matrices into the layout the models read: ``qkv`` and
    ``gate_up`` stacked, and the q/k/v biases (where present: all three) into ``qkv_b`` in
    ``qkv``'s row order; every other weight (norm gains, ``o_b``) as it is."""
    fused = ("q", "k", "v", "gate", "up", "q_b", "k_b", "v_b")
    out = {k: v for k, v in w.items() if k not in fused}
    out["qkv"] = np.concatenate([w["q"], w["k"], w["v"]], axis=0)
    out["gate_up"] = np.concatenate([w["gate"], w["up"]], axis=0)
    if any(n in w for n in ("q_b", "k_b", "v_b")):
        out["qkv_b"] = np.concatenate([w["q_b"], w["k_b"], w["v_b"]], axis=0)
    return out


def _match(name: str, keys) -> tuple[str, int | None, Transform] | None:
    for pattern, ours, fn in keys:
        rx = "^" + re.escape(pattern).replace(r"\{i\}", r"(\d+)") + "$"
        m = re.match(rx, name)
        if m:
            return ours, (int(m.group(1)) if m.groups() else None), fn
    return None


def assemble(cfg: LlamaConfig, tensors: dict[str, np.ndarray], keys, source: str,
             dtype=jnp.float32, ignore: tuple[str, ...] = ()) -> dict:
    """Maps source tensors to a params pytree, checking names and shapes exactly."""
    shapes = unfused_shapes(cfg)
    per_layer: dict[str, list] = {k: [None] * cfg.num_layers for k in shapes if k.startswith("layers/")}
    flat: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        if name in ignore:
            continue
        hit = _match(name, keys)
        if hit is None or (hit[0] not in shapes) or (hit[1] is not None and hit[1] >= cfg.num_layers):
            raise WeightLoadError(f"{source}: unexpected tensor {name!r} (shape {w.shape}) "
                                  f"for a {cfg.num_layers}-layer {family(cfg)} with "
                                  f"tie_embeddings={cfg.tie_embeddings}")
        ours, layer, fn = hit
        want = shapes[ours]
        try:
            arr = fn(np.asarray(w), cfg)
        except ValueError as e:
            raise WeightLoadError(f"{source}: tensor {name!r} has shape {w.shape}, which does not "
                                  f"fit {ours} of shape {want}: {e}") from None
        if arr.shape != tuple(want):
            raise WeightLoadError(f"{source}: tensor {name!r} has shape {w.shape}; expected "
                                  f"a tensor mapping to {ours} of shape {tuple(want)}, got {arr.shape}")
        if layer is None:
            flat[ours] = arr
        else:
            per_layer[ours][layer] = arr
    missing = [k for k in shapes if not k.startswith("layers/") and k not in flat]
    missing += [f"{k}[{i}]" for k, ws in per_layer.items() for i, w in enumerate(ws) if w is None]
    if missing:
        src = {ours: pat for pat, ours, _ in keys}
        names = [src[m.split("[")[0]].replace("{i}", m.split("[")[1][:-1]) if "[" in m else src[m]
                 for m in missing]
        raise WeightLoadError(f"{source}: missing tensors {names[:8]}"
                              f"{' and %d more' % (len(names) - 8) if len(names) > 8 else ''}")
    params = {k: jnp.asarray(v, dtype) for k, v in flat.items()}
    for i in range(cfg.num_layers):
        layer = pack_layer({k.split("/")[1]: ws[i] for k, ws in per_layer.items()})
        params.setdefault("layers", []).append({k: jnp.asarray(v, dtype) for k, v in layer.items()})
    return params


# --------------------------------------------------------------------------- GGUF

def _gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> Config:
    """The architecture recorded in a GGUF file's metadata (``llama`` or ``gemma3``)."""
    arch = _gguf_field(reader, "general.architecture")
    if arch == "gemma3":
        return _gguf_gemma3_config(reader)
    if arch != "llama":
        raise WeightLoadError(f"GGUF architecture {arch!r} is not supported (llama, gemma3)")
    g = lambda k, d=None: _gguf_field(reader, f"llama.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = RopeScaling()
    kind = g("rope.scaling.type")
    if kind == "linear":
        scaling = RopeScaling("linear", factor=float(g("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise WeightLoadError(f"GGUF rope.scaling.type {kind!r} is not supported (linear only)")
    return LlamaConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        max_position_embeddings=int(g("context_length", 4096)))


def _gguf_gemma3_config(reader) -> GemmaConfig:
    """Gemma 3 from GGUF metadata. The local RoPE base, the 5-local-1-global layer pattern
    and ``query_pre_attn_scalar`` are not recorded in the file; transformers' Gemma 3
    defaults apply (10000, 6, 256), as in the reference it loads from the same file."""
    g = lambda k, d=None: _gguf_field(reader, f"gemma3.{k}", d)  # noqa: E731
    heads, n = int(g("attention.head_count")), int(g("block_count"))
    names = {t.name for t in reader.tensors}
    scaling = RopeScaling()
    if g("rope.scaling.type") == "linear":
        scaling = RopeScaling("linear", factor=float(g("rope.scaling.factor")))
    return GemmaConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=int(g("embedding_length")), intermediate_size=int(g("feed_forward_length")),
        num_layers=n, num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length")), layer_types=gemma3_layer_types(n),
        sliding_window=int(g("attention.sliding_window", 512)),
        rope_theta=float(g("rope.freq_base", 1_000_000.0)),
        rope_local_theta=float(g("rope.freq_base_swa", 10_000.0)), rope_scaling=scaling,
        query_pre_attn_scalar=256.0, qk_norm=True,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_embeddings="output.weight" not in names,
        max_position_embeddings=int(g("context_length", 32768)))


def gguf_file_config(path: str | Path) -> Config:
    """The model config of a GGUF file, from its metadata alone (no tensor is read)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf_config(gguf.GGUFReader(str(path)))
    except WeightLoadError:
        raise
    except Exception as e:  # gguf raises assorted errors on corrupt files
        raise WeightLoadError(f"{path}: not a readable GGUF file ({e})") from e


def load_gguf(path: str | Path, dtype=jnp.float32) -> tuple[Config, dict]:
    """Reads and dequantizes a llama- or gemma3-architecture GGUF file (any ggml
    quantization)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises assorted errors on corrupt files
        raise WeightLoadError(f"{path}: not a readable GGUF file ({e})") from e
    cfg = gguf_config(reader)
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.asarray(w, np.float32).reshape(tuple(reversed(t.shape.tolist())))
    keys = GGUF_GEMMA_KEYS if isinstance(cfg, GemmaConfig) else GGUF_KEYS
    return cfg, assemble(cfg, tensors, keys, str(path), dtype)


# --------------------------------------------------------------------------- HF directory

def _hf_rope(d: dict) -> tuple[float, RopeScaling]:
    """RoPE base and scaling from an HF config: transformers-5 ``rope_parameters`` or
    transformers-4 ``rope_scaling`` beside a top-level ``rope_theta``. ``WeightLoadError``
    for a scaling type ``RopeScaling`` does not implement (yarn, dynamic, longrope, ...)."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    fields = {f: rope[f] for f in ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings") if f in rope}
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise WeightLoadError(f"partial_rotary_factor {partial} is not supported (RoPE over "
                              "the whole head)")
    try:
        return float(theta), RopeScaling(kind, **fields)
    except ValueError as e:
        raise WeightLoadError(f"config.json RoPE scaling: {e}") from None


def _hf_sliding_check(d: dict, kind: str) -> None:
    """``WeightLoadError`` if any layer of a Qwen2/Qwen3 config attends through a sliding
    window shorter than its context (the Llama port attends to every cached position). As
    transformers reads the config: the window applies only with ``use_sliding_window``, to
    the layers ``layer_types`` marks ``sliding_attention`` (default: layers from
    ``max_window_layers`` on)."""
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    if window is None:
        return
    n = d["num_hidden_layers"]
    types = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", n) else "full_attention"
        for i in range(n)]
    context = d.get("max_position_embeddings", 4096)
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and int(window) < context:
        raise WeightLoadError(
            f"{kind} config.json: use_sliding_window with sliding_window={window} < "
            f"max_position_embeddings={context} on layers {sliding[:8]} is not supported (the "
            "Llama-family port attends to every position); Qwen checkpoints ship "
            "use_sliding_window: false")


def hf_config(d: dict) -> LlamaConfig:
    """A LlamaConfig from an HF ``config.json`` of ``model_type`` ``llama`` (Llama 2/3.x,
    SmolLM2), ``qwen2`` (Qwen2/2.5) or ``qwen3`` (transformers v4 or v5 RoPE fields).

    Qwen2 always has q/k/v biases and no ``o`` bias; Llama's and Qwen3's ``attention_bias``
    (default false) biases q, k, v and o; Qwen3 norms each query and key head
    (``qk_norm``). ``WeightLoadError`` for what the port does not compute: another
    activation than SiLU, MLP biases, an unsupported RoPE scaling, or a sliding window
    shorter than the context."""
    kind = d.get("model_type", "llama")
    if kind not in ("llama", "qwen2", "qwen3"):
        raise WeightLoadError(f"model_type {kind!r} is not a Llama-family config "
                              "(llama, qwen2, qwen3)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise WeightLoadError(f"{kind} config.json: hidden_act {act!r} is not supported (silu)")
    if d.get("mlp_bias", False):
        raise WeightLoadError(f"{kind} config.json: mlp_bias is not supported (bias-free MLP)")
    if kind != "llama":
        _hf_sliding_check(d, kind)
    theta, scaling = _hf_rope(d)
    bias = bool(d.get("attention_bias", False))
    heads = d["num_attention_heads"]
    return LlamaConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads, rope_theta=theta,
        rope_scaling=scaling, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        tie_embeddings=d.get("tie_word_embeddings", False),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        attention_bias=True if kind == "qwen2" else bias,
        o_bias=False if kind == "qwen2" else bias, qk_norm=kind == "qwen3")


def hf_gemma_config(d: dict) -> GemmaConfig:
    """A GemmaConfig from an HF ``config.json`` of ``gemma2`` or ``gemma3_text``."""
    kind = d["model_type"]
    n, heads = d["num_hidden_layers"], d["num_attention_heads"]
    types = d.get("layer_types")
    if types is None:
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern",
                                                        2 if kind == "gemma2" else 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n)]
    rope = d.get("rope_parameters") or {}
    full = dict(rope.get("full_attention", rope if "rope_theta" in rope else {}))
    local = rope.get("sliding_attention", {})
    theta = full.pop("rope_theta", d.get("rope_theta", 10000.0 if kind == "gemma2" else 1e6))
    rtype = full.pop("rope_type", "default")
    fields = {f: full[f] for f in ("factor",) if f in full}
    local_theta = local.get("rope_theta", d.get("rope_local_base_freq",
                                                theta if kind == "gemma2" else 10000.0))
    act = d.get("hidden_activation") or d.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise WeightLoadError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    return GemmaConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=n, num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        layer_types=tuple("full" if t == "full_attention" else "sliding" for t in types),
        sliding_window=int(d.get("sliding_window") or 4096), rope_theta=float(theta),
        rope_local_theta=float(local_theta), rope_scaling=RopeScaling(rtype, **fields),
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        qk_norm=kind != "gemma2", attn_logit_softcapping=d.get("attn_logit_softcapping"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        tie_embeddings=d.get("tie_word_embeddings", True),
        max_position_embeddings=d.get("max_position_embeddings", 8192))


_HF_FAMILIES = {"llama": hf_config, "qwen2": hf_config, "qwen3": hf_config,
                "gemma2": hf_gemma_config, "gemma3_text": hf_gemma_config,
                "t5": lambda d: hf_t5_config(d)}


def hf_dir_config(path: str | Path) -> Config:
    """The model config of a local HF directory, from its ``config.json``."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    d = json.loads(cfg_file.read_text())
    kind = d.get("model_type", "llama")
    if kind not in _HF_FAMILIES:
        raise WeightLoadError(f"{cfg_file}: model_type {kind!r} is not supported "
                              f"({', '.join(_HF_FAMILIES)})")
    return _HF_FAMILIES[kind](d)


def load_hf_dir(path: str | Path, dtype=jnp.float32) -> tuple[Config, dict]:
    """Loads ``config.json`` and every ``*.safetensors`` file of a local HF directory."""
    from safetensors.flax import load_file

    path = Path(path)
    cfg = hf_dir_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors = {}
    for f in files:
        try:
            loaded = load_file(str(f))
        except Exception as e:
            raise WeightLoadError(f"{f}: not a readable safetensors file ({e})") from e
        tensors.update({k: np.asarray(v.astype(jnp.float32)) for k, v in loaded.items()})
    if family(cfg) == "T5":
        return _t5_tied(cfg, tensors, path, dtype)
    ignore = ()
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        emb = tensors.get("model.embed_tokens.weight")
        if emb is None or not np.array_equal(emb, tensors["lm_head.weight"]):
            raise WeightLoadError(f"{path}: config.json ties the embeddings, but "
                                  "'lm_head.weight' differs from 'model.embed_tokens.weight'")
        ignore = ("lm_head.weight",)  # a saved copy of the tied embedding
    keys = HF_GEMMA_KEYS if isinstance(cfg, GemmaConfig) else HF_KEYS
    return cfg, assemble(cfg, tensors, keys, str(path), dtype, ignore=ignore)


# --------------------------------------------------------------------------- T5 (HF directory)

def hf_t5_config(d: dict):
    """A T5Config from an HF ``config.json`` (``model_type`` ``t5``).

    The LM head scaling follows transformers: ``scale_decoder_outputs`` when the file has it
    (transformers >= 5 writes it), else ``tie_word_embeddings`` (default true). Whether the
    head is tied is settled when the weights load: by a saved ``lm_head.weight``."""
    from specjax.models.t5 import T5Config

    proj = d.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise WeightLoadError(f"feed_forward_proj {proj!r} is not supported "
                              "(relu, gated-gelu, gelu_new, gated-gelu_new)")
    act = "gelu_new" if parts[-1] in ("gelu", "gelu_new") else parts[-1]
    if act not in ("relu", "gelu_new"):
        raise WeightLoadError(f"feed_forward_proj {proj!r}: activation {parts[-1]!r} is not "
                              "supported (relu, gelu_new)")
    if d.get("decoder_start_token_id") is None:
        raise WeightLoadError("config.json has no decoder_start_token_id: the decoder cannot "
                              "start (T5 checkpoints use the pad id, usually 0)")
    tie = d.get("tie_word_embeddings", True)
    eos = d.get("eos_token_id", 1)
    return T5Config(
        vocab_size=d["vocab_size"], hidden_size=d["d_model"], intermediate_size=d["d_ff"],
        num_layers=d.get("num_decoder_layers") or d["num_layers"],
        num_encoder_layers=d["num_layers"], num_heads=d["num_heads"], head_dim=d["d_kv"],
        num_buckets=d.get("relative_attention_num_buckets", 32),
        max_distance=d.get("relative_attention_max_distance", 128),
        gated=len(parts) == 2, activation=act, tie_embeddings=tie,
        scale_output=d.get("scale_decoder_outputs", tie is not False),
        rms_norm_eps=d.get("layer_norm_epsilon", 1e-6),
        decoder_start_token_id=int(d["decoder_start_token_id"]),
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        pad_token_id=int(d.get("pad_token_id") or 0),
        max_position_embeddings=int(d.get("n_positions") or 2048),
        max_source_positions=int(d.get("n_positions") or 2048))


def _t5_name(name: str) -> tuple[str, int | None, str] | None:
    """(stack, layer, our name) of an HF T5 tensor name; None if it is not one."""
    m = re.match(r"^(encoder|decoder)\.block\.(\d+)\.layer\.(\d)\.(.+)\.weight$", name)
    if m is None:
        return None
    stack, i, sub, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    ffn = 1 if stack == "encoder" else 2
    table = {(0, "SelfAttention.q"): "q", (0, "SelfAttention.k"): "k",
             (0, "SelfAttention.v"): "v", (0, "SelfAttention.o"): "o",
             (0, "SelfAttention.relative_attention_bias"): "rel_bias",
             (0, "layer_norm"): "attn_norm",
             (ffn, "DenseReluDense.wi"): "wi", (ffn, "DenseReluDense.wi_0"): "wi_0",
             (ffn, "DenseReluDense.wi_1"): "wi_1", (ffn, "DenseReluDense.wo"): "wo",
             (ffn, "layer_norm"): "mlp_norm"}
    if stack == "decoder":
        table.update({(1, "EncDecAttention.q"): "cross_q", (1, "EncDecAttention.k"): "cross_k",
                      (1, "EncDecAttention.v"): "cross_v", (1, "EncDecAttention.o"): "cross_o",
                      (1, "layer_norm"): "cross_norm"})
    ours = table.get((sub, rest))
    return None if ours is None else (stack, i, ours)


def t5_params(cfg, tensors: dict[str, np.ndarray], source: str, dtype=jnp.float32) -> dict:
    """Maps HF T5 tensors to the T5 params pytree, checking every name and shape."""
    from specjax.models.t5 import layer_shapes

    n_layers = {"encoder": cfg.num_encoder_layers, "decoder": cfg.num_layers}
    raw = {"encoder": [dict() for _ in range(cfg.num_encoder_layers)],
           "decoder": [dict() for _ in range(cfg.num_layers)]}
    top, rel = {}, {}
    tops = {"shared.weight": "embed", "lm_head.weight": "lm_head",
            "encoder.final_layer_norm.weight": "enc_norm",
            "decoder.final_layer_norm.weight": "final_norm"}
    for name, w in tensors.items():
        if name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            continue  # copies of shared.weight (checked below)
        hit = _t5_name(name)
        if name in tops:
            top[tops[name]] = w
        elif hit is None or hit[1] >= n_layers[hit[0]]:
            raise WeightLoadError(f"{source}: unexpected tensor {name!r} (shape {w.shape}) for a "
                                  f"T5 with {cfg.num_encoder_layers}+{cfg.num_layers} layers")
        elif hit[2] == "rel_bias":
            if hit[1] == 0:
                rel[hit[0]] = w
        else:
            raw[hit[0]][hit[1]][hit[2]] = w
    if "embed" not in top:
        top["embed"] = tensors.get("encoder.embed_tokens.weight")
    d, v = cfg.hidden_size, cfg.vocab_size
    want_top = {"embed": (v, d), "enc_norm": (d,), "final_norm": (d,)}
    if not cfg.tie_embeddings or "lm_head" in top:
        want_top["lm_head"] = (v, d)
    missing = [k for k in want_top if top.get(k) is None] + [
        f"{s}.rel_bias" for s in ("encoder", "decoder") if s not in rel]
    for k, shape in want_top.items():
        if k in top and top[k] is not None and tuple(top[k].shape) != shape:
            raise WeightLoadError(f"{source}: {k} has shape {top[k].shape}; expected {shape}")
    for s, r in rel.items():
        if r.shape != (cfg.num_buckets, cfg.num_heads):
            raise WeightLoadError(f"{source}: {s} relative_attention_bias has shape {r.shape}; "
                                  f"expected {(cfg.num_buckets, cfg.num_heads)}")

    def pack(w: dict, stack: str, i: int) -> dict:
        w = dict(w)
        fused = {"qkv": ("q", "k", "v"), "cross_kv": ("cross_k", "cross_v"),
                 "wi": ("wi_0", "wi_1") if cfg.gated else ("wi",)}
        if stack == "encoder":
            del fused["cross_kv"]
        for ours, parts in fused.items():
            if all(p in w for p in parts):
                w[ours] = np.concatenate([w.pop(p) for p in parts], axis=0)
        shapes = layer_shapes(cfg, stack == "decoder")
        gone = [k for k in shapes if k not in w]
        if gone:
            missing.extend(f"{stack}.block.{i}:{k}" for k in gone)
            return {}
        extra = [k for k in w if k not in shapes]
        if extra:
            raise WeightLoadError(f"{source}: {stack}.block.{i} has tensors {extra} that a "
                                  f"{'gated' if cfg.gated else 'plain'} feed-forward T5 "
                                  "does not use")
        for k, shape in shapes.items():
            if tuple(w[k].shape) != shape:
                raise WeightLoadError(f"{source}: {stack}.block.{i} {k} has shape "
                                      f"{w[k].shape}; expected {shape}")
        return {k: jnp.asarray(w[k], dtype) for k in shapes}

    enc = [pack(w, "encoder", i) for i, w in enumerate(raw["encoder"])]
    dec = [pack(w, "decoder", i) for i, w in enumerate(raw["decoder"])]
    if missing:
        raise WeightLoadError(f"{source}: missing tensors {missing[:8]}"
                              f"{' and %d more' % (len(missing) - 8) if len(missing) > 8 else ''}")
    arr = lambda x: jnp.asarray(x, dtype)
    params = {"embed": arr(top["embed"]),
              "encoder": {"rel_bias": arr(rel["encoder"]), "layers": enc,
                          "final_norm": arr(top["enc_norm"])},
              "rel_bias": arr(rel["decoder"]), "layers": dec, "final_norm": arr(top["final_norm"])}
    if "lm_head" in want_top:
        params["lm_head"] = arr(top["lm_head"])
    return params


def _t5_tied(cfg, tensors: dict[str, np.ndarray], path: Path, dtype) -> tuple:
    """T5 params from a directory's tensors. A saved ``lm_head.weight`` equal to the shared
    embedding is a tied copy; a different one is the head (as transformers loads it)."""
    import dataclasses

    head = tensors.get("lm_head.weight")
    shared = tensors.get("shared.weight", tensors.get("encoder.embed_tokens.weight"))
    if head is not None and shared is not None and np.array_equal(head, shared):
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
        head = None
    cfg = dataclasses.replace(cfg, tie_embeddings=head is None and cfg.tie_embeddings)
    return cfg, t5_params(cfg, tensors, str(path), dtype)
