"""Prompts the target writes itself: its chat template up to the start of a user turn,
sampled, gives user requests (Magpie: Xu et al., 2024, "Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing").

On-policy training needs prompts, and the offline ones (GSM8K, self-instruct, T0) are
mostly arithmetic, classification and extraction: few of them look like a chat. An
instruction-tuned target, given only the tokens that open a user turn, writes a request of
the kind it was tuned to answer (advice, writing, code, explanations). Those requests,
answered greedily by the same target, are chat data in the target's own distribution, with
no dataset and no network.

``write`` samples such requests in batches and keeps the complete ones (the target closed
the turn itself), without duplicates and without any that shares a 13-word span with
``exclude`` (Spec-Bench). It writes them as ``self_written.jsonl`` (one ``{"prompt": ...}``
per line), which ``distill.read_prompts`` reads as the source ``self_written``. The file,
not the seed, is the dataset: sampling on other hardware may write other requests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import jax

from specjax.core import sampling
from specjax.core.decoding import generate
from specjax.train import distill

FILE = "self_written.jsonl"
_MARK = "\x00USER\x00"  # a placeholder no chat template contains


def user_turn(tokenizer) -> tuple[list[int], int]:
    """``(ids that open a user turn, the id that closes one)`` in ``tokenizer``'s chat
    template (the system prompt it adds by default included). ``ValueError`` for a
    tokenizer without a chat template, or a template that closes no turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template (a base model): only "
                         "an instruction-tuned target writes its own prompts")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    head, _, tail = text.partition(_MARK)
    close = tokenizer.encode(tail, add_special_tokens=False)
    if not close:
        raise ValueError("the chat template closes no user turn: no end-of-turn token")
    return list(tokenizer.encode(head, add_special_tokens=False)), int(close[0])


def write(lm, n: int, out_dir: str | Path, *, exclude: Sequence[str] = (), seed: int = 0,
          batch: int = 64, max_tokens: int = 128, temperature: float = 1.0,
          top_p: float = 0.95, progress=None) -> dict:
    """Samples requests from ``lm`` until ``n`` are kept (or ``50 n`` are drawn), writes them
    to ``out_dir/self_written.jsonl`` (replacing it whole) and returns counts: ``kept``,
    ``drawn``, and those dropped as ``unfinished`` (no end of turn within ``max_tokens``),
    ``empty``, ``duplicate`` or ``overlapping`` ``exclude``. Batch ``b`` samples with
    ``fold_in(key(seed), b)``, so a seed gives the same file on the same hardware."""
    if n < 1 or batch < 1 or max_tokens < 1:
        raise ValueError(f"n={n}, batch={batch}, max_tokens={max_tokens}: each must be >= 1")
    opening, close = user_turn(lm.tokenizer)
    banned = set().union(*(distill.ngrams(t) for t in exclude)) if exclude else set()
    sampler = sampling.Sample(temperature=temperature, top_p=top_p)
    kept, seen = [], set()
    counts = dict.fromkeys(("drawn", "unfinished", "empty", "duplicate", "overlapping"), 0)
    for b in range(-(-50 * n // batch)):
        if len(kept) >= n:
            break
        rows = generate(lm.model, lm.params, [opening] * batch, max_new_tokens=max_tokens,
                        sampler=sampler, key=jax.random.fold_in(jax.random.key(seed), b),
                        eos_ids=[close]).to_lists()
        for ids in rows:
            counts["drawn"] += 1
            why = _drop(lm.tokenizer, ids, close, seen, banned)
            if why:
                counts[why] += 1
            elif len(kept) < n:
                kept.append(lm.tokenizer.decode(ids[:-1], skip_special_tokens=True).strip())
                seen.add(kept[-1])
        if progress is not None:
            progress.update(min(len(kept), n) - progress.n)
    out = Path(out_dir) / FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name("tmp_" + FILE)
    tmp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in kept))
    tmp.replace(out)
    return {"kept": len(kept), **counts}


def _drop(tokenizer, ids: list[int], close: int, seen: set, banned: set) -> str | None:
    """Why a sampled request is dropped (None: kept)."""
    if not ids or ids[-1] != close:
        return "unfinished"
    text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
    if not text:
        return "empty"
    if text in seen:
        return "duplicate"
    if banned and distill.ngrams(text) & banned:
        return "overlapping"
    return None


__all__ = ["FILE", "user_turn", "write"]
