"""On-policy self-distillation: the target answers training prompts in batches, and an EAGLE
head trains online on each batch, from features its own decoding already computed.

A round decodes one batch of prompts with the target (greedy, batched, one jitted
``lax.while_loop``) and keeps, at every prompt and answer position, the residual streams the
head reads (``ttt.Kind.layers``), taken from the prefill and from each decode step's
forward: no second pass and no feature corpus on disk. The round's token ids go to a
``ShardStore`` (committed to the repository, a few bytes per token), then the head trains
on the round's sequences, prompts and answers, and the run checkpoints (Orbax).

A later run replays the shards already in the store (features from one prefill of their
tokens, ``prefill_features``) and decodes new rounds past them, so data and head grow from
run to run. Rounds are a function of the store and the seed, so a run killed after a
checkpoint resumes to the parameters of one that never stopped; the store's manifest is
written before training on a round, so a resumed run replays that round instead of
decoding it again (the manifest is unchanged).

After its rounds a run can train ``epochs`` epochs over every example of those rounds
together (``OnPolicyConfig.epochs``, ``--epochs``): each epoch one pass over all of them,
shuffled across rounds by a permutation of the seed and the epoch number
(:func:`epoch_batches`), minibatched as a round's passes are. Its checkpoints are numbered
on from the rounds' (the rounds trained, then one per epoch), so a run killed during the
epochs resumes to the parameters of one that never stopped, and a finished run given more
epochs trains them; one whose epochs began takes no more rounds.

On a mesh (``train(mesh=)``, ``specjax train onpolicy --mesh data=D,model=M``) the
target is sharded as for decoding and decodes each round with its rows over ``data``; the
head trains data-parallel with its optimizer state sharded (``loop.on_mesh``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import sharding
from specjax._compile import AotCache
from specjax.core.decoder import prepare
from specjax.core.decoding import hidden_features, prefill
from specjax.train import checkpoint, distill, glue, loop, shards, ttt
from specjax.train.eagle import _bucket  # padded lengths: multiples of 64
from specjax.train.eagle import check_run_layout, run_fields
from specjax.train.feature_cache import FeatureCache
from specjax.sharding import DATA
from specjax.train.shards import ShardStore, target_hash

Example = tuple  # (tokens int32 [n], prompt_len, feats float32 [n, F]; the last row is zero)


# ----------------------------------------------------------------------------- prompts

SOURCES = ("gsm8k", "self_instruct", "t0", "self_written", "sharegpt")
DEFAULT_SOURCES = SOURCES[:4]
"""The sources of ``sources=None``: ``sharegpt`` (an optional package,
``specjax.train.sharegpt``) only when named, so the pool of a store that records no sources
is what it was before ``sharegpt`` existed."""


def check_sources(sources: Sequence[str] | None) -> None:
    """``ValueError`` unless ``sources`` is None or a non-empty subset of ``SOURCES``."""
    unknown = sorted(set(sources or ()) - set(SOURCES))
    if unknown or (sources is not None and not sources):
        raise ValueError(f"prompt sources {unknown or '(none)'}: choose from "
                         f"{', '.join(SOURCES)}")


def prompt_pool(data_dir: str | Path | None, exclude: Sequence[str] = (), seed: int = 0,
                sources: Sequence[str] | None = None, max_prompt_tokens: int | None = None
                ) -> list[tuple[str, str | list]]:
    """Every training prompt as ``(id, text)`` in one seeded order, the sources in turn in
    ``SOURCES`` order (until each runs out), without any that shares a 13-word span with
    ``exclude`` (Spec-Bench). An id is ``source#line`` and never changes. ``sources``: only
    these of ``SOURCES`` (None: ``DEFAULT_SOURCES``); each source's prompts come in the same
    order whichever others are chosen. ``ValueError`` for another name.

    ``sharegpt`` (read from the installed package; ``data_dir`` is not read when no other
    source is chosen): its items' message lists (``sharegpt.items``: ids
    ``sharegpt#<conversation>.<turn>``, every item of an overlapping conversation left out,
    ordered by the seed and the id alone), those of more than ``sharegpt.CHARS_PER_TOKEN``
    characters a token of ``max_prompt_tokens`` left out."""
    check_sources(sources)
    chosen = DEFAULT_SOURCES if sources is None else tuple(sources)
    banned = set().union(*(distill.ngrams(t) for t in exclude)) if exclude else set()
    groups = _text_groups(data_dir, seed) if set(chosen) - {"sharegpt"} else {}
    if "sharegpt" in chosen:
        groups["sharegpt"] = _sharegpt_prompts(exclude, seed, max_prompt_tokens)
    out, iters = [], [iter(groups[k]) for k in SOURCES if k in chosen]
    while iters:  # round-robin over the sources until each runs out
        for it in list(iters):
            row = next(it, None)
            if row is None:
                iters.remove(it)
            elif not (banned and isinstance(row[1], str) and distill.ngrams(row[1]) & banned):
                out.append(row)
    return out


def conversation_pool(index, exclude: Sequence[str] = (), seed: int = 0,
                      max_prompt_tokens: int | None = None) -> list[tuple[str, list]]:
    """``prompt_pool`` for a user's conversations (``conversations.scan``'s ``index``):
    every user turn an answer follows, with the turns before it
    (``conversations.prompts``: ids ``data#<record>.<turn>``, in the seeded stream's
    order), without the prompts of a conversation that shares a 13-word span with
    ``exclude`` and those of more than ``sharegpt.CHARS_PER_TOKEN`` characters a token of
    ``max_prompt_tokens``."""
    from specjax.train import conversations, sharegpt

    banned = set().union(*(distill.ngrams(t) for t in exclude)) if exclude else set()
    limit = None if max_prompt_tokens is None else sharegpt.CHARS_PER_TOKEN * max_prompt_tokens
    out = []
    for pid, msgs in conversations.prompts(index, seed):
        if limit is not None and sum(len(m["content"]) for m in msgs) > limit:
            continue
        if banned and any(distill.ngrams(m["content"]) & banned for m in msgs):
            continue
        out.append((pid, msgs))
    return out


def _text_groups(data_dir: str | Path, seed: int) -> dict[str, list]:
    """``(id, text)`` of ``DEFAULT_SOURCES``' prompts files under ``data_dir``, by source, each
    in an order drawn from ``seed`` (every source shuffled, in turn, from one generator)."""
    src = distill.read_prompts(data_dir)
    groups: dict[str, list] = {g: [] for g in DEFAULT_SOURCES}
    for name, texts in sorted(src.items()):
        g = "t0" if name.startswith("t0/") else name
        groups[g] += [(f"{name}#{i}", t) for i, t in enumerate(texts)]
    rng = random.Random(seed)
    for g in groups.values():
        rng.shuffle(g)
    return groups


def _sharegpt_prompts(exclude: Sequence[str], seed: int, max_prompt_tokens: int | None
                      ) -> list[tuple[str, list]]:
    """``(id, messages)`` of ShareGPT's items (``prompt_pool``)."""
    from specjax.train import sharegpt

    limit = None if max_prompt_tokens is None else sharegpt.CHARS_PER_TOKEN * max_prompt_tokens
    its, _ = sharegpt.load_items(exclude, seed, limit)
    return [(i, msgs) for i, msgs, _ in its]


