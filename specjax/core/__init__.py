"""The verification core: draft trees (``tree``), target-side sampling (``sampling``),
lossless verification (``verify``) and the two decode loops, autoregressive
(``decoding``) and draft-verify-commit (``speculative``). Nothing here knows a drafter's
insides; drafters plug in through the protocol of ``specjax.core.drafter``
(``Drafter``, ``Context``)."""
