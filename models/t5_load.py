"""The T5 family's checkpoints (original, v1.1, Flan; HF directories): its ``config.json``
parser, the map from HF T5 tensor names to the T5 params pytree (every tensor read whole in
float32, not streamed), and its registration (``families.register_family``)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.models.families import Family, model_class, register_family
from specjax.models.hf_config import ConfigFields, config_fields, is_int
from specjax.models.streaming import WeightLoadError
from specjax.models.t5 import T5Config, layer_shapes


def hf_t5_config(d: dict | ConfigFields) -> T5Config:
    """A T5Config from an HF ``config.json`` (``model_type`` ``t5``); ``WeightLoadError``
    naming the file and key for a missing key or a value of the wrong type.

    The LM head scaling follows transformers: ``scale_decoder_outputs`` when the file has it
    (transformers >= 5 writes it), else ``tie_word_embeddings`` (default true). Whether the
    head is tied is settled when the weights load: by a saved ``lm_head.weight``."""
    f = config_fields(d)
    proj = f.text("feed_forward_proj", "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        f.fail(f"feed_forward_proj {proj!r} is not supported "
               "(relu, gated-gelu, gelu_new, gated-gelu_new)")
    act = "gelu_new" if parts[-1] in ("gelu", "gelu_new") else parts[-1]
    if act not in ("relu", "gelu_new"):
        f.fail(f"feed_forward_proj {proj!r}: activation {parts[-1]!r} is not supported "
               "(relu, gelu_new)")
    if f.d.get("decoder_start_token_id") is None:
        f.fail("no decoder_start_token_id: the decoder cannot start (T5 checkpoints use the "
               "pad id, usually 0)")
    tie = f.flag("tie_word_embeddings", True)
    eos = f.value("eos_token_id", 1, lambda v: is_int(v) or (
        isinstance(v, list) and v and all(is_int(x) for x in v)), "an integer or a list of them")
    layers = f.integer("num_layers")
    positions = f.integer("n_positions", 2048)
    return T5Config(
        vocab_size=f.integer("vocab_size"), hidden_size=f.integer("d_model"),
        intermediate_size=f.integer("d_ff"),
        num_layers=f.integer("num_decoder_layers", layers),
        num_encoder_layers=layers, num_heads=f.integer("num_heads"),
        head_dim=f.integer("d_kv"),
        num_buckets=f.integer("relative_attention_num_buckets", 32),
        max_distance=f.integer("relative_attention_max_distance", 128),
        gated=len(parts) == 2, activation=act, tie_embeddings=tie,
        scale_output=f.flag("scale_decoder_outputs", tie),
        rms_norm_eps=f.number("layer_norm_epsilon", 1e-6, positive=True),
        decoder_start_token_id=f.integer("decoder_start_token_id", minimum=0),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        pad_token_id=f.integer("pad_token_id", 0, minimum=0),
        max_position_embeddings=positions, max_source_positions=positions)


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


def hf_t5_params(cfg, tensors: dict[str, np.ndarray], path: Path, dtype) -> tuple:
    """T5 params from a directory's tensors. A saved ``lm_head.weight`` equal to the shared
    embedding is a tied copy; a different one is the head (as transformers loads it)."""
    head = tensors.get("lm_head.weight")
    shared = tensors.get("shared.weight", tensors.get("encoder.embed_tokens.weight"))
    if head is not None and shared is not None and np.array_equal(head, shared):
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
        head = None
    cfg = dataclasses.replace(cfg, tie_embeddings=head is None and cfg.tie_embeddings)
    return cfg, t5_params(cfg, tensors, str(path), dtype)


FAMILY = register_family(Family("T5", T5Config, model_class("t5", "T5"), hf_t5_config,
                                ("t5",), hf_params=hf_t5_params))
