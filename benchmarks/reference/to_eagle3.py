#!/usr/bin/env python3
"""Write a SpecJAX (tails-mpt/SpecJAX) EAGLE-3 checkpoint in SafeAILab/EAGLE EAGLE-3 head layout.

SpecJAX's native checkpoint already uses SafeAILab's tensor names and shapes
(fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t as offsets, t2d bool), so this is
a validating re-packer, not a re-mapper. What it changes:
  * d2t -> int64 (SpecJAX saves int32 when jax_enable_x64 is off; SafeAILab uses torch.long)
  * optional dtype cast (default keeps bfloat16; yuhuili heads are float16)
  * config.json: SafeAILab/EConfig-style fields that SpecJAX omits (hidden_act,
    max_position_embeddings, rope_scaling=null, pretraining_tp, bos/eos/pad ids,
    target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids) and an
    architectures entry chosen by --arch.
It refuses heads a stock SafeAILab EAGLE-3 loader would mis-run (head_dim != hidden/heads,
inconsistent d2t/t2d, wrong shapes).

usage: to_eagle3.py SRC_CKPT_DIR DST_DIR [--target HF_TARGET_DIR] [--dtype bfloat16|float16|float32]
"""
import argparse
import json
import os

import numpy as np
import ml_dtypes
from safetensors.numpy import load_file, save_file

KEYS = [
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
]
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def convert(src, dst, target=None, dtype="bfloat16", arch="LlamaForCausalLMEagle3"):
    state = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    missing = [k for k in KEYS if k not in state]
    extra = [k for k in state if k not in KEYS]
    if missing or extra:
        raise ValueError(f"not a SpecJAX/EAGLE-3 head: missing={missing} extra={extra}")

    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", H // nh)
    V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
    if hd * nh != H:
        raise ValueError(f"head_dim {hd} * heads {nh} != hidden {H}: SafeAILab derives "
                         "head_dim = hidden_size // num_attention_heads and would mis-shape q/k/v")
    tH = state["fc.weight"].shape[1] // 3
    want = {
        "fc.weight": (H, 3 * tH),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, nh * hd),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "lm_head.weight": (Vd, H),
        "d2t": (Vd,),
        "t2d": (V,),
    }
    for k in KEYS:
        if k.endswith("norm.weight"):
            want[k] = (H,)
    for k, shp in want.items():
        if tuple(state[k].shape) != shp:
            raise ValueError(f"{k}: shape {state[k].shape} != {shp}")

    # vocab maps: SpecJAX and SafeAILab both store d2t as offsets (target_id - draft_id)
    d2t = state["d2t"].astype(np.int64)
    t2d = state["t2d"].astype(bool)
    tgt_ids = d2t + np.arange(Vd, dtype=np.int64)
    if not (np.all(np.diff(tgt_ids) > 0) and tgt_ids.min() >= 0 and tgt_ids.max() < V):
        raise ValueError("d2t + arange is not a sorted id list inside the target vocab")
    if int(t2d.sum()) != Vd or not np.array_equal(np.where(t2d)[0], tgt_ids):
        raise ValueError("t2d mask and d2t disagree")

    out = {}
    for k in KEYS[:-2]:
        out[k] = np.ascontiguousarray(state[k].astype(np.float32).astype(DTYPES[dtype]))
    out["d2t"] = d2t
    out["t2d"] = t2d

    tcfg = {}
    if target:
        with open(os.path.join(target, "config.json")) as f:
            tcfg = json.load(f)
    L = tcfg.get("num_hidden_layers")
    new_cfg = {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "target_hidden_size": tH,
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "rope_scaling": None,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 2048),
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in tcfg:
            new_cfg[k] = tcfg[k]
    if L:
        # SpecJAX llama target fuses the outputs of layers {1, L//2-1, L-4}
        # (== SafeAILab's inputs of layers 2, L//2, L-3; SpecForge/vLLM layer-id convention)
        new_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4],
                                   "use_aux_hidden_state": True}

    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(new_cfg, f, indent=2)
    return new_cfg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--target", default=None, help="HF dir of the target (bos/eos ids, layer count)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--arch", default="LlamaForCausalLMEagle3",
                   help="yuhuili heads: LlamaForCausalLM; SGLang/vLLM/SpecForge: LlamaForCausalLMEagle3")
    a = p.parse_args()
    cfg = convert(a.src, a.dst, a.target, a.dtype, a.arch)
    print(json.dumps(cfg, indent=2))


if __name__ == "__main__":
    main()
