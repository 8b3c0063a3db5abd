"""Self-distillation data: the target answers training prompts, and its features are kept.

Each example is a prompt (in the target's chat template) and the target's greedy answer,
with the target's last-layer hidden state (before the final norm) at every position but the
last. Generation is batched and jitted; results go to numbered shards, so an interrupted run
resumes at the first missing shard. Spec-Bench questions never enter: a prompt that shares
any 13-word span with one is dropped.
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
from flax import struct
from jax import lax

from specjax import sharding
from specjax._compile import AotCache
from specjax.core.decoder import PAD, prepare, stops
from specjax.core.decoding import hidden_features, prefill

NGRAM = 13


# ----------------------------------------------------------------------------- prompts

def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def read_jsonl(path: Path, need: Sequence[str] = ()) -> list[dict]:
    """The records of a JSON-lines file (blank lines skipped), each a JSON object holding
    the keys ``need``; ``ValueError`` naming ``path:line`` for any other line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        missing = [k for k in need if k not in r] if isinstance(r, dict) else None
        if missing is None or missing:
            raise ValueError(f"{path}:{i}: expected a JSON object with "
                             f"{', '.join(repr(k) for k in need) or 'fields'}")
        out.append(r)
    return out


def prompt_files(data_dir: str | Path) -> list[Path]:
    """The prompt files ``read_prompts`` reads under ``data_dir`` (those present)."""
    d = Path(data_dir)
    files = [d / "gsm8k_train.jsonl", *sorted(d.glob("self_instruct_*.jsonl")),
             *sorted(d.glob("t0/*.jsonl")), d / "self_written.jsonl"]
    return [p for p in files if p.is_file()]


def read_prompts(data_dir: str | Path) -> dict[str, list[str]]:
    """Prompts by source: ``gsm8k``, ``self_instruct``, ``t0/<task>`` and ``self_written``
    (requests the target wrote: ``specjax.train.self_prompts``), each empty where its files
    are absent (``read_jsonl``: a malformed line is a ``ValueError`` naming it).
    ``FileNotFoundError`` for a directory holding none of them."""
    d = Path(data_dir)
    if not prompt_files(d):
        raise FileNotFoundError(f"{d} holds no prompt files (gsm8k_train.jsonl, "
                                "self_instruct_*.jsonl, t0/*.jsonl or self_written.jsonl)")
    gsm = d / "gsm8k_train.jsonl"
    out = {"gsm8k": [r["question"] for r in read_jsonl(gsm, ["question"])]
           if gsm.is_file() else []}
    si = []
    for p in sorted(d.glob("self_instruct_*.jsonl")):
        for r in read_jsonl(p, ["instruction"]):
            inp = (r.get("instances") or [{}])[0].get("input", "")
            si.append(r["instruction"] + (f"\n\n{inp}" if inp else ""))
    out["self_instruct"] = si
    for p in sorted((d / "t0").glob("*.jsonl")):
        out[f"t0/{p.stem}"] = [r["prompt"] for r in read_jsonl(p, ["prompt"])]
    own = d / "self_written.jsonl"
    out["self_written"] = ([r["prompt"] for r in read_jsonl(own, ["prompt"])]
                           if own.is_file() else [])
    return out


def select_prompts(data_dir: str | Path, n: int, exclude: Iterable[str] = (),
                   seed: int = 0) -> tuple[list[str], dict]:
    """``n`` prompts: a third each from GSM8K, self-instruct and T0 (tasks in turn), in a
    seeded order, without any that overlap ``exclude`` (13-word spans)."""
    banned = set().union(*(ngrams(t) for t in exclude)) if exclude else set()
    src = read_prompts(data_dir)
    rng = random.Random(seed)
    groups = {"gsm8k": list(src["gsm8k"]), "self_instruct": list(src["self_instruct"]),
              "t0": [p for k, v in sorted(src.items()) if k.startswith("t0/") for p in v]}
    for g in groups.values():
        rng.shuffle(g)
    picked, dropped = [], 0
    iters = {k: iter(v) for k, v in groups.items()}
    while len(picked) < n and iters:
        for k in list(iters):
            p = next(iters[k], None)
            if p is None:
                del iters[k]
                continue
            if banned and ngrams(p) & banned:
                dropped += 1
                continue
            picked.append(p)
            if len(picked) == n:
                break
    return picked, {"dropped_overlapping_spec_bench": dropped}


# ----------------------------------------------------------------------------- generation

@struct.dataclass
class _State:
    tokens: jax.Array
    feats: jax.Array
    num: jax.Array
    done: jax.Array
    last: jax.Array
    cache: object