# ----------------------------------------------------------------------------- decoding

def decode_round(lm, prompts: Sequence[list[int]], max_new_tokens: int,
                 layers: tuple[int, ...], chunk: int = 64, mesh=None) -> list[Example]:
    """The target's greedy answers to ``prompts`` (one batch, one jitted loop), with the
    residual streams after ``layers`` in float32 (``distill.answer_batch``). With ``mesh``
    (``lm`` sharded over it: :func:`on_mesh`), the rows are split over its ``data`` axis,
    the batch padded with repeats of the last prompt (whose answers are dropped)."""
    rows = list(prompts) + [prompts[-1]] * (-len(prompts) % sharding.axis_size(mesh, DATA))
    return distill.answer_batch(lm, rows, max_new_tokens, chunk, layers, np.float32,
                                mesh=mesh)[:len(prompts)]


def on_mesh(lm, mesh):
    """``lm`` (a ``LoadedModel``) with its weights sharded over ``mesh``
    (``sharding.shard_params``: the decoding layout); unchanged without a mesh."""
    if mesh is None:
        return lm
    return dataclasses.replace(lm, params=sharding.shard_params(lm.model.config, lm.params,
                                                                mesh), mesh=mesh)


def _prefill_all(params, tokens, lengths, *, model, capacity: int, chunk: int,
                 layers: tuple[int, ...]):
    cache = model.init_cache(tokens.shape[0], capacity)
    return prefill(model, params, tokens, lengths, cache, chunk, layers)[2]


_PREFILL = AotCache(_prefill_all, ("model", "capacity", "chunk", "layers"))


def _features_all(params, tokens, positions, segments, *, model, layers: tuple[int, ...]):
    """``hidden_features`` at every position of packed rows ``tokens`` [B, T], float32:
    ``segments`` [B, T] numbers the sequences of a row (each at ``positions`` from 0), and
    a token attends causally within its own sequence only, in one forward over a cache of
    capacity 0 (``ops.attention``: nothing is cached or written)."""
    b, _ = tokens.shape
    mask = segments[:, :, None] == segments[:, None, :]
    _, hidden, _ = model.forward(params, tokens, positions, model.init_cache(b, 0), mask,
                                 compute_logits=False, return_layers=layers)
    return hidden_features(hidden, layers).astype(jnp.float32)


PACK_ROWS, PACK_LEN = 8, 512  # a packed call: 8 rows of 512 tokens (longer rows if needed)


def _pack(lengths: Sequence[int], width: int) -> list[list[tuple[int, int]]]:
    """Rows of ``(sequence, start)``: the sequences, longest first, each in the first row
    with room for it (first-fit decreasing), rows of ``width`` tokens."""
    rows: list[list[tuple[int, int]]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r in range(len(rows)) if fill[r] + lengths[i] <= width), None)
        if r is None:
            rows.append([]), fill.append(0)
            r = len(rows) - 1
        rows[r].append((i, fill[r]))
        fill[r] += lengths[i]
    return rows


def _packed_features(lm, seqs: Sequence[np.ndarray], layers: tuple[int, ...]) -> dict:
    """``prefill_features``' features off a mesh: the sequences packed into calls of
    ``PACK_ROWS`` rows (``_features_all``; the last call's rows rounded up to a power of
    two), so little is padding and few shapes compile."""
    width = max(PACK_LEN, _bucket(max(len(t) for t in seqs)))
    rows, feats = _pack([len(t) for t in seqs], width), {}
    for j in range(0, len(rows), PACK_ROWS):
        part = rows[j:j + PACK_ROWS]
        n_rows = 1 << (len(part) - 1).bit_length()  # a power of two: few shapes compile
        toks, pos = np.zeros((2, n_rows, width), np.int32)
        seg = np.full((n_rows, width), -1, np.int32)
        for r, items in enumerate(part):
            for k, (i, st) in enumerate(items):
                n = len(seqs[i])
                toks[r, st:st + n], pos[r, st:st + n], seg[r, st:st + n] = seqs[i], np.arange(n), k
        h, _ = _FEATURES(lm.params, toks, pos, seg, model=lm.model, layers=tuple(layers))
        h = np.asarray(h)
        for r, items in enumerate(part):
            for i, st in items:
                n = len(seqs[i])
                feats[i] = np.concatenate([h[r, st:st + n - 1], np.zeros((1, h.shape[-1]), h.dtype)])
    return feats


