"""Which verification widths a speculative loop compiles: the width policy.

``Speculative`` compiles one target forward per verification width and runs, each round,
the narrowest that holds every row's valid draft nodes (``lax.switch``). Every width is a
whole forward in the compiled program, so the policy trades compile time against the
cost of verifying a partly empty draft at full width:

* ``Padded()``: one width, ``num_nodes + 1``; one target forward is compiled. Where a
  wider forward costs about what a one-token forward costs (GPU/TPU: Llama-3.1-8B shape,
  width 8 measured 1.02x and 16 1.09x a 1-token forward on an H200), this loses nothing.
* ``PerWidth()``: the drafter's ``verify_widths`` (n-gram: ``(1, depth + 1)``, so a round
  without a match is one ordinary decoding step; ReDrafter: every node count from
  ``L + 1`` to ``W·L + 1``, so each node that prefix dedup saves narrows the forward).
  ``merge=True`` lets widths that the target multiplies at the same padded column count
  (``specjax.models.ops.fast_width``: on XLA:CPU 2-4 become 4, then multiples of 8)
  share the widest one's forward: the weight products, most of a forward's cost, are
  then identical, and fewer forwards compile (ReDrafter 4,4: 3 instead of 13).
* ``Auto()`` (the default): ``PerWidth(merge=True)`` on the CPU backend, where a width-8
  forward costs 2.1x a one-token one (docs/design.md, "What a verification forward costs
  on this CPU") and per-width verification was measured to pay (ReDrafter 4,2: 20 % more
  tokens/s than one width, docs/results/redrafter_dedup_cpu.json); ``Padded()`` elsewhere.
* ``Fixed(widths)``: exactly these widths (the last must be ``num_nodes + 1``).

All policies are lossless and give the same greedy tokens: a width only decides how many
(invalid) node slots the forward carries past the last valid node.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Padded:
    """One verification width, ``num_nodes + 1``: one compiled target forward."""

    def widths(self, drafter) -> tuple[int, ...]:
        return (drafter.num_nodes + 1,)


@dataclasses.dataclass(frozen=True)
class PerWidth:
    """The drafter's ``verify_widths``; with ``merge``, widths the target pads to the same
    product column count share one forward (the widest of them)."""

    merge: bool = False

    def widths(self, drafter) -> tuple[int, ...]:
        ws = sorted(set(drafter.verify_widths))
        if not self.merge:
            return tuple(ws)
        from specjax.models.ops import fast_width

        return tuple(sorted({max(v for v in ws if fast_width(v) == fast_width(w))
                             for w in ws}))


@dataclasses.dataclass(frozen=True)
class Auto:
    """``PerWidth(merge=True)`` on the CPU backend, ``Padded()`` on accelerators.
    ``backend`` overrides ``jax.default_backend()`` (for tests)."""

    backend: str | None = None

    def policy(self) -> "Padded | PerWidth":
        cpu = (self.backend or jax.default_backend()) == "cpu"
        return PerWidth(merge=True) if cpu else Padded()

    def widths(self, drafter) -> tuple[int, ...]:
        return self.policy().widths(drafter)


@dataclasses.dataclass(frozen=True)
class Fixed:
    """Exactly ``widths`` (checked by ``Speculative``: within ``[1, num_nodes + 1]``, the
    largest being ``num_nodes + 1``)."""

    values: tuple[int, ...]

    def widths(self, drafter) -> tuple[int, ...]:
        return tuple(sorted(set(int(w) for w in self.values)))


WidthPolicy = Union[Padded, PerWidth, Auto, Fixed]
NAMES = {"auto": Auto(), "padded": Padded(), "per-width": PerWidth(),
         "merged": PerWidth(merge=True)}


def as_policy(spec: "WidthPolicy | Sequence[int] | str | None") -> WidthPolicy:
    """A policy from ``None`` (``Auto()``), a policy, a sequence of widths (``Fixed``), a
    name in ``NAMES`` or comma-separated widths (the CLI's ``--verify-widths``).
    ``ValueError`` for anything else, and for widths below 1."""
    if spec is None:
        return Auto()
    if isinstance(spec, (Padded, PerWidth, Auto, Fixed)):
        return spec
    if isinstance(spec, str):
        if spec in NAMES:
            return NAMES[spec]
        try:
            values = tuple(int(w) for w in spec.split(","))
        except ValueError:
            raise ValueError(f"unknown verification widths {spec!r}: use one of "
                             f"{', '.join(NAMES)} or comma-separated widths such as 1,8"
                             ) from None
    else:
        values = tuple(int(w) for w in spec)
    if not values or min(values) < 1:
        raise ValueError(f"verification widths {spec!r} must be positive integers "
                         "(a width counts the root and the draft nodes a forward holds)")
    return Fixed(values)


def narrowest(widths: Sequence[int], need) -> jax.Array:
    """The index, in ascending ``widths``, of the narrowest width that holds ``need``
    slots (root and nodes; a traced scalar): the ``lax.switch`` branch a round runs. The
    last (widest) when none does, which holds every node a drafter can propose."""
    return jnp.minimum(jnp.sum(jnp.asarray(widths) < need), len(widths) - 1)


def resolve(drafter, spec: "WidthPolicy | Sequence[int] | str | None") -> tuple[int, ...]:
    """The ascending verification widths ``spec`` compiles for ``drafter``."""
    return as_policy(spec).widths(drafter)


__all__ = ["Padded", "PerWidth", "Auto", "Fixed", "WidthPolicy", "NAMES", "as_policy",
           "resolve", "narrowest"]
