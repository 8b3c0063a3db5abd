"""Weight loading: GGUF (llama.cpp) files and local HF directories, into the params pytree
of a Llama, Gemma or T5 model (``model_for`` builds the model class for the config).

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

import dataclasses
import functools
import json
import math
import re
import struct
from pathlib import Path
from typing import Callable, NoReturn

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.models.gemma import GemmaConfig, gemma3_layer_types
from specjax.models.gguf_file import GGUFFile, read_gguf
from specjax.models.llama import LlamaConfig, RopeScaling, top_shapes
from specjax.models.t5 import T5Config

Transform = Callable[[np.ndarray, LlamaConfig], np.ndarray]
Config = LlamaConfig | GemmaConfig | T5Config


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family as loading sees it: ``config``, its config class; ``model``, a
    function returning its model class (imported when a model is built); ``hf_config``,
    parsing an HF ``config.json`` (``ConfigFields``) of one of ``hf_model_types``; and the
    GGUF ``general.architecture``s it reads."""

    name: str
    config: type
    model: Callable[[], type]
    hf_config: Callable
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {}  # by name, in registration order


def register_family(fam: Family) -> Family:
    """Adds ``fam`` to ``FAMILIES`` (``ValueError`` for a name or ``model_type`` taken)."""
    taken = {t for f in FAMILIES.values() for t in f.hf_model_types}
    if fam.name in FAMILIES or taken & set(fam.hf_model_types):
        raise ValueError(f"family {fam.name!r} or one of its model types "
                         f"{fam.hf_model_types} is registered already")
    FAMILIES[fam.name] = fam
    return fam


def family_of(cfg) -> Family:
    """The registered family whose config class ``cfg`` is an instance of."""
    for fam in FAMILIES.values():
        if isinstance(cfg, fam.config):
            return fam
    raise TypeError(f"no model family is registered for {type(cfg).__name__} "
                    f"(registered: {', '.join(FAMILIES)})")


def family(cfg: Config) -> str:
    """The name of ``cfg``'s family: ``Llama``, ``Gemma``, ``T5`` or a registered one."""
    return family_of(cfg).name


def model_for(cfg: Config, compute_dtype=jnp.float32):
    """The model class instance for a config (its family's: ``Llama``, ``Gemma``, ``T5``),
    multiplying in ``compute_dtype``."""
    return family_of(cfg).model()(cfg, compute_dtype)


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


#: fused weights of the layout the models read, each the row-wise concatenation of its parts
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up"), "qkv_b": ("q_b", "k_b", "v_b")}


def _match(name: str, keys) -> tuple[str, int | None, Transform] | None:
    for pattern, ours, fn in keys:
        rx = "^" + re.escape(pattern).replace(r"\{i\}", r"(\d+)") + "$"
        m = re.match(rx, name)
        if m:
            return ours, (int(m.group(1)) if m.groups() else None), fn
    return None


# --------------------------------------------------------------------------- tensor sources

class TensorSource:
    """Named tensors that are read one at a time: ``shapes`` (name -> shape, no data read)
    and ``read(name, rows)`` (a fresh host array in the stored dtype; ``rows=(a, b)`` reads
    only rows a..b of the first axis). Subclasses may read straight into a buffer."""

    shapes: dict[str, tuple[int, ...]]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        raise NotImplementedError

    def read_into(self, name: str, out: np.ndarray,
                  rows: tuple[int, int] | None = None) -> None:
        """Writes tensor ``name`` (its rows a..b with ``rows=(a, b)``) into ``out`` (that
        shape), cast to ``out``'s dtype."""
        out[...] = self.read(name, rows)


# --------------------------------------------------------------------------- streaming assembly

def check_names(cfg, shapes: dict[str, tuple[int, ...]], keys, source: str,
                ignore: tuple[str, ...] = ()) -> dict[str, tuple[str, int | None, Transform]]:
    """Each source tensor's (our unfused name, layer or None, transform), from names and
    shapes alone. ``WeightLoadError`` naming the tensor for one that is unexpected or of the
    wrong shape (in ``shapes``' order), then for the missing ones (up to 8 named)."""
    want = unfused_shapes(cfg)
    found: dict[str, tuple[str, int | None, Transform]] = {}
    for name, shape in shapes.items():
        if name in ignore:
            continue
        hit = _match(name, keys)
        if hit is None or hit[0] not in want or (hit[1] is not None and hit[1] >= cfg.num_layers):
            raise WeightLoadError(f"{source}: unexpected tensor {name!r} (shape {shape}) "
                                  f"for a {cfg.num_layers}-layer {family(cfg)} with "
                                  f"tie_embeddings={cfg.tie_embeddings}")
        if tuple(shape) != tuple(want[hit[0]]):
            raise WeightLoadError(f"{source}: tensor {name!r} has shape {tuple(shape)}; expected "
                                  f"a tensor mapping to {hit[0]} of shape {tuple(want[hit[0]])}")
        found[name] = hit
    have = {(ours, layer) for ours, layer, _ in found.values()}
    src = {ours: pat for pat, ours, _ in keys}
    names = [src[k] for k in want if not k.startswith("layers/") and (k, None) not in have]
    names += [src[k].replace("{i}", str(i)) for k in want if k.startswith("layers/")
              for i in range(cfg.num_layers) if (k, i) not in have]
    if names:
        raise WeightLoadError(f"{source}: missing tensors {names[:8]}"
                              f"{' and %d more' % (len(names) - 8) if len(names) > 8 else ''}")
    return found


