"""The model contract: what decoding loops, drafters, verifiers and trainers may use.

Nothing outside ``specjax.models`` reads a model's parameters by name; it goes through these
methods, so a new family plugs in by implementing them (``Llama`` and ``Gemma`` do).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array, Bool, Float, Int

from specjax.models.kv_cache import KVCache


@runtime_checkable
class ModelConfig(Protocol):
    """The configuration numbers a loop or drafter needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int


@runtime_checkable
class Model(Protocol):
    """A decoder-only language model bound to its configuration (hashable: it is a static
    argument of the jitted loops). ``params`` is a plain pytree."""

    config: Any
    compute_dtype: Any  # what products multiply in; the KV cache's default dtype

    def init_cache(self, batch: int, capacity: int, dtype=...) -> KVCache:
        """An empty KV cache of ``capacity`` slots per row (default dtype: ``compute_dtype``):
        per-layer arrays, or stacked ones (``KVCache.stacked``) for a model that runs its
        layers under ``lax.scan``; ``cache.k[i]`` is layer ``i``'s keys either way."""

    def forward(self, params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                cache: KVCache, mask: Bool[Array, "B T T"] | None = None, *,
                exit_layer: int | None = None, return_layers: tuple[int, ...] = (),
                compute_logits: bool = True
                ) -> tuple[Float[Array, "B T V"] | None, dict[int, Array], KVCache]:
        """New tokens against the cache; see ``specjax.models.llama.Llama.forward``."""

    def logits(self, params, hidden: Float[Array, "... D"],
               head: Array | None = None) -> Float[Array, "... V"]:
        """Float32 logits of hidden states (final norm and LM head; ``head`` rows override
        the LM head)."""

    def embed(self, params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """Input embeddings (scaled as the model scales them)."""

    def final_norm(self, params, hidden: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """The final norm, whose output the LM head reads."""

    def output_head(self, params) -> Float[Array, "V D"]:
        """The LM head's rows."""

    def param_dtype(self, params) -> Any:
        """The dtype the weights are stored in."""


__all__ = ["Model", "ModelConfig"]
