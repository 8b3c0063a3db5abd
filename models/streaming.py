"""Streaming weights into the params pytree: named tensors of any source (``TensorSource``:
a safetensors file, a GGUF file) checked against the config by names and shapes, then read
leaf by leaf, fused, cast and placed.

Names and shapes are checked from the file headers first (``check_names``, through a
family's table of source names: ``Family.hf_keys``, ``Family.gguf_keys``), then each leaf
of the pytree is read tensor by tensor in its stored dtype (bfloat16 stays bfloat16),
fused, cast to the requested dtype and placed on its device(s) at once, optionally straight
onto a mesh's shardings (``stream_params``). Host memory thus stays near the weights' own
size (``docs/results/load_memory_cpu.json``).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.families import family, family_of
from specjax.models.llama import LlamaConfig, top_shapes

Transform = Callable[[np.ndarray, LlamaConfig], np.ndarray]


class WeightLoadError(ValueError):
    """A checkpoint that does not match the architecture it claims."""


#: the transform of a tensor stored in our layout (a table entry that reads it as it is)
same = lambda w, cfg: w  # noqa: E731


def weight_table(top: dict[str, str], layer: dict[str, str], prefix: str,
                 transforms: dict[str, Transform] | None = None
                 ) -> list[tuple[str, str, Transform]]:
    """A format's table from its tensor names to ours, as :func:`check_names` reads it:
    ``(source name pattern, our unfused name, transform to our layout)``. ``top`` maps the
    source names of the tensors outside the layers to ours, ``layer`` those of one layer,
    each named ``prefix`` + name (``{i}`` in ``prefix`` stands for the layer's index). A
    tensor is read as stored (``same``) unless ``transforms`` maps its name of ours (``q``,
    ``final_norm``) to a transform."""
    fns = transforms or {}
    return ([(name, ours, fns.get(ours, same)) for name, ours in top.items()]
            + [(prefix + name, f"layers/{ours}", fns.get(ours, same))
               for name, ours in layer.items()])


def unfused_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Shapes of the per-matrix weights that source formats store, all [out, in]; the
    family's extra norm gains (``Family.layer_norms``: Gemma's ``post_attn_norm``,
    ``post_mlp_norm``); the optional ones (biases ``q_b``, ``k_b``, ``v_b``, ``o_b``; head
    norms ``q_norm``, ``k_norm``) exactly where the config asks for them, so a checkpoint
    with more or fewer tensors than its config fails to load."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer = {"attn_norm": (d,), "q": (nq, d), "k": (nk, d), "v": (nk, d), "o": (d, nq),
             "mlp_norm": (d,), "gate": (f, d), "up": (f, d), "down": (d, f)}
    layer.update({n: (d,) for n in family_of(cfg).layer_norms})
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
    if fn is not same:
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



def same_tensor(src: TensorSource, a: str, b: str, chunk_bytes: int = 16 << 20) -> bool:
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