def _leaves(cfg, found, split: bool, stacked: bool):
    """The params tree's leaves as (path, parts): ``parts[i]`` lists (source name,
    transform) of the rows of layer i's leaf (one entry per layer when ``stacked``, else one
    list), in the order a layer-by-layer load keeps few weights alive at once."""
    by_ours = {(ours, layer): (name, fn) for name, (ours, layer, fn) in found.items()}
    top = [((k,), [[by_ours[(k, None)]]]) for k in top_shapes(cfg)]
    names = [k.split("/")[1] for k in unfused_shapes(cfg) if k.startswith("layers/")]
    groups = {n: (n,) for n in names}
    if not split:
        groups = {n: (n,) for n in names if not any(n in p for p in FUSED.values())}
        groups.update({f: p for f, p in FUSED.items() if p[0] in names})
    part = lambda i, parts: [by_ours[(f"layers/{p}", i)] for p in parts]  # noqa: E731
    if stacked:
        return top + [(("layers", g), [part(i, ps) for i in range(cfg.num_layers)])
                      for g, ps in groups.items()]
    return top + [(("layers", i, g), [part(i, ps)]) for i in range(cfg.num_layers)
                  for g, ps in groups.items()]


Region = tuple[slice, ...]  # a block of a leaf: one slice(start, stop) per axis


def _whole(shape: tuple[int, ...]) -> Region:
    return tuple(slice(0, n) for n in shape)


def local_region(shape: tuple[int, ...], indices) -> Region:
    """The smallest block of a leaf of ``shape`` that holds each of ``indices`` (tuples of
    slices, as ``Sharding.devices_indices_map`` gives them): per axis, the lowest start to
    the highest stop. Every slice in ``indices`` lies inside it; for the slices of all of a
    sharding's devices it is the whole leaf."""
    spans = [[ix[ax].indices(n)[:2] for ix in indices] for ax, n in enumerate(shape)]
    return tuple(slice(min(a for a, _ in s), max(b for _, b in s)) for s in spans)


def _fill(src: TensorSource, cfg, name: str, fn: Transform, rows: tuple[int, int],
          cut: Region, out: np.ndarray) -> None:
    """Rows ``rows`` = (a, b) of tensor ``name`` with ``fn`` applied, cut to ``cut`` (its
    other axes), written into ``out``. Only those rows are read, except where ``fn``
    transforms the tensor (a norm gain, llama.cpp's Q/K permutation: read whole, through
    float32) or ``cut`` drops columns (``o``, ``down`` split over ``model``: the rows are
    read whole, then cut)."""
    whole_cols = cut == _whole(src.shapes[name][1:])
    if fn is not _same:
        out[...] = fn(np.asarray(src.read(name), np.float32), cfg)[(slice(*rows),) + cut]
    elif whole_cols:
        src.read_into(name, out, rows)
    else:
        out[...] = src.read(name, rows)[(slice(None),) + cut]


def _leaf_shape(src: TensorSource, parts, stacked: bool) -> tuple[int, ...]:
    """The shape of the leaf ``parts`` make (see :func:`_build`)."""
    rows = sum(src.shapes[n][0] for n, _ in parts[0])
    return ((len(parts), rows) if stacked else (rows,)) + tuple(src.shapes[parts[0][0][0]][1:])


def _build(src: TensorSource, cfg, parts, stacked: bool, dtype,
           region: Region | None = None) -> np.ndarray:
    """Block ``region`` (default: all) of one leaf, on the host in ``dtype``: each layer's
    parts concatenated by rows, the layers stacked when ``stacked``. Filled in place (no
    concatenation copies), reading only the parts' rows inside the block (:func:`_fill`);
    its values equal the same block of the whole leaf."""
    region = _whole(_leaf_shape(src, parts, stacked)) if region is None else region
    layers = range(region[0].start, region[0].stop) if stacked else range(1)
    rows, cut = region[int(stacked)], region[int(stacked) + 1:]
    out = np.empty(tuple(s.stop - s.start for s in region), dtype)
    for i in layers:
        view, at = (out[i - layers.start] if stacked else out), 0
        for name, fn in parts[i]:
            n = src.shapes[name][0]
            a, b = max(rows.start, at), min(rows.stop, at + n)
            if a < b:
                _fill(src, cfg, name, fn, (a - at, b - at), cut,
                      view[a - rows.start:b - rows.start])
            at += n
    return out


