"""Drafters: one protocol for every source of draft tokens (see ``base``), one file per
drafter: ``ngram`` (prompt lookup), ``early_exit`` (the target's first layers),
``model`` (another specjax model), ``eagle`` (EAGLE-2's head and dynamic tree),
``eagle3`` (EAGLE-3's fused-feature head on the same tree),
``redrafter`` (ReDrafter's recurrent head and beams) and ``exit_heads`` (trained early-exit
adapters); ``blocks`` holds the layers draft heads are built from. A drafter that proposes
a chain from the context alone subclasses ``StatelessChain`` (``ngram`` does). Method specs
(``sd-ngram:7``, ``eagle2:3,4,7``) live in ``specjax.methods``; head files (exported,
published and shipped heads) in ``specjax.heads``."""

from __future__ import annotations

from specjax.drafters.base import Context, Drafter, StatelessChain, tree_parents
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.eagle3 import Eagle3Drafter
from specjax.drafters.early_exit import EarlyExitDrafter, target_head
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NGramDrafter, bigram_table
from specjax.drafters.redrafter import RedrafterDrafter


__all__ = ["Context", "Drafter", "StatelessChain", "ModelDrafter", "EarlyExitDrafter", "NGramDrafter",
           "EagleDrafter", "Eagle3Drafter", "RedrafterDrafter",
           "bigram_table", "tree_parents", "target_head"]
