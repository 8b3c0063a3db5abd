"""A fixed training corpus for draft heads: existing (prompt, reference answer) texts with the
target's features from one prefill per text.

Self-distillation (``specjax.train.distill``) costs one target decoding step per answer
token; the features of existing text cost one wide forward per text, orders of magnitude
less on a CPU, which is how EAGLE itself trains (on a fixed corpus). Texts are the training
prompts of ``../shared/data/train_prompts`` (GSM8K, self-instruct, T0) with their reference
answers, or ShareGPT's conversations (``specjax.train.sharegpt``: multi-turn prefixes
rendered as messages), in the chat template, truncated to ``max_len`` tokens from the
left. Shards use the distilled corpus's format (``distill.load_shards`` reads both), are
written as they finish, and a rerun skips them (resume).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.train import distill


SOURCES = ("gsm8k", "self_instruct", "t0", "sharegpt")
DEFAULT_SOURCES = SOURCES[:3]
"""``reference_pairs``' sources (``sources=None``: the first three; ``sharegpt``, an optional
package, only when named, so a corpus built without sources is what it was)."""


def check_sources(sources: Sequence[str] | None) -> None:
    """``ValueError`` unless ``sources`` is None or a non-empty subset of ``SOURCES``."""
    unknown = sorted(set(sources or ()) - set(SOURCES))
    if unknown or (sources is not None and not sources):
        raise ValueError(f"sources {unknown or '(none)'}: choose from {', '.join(SOURCES)}")


def reference_pairs(data_dir: str | Path | None, exclude: Iterable[str] = (),
                    seed: int = 0, sources: Sequence[str] | None = None,
                    max_prompt_chars: int | None = None) -> tuple[list[tuple], dict]:
    """``(prompt, answer)`` pairs from GSM8K, self-instruct and T0 (``sources``: these of
    ``SOURCES``; None: those three), interleaved by source in a seeded order, without those
    whose prompt overlaps ``exclude`` (13-word spans). GSM8K's calculator annotations
    (``<<48/2=24>>``) are removed from its answers. Each source's pairs come in the same
    order whichever others are chosen.

    ``sharegpt``: ShareGPT's items (``sharegpt.load_items``), the prompt a message list
    (earlier turns as context) and the answer ShareGPT's; every item of a conversation that
    overlaps ``exclude`` left out, and prompts of more than ``max_prompt_chars`` characters.
    The counts of its file and items are under ``"sharegpt"``. ``data_dir`` is not read
    when no other source is chosen."""
    check_sources(sources)
    chosen = DEFAULT_SOURCES if sources is None else tuple(sources)
    groups = _text_pairs(data_dir, seed) if set(chosen) - {"sharegpt"} else {}
    banned = set().union(*(distill.ngrams(t) for t in exclude)) if exclude else set()
    info: dict = {}
    if "sharegpt" in chosen:
        from specjax.train import sharegpt

        its, info["sharegpt"] = sharegpt.load_items(list(exclude), seed, max_prompt_chars)
        groups["sharegpt"] = [(msgs, answer) for _, msgs, answer in its]
    pairs, dropped = [], 0
    iters = {k: iter(groups[k]) for k in SOURCES if k in chosen}
    while iters:
        for k in list(iters):
            pair = next(iters[k], None)
            if pair is None:
                del iters[k]
            elif banned and isinstance(pair[0], str) and distill.ngrams(pair[0]) & banned:
                dropped += 1
            else:
                pairs.append(pair)
    return pairs, {"pairs": len(pairs), "dropped_overlapping_exclude": dropped,
                   **{f"available_{k}": len(groups[k]) for k in SOURCES if k in chosen},
                   **info}


def _text_pairs(data_dir: str | Path, seed: int) -> dict[str, list[tuple[str, str]]]:
    """GSM8K's, self-instruct's and T0's ``(prompt, answer)`` pairs under ``data_dir``, by
    source, each in an order drawn from ``seed`` (every source shuffled, in turn, from one
    generator)."""
    d = Path(data_dir)
    load = distill.read_jsonl  # a malformed line: ValueError naming it
    groups: dict[str, list[tuple[str, str]]] = {
        "gsm8k": [(r["question"], re.sub(r"<<[^>]*>>", "", r["answer"]))
                  for r in load(d / "gsm8k_train.jsonl", ["question", "answer"])],
        "self_instruct": [], "t0": []}
    for p in sorted(d.glob("self_instruct_*.jsonl")):
        for r in load(p, ["instruction"]):
            for inst in r.get("instances") or []:
                inp = inst.get("input", "")
                if inst.get("output"):
                    groups["self_instruct"].append(
                        (r["instruction"] + (f"\n\n{inp}" if inp else ""), inst["output"]))
    for p in sorted((d / "t0").glob("*.jsonl")):
        groups["t0"] += [(r["prompt"], r["completion"]) for r in load(p, ["prompt"])
                         if r.get("completion")]
    rng = random.Random(seed)
    for g in groups.values():
        rng.shuffle(g)
    return groups


def encode_pair(lm, prompt: str | list, answer: str, max_len: int) -> tuple[np.ndarray, int]:
    """Chat-templated prompt (a text, or a message list rendered whole: ``lm.encode``), then
    the answer and EOS; the last ``max_len`` tokens, and how many of them belong to the
    prompt."""
    p = lm.encode(prompt, chat=lm.has_chat_template)
    a = list(lm.tokenizer.encode(answer.strip(), add_special_tokens=False)) + list(lm.eos_ids[:1])
    toks = np.asarray(p + a, np.int32)
    cut = max(0, len(toks) - max_len)
    return toks[cut:], max(len(p) - cut, 0)


def _prefill_fn(model):
    """``run(params, tokens[B, T]) -> last-layer features [B, T, D]`` (bfloat16): one causal
    forward from position 0 over a cache of capacity 0, so attention runs over the tokens
    alone and nothing is written (``ops.attention``); the features equal those of a forward
    into an empty cache (``tests/test_contract.py``)."""
    @jax.jit
    def run(params, tokens):
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        _, hidden, _ = model.forward(params, tokens, pos, model.init_cache(b, 0),
                                     compute_logits=False)
        return hidden[model.config.num_layers].astype(jnp.bfloat16)
    return run


def build(lm, pairs: Sequence[tuple[str, str]], out_dir: str | Path, *, max_tokens: int,
          max_len: int = 512, batch_tokens: int = 4096, shard_tokens: int = 65536,
          progress=None) -> dict:
    """Writes ``out_dir/shard_*.npz`` for the first pairs holding ``max_tokens`` tokens, and
    ``summary.json``; existing shards are kept (resume). Returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = _prefill_fn(lm.model)
    examples, total = [], 0
    for prompt, answer in pairs:
        if total >= max_tokens:
            break
        toks, pl = encode_pair(lm, prompt, answer, max_len)
        examples.append((toks, pl))
        total += len(toks)
    shards, cur, n = [], [], 0
    for e in examples:  # consecutive examples per shard: the split is a function of the pairs
        cur.append(e)
        n += len(e[0])
        if n >= shard_tokens:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    prev = out / "summary.json"
    before = json.loads(prev.read_text()).get("seconds_total", 0.0) if prev.exists() else 0.0
    t0, made, summary = time.perf_counter(), 0, {}
    for s, part in enumerate(shards):
        path = out / f"shard_{s:05d}.npz"
        ntok = sum(len(e[0]) for e in part)
        if not path.exists():
            distill.save_shard(path, _features(run, lm.params, part, batch_tokens))
            made += ntok
        if progress is not None:
            progress.update(ntok)
            progress.set_postfix(tok_per_s=f"{made / max(time.perf_counter() - t0, 1e-9):.0f}")
        summary = _summarize(out, shards[:s + 1], total, max_len, before,
                             time.perf_counter() - t0, lm)
    return summary