def _shift(idx: tuple[slice, ...], shape: tuple[int, ...], region: Region) -> tuple:
    """Index ``idx`` of a leaf of ``shape``, as an index into its block ``region``."""
    return tuple(slice(s.indices(n)[0] - r.start, s.indices(n)[1] - r.start)
                 for s, n, r in zip(idx, shape, region))


def placer(cfg, mesh=None) -> Callable[[tuple, tuple, Callable[[Region], np.ndarray]],
                                       jax.Array]:
    """``place(path, shape, build)``: leaf ``path`` of ``shape`` on the device(s), its host
    values made by ``build(region)`` (that block of the leaf). Without a mesh, the whole
    leaf, ``jax.device_put`` on the default device. With one, sharded by
    ``specjax.sharding.param_spec`` of its path (``shard_params``' placement): ``build`` is
    asked only for the smallest block holding every slice this process's devices hold
    (:func:`local_region`; the whole leaf where it is replicated, or in a one-process run),
    and each device receives its slice of it (``jax.make_array_from_callback``)."""
    if mesh is None:
        return lambda path, shape, build: jax.device_put(build(_whole(shape)))
    from jax.sharding import NamedSharding

    from specjax import sharding

    def place(path, shape, build):
        where = NamedSharding(mesh, sharding.param_spec(cfg, path, shape, mesh))
        region = local_region(shape, where.addressable_devices_indices_map(shape).values())
        block = build(region)
        return jax.make_array_from_callback(shape, where,
                                            lambda idx: block[_shift(idx, shape, region)])
    return place


def stream_params(cfg, src: TensorSource, keys, source: str, dtype=jnp.float32, mesh=None,
                  stacked: bool = False, ignore: tuple[str, ...] = ()) -> dict:
    """The params pytree of ``src``'s tensors, names and shapes checked first
    (:func:`check_names`), then built one leaf at a time, cast to ``dtype`` per tensor and
    placed at once (:func:`placer`), so the host holds about one leaf beyond what is placed:
    one layer's fused matrix, the embedding, or with ``stacked`` one weight of all layers.
    On a mesh spanning processes, each process builds and reads only the block of each
    leaf its own devices hold (the whole of replicated leaves; row ranges of safetensors
    and GGUF tensors, whole tensors where columns are split or a tensor is transformed),
    so its host memory is its share of the weights plus about one such block.

    Layout: without a mesh, ``FUSED``'s (``qkv``, ``gate_up``, ``qkv_b``: row-wise
    concatenations, biases only where present); with one,
    the split layout ``specjax.sharding.shard_params`` returns, on the same shardings.
    ``layers`` is a list of per-layer dicts, or with ``stacked`` one dict of ``[L, ...]``
    arrays (``llama.stack_layers``' layout). Values equal reading every tensor in float32
    and casting to ``dtype``."""
    found = check_names(cfg, src.shapes, keys, source, ignore)
    if mesh is not None:
        from specjax import sharding

        sharding.check_model(cfg, mesh)
    dtype, place = jnp.dtype(dtype), placer(cfg, mesh)
    params: dict = {}
    pending = None
    for path, parts in _leaves(cfg, found, split=mesh is not None, stacked=stacked):
        st = stacked and path[0] == "layers"
        if path[0] == "layers" and "layers" not in params:
            params["layers"] = {} if stacked else [{} for _ in range(cfg.num_layers)]
        node = params
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = place(path, _leaf_shape(src, parts, st),
                               functools.partial(_build, src, cfg, parts, st, dtype))
        if pending is not None:  # one transfer in flight at most: its host copy is freed
            pending.block_until_ready()
        pending = node[path[-1]]
    return params


# --------------------------------------------------------------------------- GGUF

_ABSENT = object()


class _GGUFFields:
    """Typed reads of ``{arch}.*`` metadata keys of a GGUF file: a missing key without a
    default, or a value of the wrong type or range, is one ``WeightLoadError`` naming the
    file and the key (never a ``TypeError`` or ``ZeroDivisionError`` further on)."""

    def __init__(self, reader: GGUFFile, arch: str):
        self.reader, self.arch = reader, arch

    def fail(self, key: str, what: str) -> NoReturn:
        raise WeightLoadError(f"{self.reader.path or 'GGUF file'}: metadata key "
                              f"'{self.arch}.{key}' {what}")

    def raw(self, key: str, default=_ABSENT):
        v = self.reader.get(f"{self.arch}.{key}", default)
        if v is _ABSENT:
            self.fail(key, "is missing")
        return v

    def integer(self, key: str, default=_ABSENT, minimum: int = 1) -> int:
        v = self.raw(key, default)
        if isinstance(v, np.integer):
            v = int(v)
        if not _is_int(v) or v < minimum:
            self.fail(key, f"must be an integer >= {minimum}, got {v!r}")
        return v

    def number(self, key: str, default=_ABSENT) -> float:
        v = self.raw(key, default)
        if isinstance(v, (np.integer, np.floating)):
            v = v.item()
        if not _is_number(v) or not math.isfinite(v) or v <= 0:
            self.fail(key, f"must be a finite number > 0, got {v!r}")
        return float(v)

    def rope_scaling(self) -> RopeScaling:
        kind = self.raw("rope.scaling.type", None)
        if kind == "linear":
            return RopeScaling("linear", factor=self.number("rope.scaling.factor"))
        if kind not in (None, "none"):
            self.fail("rope.scaling.type", f"is {kind!r}, which is not supported (linear only)")
        return RopeScaling()