_FEATURES = AotCache(_features_all, ("model", "layers"))


def prefill_features(lm, examples: Sequence[tuple[np.ndarray, int]], layers: tuple[int, ...],
                     chunk: int = 64, group: int = 8, mesh=None) -> list[Example]:
    """Features of stored sequences: what ``decode_round`` returned for them, up to float
    rounding. Off a mesh, from cacheless forwards of the sequences packed into rows
    (``_packed_features``). With ``mesh`` (``lm`` sharded over it), from one prefill of
    each, in groups of ``group`` sequences of similar length (the last group padded with
    repeats), each group's rows split over ``data`` (``group`` rounded up to a multiple of
    it); on a mesh spanning processes, every process calls it with the same sequences and
    gets every row's features."""
    seqs = [np.asarray(t, np.int32) for t, _ in examples]
    if mesh is None:
        feats = _packed_features(lm, seqs, layers) if seqs else {}
        return [(t, pl, feats[i]) for i, (t, pl) in enumerate(examples)]
    group += -group % sharding.axis_size(mesh, DATA)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    feats: dict[int, np.ndarray] = {}
    for j in range(0, len(order), group):
        idx = order[j:j + group]
        rows = idx + [idx[-1]] * (group - len(idx))
        x = prepare(lm.model, [seqs[i] for i in rows], 1, chunk=chunk, mesh=mesh)
        h, _ = _PREFILL(lm.params, x.tokens, x.lengths, model=lm.model, capacity=x.capacity,
                        chunk=chunk, layers=tuple(layers))
        h = np.asarray(sharding.gather(h))  # rows of other processes: a collective
        for r, i in enumerate(idx):
            n = len(seqs[i])
            feats[i] = np.concatenate([h[r, :n - 1], np.zeros((1, h.shape[-1]), h.dtype)])
    return [(t, pl, feats[i]) for i, (t, pl) in enumerate(examples)]


# ----------------------------------------------------------------------------- batches

@dataclasses.dataclass(frozen=True)
class OnPolicyConfig:
    """A run: ``rounds`` decode batches of ``batch`` prompts (``max_new_tokens`` each,
    prompts longer than ``max_prompt_tokens`` skipped), ``passes`` optimizer passes over each
    round's sequences in minibatches of about ``batch_tokens`` tokens; ``val_prompts``
    held-out prompts (the first of the pool) scored every ``val_every`` rounds. Then
    ``epochs`` epochs over every round's sequences together (:func:`epoch_batches`),
    scored after each."""

    rounds: int = glue.option(8, "decode batches in all (replayed ones included)", low=1)
    batch: int = glue.option(32, "prompts decoded together", low=1)
    max_new_tokens: int = glue.option(128, "tokens decoded per answer at most", low=1)
    max_prompt_tokens: int = glue.option(384, "longer prompts are skipped (the store records "
                                              "it: a store decoded with another limit is "
                                              "refused)", low=1)
    passes: int = glue.option(1, "optimizer passes over each round", low=1)
    batch_tokens: int = glue.batch_tokens(4096)
    lr: float = glue.lr(3e-4)
    warmup: int = glue.warmup(20)
    weight_decay: float = glue.weight_decay(0.01)
    clip: float = glue.clip(1.0)
    draft_vocab: int = glue.option(8192, "EAGLE-3: the head's vocabulary; EAGLE-2: the "
                                         "cross-entropy's rows", low=1)
    val_prompts: int = glue.option(48, "held-out prompts (the pool's first), scored every "
                                       "--val-every rounds", low=1)
    val_every: int = glue.option(4, "score the held-out prompts every this many rounds", low=1)
    seed: int = glue.seed(0)
    # the prompt sources (``prompt_pool``); None: all of them
    sources: tuple[str, ...] | None = glue.option(
        None, "comma-separated prompt sources to draw from, in turn (gsm8k, self_instruct, "
              "t0, self_written, sharegpt; default all but sharegpt; the store records it). "
              "sharegpt: ShareGPT's chat prompts, multi-turn ones as messages (pip install "
              "'specjax[data]')", parse=lambda text: tuple(text.split(",")),
        argparse={"type": str})
    # the name of the user's conversations the prompts come from instead (``--data``)
    data_file: str | None = glue.option(None, "the name of --data's conversations", cli=False)
    loss: ttt.LossConfig = glue.option(ttt.LossConfig(), "the loss: ttt.LossConfig's flags",
                                       cli=False)
    # EAGLE-2 only. False: no attention-input norm in the head's layer (layer 0 of a
    # published EAGLE-1/2 head), so it has SafeAILab/EAGLE's layout
    attn_norm: bool = glue.attn_norm(" (--kind eagle; default: as the --init head has it, "
                                     "with the norm for --init none)")
    epochs: int = glue.option(0, "after the rounds, epochs over every round's answers "
                                 "together, shuffled across rounds; a finished run given more "
                                 "trains them (one whose epochs began takes no more --rounds)",
                              low=0)
    # EAGLE-2 only: the head's decoder layers (``eagle.init_head(layers=...)``)
    head_layers: int = glue.head_layers(1, " (--kind eagle)")
    # train on answer positions only (the predictions of the target's own tokens), not on
    # the prompts' too; held-out scoring is on answer positions either way
    answers_only: bool = glue.option(False, "train on the answers' positions only, not the "
                                            "prompts' too (the run records it)")
    # EAGLE-2 only, with attn_norm False: a warm start from a head with the norm, its norm
    # folded into ``qkv`` (``specjax.train.eagle.fold_attn_norm``) at the ``fc`` output's
    # mean RMS over the store's first round
    fold_attn_norm: bool = glue.option(
        False, "with --no-attn-norm, start from --init's head (which has the norm) with its "
               "norm folded into the attention's input weights at the mean scale of the "
               "store's first round, an approximation the run trains away")

    def __post_init__(self):
        glue.check_fields(self)

    def rounds_from(self, start: int, stop_after: int | None = None) -> range:
        """The rounds a run whose latest checkpoint is round ``start`` trains: up to
        ``rounds``, and at most ``stop_after`` of them."""
        end = self.rounds if stop_after is None else min(self.rounds, start + stop_after)
        return range(start, end)

    def epochs_from(self, start: int, stop_after: int | None = None) -> range:
        """The epochs a run that has trained ``start`` of them trains: up to ``epochs``, and
        at most ``stop_after`` of them."""
        end = self.epochs if stop_after is None else min(self.epochs, start + stop_after)
        return range(start, max(start, end))


