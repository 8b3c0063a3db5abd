"""Every specjax model as a Flax NNX module.

``LanguageModel(arch, params)`` is a ``flax.nnx.Module`` whose state is the model's
parameter pytree and whose call is the family's pure ``forward``:

* ``nnx.split(m)`` gives ``(graphdef, state)``; ``nnx.to_pure_dict(state)`` has the keys of
  ``params`` (``"layers"`` indexed by int instead of a list), and every specjax function
  that takes ``params`` (``generate``, ``speculative_generate``, drafters, training) accepts
  it as is;
* inside a user's ``jit`` or ``lax.while_loop``, ``nnx.merge(graphdef, state)(tokens, ...)``
  is the same computation as ``m(tokens, ...)``, with nothing captured but the weights.

The arithmetic lives once, in the family's pure functions (``Llama.forward``,
``Gemma.forward``): unrolled layers, weights as the left operand, padded widths, the layout
that measured fastest on XLA:CPU (docs/design.md). The module adds no computation, so
decoding through it costs what decoding through the functions costs.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax.models.base import Model
from specjax.models.kv_cache import KVCache


def _as_params(tree):
    return jax.tree.map(nnx.Param, tree)


def _values(tree):
    return jax.tree.map(lambda v: v[...], tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


class LanguageModel(nnx.Module):
    """A decoder-only model (any family of the ``Model`` contract) with its weights.

    Attributes: ``arch`` (the static ``Llama``/``Gemma`` object, hashable) and one attribute
    per top-level parameter (``embed``, ``layers``, ``final_norm``, ``lm_head`` when untied),
    each a pytree of ``nnx.Param``.
    """

    def __init__(self, arch: Model, params: dict[str, Any]):
        if not isinstance(arch, Model):
            raise TypeError(f"{type(arch).__name__} does not implement specjax.models.Model")
        clash = {"arch", "param_names"} & set(params)
        if clash:
            raise ValueError(f"parameter names {sorted(clash)} clash with module attributes")
        self.arch = arch
        self.param_names = tuple(params)
        for name, tree in params.items():
            setattr(self, name, nnx.data(_as_params(tree)))

    @property
    def config(self):
        return self.arch.config

    @property
    def params(self) -> dict[str, Any]:
        """The weights as the plain pytree the functional API takes (layers as a list)."""
        return {name: _values(getattr(self, name)) for name in self.param_names}

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache in the model's dtype."""
        return self.arch.init_cache(batch, capacity)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"] | None = None,
        cache: KVCache | None = None,
        mask: Bool[Array, "B T T"] | None = None,
        *,
        exit_layer: int | None = None,
        return_layers: tuple[int, ...] = (),
        compute_logits: bool = True,
    ) -> tuple[Float[Array, "B T V"] | None, dict[int, Array], KVCache]:
        """``arch.forward`` with this module's weights. Defaults: a fresh cache holding
        exactly the ``T`` new tokens, and positions continuing each row's cache length.
        Returns ``(logits, hidden, cache)`` as ``specjax.models.Model.forward`` does."""
        chex.assert_rank(tokens, 2)
        b, t = tokens.shape
        if cache is None:
            cache = self.init_cache(b, t)
        if positions is None:
            positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        chex.assert_shape(positions, (b, t))
        if mask is not None:
            chex.assert_shape(mask, (b, t, t))
        return self.arch.forward(self.params, tokens, positions, cache, mask,
                                 exit_layer=exit_layer, return_layers=return_layers,
                                 compute_logits=compute_logits)

    def logits(self, hidden: Float[Array, "... D"]) -> Float[Array, "... V"]:
        """Float32 logits of hidden states (final norm and LM head)."""
        return self.arch.logits(self.params, hidden)


__all__ = ["LanguageModel"]
