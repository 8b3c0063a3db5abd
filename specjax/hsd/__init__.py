"""Hierarchical speculative decoding (HSD): the recursion over levels (``loop``: nested
``lax.while_loop``s, lossless), the hierarchy's text form (``spec``), its latency model and
exact optimisers (``hierarchy``), and the measured costs and acceptance rates that feed
them (``calibrate``)."""

from specjax.hsd.loop import HSD, Exit, Hierarchy, HSDOutput, HSDState, NGram, hsd_generate
from specjax.hsd.spec import HierarchySpec, LevelSpec

__all__ = ["Exit", "NGram", "Hierarchy", "HSD", "HSDState", "HSDOutput", "hsd_generate",
           "HierarchySpec", "LevelSpec"]
