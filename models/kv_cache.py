"""The KV cache: a pytree with fixed capacity and per-row lengths.

Entries ``[0, length[b])`` of row ``b`` are the committed prefix. A forward pass reads the
prefix, then writes its ``T`` new entries at ``[length[b], length[b] + T)`` without moving
``length``; the caller
then advances the row (autoregressive decoding) or commits an accepted subset (speculative
decoding). Everything here has static shapes and runs on device.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from flax import struct
from jaxtyping import Array, Bool, Int


@struct.dataclass
class KVCache:
    """Keys and values of every layer.

    Attributes:
      k: one ``[B, K, H, S]`` array per layer (B rows, K kv-heads, H head dim, S capacity);
         slots are minor so that scoring a query is a vector-matrix product.
      v: one ``[B, K, S, H]`` array per layer.
      length: ``[B]`` int32, committed entries per row.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    length: Int[Array, "B"]

    @property
    def capacity(self) -> int:
        return self.v[0].shape[2]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
              head_dim: int, dtype=jnp.float32) -> "KVCache":
        kshape = (batch, num_kv_heads, head_dim, capacity)
        vshape = (batch, num_kv_heads, capacity, head_dim)
        return cls(k=tuple(jnp.zeros(kshape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(vshape, dtype) for _ in range(num_layers)),
                   length=jnp.zeros((batch,), jnp.int32))

    def advance(self, n: Int[Array, "B"] | int) -> "KVCache":
        """Commits the first ``n[b]`` entries written after each row's length."""
        return self.replace(length=self.length + jnp.asarray(n, jnp.int32))


def write(layer_kv: Array, length: Int[Array, "B"], new: Array, axis: int) -> Array:
    """Returns ``layer_kv`` with ``new`` at slots ``length[b] + j`` along its slot ``axis``.

    ``new`` has the layout of ``layer_kv`` with T entries on ``axis``. Requires
    ``length[b] + T <= capacity``; the slice update is in place inside a loop.
    """
    new = new.astype(layer_kv.dtype)
    for b in range(new.shape[0]):  # one slice update per row
        start = [b] + [0] * (layer_kv.ndim - 1)
        start[axis] = length[b]
        layer_kv = lax.dynamic_update_slice(layer_kv, new[b:b + 1], start)
    return layer_kv


def causal_mask(batch: int, t: int) -> Bool[Array, "B T T"]:
    """The mask of a chain: new token i sees new tokens j <= i."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


__all__ = ["KVCache", "write", "causal_mask"]
