"""Mesh sharding: a ``data`` axis for batch rows and a ``model`` axis for weights.

Parameters follow the usual Megatron split, by logical axes that each model family
declares (its config's ``partitioning``: a :class:`Partitioning`, the way MaxText and gemma
name their weights' axes), so this module knows no family's parameter names. A weight dim
whose logical axis is :data:`HEADS`, :data:`KV_HEADS` or :data:`MLP` is split over
``model`` when the config's count of it (query heads, K/V heads, MLP width) divides the
axis, and a :data:`VOCAB` dim when its size does: query heads, K/V heads and the MLP's
gate/up rows by rows, the output projections by their input columns, so each device
computes whole heads and whole MLP columns and one all-reduce per block sums them.
Embeddings and LM heads split over the vocabulary, Q/K/V biases with their rows' heads.
What a family does not list (norms, biases of outputs, relative-bias tables, small
draft-head tensors) is replicated. The KV cache is
split over ``data`` (rows) and ``model`` (KV heads, where they divide), and so is a T5's
bound source (its cross-attention K/V); token buffers over ``data``.

Sharding never changes a result: XLA's SPMD partitioner runs the same program on the
mesh, so greedy tokens equal the one-device run (``tests/test_sharding.py``).

Multi-process (a TPU pod slice, a GPU cluster: one JAX process per host): every process
calls ``specjax.distributed.initialize`` (``jax.distributed.initialize``) before anything
else, builds the same mesh over ``jax.devices()`` (every process's devices) and runs the
same program on the same prompts. Host values reach a mesh through :func:`place`, which
makes on each process only the slices its own devices hold (``jax.make_array_from_callback``;
``jax.device_put`` of a whole host array refuses devices of other processes), and results
come back through :func:`gather`, once, after the decoding loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# Logical axes of weight dims. Each counts a number of the model contract
# (``specjax.models.base.ModelConfig``); ``VOCAB`` counts the dim's own size.
HEADS, KV_HEADS, MLP, VOCAB = "heads", "kv_heads", "mlp", "vocab"
MOE_MLP = "moe_mlp"  # an expert's MLP width (Gemma 4's MoE block)
_COUNTS = {HEADS: "num_heads", KV_HEADS: "num_kv_heads", MLP: "intermediate_size",
           MOE_MLP: "moe_intermediate_size"}

Fused = Mapping[str, tuple[tuple[str, ...], list[int]]]


@dataclasses.dataclass(frozen=True, eq=False)
class Partitioning:
    """How a family's parameters split over a mesh (a config's ``partitioning``).

    ``axes``: a parameter name -> the logical axis (or None) of each of its trailing dims,
    ``[out, in]`` for a weight and ``[out]`` for a bias, at most one of them split; a
    leading dim (``scan_layers``' stacked layer axis) stays whole, and a name not listed
    is replicated. ``fused``: a config -> the weights stored fused, each with the names of
    its row blocks and their row offsets (split by :func:`split_layout` into the layout
    sharded by heads; the models read both layouts)."""

    axes: Mapping[str, tuple[str | None, ...]]
    fused: Callable[[Any], Fused] = lambda config: {}

    def extend(self, axes: Mapping[str, tuple[str | None, ...]],
               fused: Callable[[Any], Fused] | None = None) -> "Partitioning":
        """This partitioning with more names, and more fused weights."""
        own = self.fused
        both = own if fused is None else (lambda config: {**own(config), **fused(config)})
        return Partitioning({**self.axes, **axes}, both)


REPLICATED = Partitioning({})  # a config that declares none: every weight whole


def partitioning(config) -> Partitioning:
    """The config's ``partitioning`` (``REPLICATED`` when it declares none)."""
    return getattr(config, "partitioning", REPLICATED)


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}`` (a missing axis is 1)."""
    sizes = {DATA: 1, MODEL: 1}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, eq, value = part.partition("=")
        name = name.strip()
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {spec!r}: the axes are "
                             f"{' and '.join(AXES)} (e.g. data=2,model=4)")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {part!r}: expected {name}=N with an int N") from None
        if not eq or sizes[name] < 1:
            raise ValueError(f"mesh axis {part!r}: the size must be an int >= 1")
    return sizes


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ``(data, model)`` mesh over the first ``data * model`` of ``devices`` (default:
    ``jax.devices()``). ``ValueError`` when there are fewer devices than that."""
    devices = list(jax.devices() if devices is None else devices)
    for name, n in ((DATA, data), (MODEL, model)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"mesh axis {name} must be an int >= 1, got {n!r}")
    if data * model > len(devices):
        raise ValueError(f"a mesh of data={data} x model={model} needs {data * model} devices, "
                         f"but {len(devices)} are visible (on CPU, simulate more with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)")
    grid = np.asarray(devices[:data * model], dtype=object).reshape(data, model)
    return Mesh(grid, AXES)


