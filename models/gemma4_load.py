"""Gemma 4's checkpoints: its HF ``config.json`` parser (``gemma4_text``, or ``gemma4`` with
a ``text_config``: the text decoder of the multimodal model, its vision and audio towers
ignored), its table from transformers' tensor names to ours, the streaming of those
tensors (each layer has its own shapes) and its registration (``register_family``)."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from specjax.models.families import Family, model_class, register_family
from specjax.models.gemma4 import FULL, SLIDING, Gemma4Config, layer_shapes, top_shapes
from specjax.models.hf_config import ConfigFields, config_fields, read_config_json
from specjax.models.safetensors_file import check_floating
from specjax.models.streaming import TensorSource, WeightLoadError, placer

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
_TYPES = {"sliding_attention": SLIDING, "full_attention": FULL}


def _rope(f: ConfigFields) -> tuple[float, float, float]:
    """(full base, sliding base, full layers' partial rotary factor) from
    ``rope_parameters`` nested by layer type, with transformers' Gemma 4 defaults: sliding
    ``default`` at 1e4, full ``proportional`` at 1e6 over a quarter of each head."""
    rp = f.obj("rope_parameters")
    if not rp.d:
        return 1e6, 1e4, 0.25
    flat = sorted(set(rp.d) - {"full_attention", "sliding_attention"})
    if flat:
        f.fail(f"'rope_parameters' holds {flat}: Gemma 4 nests it by layer type "
               "(full_attention, sliding_attention)")
    out = []
    for kind, theta in (("full_attention", 1e6), ("sliding_attention", 1e4)):
        r = rp.obj(kind)
        rtype = r.text("rope_type", "default")
        if rtype not in ("default", "proportional") or r.number("factor", 1.0) != 1.0:
            r.fail(f"'rope_parameters.{kind}' rope_type {rtype!r} with factor "
                   f"{r.d.get('factor', 1.0)} is not supported (default or proportional, "
                   "factor 1)")
        partial = r.number("partial_rotary_factor", 1.0) if rtype == "proportional" else 1.0
        if kind == "sliding_attention" and partial != 1.0:
            r.fail("a partial RoPE on the sliding layers is not supported")
        out.append((r.number("rope_theta", theta, positive=True), partial))
    (full, partial), (local, _) = out
    return full, local, partial


def _global_geometry(f: ConfigFields, types: list[str], k_eq_v: bool):
    """(global head dim, global K/V heads or None): ``per_layer_config`` (what
    ``save_pretrained`` writes: the same override on every full layer, none on a sliding
    one) or ``global_head_dim`` (default 512) and ``num_global_key_value_heads``."""
    plc = f.obj("per_layer_config")
    if not plc.d:
        heads = f.integer("num_global_key_value_heads", None) if k_eq_v else None
        return f.integer("global_head_dim", 512), heads
    by_layer = {}
    for key in plc.d:  # transformers writes the indices zero-padded past 9 layers ("05")
        if not key.isdigit() or int(key) >= len(types):
            plc.fail(f"'per_layer_config' key {key!r} is not a layer index below {len(types)}")
        by_layer[int(key)] = plc.obj(key)
    seen = set()
    for i, kind in enumerate(types):
        o = by_layer.get(i, dataclasses.replace(plc, d={}, prefix=f"per_layer_config.{i}."))
        if set(o.d) - {"head_dim", "num_key_value_heads"}:
            o.fail(f"'per_layer_config.{i}' overrides {sorted(o.d)}; only head_dim and "
                   "num_key_value_heads are read")
        if kind == SLIDING and o.d:
            o.fail(f"'per_layer_config.{i}' overrides a sliding layer, which the port "
                   "does not support")
        if kind == FULL:
            seen.add((o.integer("head_dim", None), o.integer("num_key_value_heads", None)))
    if len(seen) > 1:
        plc.fail("'per_layer_config' gives the full layers different geometries")
    hd, heads = seen.pop() if seen else (None, None)
    return hd, heads


def hf_gemma4_config(d: dict | ConfigFields) -> Gemma4Config:
    """A ``Gemma4Config`` from an HF ``config.json`` of ``gemma4_text``, or of ``gemma4``
    (its ``text_config``; loading its weights says in one warning line that the vision
    and audio towers are ignored: ``hf_gemma4_stream``). Absent keys take transformers' ``Gemma4TextConfig`` defaults; what the port does not
    compute is ``WeightLoadError`` naming the file and key."""
    f = config_fields(d)
    if f.text("model_type") == "gemma4":
        f = f.obj("text_config")
    n = f.integer("num_hidden_layers", 30)
    names = f.texts("layer_types", None)
    if names is None:
        names = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                 for i in range(n)]
    if len(names) != n or set(names) - set(_TYPES):
        f.fail(f"'layer_types' must name {n} layers, each sliding_attention or "
               "full_attention")
    types = [_TYPES[t] for t in names[:-1]] + [FULL]  # transformers forces the last full
    act = f.text("hidden_activation", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        f.fail(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if f.flag("attention_bias", False):
        f.fail("'attention_bias' true is not supported (no released Gemma 4 has biases)")
    if f.d.get("use_bidirectional_attention") == "all":
        f.fail("'use_bidirectional_attention' \"all\" is not supported (a causal decoder)")
    k_eq_v = f.flag("attention_k_eq_v", False)
    ghd, gheads = _global_geometry(f, types, k_eq_v)
    full, local, partial = _rope(f)
    moe = f.flag("enable_moe_block", False)
    return Gemma4Config(
        vocab_size=f.integer("vocab_size", 262144), hidden_size=f.integer("hidden_size", 2304),
        intermediate_size=f.integer("intermediate_size", 9216), num_layers=n,
        num_heads=f.integer("num_attention_heads", 8),
        num_kv_heads=f.integer("num_key_value_heads", 4), head_dim=f.integer("head_dim", 256),
        layer_types=tuple(types), global_head_dim=ghd, num_global_kv_heads=gheads,
        attention_k_eq_v=k_eq_v, sliding_window=f.integer("sliding_window", 512),
        rope_theta=full, rope_local_theta=local, partial_rotary_factor=partial,
        final_logit_softcapping=f.number("final_logit_softcapping", None, positive=True),
        hidden_size_per_layer_input=f.integer("hidden_size_per_layer_input", 256, minimum=0),
        vocab_size_per_layer_input=f.integer("vocab_size_per_layer_input", 262144, minimum=0),
        num_kv_shared_layers=f.integer("num_kv_shared_layers", 0, minimum=0),
        use_double_wide_mlp=f.flag("use_double_wide_mlp", False),
        num_experts=f.integer("num_experts") if moe else 0,
        top_k_experts=f.integer("top_k_experts") if moe else 0,
        moe_intermediate_size=f.integer("moe_intermediate_size", f.integer(
            "expert_intermediate_size", None)) if moe else 0,
        rms_norm_eps=f.number("rms_norm_eps", 1e-6, positive=True),
        tie_embeddings=f.flag("tie_word_embeddings", True),
        max_position_embeddings=f.integer("max_position_embeddings", 131072))


# transformers' names -> ours; the experts' fused gate_up splits in two (by rows)
TOP = {"embed_tokens.weight": "embed", "norm.weight": "final_norm",
       "embed_tokens_per_layer.weight": "ple_embed",
       "per_layer_model_projection.weight": "ple_model_proj",
       "per_layer_projection_norm.weight": "ple_proj_norm"}
LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm", "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "post_feedforward_layernorm.weight": "post_mlp_norm", "layer_scalar": "layer_scalar",
    "per_layer_input_gate.weight": "ple_gate", "per_layer_projection.weight": "ple_proj",
    "post_per_layer_input_norm.weight": "ple_norm", "router.proj.weight": "router",
    "router.scale": "router_scale", "router.per_expert_scale": "expert_scale",
    "experts.gate_up_proj": ("experts_gate", "experts_up"), "experts.down_proj": "experts_down",
    "pre_feedforward_layernorm_2.weight": "moe_pre_norm",
    "post_feedforward_layernorm_1.weight": "mlp_out_norm",
    "post_feedforward_layernorm_2.weight": "moe_out_norm",
}
# tensors a KV-shared layer's checkpoint may hold and transformers drops on load
_SHARED_DROPPED = ("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "self_attn.k_norm.weight", "self_attn.v_norm.weight")


def text_prefix(names) -> str:
    """The prefix of the text decoder's tensors: ``model.language_model.`` in a multimodal
    checkpoint, ``model.`` otherwise."""
    return "model.language_model." if any(n.startswith("model.language_model.")
                                          for n in names) else "model."


def tensor_table(cfg: Gemma4Config, shapes: dict[str, tuple], source: str,
                 ignore: Callable[[str], bool] = lambda n: False) -> dict[tuple, tuple]:
    """Our leaf path -> ``(source name, row slice or None)`` for every weight of ``cfg``,
    from the tensors' names and shapes alone. ``WeightLoadError`` naming the tensor for one
    that is unexpected or misshapen, then for the missing ones (up to 8 named). Tensors
    outside the text decoder of a multimodal checkpoint, a tied copy of the embedding and
    the key/value tensors transformers drops from KV-shared layers are skipped."""
    pre = text_prefix(shapes)
    layer_rx = re.compile("^" + re.escape(pre) + r"layers\.(\d+)\.(.+)$")
    want = {(k,): s for k, s in top_shapes(cfg).items()}
    for i in range(cfg.num_layers):
        want.update({("layers", i, k): s for k, s in layer_shapes(cfg, i).items()})
    found: dict[tuple, tuple] = {}
    for name, shape in shapes.items():
        if ignore(name) or (name == "lm_head.weight" and cfg.tie_embeddings):
            continue
        m = layer_rx.match(name)
        if m and int(m.group(1)) >= cfg.first_shared and m.group(2) in _SHARED_DROPPED:
            continue
        if m and int(m.group(1)) < cfg.num_layers and m.group(2) in LAYER:
            ours = LAYER[m.group(2)]
            paths = [("layers", int(m.group(1)), o) for o in
                     (ours if isinstance(ours, tuple) else (ours,))]
        elif name == "lm_head.weight":
            paths = [("lm_head",)]
        elif name.startswith(pre) and name[len(pre):] in TOP:
            paths = [(TOP[name[len(pre):]],)]
        else:
            paths = []
        if not paths or any(p not in want for p in paths):
            raise WeightLoadError(f"{source}: unexpected tensor {name!r} (shape "
                                  f"{tuple(shape)}) for a {cfg.num_layers}-layer Gemma 4 "
                                  f"({_features(cfg)})")
        rows = shape[1] // len(paths) if len(paths) > 1 else None
        for j, p in enumerate(paths):
            got = tuple(shape) if rows is None else (shape[0], rows) + tuple(shape[2:])
            if got != tuple(want[p]):
                raise WeightLoadError(f"{source}: tensor {name!r} has shape {tuple(shape)}; "
                                      f"expected {_expected(want, paths)} for "
                                      f"{'.'.join(map(str, p))}")
            found[p] = (name, None if rows is None else slice(j * rows, (j + 1) * rows))
    missing = [_source_name(p, pre) for p in want if p not in found]
    if missing:
        raise WeightLoadError(f"{source}: missing weights {missing[:8]}"
                              f"{' and %d more' % (len(missing) - 8) if len(missing) > 8 else ''}"
                              f" ({_features(cfg)})")
    return found


def _source_name(path: tuple, pre: str) -> str:
    """transformers' name of the tensor holding our leaf ``path``."""
    if path[0] == "lm_head":
        return "lm_head.weight"
    if len(path) == 1:
        return pre + next(k for k, v in TOP.items() if v == path[0])
    src = next(k for k, v in LAYER.items() if path[2] in (v if isinstance(v, tuple) else (v,)))
    return f"{pre}layers.{path[1]}.{src}"


def _features(cfg: Gemma4Config) -> str:
    parts = [f"{cfg.num_kv_shared_layers} KV-shared layers" if cfg.num_kv_shared_layers else "",
             "per-layer embeddings" if cfg.hidden_size_per_layer_input else "",
             f"{cfg.num_experts} experts" if cfg.num_experts else "",
             "K as V" if cfg.attention_k_eq_v else "",
             f"tie_embeddings={cfg.tie_embeddings}"]
    return ", ".join(p for p in parts if p)


def _expected(want: dict, paths: list[tuple]) -> tuple:
    s = [want[p] for p in paths]
    return s[0] if len(s) == 1 else (s[0][0], sum(x[1] for x in s)) + tuple(s[0][2:])


def stream_gemma4(cfg: Gemma4Config, src: TensorSource, source: str, dtype, mesh=None,
                  ignore: Callable[[str], bool] = lambda n: False) -> dict:
    """The params pytree of ``src``'s tensors (names and shapes checked first,
    :func:`tensor_table`), read one tensor at a time in its stored dtype, cast to ``dtype``
    and placed at once (``streaming.placer``: with ``mesh``, on its sharding)."""
    table = tensor_table(cfg, src.shapes, source, ignore)
    dtypes = getattr(src, "table", {})
    for name, _ in table.values():  # integers or booleans are no weights a cast recovers
        if name in dtypes:
            check_floating(name, dtypes[name].dtype, dtypes[name].file)
    place = placer(cfg, mesh)
    params: dict = {"layers": [{} for _ in range(cfg.num_layers)]}
    pending = None
    for path, (name, rows) in table.items():
        def build(region, name=name, rows=rows):
            w = src.read(name)
            w = w if rows is None else w[:, rows]
            return np.asarray(w[region], dtype)
        shape = tuple(src.shapes[name]) if rows is None else \
            (src.shapes[name][0], rows.stop - rows.start) + tuple(src.shapes[name][2:])
        node = params if len(path) == 1 else params["layers"][path[1]]
        node[path[-1]] = place(path, shape, build)
        if pending is not None:  # one transfer in flight at most
            pending.block_until_ready()
        pending = node[path[-1]]
    return params


def _multimodal_extra(names) -> Callable[[str], bool]:
    """Names outside the text decoder of a multimodal checkpoint."""
    pre = text_prefix(names)
    return lambda n: pre == "model.language_model." and not n.startswith(pre) and \
        n != "lm_head.weight"


def hf_gemma4_stream(cfg: Gemma4Config, src: TensorSource, path, dtype, mesh=None) -> dict:
    """``Family.hf_stream``: :func:`stream_gemma4` of an HF directory's tensors; for a
    multimodal ``gemma4`` directory, one warning line that its towers are ignored."""
    towers = [k for k in ("vision_config", "audio_config")
              if read_config_json(Path(path) / "config.json").d.get(k)]
    if towers:
        warnings.warn(f"{path}: a multimodal gemma4 checkpoint: its text decoder loads, its "
                      f"{' and '.join(t[:-7] for t in towers)} tower(s) are ignored",
                      stacklevel=2)
    return stream_gemma4(cfg, src, str(path), dtype, mesh, _multimodal_extra(src.shapes))


FAMILY = register_family(Family(
    "Gemma4", Gemma4Config, model_class("gemma4", "Gemma4"), hf_gemma4_config,
    ("gemma4_text", "gemma4"), hf_stream=hf_gemma4_stream))
