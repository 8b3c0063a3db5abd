"""DFlash drafters as z-lab publishes them on the hub: a directory with a Qwen3-style
``config.json`` (``block_size``, ``num_target_layers``, ``dflash_config`` with
``mask_token_id`` and ``target_layer_ids``; ``auto_map`` to its ``DFlashDraftModel``) and
``model.safetensors`` holding ``fc``, ``hidden_norm``, ``norm`` and ``layers.{i}.*`` (no
embedding, no LM head: the target's are used).

``read_spec`` reads the config alone (no weight), ``check_target`` checks it against a
target's config, ``load`` reads and checks every tensor by an explicit name map, and
``save`` writes the same layout (z-lab's ``DFlashDraftModel.from_pretrained`` reads it).
Anything missing, unexpected, misshapen or of the wrong type is a ``CheckpointError`` of
one line naming the file and the field or tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specjax.heads.exported import CheckpointError
from specjax.models.loading import ConfigFields, read_config_json

WEIGHTS = "model.safetensors"

#: specjax's name of each weight of one layer -> z-lab's, under ``layers.{i}.``
LAYER_KEYS = {
    "attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}
TOP_KEYS = {"fc": "fc.weight", "hidden_norm": "hidden_norm.weight", "norm": "norm.weight"}


def is_dflash(path: str | Path) -> bool:
    """Whether ``path`` holds a DFlash drafter: a ``config.json`` with ``dflash_config``
    or ``block_size`` beside ``model.safetensors``."""
    p = Path(path)
    try:
        d = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and ("dflash_config" in d or "block_size" in d) and (
        p / WEIGHTS).is_file()


def _config(path: str | Path) -> ConfigFields:
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p} is not a directory (a DFlash drafter is a directory "
                              f"with config.json and {WEIGHTS})")
    for name in ("config.json", WEIGHTS):
        if not (p / name).is_file():
            raise CheckpointError(f"{p} has no {name}: not a DFlash drafter directory")
    return read_config_json(p / "config.json", CheckpointError)


def read_spec(path: str | Path):
    """The ``DFlashSpec`` of the drafter in ``path``, from its ``config.json`` alone."""
    from specjax.drafters.dflash import DFlashSpec, default_target_layers
    from specjax.heads.published import layer_spec

    f = _config(path)
    dc = f.obj("dflash_config")
    if not dc.d and "block_size" not in f.d:
        f.fail("no 'dflash_config' or 'block_size': not a DFlash drafter's config")
    if f.flag("attention_bias", False):
        f.fail("'attention_bias' is true: a DFlash drafter with attention biases is not "
               "supported (z-lab's have none)")
    types = f.texts("layer_types", [])
    if any(t != "full_attention" for t in types):
        f.fail(f"'layer_types' {sorted(set(types))}: only full attention is supported (a "
               "sliding-window DFlash layer is not)")
    n_layers = f.integer("num_hidden_layers")
    n_target = f.integer("num_target_layers")
    ids = dc.integers("target_layer_ids", None)
    ids = tuple(default_target_layers(n_target, n_layers) if ids is None else ids)
    if any(not 0 <= i < n_target for i in ids):
        dc.fail(f"'dflash_config.target_layer_ids' {list(ids)} must lie in [0, "
                f"num_target_layers={n_target})")
    spec = layer_spec(f, f.integer("hidden_size"))
    if spec.head_dim % 2:
        f.fail(f"'head_dim' {spec.head_dim} must be even (RoPE rotates pairs)")
    mask = dc.integer("mask_token_id", None, minimum=0)
    if mask is None:
        f.fail("'dflash_config.mask_token_id' is missing: the drafter's mask token")
    try:
        return DFlashSpec(layer=spec, num_layers=n_layers,
                          block_size=f.integer("block_size", minimum=2), mask_id=mask,
                          target_layers=ids)
    except ValueError as e:
        f.fail(str(e))


def check_target(spec, target_cfg, path) -> None:
    """``CheckpointError`` unless the drafter fits the target: its width, the mask id
    within the target's vocabulary, the fused layers within its layers."""
    where = f"{path}/config.json"
    if spec.layer.width != target_cfg.hidden_size:
        raise CheckpointError(f"{where}: 'hidden_size' {spec.layer.width} is not the "
                              f"target's {target_cfg.hidden_size} (the drafter reads the "
                              "target's embedding and LM head)")
    if spec.mask_id >= target_cfg.vocab_size:
        raise CheckpointError(f"{where}: 'dflash_config.mask_token_id' {spec.mask_id} is "
                              f"past the target's vocabulary of {target_cfg.vocab_size}")
    n = read_config_json(Path(path) / "config.json", CheckpointError).d.get("num_target_layers")
    if n != target_cfg.num_layers:
        raise CheckpointError(f"{where}: 'num_target_layers' {n}: the drafter was made for a "
                              f"{n}-layer target, this one has {target_cfg.num_layers}")
    if max(spec.target_layers) >= target_cfg.num_layers:
        raise CheckpointError(f"{where}: 'dflash_config.target_layer_ids' "
                              f"{list(spec.target_layers)} name layers a "
                              f"{target_cfg.num_layers}-layer target lacks")


