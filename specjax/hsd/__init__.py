"""Hierarchical speculative decoding (HSD): the recursion over levels (``loop``: nested
``lax.while_loop``s, lossless), its latency model and exact optimisers (``hierarchy``),
and the measured costs and acceptance rates that feed them (``calibrate``)."""

from specjax.hsd.loop import HSD, Exit, Hierarchy, HSDOutput, HSDState, NGram, hsd_generate

__all__ = ["Exit", "NGram", "Hierarchy", "HSD", "HSDState", "HSDOutput", "hsd_generate"]
