"""The model contract: what decoding loops, drafters, verifiers and trainers may use.

Nothing outside ``specjax.models`` reads a model's parameters by name; it goes through these
methods, so a new family plugs in by implementing them. ``Llama`` and ``Gemma`` do, and so
does the decoder of the encoder-decoder ``T5`` (its parameters bound to an encoded source).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specjax.models.kv_cache import KVCache
from specjax.sharding import HEADS, KV_HEADS, MLP, VOCAB, Partitioning


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as HF configs name it (``rope_type``).

    ``default`` leaves frequencies alone; ``linear`` divides them by ``factor``; ``llama3``
    applies Llama 3.1's smooth band-wise rescaling.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; "
                             "supported: default, linear, llama3")

    def inv_freq(self, head_dim: int, theta: float) -> Float[Array, "H2"]:
        """Inverse frequencies of the rotary embedding with base ``theta``, after scaling."""
        half = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
        inv = 1.0 / (theta ** half)
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            wavelen = 2 * math.pi / inv
            low_wl, high_wl = old / self.low_freq_factor, old / self.high_freq_factor
            scaled = jnp.where(wavelen > low_wl, inv / self.factor, inv)
            smooth = ((old / wavelen - self.low_freq_factor)
                      / (self.high_freq_factor - self.low_freq_factor))
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return jnp.where(medium, smoothed, scaled)
        return inv


@runtime_checkable
class ModelConfig(Protocol):
    """The configuration numbers a loop or drafter reads (every family provides each one;
    T5's decoder too: one K/V head per query head, and RoPE numbers that only a draft head
    built on it uses, since T5 itself has relative position biases)."""

    vocab_size: int
    hidden_size: int  # the residual width D (T5's d_model)
    num_layers: int  # decoder layers: what early exits and the loops count
    max_position_embeddings: int  # the decoder's cache bound
    num_heads: int  # query heads per layer
    num_kv_heads: int  # K/V heads per layer (grouped-query attention)
    head_dim: int  # width of one head (T5's d_kv)
    intermediate_size: int  # the MLP's inner width (T5's d_ff)
    rms_norm_eps: float  # the epsilon of the model's RMS norms
    rope_theta: float  # RoPE base (of the global layers, for Gemma)
    rope_scaling: RopeScaling  # RoPE frequency scaling (of the global layers, for Gemma)


@runtime_checkable
class Model(Protocol):
    """A language model's decoder bound to its configuration (hashable: it is a static
    argument of the jitted loops). ``params`` is a plain pytree; for an encoder-decoder
    model it is the weights bound to an encoded source (``T5.bind``)."""

    config: Any  # a ModelConfig
    compute_dtype: Any  # what products multiply in; the KV cache's default dtype
    is_encoder_decoder: bool  # True: prompts are sources, encoded once and bound to params

    def init_cache(self, batch: int, capacity: int, dtype=...) -> KVCache:
        """An empty KV cache of ``capacity`` slots per row (default dtype: ``compute_dtype``):
        per-layer arrays, or stacked ones (``KVCache.stacked``) for a model that runs its
        layers under ``lax.scan``; ``cache.k[i]`` is layer ``i``'s keys either way."""

    def forward(self, params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                cache: KVCache, mask: Bool[Array, "B T T"] | None = None, *,
                exit_layer: int | None = None, return_layers: tuple[int, ...] = (),
                compute_logits: bool = True
                ) -> tuple[Float[Array, "B T V"] | None, dict[int, Array], KVCache]:
        """New tokens against the cache; see ``specjax.models.decoder.DecoderParts.forward``
        (every port's forward)."""

    def logits(self, params, hidden: Float[Array, "... D"],
               head: Array | None = None) -> Float[Array, "... V"]:
        """Float32 logits of hidden states: ``unembed`` after ``final_norm``."""

    def unembed(self, params, normed: Float[Array, "... D"],
                head: Array | None = None) -> Float[Array, "... V"]:
        """Float32 logits of features past the final norm: the LM head (``head`` rows
        override it) and the family's own transform of its output (Gemma 2's soft-cap).
        Draft heads that predict such features score them through this."""

    def embed(self, params, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """Input embeddings (scaled as the model scales them)."""

    def final_norm(self, params, hidden: Float[Array, "... D"]) -> Float[Array, "... D"]:
        """The final norm, whose output the LM head reads."""

    def output_head(self, params) -> Float[Array, "V D"]:
        """The LM head's rows."""

    def param_dtype(self, params) -> Any:
        """The dtype the weights are stored in."""

    def source_tokens(self, params) -> Int[Array, "B S"] | None:
        """The source ids the decoder reads (``-1`` past each row's end) for an
        encoder-decoder model whose ``params`` are bound to a source; None otherwise."""


def _decoder_fused(cfg) -> dict:
    nq, nk, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = [nq * hd, (nq + nk) * hd]  # rows: the Q, K and V heads stacked
    return {"qkv": (("q", "k", "v"), qkv), "qkv_b": (("q_b", "k_b", "v_b"), qkv),
            "gate_up": (("gate", "up"), [cfg.intermediate_size])}


# The partitioning of a pre-norm decoder layer as the Llama port names it (and Gemma's, and
# the draft heads' layers): query, K/V and gate/up rows by heads and MLP width, the output
# projections by their input columns, embeddings and LM heads (a draft head's
# ``out_embed`` too) by the vocabulary; ``qkv``, its bias ``qkv_b`` and ``gate_up`` fused.
DECODER_PARTITIONING = Partitioning(
    axes={"q": (HEADS, None), "k": (KV_HEADS, None), "v": (KV_HEADS, None),
          "o": (None, HEADS), "gate": (MLP, None), "up": (MLP, None), "down": (None, MLP),
          "q_b": (HEADS,), "k_b": (KV_HEADS,), "v_b": (KV_HEADS,),
          "embed": (VOCAB, None), "lm_head": (VOCAB, None), "out_embed": (VOCAB, None)},
    fused=_decoder_fused)


__all__ = ["Model", "ModelConfig", "RopeScaling", "DECODER_PARTITIONING"]
