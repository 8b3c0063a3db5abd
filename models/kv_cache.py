"""The KV cache: a pytree with fixed capacity and per-row lengths.

Entries ``[0, length[b])`` of row ``b`` are the committed prefix. A forward pass reads the
prefix, then writes its ``T`` new entries at ``[length[b], length[b] + T)`` without moving
``length``; the caller
then advances the row (autoregressive decoding) or commits an accepted subset (speculative
decoding). Everything here has static shapes and runs on device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from flax import struct
from jaxtyping import Array, Bool, Int


_UNROLL_ROWS = 8  # up to this batch, rows are updated by unrolled in-place slice updates


@struct.dataclass
class KVCache:
    """Keys and values of every layer.

    Attributes:
      k: one ``[B, K, H, S]`` array per layer (B rows, K kv-heads, H head dim, S capacity);
         slots are minor so that scoring a query is a vector-matrix product. Or, for a
         model that runs its layers under ``lax.scan`` (``stacked``), one ``[L, B, K, H, S]``
         array: ``k[i]`` is layer ``i``'s keys either way.
      v: one ``[B, K, S, H]`` array per layer, or one ``[L, B, K, S, H]`` array.
      length: ``[B]`` int32, committed entries per row.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    length: Int[Array, "B"]

    @property
    def capacity(self) -> int:
        return self.v[0].shape[2]

    @property
    def stacked(self) -> bool:
        """Whether all layers share one array with a leading layer axis (scanned layers)."""
        return not isinstance(self.k, (tuple, list))

    @classmethod
    def zeros(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
              head_dim: int, dtype=jnp.float32, stacked: bool = False) -> "KVCache":
        """An empty cache: per-layer arrays, or with ``stacked`` one array per K and V with
        a leading layer axis (what a ``lax.scan`` over layers reads and writes)."""
        kshape = (batch, num_kv_heads, head_dim, capacity)
        vshape = (batch, num_kv_heads, capacity, head_dim)
        if stacked:
            return cls(k=jnp.zeros((num_layers,) + kshape, dtype),
                       v=jnp.zeros((num_layers,) + vshape, dtype),
                       length=jnp.zeros((batch,), jnp.int32))
        return cls(k=tuple(jnp.zeros(kshape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(vshape, dtype) for _ in range(num_layers)),
                   length=jnp.zeros((batch,), jnp.int32))

    def advance(self, n: Int[Array, "B"] | int) -> "KVCache":
        """Commits the first ``n[b]`` entries written after each row's length."""
        return self.replace(length=self.length + jnp.asarray(n, jnp.int32))

    def commit(self, src: Int[Array, "B M"], count: Int[Array, "B"], window: int) -> "KVCache":
        """Keeps an accepted subset of the ``window`` entries written after each row's length.

        Entry ``length[b] + src[b, i]`` moves to ``length[b] + i`` for ``i < count[b]``, in
        every layer, and the row's length grows by ``count[b]``. ``src`` must be increasing
        (a path through a draft tree is) and below ``window``; ``length + window`` must fit
        the capacity, as it does after a forward of ``window`` tokens.
        """
        m = src.shape[1]
        ident = jnp.arange(window, dtype=jnp.int32)
        keep = jnp.arange(m)[None, :] < count[:, None]
        src = jnp.where(keep, src, ident[None, :m])
        src = jnp.concatenate([src, jnp.broadcast_to(ident[m:], (src.shape[0], window - m))], 1)
        if self.stacked:  # one gather over every layer at once: batch axis 1
            k = _gather_window(self.k, self.length, src, axis=4, rows=1)
            v = _gather_window(self.v, self.length, src, axis=3, rows=1)
        else:
            k = tuple(_gather_window(x, self.length, src, axis=3) for x in self.k)
            v = tuple(_gather_window(x, self.length, src, axis=2) for x in self.v)
        return KVCache(k=k, v=v, length=self.length + count.astype(jnp.int32))


def _gather_window(layer_kv: Array, length: Int[Array, "B"], src: Int[Array, "B W"],
                   axis: int, rows: int = 0) -> Array:
    """Per row, slots ``length + i`` take the old slots ``length + src[i]`` (in place).
    ``axis`` is the slot axis, ``rows`` the batch axis (1 for a stacked cache)."""
    w = src.shape[1]
    if layer_kv.shape[rows] > _UNROLL_ROWS:
        def row(l, s, idx):
            win = lax.dynamic_slice_in_dim(l, s, w, axis - 1)
            return lax.dynamic_update_slice_in_dim(l, jnp.take(win, idx, axis - 1), s, axis - 1)
        return jax.vmap(row, in_axes=(rows, 0, 0), out_axes=rows)(layer_kv, length, src)
    for b in range(layer_kv.shape[rows]):
        start = [0] * layer_kv.ndim
        start[rows], start[axis] = b, length[b]
        size = list(layer_kv.shape)
        size[rows], size[axis] = 1, w
        win = lax.dynamic_slice(layer_kv, start, size)
        layer_kv = lax.dynamic_update_slice(layer_kv, jnp.take(win, src[b], axis=axis), start)
    return layer_kv


def write(layer_kv: Array, length: Int[Array, "B"], new: Array, axis: int) -> Array:
    """Returns ``layer_kv`` with ``new`` at slots ``length[b] + j`` along its slot ``axis``.

    ``new`` has the layout of ``layer_kv`` with T entries on ``axis``. Requires
    ``length[b] + T <= capacity``; the slice update is in place inside a loop. A cache of
    capacity 0 (a forward that keeps no cache: ``ops.attention`` then sees only the new
    tokens) is returned as it is.
    """
    if layer_kv.shape[axis] == 0:
        return layer_kv
    new = new.astype(layer_kv.dtype)
    if new.shape[0] > _UNROLL_ROWS:  # one batched scatter
        upd = lambda l, n, s: lax.dynamic_update_slice_in_dim(l, n, s, axis - 1)
        return jax.vmap(upd)(layer_kv, new, length)
    for b in range(new.shape[0]):  # one slice update per row
        start = [b] + [0] * (layer_kv.ndim - 1)
        start[axis] = length[b]
        layer_kv = lax.dynamic_update_slice(layer_kv, new[b:b + 1], start)
    return layer_kv


def write_layer(stack: Array, layer: Int[Array, ""], length: Int[Array, "B"], new: Array,
                axis: int) -> Array:
    """``write`` into layer ``layer`` of a stacked ``[L, B, ...]`` cache array: ``new`` (one
    layer's layout, T entries on its slot ``axis``) goes to slots ``length[b] + j``. Only the
    new entries are written, so inside a ``lax.scan`` over layers the stacked cache is
    updated in place. A stack of capacity 0 is returned as it is (``write``)."""
    if stack.shape[axis + 1] == 0:
        return stack
    new = new.astype(stack.dtype)
    if new.shape[0] > _UNROLL_ROWS:
        def upd(l, n, s):
            start = [layer] + [0] * (l.ndim - 1)
            start[axis] = s  # l: [L, ...] without the batch axis
            return lax.dynamic_update_slice(l, n[None], start)
        return jax.vmap(upd, in_axes=(1, 0, 0), out_axes=1)(stack, new, length)
    for b in range(new.shape[0]):
        start = [layer, b] + [0] * (stack.ndim - 2)
        start[axis + 1] = length[b]
        stack = lax.dynamic_update_slice(stack, new[None, b:b + 1], start)
    return stack


def causal_mask(batch: int, t: int) -> Bool[Array, "B T T"]:
    """The mask of a chain: new token i sees new tokens j <= i."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


__all__ = ["KVCache", "write", "write_layer", "causal_mask"]