def _answer(params, prompt, prompt_len, budget, eos_ids, *, model, capacity: int,
            max_out: int, chunk: int, layers: tuple[int, ...]):
    """Greedy answers, and the residual streams after ``layers`` (float32, concatenated)
    at every prompt position (from the prefill) and every answer position but the last
    (from the decode step that fed it): the features cost no second forward."""
    b = prompt.shape[0]
    cache = model.init_cache(b, capacity)
    h_last, cache, h_prompt = prefill(model, params, prompt, prompt_len, cache, chunk, layers)
    first = jnp.argmax(model.logits(params, h_last), -1).astype(jnp.int32)
    one = jnp.ones((b,), jnp.int32)
    s = _State(tokens=jnp.full((b, max_out), PAD, jnp.int32).at[:, 0].set(first),
               feats=jnp.zeros((b, max_out, h_prompt.shape[-1]), jnp.float32), num=one,
               done=stops(first, one, budget, eos_ids), last=first, cache=cache)
    rows = jnp.arange(b)

    def step(s: _State) -> _State:
        logits, hid, cache = model.forward(params, s.last[:, None], s.cache.length[:, None],
                                           s.cache, return_layers=layers)
        tok = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        active = ~s.done
        h = hidden_features(hid, layers)[:, 0].astype(jnp.float32)
        return _State(tokens=s.tokens.at[rows, jnp.where(active, s.num, max_out)]
                      .set(tok, mode="drop"),
                      feats=s.feats.at[rows, jnp.where(active, s.num - 1, max_out)]
                      .set(h, mode="drop"),
                      num=s.num + active, done=s.done | stops(tok, s.num + active, budget, eos_ids),
                      last=jnp.where(active, tok, s.last), cache=cache.advance(active))

    s = lax.while_loop(lambda s: jnp.any(~s.done), step, s)
    return s.tokens, s.num, h_prompt, s.feats


_ANSWER = AotCache(_answer, ("model", "capacity", "max_out", "chunk", "layers"))


def answer_batch(lm, prompts: Sequence[list[int]], max_new_tokens: int, chunk: int = 64,
                 layers: tuple[int, ...] | None = None, dtype=ml_dtypes.bfloat16, mesh=None):
    """Examples ``(tokens, prompt_len, feats[len, F])`` for a batch of prompts: the greedy
    answer after each prompt, and the residual streams after ``layers`` (default: the last
    layer) at every position but the last (zero there: its successor was never generated),
    stored as ``dtype``. With ``mesh`` (``lm.params`` sharded over it, the prompts a
    multiple of its ``data`` axis), the rows are split over ``data``."""
    layers = (lm.model.config.num_layers,) if layers is None else tuple(layers)
    x = prepare(lm.model, prompts, max_new_tokens, eos_ids=lm.eos_ids, chunk=chunk, mesh=mesh)
    (toks, num, hp, hg), _ = _ANSWER(lm.params, x.tokens, x.lengths, x.budgets, x.eos,
                                     model=lm.model, capacity=x.capacity, max_out=x.max_out,
                                     chunk=chunk, layers=layers)
    # rows on other processes' devices (a multi-process mesh) come here first: a collective
    toks, num, hp, hg = sharding.gather((toks, num, hp, hg))
    for a in (toks, num, hp, hg):  # the four copies to the host start together
        a.copy_to_host_async()
    toks, num, hp, hg = map(np.asarray, (toks, num, hp, hg))
    out = []
    for i, p in enumerate(prompts):
        n, pl = int(num[i]), len(p)
        seq = np.concatenate([np.asarray(p, np.int32), toks[i, :n]])
        f = np.empty((pl + n, hp.shape[-1]), dtype)  # written once: no concatenated copy
        f[:pl], f[pl:-1], f[-1] = hp[i, :pl], hg[i, :n - 1], 0
        out.append((seq, pl, f))
    return out


# ----------------------------------------------------------------------------- shards

class Example(tuple):
    """``(tokens, prompt_len, feats)``, as every consumer unpacks it, and ``loss_mask``:
    None (the loss covers the tokens after ``prompt_len``), or uint8 per token, 1 where
    the loss covers that token (a conversation's assistant turns: ``train.conversations``;
    ``prompt_len`` is then the first such token)."""

    loss_mask: np.ndarray | None = None

    @classmethod
    def of(cls, tokens, prompt_len, feats, loss_mask=None) -> "Example":
        e = cls((tokens, prompt_len, feats))
        if loss_mask is not None:
            e.loss_mask = np.asarray(loss_mask, np.uint8)
        return e


def loss_mask(example) -> np.ndarray:
    """Which tokens of ``example`` the loss covers (uint8 per token): its ``loss_mask``,
    else those after its prompt."""
    m = getattr(example, "loss_mask", None)
    if m is not None:
        return m
    out = np.zeros(len(example[0]), np.uint8)
    out[example[1]:] = 1
    return out


def save_shard(path: Path, examples) -> None:
    tokens = np.concatenate([e[0] for e in examples])
    feats = np.concatenate([e[2] for e in examples]).view(np.uint16)
    masks = {}
    if any(getattr(e, "loss_mask", None) is not None for e in examples):
        masks["loss_masks"] = np.concatenate([loss_mask(e) for e in examples])
    tmp = path.with_name("tmp_" + path.name)  # outside the shard_*.npz glob
    np.savez(tmp, tokens=tokens, lengths=np.asarray([len(e[0]) for e in examples], np.int32),
             prompt_lens=np.asarray([e[1] for e in examples], np.int32), feats=feats, **masks)
    tmp.rename(path)  # a shard exists only once complete