def mesh_from_spec(spec: str) -> Mesh:
    """``make_mesh(**parse_mesh(spec))``: the CLI's ``--mesh data=D,model=M``."""
    return make_mesh(**parse_mesh(spec))


def axis_size(mesh: Mesh | None, name: str) -> int:
    return 1 if mesh is None else int(mesh.shape[name])


def check_model(config, mesh: Mesh) -> None:
    """``ValueError`` unless the ``model`` axis divides the query heads and the MLP width."""
    m = axis_size(mesh, MODEL)
    if m == 1:
        return
    for what, n in (("query heads", config.num_heads),
                    ("MLP width (intermediate_size)", config.intermediate_size)):
        if n % m:
            divs = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
            raise ValueError(f"mesh model={m} does not divide the model's {n} {what}; "
                             f"use one of model={divs}")


def check_batch(batch: int, mesh: Mesh | None) -> None:
    d = axis_size(mesh, DATA)
    if batch % d:
        raise ValueError(f"mesh data={d} does not divide the batch of {batch} rows; give a "
                         f"multiple of {d} prompts")


# ----------------------------------------------------------------------------- layouts

def split_layout(config, params: Any) -> Any:
    """The same parameters with every weight the config's :class:`Partitioning` lists as
    fused (``qkv``, ``gate_up``, ...) split into its row blocks (``q``, ``k``, ``v``, ...):
    the layout sharded by heads, which the models read as well. Exact: only rows are
    regrouped."""
    part = partitioning(config)
    fused = part.fused(config)
    # a bias's blocks are slices of its one dim (its parts have one logical axis)
    bias = {name: len(part.axes.get(parts[0], (None, None))) == 1
            for name, (parts, _) in fused.items()}

    def walk(x):
        if isinstance(x, dict):
            y = {k: walk(v) for k, v in x.items()}
            for name, (parts, at) in fused.items():
                if name in y:
                    y.update(zip(parts, _split_rows(y.pop(name), at, bias[name])))
            return y
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(params)


def _split_rows(w, at, bias: bool = False):
    """Row blocks of an ``[out, in]`` weight (or a stacked ``[L, out, in]`` one); with
    ``bias``, blocks of an ``[out]`` bias (or a stacked ``[L, out]`` one)."""
    if bias:
        return tuple(w[..., a:b] for a, b in zip([0] + at, at + [w.shape[-1]]))
    return tuple(w[..., a:b, :] for a, b in zip([0] + at, at + [w.shape[-2]]))


def param_spec(config, path, shape, mesh: Mesh) -> P:
    """The ``PartitionSpec`` of one parameter in the split layout, from the config's
    :class:`Partitioning`, the parameter's path (a name, or a sequence of keys whose last
    string is the name: ``("layers", 3, "q")``) and its shape alone; no array is needed.
    This is the spec :func:`param_specs` gives that leaf, so weights placed straight from
    a checkpoint (``specjax.models.load(..., mesh=)``) land as :func:`shard_params` would
    place them."""
    name = path if path is None or isinstance(path, str) else next(
        (k for k in reversed(tuple(path)) if isinstance(k, str)), None)
    axes = partitioning(config).axes.get(name)
    m = axis_size(mesh, MODEL)
    if axes is None or m == 1 or len(shape) < len(axes):
        return P()
    lead = len(shape) - len(axes)

    def split(axis, size) -> bool:
        n = size if axis == VOCAB else getattr(config, _COUNTS[axis], 0) if axis else 0
        return n > 0 and n % m == 0

    dims = [MODEL if split(a, n) else None for a, n in zip(axes, shape[lead:])]
    return P(*(None,) * lead, *dims) if MODEL in dims else P()


def param_specs(config, params: Any, mesh: Mesh) -> Any:
    """A ``PartitionSpec`` per leaf of ``params`` (in the split layout): :func:`param_spec`
    of each leaf's innermost dict key and shape."""
    def walk(x, name=None):
        if isinstance(x, dict):
            return {k: walk(v, k) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v, name) for v in x)
        return None if x is None else param_spec(config, name, np.shape(x), mesh)

    return walk(params)


