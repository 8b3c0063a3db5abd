"""Drafters: one protocol for every source of draft tokens (see ``base``), one file per
drafter: ``ngram`` (prompt lookup), ``early_exit`` (the target's first layers),
``model`` (another specjax model), ``eagle`` (EAGLE-2's head and dynamic tree),
``redrafter`` (ReDrafter's recurrent head and beams) and ``exit_heads`` (trained early-exit
adapters); ``blocks`` holds the layers draft heads are built from."""

from __future__ import annotations

from specjax.drafters.base import Context, Drafter, tree_parents
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.early_exit import EarlyExitDrafter, target_head
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NGramDrafter, bigram_table
from specjax.drafters.redrafter import RedrafterDrafter


def from_spec(spec: str, target, depth: int | None = None):
    """A drafter from a command-line spec: ``ngram[:depth]`` or ``early-exit:L``."""
    name, _, arg = spec.partition(":")
    if name == "ngram" and (not arg or arg.isdigit()):
        depth = int(arg) if arg else depth
        return NGramDrafter(**({} if depth is None else {"depth": depth}))
    if name == "early-exit" and arg.isdigit():
        return EarlyExitDrafter(target, int(arg), **({} if depth is None else {"depth": depth}))
    raise ValueError(f"unknown drafter {spec!r}; use 'ngram[:depth]' or 'early-exit:L' "
                     f"(L in [1, {target.config.num_layers - 1}])")


__all__ = ["Context", "Drafter", "ModelDrafter", "EarlyExitDrafter", "NGramDrafter",
           "EagleDrafter", "RedrafterDrafter",
           "bigram_table", "tree_parents", "target_head", "from_spec"]