def minibatches(examples: Sequence[Example], batch_tokens: int, key: int) -> list[list[int]]:
    """Example indices per minibatch: sorted by length, cut at about ``batch_tokens``
    padded tokens, in an order seeded by ``key``."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    plan, cur = [], []
    for i in order:
        t = _bucket(len(examples[i][0]))
        if cur and t * (len(cur) + 1) > batch_tokens:
            plan.append(cur)
            cur = []
        cur.append(i)
    plan.append(cur)
    return [plan[j] for j in np.random.default_rng(key).permutation(len(plan))]


def epoch_batches(examples: Sequence[Example], batch_tokens: int, seed: int, epoch: int
                  ) -> list[list[int]]:
    """Indices into ``examples`` (every round's, in round order) per minibatch of epoch
    ``epoch``: the examples in an order drawn from ``seed`` and ``epoch`` alone, then cut
    and ordered by :func:`minibatches` (as a round's passes are), so rounds mix within a
    minibatch and across the epoch, and a resumed run draws the same batches. Every example
    is in exactly one minibatch."""
    rng = np.random.default_rng([0x45504F43, seed % 2**63, epoch])  # "EPOC": not a round's key
    perm = rng.permutation(len(examples))
    shuffled = [examples[i] for i in perm]
    plan = minibatches(shuffled, batch_tokens, int(rng.integers(2**32)))
    return [[int(perm[i]) for i in idx] for idx in plan]


def batch_arrays(examples: Sequence[Example], idx: Sequence[int], answers_only: bool = False):
    """``(tokens [B, T], feats [B, T, F], mask [B, T])`` of the chosen examples; ``mask``
    marks positions whose feature and next token are known (answer positions only with
    ``answers_only``: the predictions of answer tokens)."""
    t = _bucket(max(len(examples[i][0]) for i in idx))
    f = examples[idx[0]][2].shape[-1]
    toks = np.zeros((len(idx), t), np.int32)
    feats = np.zeros((len(idx), t, f), np.float32)
    mask = np.zeros((len(idx), t), np.float32)
    for r, i in enumerate(idx):
        tok, pl, fe = examples[i]
        n = len(tok)
        toks[r, :n], feats[r, :n] = tok, fe
        mask[r, (pl - 1 if answers_only else 0):n - 1] = 1.0
    return toks, feats, mask


# ----------------------------------------------------------------------------- training

def optimizer(cfg: OnPolicyConfig) -> optax.GradientTransformation:
    """AdamW at a constant rate after a linear warmup (online: no planned end), clipped."""
    sched = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup),
                                  optax.constant_schedule(cfg.lr)], [cfg.warmup])
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(sched, weight_decay=cfg.weight_decay))


def make_step(kind: ttt.Kind, target, cfg: OnPolicyConfig, opt, mesh=None):
    """The jitted training step; with ``mesh``, its new state keeps ``loop.state_specs``."""
    @jax.jit
    def step(state, tparams, toks, feats, mask, vocab_ids):
        key = jax.random.fold_in(jax.random.key(cfg.seed), state["step"])
        grads, metrics = jax.grad(ttt.loss_fn, has_aux=True)(
            state["params"], tparams, toks, feats, mask, key, vocab_ids, kind=kind,
            target=target, cfg=cfg.loss)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return loop.constrain_state(mesh, {
            **state, "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state, "step": state["step"] + 1}), metrics

    return step


def make_eval(kind: ttt.Kind, target, k: int = 3):
    """Jitted held-out scoring without noise, unrolled ``k`` steps on the head's own
    outputs: sums of per-step top-1 hits on answer positions, and their counts."""
    quiet = ttt.LossConfig(k=k, noise=0.0)

    @jax.jit
    def evaluate(params, tparams, toks, feats, mask, vocab_ids):
        _, m = ttt.loss_fn(params, tparams, toks, feats, mask, jax.random.key(0), vocab_ids,
                           kind=kind, target=target, cfg=quiet)
        counts = [jnp.sum(ttt.shift(mask, s) * mask) for s in range(k)]
        return jnp.stack([m[f"acc{s}"] * c for s, c in enumerate(counts)]), jnp.stack(counts)

    return evaluate


def validate(evaluate, params, tparams, val: Sequence[Example], vocab_ids,
             batch_tokens: int, mesh=None) -> dict:
    """Held-out top-1 per draft step (the head unrolled on its own outputs, the teacher's
    tokens fed) on the target's answers: ``val_top1`` [step 1, step 2, ...]. With ``mesh``,
    rows over ``data`` (``loop.batch_on``)."""
    hits, counts = 0.0, 0.0
    for idx in minibatches(val, batch_tokens, 0):
        batch = loop.batch_on(mesh, batch_arrays(val, idx, answers_only=True))
        h, c = loop.host(evaluate(params, tparams, *batch, vocab_ids))
        hits, counts = hits + h, counts + c
    return {"val_top1": [round(float(x), 4) for x in hits / np.maximum(counts, 1)],
            "val_tokens": int(counts[0])}


# ----------------------------------------------------------------------------- the run

def store_settings(cfg: OnPolicyConfig, exclude: str) -> dict:
    """The part of a store's header that needs no model: the sampling settings and how
    prompts were chosen."""
    chosen = {} if cfg.sources is None else {"sources": list(cfg.sources)}
    if cfg.data_file is not None:
        chosen["data"] = cfg.data_file
    return {"sampling": {"decoding": "greedy", "max_new_tokens": cfg.max_new_tokens},
            "prompts": {"seed": cfg.seed, "batch": cfg.batch, "exclude": exclude,
                        "max_prompt_tokens": cfg.max_prompt_tokens,
                        "val_prompts": cfg.val_prompts, **chosen}}


def store_target(lm, thash: str) -> dict:
    """The target a store is bound to: its name and ``target_hash``."""
    return {"name": Path(str(lm.source)).name, "hash": thash}


def store_header(lm, cfg: OnPolicyConfig, exclude: str, thash: str) -> dict:
    """What a shard store is bound to: the target (``store_target``) and
    ``store_settings``."""
    return {"target": store_target(lm, thash), **store_settings(cfg, exclude)}


def check_store(root: str | Path, run_dir: str | Path, cfg: OnPolicyConfig, exclude: str,
                stop_after: int | None = None) -> None:
    """Before the target loads (``shards.check_store``): the store under ``root`` was
    written with this run's settings, and its held-out shard and every round a run in
    ``run_dir`` will replay (from its latest checkpoint on; with ``cfg.epochs``, every
    round: the epochs read them all) are present and unaltered."""
    todo = (range(cfg.rounds) if cfg.epochs else
            cfg.rounds_from(checkpoint.latest_step(run_dir), stop_after))
    shards.check_store(root, ["val", *todo], store_settings(cfg, exclude))


def _encode(lm, pool, cfg: OnPolicyConfig) -> tuple[list[str], list[list[int]]]:
    ids, toks = [], []
    for pid, text in pool:
        t = lm.encode(text, chat=lm.has_chat_template)
        if len(t) <= cfg.max_prompt_tokens:
            ids.append(pid)
            toks.append(t)
    return ids, toks


def _sorted_prompts(lm, pool, cfg: OnPolicyConfig) -> tuple[list[str], list[list[int]]]:
    """A round's prompt ids and tokens as it decodes them: similar lengths together."""
    ids, toks = _encode(lm, pool, cfg)
    order = sorted(range(len(toks)), key=lambda i: len(toks[i]))
    return [ids[i] for i in order], [toks[i] for i in order]


def _known(store: ShardStore, which, ids: list[str]) -> bool:
    """Whether ``store`` holds round ``which`` (a shard number or ``"val"``); ``ValueError``
    if it holds it for other prompts than ``ids``."""
    known = store.has(which) if isinstance(which, str) else which < len(store)
    entry = known and (store.manifest[which] if isinstance(which, str)
                       else store.manifest["shards"][which])
    if known and entry["prompt_ids"] != ids:
        raise ValueError(f"shard {which} of {store.root} answers other prompts than this run "
                         "chooses: the prompt data changed")
    return known


def _round_data(lm, store: ShardStore, which, pool, cfg: OnPolicyConfig, layers, mesh=None,
                cache: FeatureCache | None = None):
    """``(examples, replayed, seconds)`` of a round (a shard number) or of ``"val"``: read
    from the store and prefilled (or their prefill's features read from ``cache``), or
    decoded and appended to it (on ``mesh``: ``lm`` sharded over it)."""
    t0 = time.perf_counter()
    ids, toks = _sorted_prompts(lm, pool, cfg)
    known = _known(store, which, ids)
    if known:
        ex = _replay(lm, store, which, layers, mesh, cache)
    else:
        ex = decode_round(lm, toks, cfg.max_new_tokens, layers, mesh=mesh)
        store.append(ids, [(t, pl) for t, pl, _ in ex],
                     name=which if isinstance(which, str) else None)
    return ex, known, time.perf_counter() - t0


def _replay(lm, store: ShardStore, which, layers, mesh=None,
            cache: FeatureCache | None = None) -> list[Example]:
    """Shard ``which`` of ``store`` with its features: one prefill of its tokens, or read
    from ``cache`` (computed and written there the first time)."""
    if cache is None:
        return prefill_features(lm, store.read(which), layers, mesh=mesh)
    return cache.examples(store, which, layers,
                          lambda rows: prefill_features(lm, rows, layers, mesh=mesh))


def mix_digest(mix: Sequence[tuple[ShardStore, int]]) -> str:
    """SHA-256 (16 hex digits) of the shards ``mix`` names (``(store, rounds)``: its first
    ``rounds`` numbered shards), in order: what a run records of the data it mixes into
    its epochs, so a resumed run mixes the same."""
    h = hashlib.sha256()
    for s, n in mix:
        h.update("\n".join(s.sha256(w) for w in range(n)).encode() + b"|")
    return h.hexdigest()[:16]


def extend_store(lm, store: ShardStore, pool: Sequence[tuple[str, str]], cfg: OnPolicyConfig,
                 *, progress=None, mesh=None) -> list:
    """Decodes into ``store`` its held-out shard, if absent, and the rounds it lacks up to
    ``cfg.rounds``, and trains nothing: the shards a :func:`train` run of ``cfg`` would
    decode, token for token, which that run then replays. Shards already held are not
    read; the held-out shard's and the last round's prompts are checked against ``pool``
    (``ValueError`` if the prompt data changed). Returns what it decoded (``"val"`` and
    round numbers). With ``mesh``: ``lm`` sharded over it, rows over ``data``."""
    lm = on_mesh(lm, mesh)
    val, last = list(pool[:cfg.val_prompts]), len(store) - 1
    for which, prompts in [("val", val)] + ([(last, _round_prompts(pool, cfg, last))]
                                             if last >= 0 else []):
        _known(store, which, _sorted_prompts(lm, prompts, cfg)[0])  # the prompts unchanged
    todo = ([] if store.has("val") else ["val"]) + list(range(len(store), cfg.rounds))
    for w in todo:
        _round_data(lm, store, w, val if w == "val" else _round_prompts(pool, cfg, w), cfg,
                    (lm.model.config.num_layers,), mesh)
        if progress is not None:
            progress.update(1)
    return todo


def init_params(kind: ttt.Kind, target_cfg, cfg: OnPolicyConfig, init=None) -> dict:
    """A fresh head of ``kind`` (float32; EAGLE-2: with the layer's ``attn_norm`` as
    ``cfg.attn_norm`` says, of ``cfg.head_layers`` layers), or ``init``'s parameters cast
    to float32. An EAGLE-2 ``init`` of fewer layers gains the fresh head's extra layers,
    which start as the identity, so the run starts from ``init``'s own drafts.
    ``ValueError`` for ``attn_norm=False`` or ``head_layers > 1`` with EAGLE-3, an
    ``init`` of the other EAGLE-2 layout (``train.eagle.check_layout``) or of more layers
    (``train.eagle.grow_layers``)."""
    from specjax.drafters import eagle, eagle3
    from specjax.train.eagle import check_layout, grow_layers

    key = jax.random.key(cfg.seed)
    if kind.name != "eagle" and (not cfg.attn_norm or cfg.head_layers != 1):
        raise ValueError("attn_norm=False and head_layers > 1 are EAGLE-2 options: an "
                         "EAGLE-3 head has one layer, normalizing its inputs with embed_norm "
                         "and hidden_norm")
    fresh = (eagle.init_head(target_cfg, key, attn_norm=cfg.attn_norm, layers=cfg.head_layers)
             if kind.name == "eagle" else eagle3.init_head(target_cfg, key, cfg.draft_vocab))
    if init is None:
        return fresh
    if kind.name == "eagle":
        check_layout(init, cfg.attn_norm)
        init = grow_layers(init, fresh)
    return jax.tree.map(lambda a, b: jnp.asarray(b, a.dtype), fresh, init)



def train(lm, kind: ttt.Kind, cfg: OnPolicyConfig, run_dir: str | Path, store: ShardStore,
          pool: Sequence[tuple[str, str]], vocab_ids: np.ndarray, *, init=None,
          stop_after: int | None = None, log=None, progress=None, mesh=None,
          feature_cache: FeatureCache | None = None,
          mix: Sequence[tuple[ShardStore, int]] = ()) -> dict:
    """Trains (or resumes) the head in ``run_dir`` up to ``cfg.rounds`` rounds (or
    ``stop_after`` more) over ``pool`` (``prompt_pool``: its first ``val_prompts`` are held
    out), replaying the rounds ``store`` holds and decoding the rest into it. ``vocab_ids``:
    the draft vocabulary (EAGLE-3's head rows; EAGLE-2's cross-entropy rows). Returns the
    state. Each round's checkpoint is complete on disk before ``log`` records the round,
    and on any error the checkpoint manager finishes its writes and closes
    (``checkpoint.closing``), so the last logged round is the one a rerun resumes from.

    Then ``cfg.epochs`` epochs over every round's examples (read from ``store``:
    ``_train_epochs``), each checkpointed (step ``rounds + epoch``) and scored; ``stop_after``
    counts rounds and epochs of this call together. ``CheckpointError`` (before any round
    or epoch) for a run whose epochs began given other ``rounds``, or epochs with fewer
    ``rounds`` than the run trained (``_check_epochs``).

    With ``mesh`` (``specjax.sharding.make_mesh``): the target sharded over it decodes the
    rounds (rows over ``data``) and gives the features, each minibatch's rows are split over
    ``data`` and the optimizer state is sharded (``loop.on_mesh``); the parameters equal
    the one-device run's up to float rounding (``tests/test_sharding.py``). On a mesh
    spanning processes every process calls ``train`` with the same arguments: each
    decodes and prefills its rows and receives all of them, process 0 alone writes the
    store's shards, the feature cache and ``log``, and all write the checkpoints together.

    With ``feature_cache``, replayed shards (the held-out one, rounds and epochs) read
    their prefill's features from it, computed and written the first time: the same
    parameters as without it, bit for bit.

    ``mix``: ``(store, rounds)`` pairs, other stores of the same target
    (``ShardStore.open``) whose first ``rounds`` numbered shards join the epochs, shuffled
    with the run's rounds: data of other prompt sources or settings, trained together
    without a second run. The run records them (``mix_digest``), so a run resumed with
    others is refused (``CheckpointError``); ``ValueError`` for ``mix`` without
    ``cfg.epochs``, or for more rounds than a store holds."""
    if mix and not cfg.epochs:
        raise ValueError("stores mixed into the epochs need epochs (OnPolicyConfig.epochs)")
    for s, n in mix:
        if not 1 <= n <= len(s):
            raise ValueError(f"{s.root} holds {len(s)} rounds: cannot mix {n} of them")
    lm = on_mesh(lm, mesh)
    target, tparams = lm.model, lm.params
    layers = kind.layers(target.config)
    opt = optimizer(cfg)
    params = init_params(kind, target.config, cfg, init)
    fresh = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0, jnp.int32),
             "round": jnp.asarray(0, jnp.int32), "tokens": jnp.asarray(0, jnp.int32)}
    meta = {"kind": kind.name, "store": store.manifest["target"], "vocab": len(vocab_ids),
            **{k: v for k, v in run_fields(cfg).items()
               if k not in ("rounds", "val_every", "epochs")},  # these three may grow
            "mix": mix_digest(mix) if mix else None}  # None: as a run.json without it
    check_run_layout(run_dir, cfg.attn_norm)
    state, mngr = loop.resume(run_dir, meta, fresh, mesh)
    step = make_step(kind, target, cfg, opt, mesh)
    evaluate = make_eval(kind, target)
    vids = loop.replicated(mesh, np.asarray(vocab_ids, np.int32))

    def data(which, prompts):  # a round's examples: replayed (features cached) or decoded
        return _round_data(lm, store, which, prompts, cfg, layers, mesh, feature_cache)

    with checkpoint.closing(mngr):
        done = (mngr.latest_step() or 0) - int(state["round"])  # epochs trained
        _check_epochs(run_dir, cfg, int(state["round"]), done)
        val, _, _ = data("val", pool[:cfg.val_prompts])
        score = lambda st: validate(evaluate, st["params"], tparams, val, vids,
                                    cfg.batch_tokens, mesh)
        todo = cfg.rounds_from(int(state["round"]), stop_after)
        if progress is not None and todo.start + done:  # what a resumed run already did
            progress.update(todo.start + done)
        if isinstance(log, loop.RunLog):
            log.rewind(todo.start, key="round")
            log.rewind(done, key="epoch")
        if todo.start == 0 and log is not None:  # where the head starts from
            log({"round": 0, "step": 0, "tokens_seen": 0, **score(state)})
        for r in todo:
            ex, replayed, secs = data(r, _round_prompts(pool, cfg, r))
            t0 = time.perf_counter()
            state, metrics = jax.block_until_ready(  # steps dispatch asynchronously
                _train_round(step, state, tparams, ex, vids, cfg, r, mesh))
            row = _round_row(state, metrics, ex, replayed, secs, time.perf_counter() - t0)
            if (r + 1) % cfg.val_every == 0 or r + 1 == todo.stop:
                row.update(score(state))
            mngr.save(r + 1, args=checkpoint.ocp.args.StandardSave(state), force=True)
            mngr.wait_until_finished()  # complete on disk before the log records the round
            if log is not None:
                log(row)
            if progress is not None:
                progress.update(1)
                progress.set_postfix({k: row[k] for k in ("tokens_seen", "data_tok_per_s")})
        left = None if stop_after is None else stop_after - len(todo)
        epochs = cfg.epochs_from(done, left) if int(state["round"]) == cfg.rounds else range(0)
        if epochs:
            mixed = lambda: _mixed(lm, mix, layers, mesh, feature_cache, progress)  # noqa: E731
            state = _train_epochs(data, pool, cfg, state, epochs, step, tparams, vids,
                                  score, mngr, log, progress, mesh, mixed)
    return state