def gguf_config(reader: GGUFFile) -> Config:
    """The architecture recorded in a GGUF file's metadata (``llama`` or ``gemma3``)."""
    arch = reader.get("general.architecture")
    if arch == "gemma3":
        return _gguf_gemma3_config(reader)
    if arch != "llama":
        archs = [a for fam in FAMILIES.values() for a in fam.gguf_architectures]
        raise WeightLoadError(f"GGUF architecture {arch!r} is not supported "
                              f"({', '.join(archs)})")
    g = _GGUFFields(reader, "llama")
    heads = g.integer("attention.head_count")
    hidden = g.integer("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = g.integer("vocab_size", len(reader.get("tokenizer.ggml.tokens", ())) or _ABSENT)
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


def _gguf_gemma3_config(reader: GGUFFile) -> GemmaConfig:
    """Gemma 3 from GGUF metadata. The local RoPE base, the 5-local-1-global layer pattern
    and ``query_pre_attn_scalar`` are not recorded in the file; transformers' Gemma 3
    defaults apply (10000, 6, 256), as in the reference it loads from the same file."""
    g = _GGUFFields(reader, "gemma3")
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


def gguf_file_config(path: str | Path) -> Config:
    """The model config of a GGUF file, from its metadata alone (no tensor is read)."""
    return gguf_config(_open_gguf(path))


def _open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return read_gguf(path)
    except (ValueError, OSError) as e:  # GGUFFormatError is a ValueError
        raise WeightLoadError(f"{path}: not a readable GGUF file ({e})") from e


class GGUFSource(TensorSource):
    """The tensors of a read ``GGUFFile``, each dequantized to float32 when read. ``rows``
    of a matrix dequantize only those rows' bytes (ggml blocks never cross a row, so the
    values equal those rows of the whole tensor)."""

    def __init__(self, reader: GGUFFile):
        self.by_name = {t.name: t for t in reader.tensors}
        self.shapes = {t.name: t.shape for t in reader.tensors}

    def read(self, name, rows=None):
        import gguf

        t, shape = self.by_name[name], self.shapes[name]
        if rows is not None and len(shape) >= 2:  # t.data's first axis is the rows
            a, b = rows[0], min(rows[1], shape[0])
            w = np.asarray(gguf.quants.dequantize(t.data[a:b], t.qtype), np.float32)
            return w.reshape((b - a,) + tuple(shape[1:]))
        w = np.asarray(gguf.quants.dequantize(t.data, t.qtype), np.float32).reshape(shape)
        return w if rows is None else w[rows[0]:rows[1]]


def load_gguf(path: str | Path, dtype=jnp.float32, mesh=None,
              stacked: bool = False) -> tuple[Config, dict]:
    """Reads a llama- or gemma3-architecture GGUF file (any ggml quantization), dequantizing
    one tensor at a time and placing each leaf as it is made (:func:`stream_params`: with
    ``mesh``, sharded as ``specjax.sharding.shard_params`` would; ``stacked`` for
    ``scan_layers``)."""
    reader = _open_gguf(path)
    cfg = gguf_config(reader)
    for t in reader.tensors:  # unquantized integer tensors hold no weights
        if t.qtype.name in ("I8", "I16", "I32", "I64"):
            check_floating(t.name, t.data.dtype, path)
    keys = GGUF_GEMMA_KEYS if isinstance(cfg, GemmaConfig) else GGUF_KEYS
    return cfg, stream_params(cfg, GGUFSource(reader), keys, str(path), dtype, mesh, stacked)


# --------------------------------------------------------------------------- HF config.json


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class ConfigFields:
    """Typed reads of one ``config.json`` object ``d`` (``where`` names the file). A read
    returns the value at ``key``, or ``default`` where the key is absent or null; a required
    key that is absent, or a value of the wrong type, raises ``error`` in one line naming
    the file and the key (``prefix + key`` inside a nested object)."""

    d: dict
    where: str = "config.json"
    error: type = WeightLoadError
    prefix: str = ""

    def fail(self, msg: str) -> NoReturn:
        raise self.error(f"{self.where}: {msg}")

    def name(self, key: str) -> str:
        return repr(self.prefix + key)

    def value(self, key: str, default, ok: Callable[[object], bool], what: str):
        """``d[key]`` where ``ok`` accepts it (``what`` describes what it accepts)."""
        v = self.d.get(key)
        if v is None:
            if default is _ABSENT:
                self.fail(f"{self.name(key)} is missing")
            return default
        if not ok(v):
            self.fail(f"{self.name(key)} must be {what}, got {v!r}")
        return v

    def integer(self, key: str, default=_ABSENT, minimum: int = 1) -> int:
        return self.value(key, default, lambda v: _is_int(v) and v >= minimum,
                          f"an integer >= {minimum}")

    def number(self, key: str, default=_ABSENT, positive: bool = False) -> float:
        v = self.value(key, default, lambda v: _is_number(v) and (v > 0 or not positive),
                       "a positive number" if positive else "a number")
        return v if v is None else float(v)

    def flag(self, key: str, default=_ABSENT) -> bool:
        return self.value(key, default, lambda v: isinstance(v, bool), "true or false")

    def text(self, key: str, default=_ABSENT) -> str:
        return self.value(key, default, lambda v: isinstance(v, str), "a string")

    def texts(self, key: str, default=_ABSENT) -> list[str]:
        return self.value(key, default, lambda v: isinstance(v, list) and all(
            isinstance(x, str) for x in v), "a list of strings")

    def integers(self, key: str, default=_ABSENT) -> list[int]:
        return self.value(key, default, lambda v: isinstance(v, list) and all(
            _is_int(x) for x in v), "a list of integers")

    def obj(self, key: str) -> ConfigFields:
        """The object at ``key`` (empty where absent or null), its keys named ``key.*``."""
        v = self.value(key, {}, lambda v: isinstance(v, dict), "an object")
        return dataclasses.replace(self, d=v, prefix=f"{self.prefix}{key}.")


def read_config_json(f: Path, error: type = WeightLoadError) -> ConfigFields:
    """The JSON object in file ``f``, for typed reads; ``error`` naming ``f`` for a file
    that cannot be read, is not JSON, or holds something else than an object."""
    try:
        d = json.loads(Path(f).read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError included
        raise error(f"{f}: not a readable JSON file ({e})") from None
    if not isinstance(d, dict):
        raise error(f"{f}: holds a JSON {type(d).__name__}, not an object")
    return ConfigFields(d, str(f), error)


def _fields(d: dict | ConfigFields) -> ConfigFields:
    return d if isinstance(d, ConfigFields) else ConfigFields(d)


#: the RoPE types ``RopeScaling`` computes
ROPE_TYPES = ("default", "linear", "llama3")


def rope_block(f: ConfigFields, theta: float, max_positions: int | None = None,
               dynamic_ok: bool = False) -> tuple[float, RopeScaling]:
    """RoPE base and scaling of one flat RoPE object ``f``, as transformers 5 standardizes
    and validates it (``modeling_rope_utils``): type ``rope_type``, else the v4 ``type``,
    else default; base ``rope_theta``, else ``theta``; the fields its type requires
    (linear: ``factor``; llama3: ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``, which defaults to ``max_positions`` where that is
    given). With ``dynamic_ok``, ``dynamic`` reads as default (it changes nothing within
    ``max_position_embeddings``). ``f.error`` naming the key for another type, a missing
    field, a value of the wrong type, or a ``partial_rotary_factor`` other than 1."""
    if {"full_attention", "sliding_attention"} & set(f.d):
        f.fail(f"{f.prefix[:-1]!r} is nested by layer type, but this family reads one flat "
               "RoPE object")
    tkey = "rope_type" if f.d.get("rope_type") is not None else "type"
    kind = f.text(tkey, "default")
    if kind == "dynamic" and dynamic_ok:
        kind = "default"
    if kind not in ROPE_TYPES:
        f.fail(f"{f.name(tkey)} {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if f.number("partial_rotary_factor", 1.0) != 1.0:
        f.fail(f"{f.name('partial_rotary_factor')} other than 1 is not supported (RoPE over "
               "the whole head)")
    theta = f.number("rope_theta", theta, positive=True)
    if kind == "default":
        return theta, RopeScaling()
    factor = f.number("factor", positive=True)
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3", factor, f.number("low_freq_factor", positive=True),
        f.number("high_freq_factor", positive=True),
        f.integer("original_max_position_embeddings",
                  _ABSENT if max_positions is None else max_positions))


def hf_rope(d: dict | ConfigFields, default_theta: float = 10000.0,
            dynamic_ok: bool = False) -> tuple[float, RopeScaling]:
    """RoPE base and scaling of a config whose layers share one RoPE (Llama, Qwen, Gemma 2,
    EAGLE heads), read as transformers 5.24 reads it
    (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``): a non-empty v4
    ``rope_scaling`` replaces ``rope_parameters`` whole, else ``rope_parameters`` is read;
    a base that object lacks is the top-level ``rope_theta``, else ``default_theta`` (so
    beside a non-empty ``rope_scaling``, ``rope_parameters``' own ``rope_theta`` is not
    read, as in transformers). Fields and errors: :func:`rope_block`."""
    f = _fields(d)
    if f.number("partial_rotary_factor", 1.0) != 1.0:
        f.fail("'partial_rotary_factor' other than 1 is not supported (RoPE over the whole "
               "head)")
    key = "rope_scaling" if f.d.get("rope_scaling") else "rope_parameters"
    return rope_block(f.obj(key), f.number("rope_theta", default_theta, positive=True),
                      f.integer("max_position_embeddings", None), dynamic_ok)


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
    f = _fields(d)
    kind = f.text("model_type", "llama")
    kinds = FAMILIES["Llama"].hf_model_types
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
    f = _fields(d)
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


def _model_class(module: str, name: str) -> Callable[[], type]:
    def model():
        import importlib

        return getattr(importlib.import_module(f"specjax.models.{module}"), name)
    return model


# The built-in families. A family of its own registers a ``Family`` the same way; another
# ``model_type`` of an existing family is one more name in its ``hf_model_types``.
register_family(Family("Llama", LlamaConfig, _model_class("llama", "Llama"), hf_config,
                       ("llama", "qwen2", "qwen3", "mistral"), ("llama",)))
register_family(Family("Gemma", GemmaConfig, _model_class("gemma", "Gemma"), hf_gemma_config,
                       ("gemma2", "gemma3_text"), ("gemma3",)))
register_family(Family("T5", T5Config, _model_class("t5", "T5"), lambda f: hf_t5_config(f),
                       ("t5",)))


def _hf_family(kind: str) -> Family | None:
    return next((f for f in FAMILIES.values() if kind in f.hf_model_types), None)


def hf_dir_config(path: str | Path) -> Config:
    """The model config of a local HF directory, from its ``config.json``;
    ``WeightLoadError`` naming the file (and the key) for a file that is not a JSON object,
    an unsupported ``model_type``, a missing key or a value of the wrong type."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    f = read_config_json(cfg_file)
    kind = f.text("model_type", "llama")
    fam = _hf_family(kind)
    if fam is None:
        kinds = [t for fam in FAMILIES.values() for t in fam.hf_model_types]
        f.fail(f"model_type {kind!r} is not supported ({', '.join(kinds)})")
    return fam.hf_config(f)


# --------------------------------------------------------------------------- safetensors, lazily

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
              "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
              "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_, "C64": np.complex64}
#: the stored dtypes that weights may have: floating point, never integers, booleans or
#: complex numbers (which casting would turn into numbers no model was trained with)
FLOAT_DTYPES = frozenset(np.dtype(v) for k, v in _ST_DTYPES.items()
                         if k.startswith(("F", "BF")))


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in a safetensors file: absolute byte range ``[start, end)``."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def safetensors_header(f: Path) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors file ``f`` (in header order), from its header alone
    (8-byte little-endian length, then JSON). ``WeightLoadError`` naming ``f`` for a file
    that is not complete safetensors: a bad header, an unknown dtype, or a byte range that
    does not match the shape or lies past the end of the file; and, as the ``safetensors``
    package refuses them, a name (or any key) given twice in the header, two tensors over
    the same bytes, bytes no tensor covers, or bytes after the last tensor."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > min(size - 8, 100 << 20):
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(fh.read(n), object_pairs_hook=_unique_keys)
        out = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if e["dtype"] not in _ST_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {e['dtype']}, which is not read")
            dtype, shape = np.dtype(_ST_DTYPES[e["dtype"]]), tuple(int(s) for s in e["shape"])
            a, b = (8 + n + int(o) for o in e["data_offsets"])
            if b - a != math.prod(shape) * dtype.itemsize or b > size or a < 8 + n:
                raise ValueError(f"tensor {name!r}: bytes {a}..{b} of a {size}-byte file do "
                                 f"not hold {e['dtype']} {list(shape)}")
            out[name] = StoredTensor(f, dtype, shape, a, b)
        _check_coverage(out, 8 + n, size)
        return out
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise WeightLoadError(f"{f}: not a readable safetensors file ({e})") from None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's pairs as a dict; ``ValueError`` for a key given twice (which
    ``json`` would otherwise resolve silently to the last value)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"{k!r} is named twice in the header")
        out[k] = v
    return out


def _check_coverage(table: dict[str, StoredTensor], start: int, size: int) -> None:
    """``ValueError`` unless the tensors' byte ranges tile ``[start, size)`` exactly, as
    the ``safetensors`` package requires: no two over the same bytes (reported first: a
    tensor pointed at another's bytes also leaves its own uncovered), no bytes between two
    tensors, none after the last. Messages give data offsets (``data_offsets``' terms)."""
    ranges = sorted(table.items(), key=lambda kv: (kv[1].start, kv[1].end))
    for (p, a), (name, t) in zip(ranges, ranges[1:]):
        if t.start < a.end:
            raise ValueError(f"tensor {name!r} (data bytes {t.start - start}..{t.end - start}) "
                             f"overlaps tensor {p!r} ({a.start - start}..{a.end - start})")
    at, last = start, None
    for name, t in ranges:
        if t.start > at:
            where = f"after tensor {last!r}" if last else "before the first tensor"
            raise ValueError(f"data bytes {at - start}..{t.start - start} {where} belong to "
                             f"no tensor (next: tensor {name!r})")
        at, last = t.end, name
    if at != size:
        after = f"tensor {last!r}" if last else "the header"
        raise ValueError(f"data bytes {at - start}..{size - start} after {after} belong to "
                         "no tensor (data past the end of the header's tensors)")


class SafetensorsSource(TensorSource):
    """Tensors of safetensors files, read one at a time from their byte ranges, in the
    stored dtype (bfloat16 stays bfloat16). Plain reads, not a mapping, so a tensor no
    longer referenced leaves no file pages counted in the process."""

    def __init__(self, table: dict[str, StoredTensor]):
        self.table = table
        self.shapes = {k: t.shape for k, t in table.items()}

    def _read_bytes(self, t: StoredTensor, a: int, buf: np.ndarray) -> None:
        view = memoryview(buf.reshape(-1).view(np.uint8))
        with open(t.file, "rb", buffering=0) as fh:
            fh.seek(a)
            got = 0
            while got < len(view):
                k = fh.readinto(view[got:])
                if not k:
                    raise WeightLoadError(f"{t.file}: ends inside tensor data (truncated)")
                got += k

    def read(self, name, rows=None):
        t = self.table[name]
        if rows is None or not t.shape:
            out = np.empty(t.shape, t.dtype)
            self._read_bytes(t, t.start, out)
            return out
        a, b = rows[0], min(rows[1], t.shape[0])
        out = np.empty((b - a,) + t.shape[1:], t.dtype)
        self._read_bytes(t, self._row_offset(t, a), out)
        return out

    def _row_offset(self, t: StoredTensor, row: int) -> int:
        return t.start + row * math.prod(t.shape[1:]) * t.dtype.itemsize

    def read_into(self, name, out, rows=None):
        t = self.table[name]
        if out.dtype == t.dtype and out.flags.c_contiguous:
            self._read_bytes(t, t.start if rows is None or not t.shape
                             else self._row_offset(t, rows[0]), out)
        else:
            out[...] = self.read(name, rows)


def hf_weight_table(path: Path) -> dict[str, StoredTensor]:
    """The tensors of an HF directory, from the files transformers 5 reads, in its order
    (``modeling_utils._get_resolved_checkpoint_files``): the file ``config.json`` names in
    ``transformers_weights``; else ``model.safetensors``; else the files
    ``model.safetensors.index.json``'s ``weight_map`` names, each tensor from the file the
    map gives. Other ``*.safetensors`` files (a stray ``model_backup.safetensors``) are
    ignored. Without any of these, one other ``*.safetensors`` file is read as the weights;
    several are a ``WeightLoadError`` naming them, none a ``FileNotFoundError``.
    ``WeightLoadError`` for an index naming a missing file, or a tensor its file lacks, or
    a shard holding a tensor the map does not assign to it (so no name is in two files)."""
    named = _named_weights(path)
    if named is not None:
        if named.name.endswith(".index.json"):
            return _indexed_table(path, named)
        return safetensors_header(named)
    if (path / "model.safetensors").is_file():
        return safetensors_header(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return _indexed_table(path, index)
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json "
                                "or other *.safetensors file")
    if len(files) > 1:
        raise WeightLoadError(f"{path}: no model.safetensors or model.safetensors.index.json, "
                              f"and several weight files {[f.name for f in files]}: which hold "
                              "the model is ambiguous (name it model.safetensors, or write "
                              "an index)")
    return safetensors_header(files[0])


def _named_weights(path: Path) -> Path | None:
    """The weights file ``config.json``'s ``transformers_weights`` names, if it names one,
    checked as transformers checks it: a ``.safetensors`` or ``.safetensors.index.json``
    file inside ``path`` (``WeightLoadError`` otherwise, or where it does not exist)."""
    if not (path / "config.json").is_file():
        return None
    f = read_config_json(path / "config.json")
    name = f.text("transformers_weights", None)
    if name is None:
        return None
    target = (path / name).resolve()
    if (not name.endswith((".safetensors", ".safetensors.index.json"))
            or path.resolve() not in target.parents):
        f.fail(f"'transformers_weights' must name a .safetensors or .safetensors.index.json "
               f"file inside {path}, got {name!r}")
    if not target.is_file():
        f.fail(f"'transformers_weights' names {name}, which does not exist")
    return target


def check_floating(name: str, dtype, where, error: type = WeightLoadError) -> None:
    """``error`` naming ``where`` and tensor ``name`` unless its stored ``dtype`` is floating
    point: integers, booleans and complex numbers (a quantized or corrupt checkpoint) are
    not weights that a cast to floats would recover."""
    dt = np.dtype(dtype)
    if dt not in FLOAT_DTYPES:
        raise error(f"{where}: tensor {name!r} is stored as {dt.name}; weights must be "
                    "floating point (quantized checkpoints are not supported)")


def _indexed_table(path: Path, index: Path) -> dict[str, StoredTensor]:
    """The tensors a sharded checkout's index names (see :func:`hf_weight_table`)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(str(fname), []).append(str(name))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightLoadError(f"{index}: not a readable index ({e!r})") from None
    table: dict[str, StoredTensor] = {}
    for fname, names in by_file.items():
        f = path / fname
        if not f.is_file():
            raise WeightLoadError(f"{index}: weight_map names {fname}, which is missing from "
                                  f"{path} ({len(names)} tensors, e.g. {names[0]!r})")
        header = safetensors_header(f)
        absent = [n for n in names if n not in header]
        if absent:
            raise WeightLoadError(f"{index}: weight_map puts {absent[0]!r} in {fname}, which "
                                  f"does not hold it ({len(absent)} such tensors)")
        extra = [n for n in header if weight_map.get(n) != fname]
        if extra:
            raise WeightLoadError(f"{f}: holds {extra[0]!r}, which {index.name} does not "
                                  f"assign to it ({len(extra)} such tensors)")
        table.update({n: header[n] for n in names})
    return {n: table[n] for n in weight_map}


def _same_tensor(src: TensorSource, a: str, b: str, chunk_bytes: int = 16 << 20) -> bool:
    """Whether tensors ``a`` and ``b`` of ``src`` hold equal values, compared a block of
    rows at a time (neither is read whole, nor widened unless their dtypes differ)."""
    if src.shapes[a] != src.shapes[b]:
        return False
    shape = src.shapes[a]
    if not shape:
        return bool(np.array_equal(src.read(a), src.read(b)))
    step = max(1, chunk_bytes // max(1, math.prod(shape[1:]) * 4))
    for r in range(0, shape[0], step):
        x, y = src.read(a, (r, r + step)), src.read(b, (r, r + step))
        if x.dtype != y.dtype:
            x, y = x.astype(np.float32), y.astype(np.float32)
        if not np.array_equal(x, y):
            return False
    return True


def load_hf_dir(path: str | Path, dtype=jnp.float32, mesh=None,
                stacked: bool = False) -> tuple[Config, dict]:
    """Loads ``config.json`` and the weights of a local HF directory (the files
    :func:`hf_weight_table` picks), tensor by tensor in their stored dtype, each leaf placed
    as it is made (:func:`stream_params`: with ``mesh``, sharded as
    ``specjax.sharding.shard_params`` would; ``stacked`` for ``scan_layers``). Peak host
    memory is the placed weights plus about one leaf. T5 is read whole in float32, then
    placed (``stacked`` is a ``ValueError`` for it)."""
    path = Path(path)
    cfg = hf_dir_config(path)
    table = hf_weight_table(path)
    for name, t in table.items():
        check_floating(name, t.dtype, t.file)
    src = SafetensorsSource(table)
    if family(cfg) == "T5":
        if stacked:
            raise ValueError("stacked layers (scan_layers) are for Llama-family models only")
        tensors = {k: src.read(k).astype(np.float32) for k in src.shapes}
        cfg, params = _t5_tied(cfg, tensors, path, dtype)
        if mesh is not None:
            from specjax import sharding

            params = sharding.shard_params(cfg, params, mesh)
        return cfg, params
    ignore = ()
    if cfg.tie_embeddings and "lm_head.weight" in src.shapes:
        emb = "model.embed_tokens.weight"
        if emb not in src.shapes or not _same_tensor(src, emb, "lm_head.weight"):
            raise WeightLoadError(f"{path}: config.json ties the embeddings, but "
                                  "'lm_head.weight' differs from 'model.embed_tokens.weight'")
        ignore = ("lm_head.weight",)  # a saved copy of the tied embedding
    keys = HF_GEMMA_KEYS if isinstance(cfg, GemmaConfig) else HF_KEYS
    return cfg, stream_params(cfg, src, keys, str(path), dtype, mesh, stacked, ignore)


# --------------------------------------------------------------------------- T5 (HF directory)

def hf_t5_config(d: dict | ConfigFields):
    """A T5Config from an HF ``config.json`` (``model_type`` ``t5``); ``WeightLoadError``
    naming the file and key for a missing key or a value of the wrong type.

    The LM head scaling follows transformers: ``scale_decoder_outputs`` when the file has it
    (transformers >= 5 writes it), else ``tie_word_embeddings`` (default true). Whether the
    head is tied is settled when the weights load: by a saved ``lm_head.weight``."""
    f = _fields(d)
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
    eos = f.value("eos_token_id", 1, lambda v: _is_int(v) or (
        isinstance(v, list) and v and all(_is_int(x) for x in v)), "an integer or a list of them")
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