def _features(run, params, part, batch_tokens: int):
    """``(tokens, prompt_len, feats bfloat16)`` per example, in the order given."""
    order = sorted(range(len(part)), key=lambda i: len(part[i][0]))
    feats: dict[int, np.ndarray] = {}
    i = 0
    while i < len(order):
        t = -(-len(part[order[i]][0]) // 64) * 64
        n_rows = max(1, batch_tokens // t)  # one compiled shape per length bucket
        rows = []
        while i < len(order) and len(part[order[i]][0]) <= t and len(rows) < n_rows:
            rows.append(order[i])
            i += 1
        toks = np.zeros((n_rows, t), np.int32)
        for r, k in enumerate(rows):
            toks[r, :len(part[k][0])] = part[k][0]
        h = np.asarray(run(params, jnp.asarray(toks)).astype(jnp.float32)).astype(ml_dtypes.bfloat16)
        for r, k in enumerate(rows):
            feats[k] = h[r, :len(part[k][0])]
    return [(e[0], e[1], feats[k]) for k, e in enumerate(part)]


def _summarize(out: Path, done: list, planned_tokens: int, max_len: int, before: float,
               seconds: float, lm) -> dict:
    """Writes ``summary.json`` for the shards written so far (seconds add up over resumes)."""
    ex = [e for part in done for e in part]
    summary = {"kind": "text", "examples": len(ex), "tokens": int(sum(len(e[0]) for e in ex)),
               "answer_tokens": int(sum(len(e[0]) - e[1] for e in ex)),
               "planned_tokens": planned_tokens, "max_len": max_len,
               "seconds_this_run": round(seconds, 1), "seconds_total": round(before + seconds, 1),
               "model": Path(str(lm.source)).name}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