def _mixed(lm, mix: Sequence[tuple[ShardStore, int]], layers, mesh, cache, progress
           ) -> list[Example]:
    """The examples of the shards ``mix`` names (``train``'s ``mix``), replayed in order;
    ``progress``'s postfix follows them."""
    out, total, done = [], sum(n for _, n in mix), 0
    for s, n in mix:
        for w in range(n):
            out += _replay(lm, s, w, layers, mesh, cache)
            done += 1
            if progress is not None:
                progress.set_postfix({"features of mixed round": f"{done}/{total}"})
    return out


def _round_prompts(pool: Sequence[tuple[str, str]], cfg: OnPolicyConfig, r: int) -> list:
    """The prompts round ``r`` answers: the ``r``-th batch after the held-out ones."""
    lo = cfg.val_prompts + r * cfg.batch
    return list(pool[lo:lo + cfg.batch])


def _check_epochs(run_dir, cfg: OnPolicyConfig, rounds: int, epochs: int) -> None:
    """``CheckpointError`` (one line) for what epochs make ambiguous: a run that trained
    ``rounds`` rounds then ``epochs`` epochs given other ``cfg.rounds`` (more rounds would
    come after epochs that did not see them), or ``cfg.epochs`` with fewer ``cfg.rounds``
    than the run trained (which rounds would the epochs cover?)."""
    from specjax.heads import CheckpointError

    if epochs and cfg.rounds != rounds:
        raise CheckpointError(f"{run_dir} trained {rounds} rounds then {epochs} epochs over "
                              f"them; it takes more epochs (--epochs) but not --rounds "
                              f"{cfg.rounds}: pass --rounds {rounds}, or use another directory")
    if cfg.epochs and cfg.rounds < rounds:
        raise CheckpointError(f"{run_dir} trained {rounds} rounds: epochs over --rounds "
                              f"{cfg.rounds} of them are ambiguous; pass --rounds {rounds}")