class ShardReadError(ValueError):
    """A distilled shard that cannot be read whole (its zip's CRC-32s, its arrays)."""


def _read_shard(p: Path) -> dict[str, np.ndarray]:
    """The arrays of shard ``p``, each read whole (so ``zipfile`` checks its CRC-32);
    ``ShardReadError`` naming ``p`` when it is damaged or its arrays do not fit together."""
    try:
        with np.load(p) as z:
            a = {k: z[k] for k in ("tokens", "lengths", "prompt_lens", "feats", "loss_masks")
                 if k != "loss_masks" or k in z.files}
        lengths, tokens, feats = a["lengths"], a["tokens"], a["feats"]
        if "loss_masks" in a and a["loss_masks"].shape != tokens.shape:
            raise ValueError("its loss_masks do not match its tokens")
        if (tokens.ndim != 1 or lengths.ndim != 1 or feats.ndim != 2
                or feats.dtype != np.uint16 or a["prompt_lens"].shape != lengths.shape
                or int(lengths.sum()) != len(tokens) or len(feats) != len(tokens)
                or np.any(lengths < 1) or np.any(a["prompt_lens"] < 0)
                or np.any(a["prompt_lens"] > lengths)):
            raise ValueError("its tokens, lengths, prompt_lens and feats do not fit together")
    except Exception as e:  # noqa: BLE001 -- zipfile and np.lib.format fail many ways
        raise ShardReadError(f"{p} is damaged ({type(e).__name__}: {e}); delete it and rerun "
                             "the command that wrote it (`specjax distill` writes the missing "
                             "shards and keeps the others)") from None
    return a


def load_shards(data: str | Path) -> list[Example]:
    """Every example of a distilled corpus: ``(tokens, prompt_len, feats bfloat16)``, with
    its ``loss_mask`` where the shard holds one (an ``Example``).
    ``ShardReadError`` naming a shard that is damaged (a bad CRC-32, arrays that do not
    fit together)."""
    paths = sorted(Path(data).glob("shard_*.npz"))
    if not paths:
        raise FileNotFoundError(f"no shard_*.npz in {data}: run `specjax distill` first")
    out = []
    for p in paths:
        z = _read_shard(p)
        tokens, feats = z["tokens"], z["feats"].view(ml_dtypes.bfloat16)
        ends = np.cumsum(z["lengths"])
        masks = z.get("loss_masks")
        for e, n, pl in zip(ends, z["lengths"], z["prompt_lens"]):
            out.append(Example.of(tokens[e - n:e], int(pl), feats[e - n:e],
                                  None if masks is None else masks[e - n:e]))
    return out


def distill(lm, prompts: Sequence[str], out_dir: str | Path, *, max_new_tokens: int = 192,
            max_prompt_tokens: int = 768, batch: int = 16, shard_batches: int = 4,
            progress=None) -> dict:
    """Writes the target's answers to ``prompts`` into ``out_dir/shard_*.npz``; existing
    shards are kept (resume). Returns the corpus summary, also written as ``summary.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = [lm.encode(p, chat=lm.has_chat_template) for p in prompts]
    keep = [i for i in ids if len(i) <= max_prompt_tokens]
    per_shard = batch * shard_batches
    n_shards = -(-len(keep) // per_shard)
    prev = out / "summary.json"
    before = json.loads(prev.read_text()).get("seconds_total", 0.0) if prev.exists() else 0.0
    t0, made = time.perf_counter(), 0
    for s in range(n_shards):
        path = out / f"shard_{s:05d}.npz"
        part = keep[s * per_shard:(s + 1) * per_shard]
        if path.exists():
            if progress is not None:
                progress.update(len(part))
            continue
        part_sorted = sorted(part, key=len)  # similar lengths share a batch
        examples = []
        for i in range(0, len(part_sorted), batch):
            examples += answer_batch(lm, part_sorted[i:i + batch], max_new_tokens)
            if progress is not None:
                progress.update(len(part_sorted[i:i + batch]))
                made += sum(len(e[0]) - e[1] for e in examples[-batch:])
                progress.set_postfix(new_tok_per_s=f"{made / (time.perf_counter() - t0):.0f}")
        save_shard(path, examples)
        _summarize(out, lm, len(ids) - len(keep), max_new_tokens, before, t0)
    return _summarize(out, lm, len(ids) - len(keep), max_new_tokens, before, t0)


def _summarize(out: Path, lm, too_long: int, max_new_tokens: int, before: float,
               t0: float) -> dict:
    """Writes ``summary.json`` for the shards on disk; seconds add up across resumed runs."""
    corpus = load_shards(out)
    seconds = round(time.perf_counter() - t0, 1)
    summary = {"examples": len(corpus), "prompts_too_long": too_long,
               "tokens": int(sum(len(e[0]) for e in corpus)),
               "answer_tokens": int(sum(loss_mask(e).sum() for e in corpus)),
               "seconds_this_run": seconds, "seconds_total": round(before + seconds, 1),
               "max_new_tokens": max_new_tokens, "model": Path(str(lm.source)).name}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