def _names(spec) -> dict[str, tuple]:
    """z-lab's tensor name -> (specjax path, shape)."""
    from specjax.drafters.dflash import param_shapes

    shapes = param_shapes(spec)
    out = {TOP_KEYS[k]: ((k,), shapes[k]) for k in TOP_KEYS}
    for i, ls in enumerate(shapes["layers"]):
        out.update({f"layers.{i}.{LAYER_KEYS[k]}": (("layers", i, k), s) for k, s in ls.items()})
    return out


def load(path: str | Path, target_cfg) -> tuple:
    """``(spec, dp)``: the drafter in ``path`` checked against ``target_cfg``, its
    weights as float32 numpy in ``specjax.drafters.dflash``'s pytree."""
    from specjax.heads.published import _check_dtypes, _take, read_tensors

    spec = read_spec(path)
    check_target(spec, target_cfg, path)
    tensors, f = read_tensors(path)
    _check_dtypes(tensors, f)
    names = _names(spec)
    got = _take(tensors, {k: s for k, (_, s) in names.items()}, f)
    dp = {k: None for k in TOP_KEYS}
    dp["layers"] = [{} for _ in range(spec.num_layers)]
    for name, (where, _) in names.items():
        if where[0] == "layers":
            dp["layers"][where[1]][where[2]] = got[name]
        else:
            dp[where[0]] = got[name]
    return spec, dp


def config(spec, target_cfg, dtype: str = "bfloat16") -> dict:
    """The hub ``config.json`` of a drafter ``spec`` for a target (z-lab's fields)."""
    s = spec.layer
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": spec.block_size,
        "dflash_config": {"mask_token_id": spec.mask_id,
                          "target_layer_ids": list(spec.target_layers)},
        "num_target_layers": target_cfg.num_layers, "num_hidden_layers": spec.num_layers,
        "hidden_size": s.width, "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim, "rms_norm_eps": s.rms_norm_eps, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * spec.num_layers,
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": target_cfg.vocab_size, "tie_word_embeddings": False,
        "torch_dtype": dtype, **rope_fields(s),
    }


def rope_fields(s) -> dict:
    """``rope_theta`` and ``rope_scaling`` as transformers writes them (``hf_rope`` reads
    them back to the same ``LayerSpec``)."""
    rs = s.rope_scaling
    out: dict = {"rope_theta": float(s.rope_theta), "rope_scaling": None}
    if rs.rope_type == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(rs.factor)}
    elif rs.rope_type == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": int(rs.original_max_position_embeddings)}
    return out


def save(spec, dp, out_dir: str | Path, target_cfg, dtype: str = "bfloat16") -> Path:
    """Writes the drafter ``dp`` in the hub layout to ``out_dir`` (absent, empty or a
    previous ``save``), swapped in whole, and checks it reads back; returns the directory."""
    import jax
    from safetensors.numpy import save_file

    from specjax import _atomic
    from specjax.heads.published import _np_dtype, check_out_dir

    out = Path(out_dir).absolute()
    _atomic.recover(out)
    check_out_dir(out)
    np_dtype = _np_dtype(dtype)
    tensors = {}
    for name, (where, _) in _names(spec).items():
        leaf = dp[where[0]] if where[0] != "layers" else dp["layers"][where[1]][where[2]]
        tensors[name] = np.ascontiguousarray(np.asarray(jax.device_get(leaf), np.float32)
                                             .astype(np_dtype))
    with _atomic.replace_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(config(spec, target_cfg, dtype),
                                                    indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        _atomic.plain_mode(tmp / WEIGHTS)
        load(tmp, target_cfg)
    return out


__all__ = ["CheckpointError", "LAYER_KEYS", "TOP_KEYS", "WEIGHTS", "check_target", "config",
           "is_dflash", "load", "read_spec", "save"]