def _train_epochs(data, pool, cfg: OnPolicyConfig, state: dict, epochs: range, step, tparams,
                  vids, score, mngr, log, progress, mesh=None, mixed=list) -> dict:
    """The state after ``epochs`` (numbers from 0) over every round's examples, their
    features from one prefill of the stored tokens (``data(round, prompts)``: the run's
    ``_round_data``, never the decoded features, so a resumed run trains on the same
    ones): each epoch scored (``score``),
    checkpointed as step ``cfg.rounds + epoch + 1`` (complete on disk before ``log``
    records it) and counted on ``progress``, whose postfix follows the prefill. ``mixed()``:
    the examples of the stores mixed in, after the rounds'."""
    ex = []
    for r in range(cfg.rounds):
        ex += data(r, _round_prompts(pool, cfg, r))[0]
        if progress is not None:
            progress.set_postfix({"features of round": f"{r + 1}/{cfg.rounds}"})
    ex += mixed()
    for e in epochs:
        t0 = time.perf_counter()
        tick = None if progress is None else _step_ticker(progress, e)
        state, metrics = jax.block_until_ready(_train_pass(
            step, state, tparams, ex, epoch_batches(ex, cfg.batch_tokens, cfg.seed, e), vids,
            mesh, tick, cfg.answers_only))
        row = {"round": int(state["round"]), "epoch": e + 1, "step": int(state["step"]),
               "tokens_seen": int(state["tokens"]),
               **{k: round(float(v), 4) for k, v in metrics.items()},
               "examples": len(ex), "train_seconds": round(time.perf_counter() - t0, 1),
               **score(state)}
        mngr.save(cfg.rounds + e + 1, args=checkpoint.ocp.args.StandardSave(state), force=True)
        mngr.wait_until_finished()
        if log is not None:
            log(row)
        if progress is not None:
            progress.update(1)
            progress.set_postfix({k: row[k] for k in ("epoch", "tokens_seen")})
    return state