def shard_params(config, params: Any, mesh: Mesh) -> Any:
    """``params`` in the split layout, placed on ``mesh`` by :func:`param_specs`. An
    encoder-decoder's bound source (``params["source"]``, from ``T5.bind``) is placed by
    :func:`source_spec`. Idempotent; ``ValueError`` for a mesh the model cannot be split
    over."""
    check_model(config, mesh)
    source = params.get("source") if isinstance(params, dict) else None
    if source is not None:
        params = {k: v for k, v in params.items() if k != "source"}
    params = split_layout(config, params)
    specs = param_specs(config, params, mesh)
    placed = jax.tree.map(lambda x, s: None if x is None else place(x, NamedSharding(mesh, s)),
                          params, specs, is_leaf=lambda x: x is None)
    return placed if source is None else {**placed, "source": place_source(source, mesh)}


def place_source(source, mesh: Mesh):
    """An encoded source (``T5.encode``) placed on ``mesh`` by :func:`source_spec`."""
    return jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)), source,
                        source_spec(source, mesh))


def source_spec(source, mesh: Mesh):
    """The ``PartitionSpec`` pytree of an encoded source (``T5.encode``): rows over
    ``data``, the cross-attention K/V's heads over ``model`` where they divide."""
    m = axis_size(mesh, MODEL)
    heads = MODEL if m > 1 and source.v[0].shape[1] % m == 0 else None
    return source.replace(tokens=P(DATA), valid=P(DATA),
                          k=tuple(P(DATA, heads) for _ in source.k),
                          v=tuple(P(DATA, heads) for _ in source.v))


def cache_spec(cache, mesh: Mesh):
    """The ``PartitionSpec`` pytree of a ``KVCache``: rows over ``data``, KV heads over
    ``model`` where they divide (each layer's own, where layers differ: Gemma 4)."""
    m = axis_size(mesh, MODEL)
    heads = lambda x: MODEL if m > 1 and x.shape[-3] % m == 0 else None  # noqa: E731
    if getattr(cache, "stacked", False):  # [L, B, K, ., .]: the layer axis stays whole
        h = heads(cache.v)
        return cache.replace(k=P(None, DATA, h, None, None),
                             v=P(None, DATA, h, None, None), length=P(DATA))
    return cache.replace(k=tuple(P(DATA, heads(x), None, None) for x in cache.k),
                         v=tuple(P(DATA, heads(x), None, None) for x in cache.v),
                         length=P(DATA))


def constrain_cache(cache, mesh: Mesh | None):
    """``cache`` with its sharding pinned (inside ``jit``); unchanged without a mesh."""
    if mesh is None or cache is None:
        return cache
    specs = cache_spec(cache, mesh)
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)),
                        cache, specs)


def rows(mesh: Mesh | None, x):
    """``x`` (leading axis: batch rows) placed with its rows over ``data`` (:func:`place`)."""
    if mesh is None:
        return x
    return jax.tree.map(lambda a: place(
        a, NamedSharding(mesh, P(DATA, *([None] * (np.ndim(a) - 1))))), x)


def replicated(mesh: Mesh | None, x):
    """``x`` copied to every device of ``mesh`` (:func:`place`)."""
    if mesh is None:
        return x
    return jax.tree.map(lambda a: place(a, NamedSharding(mesh, P())), x)


# ----------------------------------------------------------------------------- processes

def place(x, where: jax.sharding.Sharding) -> jax.Array:
    """``x`` laid out by ``where``. A sharding within this process, or an array already
    spread over processes (resharded by XLA), is ``jax.device_put``. A host value (numpy,
    or an array of this process) on a sharding that spans processes is made with
    ``jax.make_array_from_callback``: each process builds only the slices its own devices
    hold, so every process must pass the same value. Typed PRNG keys keep their type."""
    if where.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, where)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = place(jax.random.key_data(x), where)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, where, lambda idx: host[idx])


def gather(tree):
    """``tree`` with every array that spans processes made whole on every device of its
    mesh (one jitted copy, an all-gather), so that every process can read all of it with
    ``np.asarray``. Arrays this process holds whole, and other leaves, pass unchanged."""
    leaves, treedef = jax.tree.flatten(tree)
    far = [i for i, x in enumerate(leaves)
           if isinstance(x, jax.Array) and not x.is_fully_addressable
           and not x.is_fully_replicated]
    if not far:
        return tree
    whole = [NamedSharding(leaves[i].sharding.mesh, P()) for i in far]
    got = jax.jit(lambda *xs: xs, out_shardings=tuple(whole))(*(leaves[i] for i in far))
    for i, x in zip(far, got):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


__all__ = ["DATA", "MODEL", "make_mesh", "mesh_from_spec", "parse_mesh", "check_model",
           "check_batch", "split_layout", "param_spec", "param_specs", "shard_params",
           "place_source", "source_spec",
           "cache_spec",
           "constrain_cache", "rows", "replicated", "place", "gather"]
