"""The main job's choice of method: the fastest lossless configuration measured on this
machine, remembered between runs.

The first ``specjax demo`` on a machine decodes its prompt with every candidate below (greedy,
so each must equal ``ar``), reports them all, and records the fastest in a small JSON file
keyed by model, device, core count and package version. Later runs decode with ``ar`` and the
recorded choice only. ``--remeasure`` measures again. The file lives in ``$SPECJAX_CACHE``
(default ``~/.cache/specjax``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specjax import methods


# The candidates: every registered method's ``Method.demo`` specs (verification widths 4
# and 8, root included: the cheapest wide forwards on XLA:CPU, docs/results/width_cost_cpu.json).
# Each is lossless. ``redrafter:1,3`` runs only where a ReDrafter head ships for the model
# (``available``); none ships now, since both trained heads were slower than ar.
CANDIDATES = tuple(methods.parse(t) for cls in methods.registered() for t in cls.demo)


def available(model: str, candidates=CANDIDATES) -> tuple:
    """The candidates that can run on ``model`` without options: those reading no head
    (``checkpoint`` None), and those whose default head ships for it (``shipped``)."""
    return tuple(c for c in candidates
                 if type(c).checkpoint is None or c.shipped(model) is not None)


def cache_file(model: str) -> Path:
    """Where the choice for ``model`` on this machine is recorded."""
    import jax

    import specjax

    dev = jax.devices()[0]
    sha = hashlib.sha1()  # a retrained head invalidates the record
    for head in (c.shipped(model) for c in methods.registered() if c.ships_heads):
        sha.update(head.joinpath("head.json").read_bytes() if head else b"none")
    digest = sha.hexdigest()[:8]
    key = "_".join([model, dev.platform, dev.device_kind, f"{os.cpu_count()}cpu",
                    specjax.__version__, digest])
    key = "".join(c if c.isalnum() or c in "._-" else "-" for c in key)
    from specjax.models.registry import cache_dir

    return cache_dir() / f"demo_{key}.json"


def read_choice(model: str, candidates=CANDIDATES):
    """The recorded fastest candidate, or None when nothing valid is recorded."""
    f = cache_file(model)
    try:
        rec = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    by_name = {c.format(): c for c in candidates}
    if rec.get("candidates") != sorted(by_name) or rec.get("choice") not in by_name:
        return None
    return by_name[rec["choice"]]


def write_choice(model: str, results: dict[str, dict], candidates=CANDIDATES):
    """Records the fastest of ``results`` (name -> the CLI's run dict, with ``tokens_per_s``
    and ``lossless``) among candidates that matched ``ar``; returns it."""
    ok = {n: r for n, r in results.items() if r["lossless"]}
    if not ok:
        raise RuntimeError("no candidate reproduced ar's greedy output")
    best = max(ok, key=lambda n: ok[n]["tokens_per_s"])
    f = cache_file(model)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps({
        "choice": best, "candidates": sorted(c.format() for c in candidates),
        "tokens_per_s": {n: round(r["tokens_per_s"], 2) for n, r in results.items()},
        "tau": {n: round(r["tau"], 3) for n, r in results.items()},
        "ar_tokens_per_s": round(next(iter(results.values()))["ar_tokens_per_s"], 2)},
        indent=1))
    return {c.format(): c for c in candidates}[best]