def _train_pass(step, state: dict, tparams, ex: Sequence[Example], plan: list[list[int]],
                vids, mesh=None, tick=None, answers_only: bool = False) -> tuple[dict, dict]:
    """``(state, last metrics)`` after one optimizer step per minibatch of ``plan``
    (indices into ``ex``), in order, each minibatch's rows over ``mesh``'s ``data`` axis,
    trained on ``batch_arrays``' positions (``answers_only``: answers'); the state's
    ``tokens`` counts them. ``tick(i, n, metrics)`` follows step ``i`` of ``n``."""
    metrics = {}
    for i, idx in enumerate(plan):
        toks, feats, mask = batch_arrays(ex, idx, answers_only)
        state, metrics = step(state, tparams, *loop.batch_on(mesh, (toks, feats, mask)), vids)
        state["tokens"] = state["tokens"] + int(mask.sum())
        if tick is not None:
            tick(i + 1, len(plan), metrics)
    return state, metrics


def _step_ticker(progress, epoch: int, every: int = 50):
    """A ``_train_pass`` tick that shows epoch ``epoch``'s step on ``progress``'s postfix
    every ``every`` steps and at its last, each shown step finished (not only dispatched)."""
    def tick(i: int, n: int, metrics) -> None:
        if i % every == 0 or i == n:
            jax.block_until_ready(metrics)
            progress.set_postfix({"epoch": epoch + 1, "step": f"{i}/{n}"})
    return tick


