"""The drafter protocol and the context a drafter reads: what the decoding loops in
``specjax.core`` require of a drafter, so that core depends on no drafter.

A drafter is a hashable frozen dataclass (its sizes are static) that implements the
``Drafter`` protocol below, with three pure methods:

* ``init(dparams, ctx, chunk) -> state`` after the prompt is in the target's cache;
* ``propose(dparams, state, ctx, key, sampler) -> (Draft, state, target_cache)``;
* ``commit(dparams, state, ctx, result) -> state`` once ``ctx`` holds the emitted tokens.

A drafter whose drafts are always chains says so with ``chain = True``: its parents are then
taken to be ``[-1, 0, 1, ...]``, and since a chain's accepted path is its first nodes, which
the verification forward already wrote in place, the target cache is committed by moving
its length alone (no gather of K/V for every layer).

``ctx`` is a ``Context``: the tokens so far (prompt, then emitted; the root is the last),
and the target's parameters and committed cache. A drafter may write scratch entries past
the target cache's length (an early exit does), but must return its length unchanged.
With a ``Greedy`` target, drafts are deterministic (``Draft.probs is None``); with
``Sample``, model drafters sample and report the distributions they drew from.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from flax import struct
from jaxtyping import Array, Int

from specjax.core.verify import Draft
from specjax.models.kv_cache import KVCache


@struct.dataclass
class Context:
    """What a drafter may read: ``tokens[b, :length[b]]`` is prompt then emitted tokens; the
    last is the root, not yet in ``cache`` (whose length is ``length - 1``).

    ``hidden`` holds the target's hidden states for a drafter with ``needs_features``
    (after its ``feature_layers``, concatenated; for EAGLE-2, the last layer's, before the
    final norm): at ``init``, of every prompt slot ``[B, C, D]``; at
    ``commit``, of the round's verification forward over ``[root, nodes]`` ``[B, N+1, D]``.
    """

    tokens: Int[Array, "B C"]
    length: Int[Array, "B"]
    prompt_len: Int[Array, "B"]
    cache: KVCache
    params: Any
    hidden: Any = None
    source: Any = None  # [B, S] source ids of an encoder-decoder target (Model.source_tokens)


@runtime_checkable
class Drafter(Protocol):
    """What the decoding loops read of a drafter. Every drafter declares each member
    itself (no attribute is probed with a default):

    * ``depth``: the most tokens one root-to-leaf path drafts; ``num_nodes``: the nodes of
      a draft (``Draft.tokens.shape[1]``); ``verify_widths``: the forward widths its rounds
      are verified at (ascending; the last covers ``num_nodes + 1``);
    * ``chain``: every draft is a chain (parents ``[-1, 0, 1, ...]``), so the target cache
      commits by moving its length alone;
    * ``needs_features``: ``Context.hidden`` must hold the target's hidden states at
      ``init`` and ``commit``; ``feature_layers``: which ones, the residual streams after
      those layers concatenated in that order (``(num_layers,)``: the last layer's output,
      EAGLE-2's and ReDrafter's; EAGLE-3 fuses three; ``()`` without features);
    * ``draft_model``: the model a ``ModelDrafter`` drafts with (its parameters are
      ``dparams``; an encoder-decoder one encodes the source with them), None otherwise;
    * ``check(target)``: ``ValueError`` unless it can draft for ``target``;
    * ``init``, ``propose``, ``commit``: the pure methods of the module docstring.
    """

    chain: bool
    needs_features: bool
    feature_layers: tuple[int, ...]
    draft_model: Any

    @property
    def depth(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def verify_widths(self) -> tuple[int, ...]: ...

    def check(self, target) -> None: ...

    def init(self, dparams, ctx: Context, chunk: int) -> Any: ...

    def propose(self, dparams, state, ctx: Context, key, sampler) -> tuple[Draft, Any, KVCache]:
        ...

    def commit(self, dparams, state, ctx: Context, result) -> Any: ...


__all__ = ["Context", "Drafter"]