def _train_round(step, state: dict, tparams, ex: Sequence[Example], vids, cfg: OnPolicyConfig,
                 r: int, mesh=None) -> tuple[dict, dict]:
    """``(state, last metrics)`` after ``cfg.passes`` passes over round ``r``'s examples
    (``_train_pass``); the state's ``round`` is then ``r + 1``."""
    metrics = {}
    for p in range(cfg.passes):
        plan = minibatches(ex, cfg.batch_tokens, hash((cfg.seed, r, p)) % 2**32)
        state, metrics = _train_pass(step, state, tparams, ex, plan, vids, mesh,
                                     answers_only=cfg.answers_only)
    state["round"] = sharding.replicated(mesh, jnp.asarray(r + 1, jnp.int32))
    return state, metrics


def _round_row(state: dict, metrics: dict, ex: Sequence[Example], replayed: bool,
               data_secs: float, train_secs: float) -> dict:
    """A round's ``log.jsonl`` row (validation scores are added by the caller)."""
    answer = sum(len(t) - pl for t, pl, _ in ex)
    return {"round": int(state["round"]), "step": int(state["step"]),
            "tokens_seen": int(state["tokens"]),
            **{k: round(float(v), 4) for k, v in metrics.items()},
            "replayed": replayed, "data_seconds": round(data_secs, 1), "answer_tokens": answer,
            "data_tok_per_s": round(answer / data_secs, 1),
            "train_seconds": round(train_secs, 1)}


def store_corpus(lm, root: str | Path, batch: int = 16, progress=None) -> list[Example]:
    """Every sequence of a shard store (its held-out set excepted) with the target's last
    hidden state (before the final norm) at each position: the corpus layout of
    ``specjax.train.distill`` (features float32), from one prefill per batch. Refuses a
    store written by another target (``ShardError`` naming both targets)."""
    store = ShardStore.open(root, store_target(lm, target_hash(lm.model.config, lm.params)),
                            lm.model.config.vocab_size)
    layers = (lm.model.config.num_layers,)
    out = []
    for i in range(len(store)):
        rows = store.read(i)
        for j in range(0, len(rows), batch):
            out += prefill_features(lm, rows[j:j + batch], layers)
        if progress is not None:
            progress.update(1)
    return out


__all__ = ["OnPolicyConfig", "batch_arrays", "check_store", "decode_round", "epoch_batches",
           "extend_store", "make_eval",
           "make_step", "minibatches", "mix_digest", "on_mesh", "optimizer", "init_params", "store_header",
           "store_settings", "store_target", "train", "prefill_features", "prompt_pool",
           "validate", "ShardStore", "store_corpus", "target_hash"]
