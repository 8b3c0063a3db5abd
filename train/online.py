"""EAGLE training straight from a user's conversations (``specjax train eagle --data
FILE``): no corpus on disk, the target's features computed in each step.

The conversations stream in the seeded order of ``conversations.Stream`` (every epoch a new
order), rendered with the loss on the assistant's tokens (or all), cut at ``max_len``. A
batch is the next examples that fit ``batch_tokens`` at their padded length (a bucket of 64;
the rows padded to ``batch_tokens // bucket`` so each bucket compiles once). The target's
last-layer features come from one forward of the batch (``text_corpus``'s feature pass, in
bfloat16 as a stored corpus holds them), and the step is ``train.eagle``'s.

The stream's position after each batch is part of the training state, so Orbax saves it
with the parameters: a run killed mid-epoch resumes at the same example and reaches the
parameters of a run that never stopped (``tests/test_conversations.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import eagle
from specjax.train import conversations as conv
from specjax.train import distill, loop, text_corpus
from specjax.train import eagle as train_eagle

VOCAB_EXAMPLES = 2000
"""Examples (the stream's first, epoch 0) whose trained tokens give the cross-entropy's
vocabulary (``TrainConfig.ce_vocab``) and the exported head's vocabulary order."""


def batches(stream: conv.Stream, tokenizer, cfg: train_eagle.TrainConfig, loss: str,
            eos: int | None, counts: dict | None = None
            ) -> Iterator[tuple[tuple[int, ...], np.ndarray, np.ndarray]]:
    """``(position after the batch, tokens[R, T], loss mask[R, T])`` per batch (``R`` =
    ``batch_tokens // T``; zero rows pad it). The mask is per position: 1 where the next
    token is trained. A batch ends before the example that would overflow it, and the
    position is the one before that example, so a stream reopened there yields it again."""
    cur: list[conv.Rendered] = []
    it = conv.examples(stream, tokenizer, cfg.max_len, loss, eos, counts)
    while True:
        before = stream.position
        nxt = next(it, None)
        if nxt is not None:
            t = train_eagle._bucket(max(len(r.tokens) for r in cur + [nxt[1]]))
            if len(cur) < max(1, cfg.batch_tokens // t):
                cur.append(nxt[1])
                continue
        if not cur:
            return
        yield (stream.position if nxt is None else before), *_arrays(cur, cfg)
        if nxt is None:
            return
        cur = [nxt[1]]


def _arrays(rows: list[conv.Rendered], cfg) -> tuple[np.ndarray, np.ndarray]:
    t = train_eagle._bucket(max(len(r.tokens) for r in rows))
    n = max(1, cfg.batch_tokens // t)
    toks, mask = np.zeros((n, t), np.int32), np.zeros((n, t), np.float32)
    for i, r in enumerate(rows):
        k = len(r.tokens)
        toks[i, :k] = r.tokens
        mask[i, :k - 1] = 1.0 if cfg.all_positions else r.loss_mask[1:]
    return toks, mask


def vocab_sample(index: conv.Index, tokenizer, cfg, loss: str, eos, seed: int) -> list:
    """The first ``VOCAB_EXAMPLES`` examples of the stream (tokens and loss mask, as
    ``distill.Example`` without features): what ``vocab_by_frequency`` counts."""
    out = []
    for _, r in conv.examples(conv.Stream(index, seed), tokenizer, cfg.max_len, loss, eos):
        out.append(distill.Example.of(r.tokens, int(np.argmax(r.loss_mask)), None, r.loss_mask))
        if len(out) == VOCAB_EXAMPLES:
            break
    return out


def _features_fn(target):
    fwd = text_corpus._prefill_fn(target)

    def feats(tparams, toks):
        h = fwd(tparams, toks).astype(jnp.float32)
        return h, jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))  # features, previous position's
    return feats


def train(target, tparams, tokenizer, index: conv.Index, cfg: train_eagle.TrainConfig,
          run_dir: str | Path, *, loss: str = "assistant", eos: int | None = None,
          meta: dict | None = None, stop_after: int | None = None, progress=None, log=None,
          init: dict | None = None, mesh=None, counts: dict | None = None) -> dict:
    """Trains (or resumes) the EAGLE head in ``run_dir`` on the conversations of ``index``
    up to ``cfg.steps`` steps (epochs repeat in new orders); returns the state, whose
    ``reader`` is the stream's position. ``init``, ``mesh``, ``stop_after`` as in
    ``train.eagle.train``; ``counts`` (a dict) gathers the stream's counts of kept, cut
    and dropped conversations. ``cfg.val_examples`` must be 0 (there is no held-out
    corpus)."""
    if cfg.val_examples:
        raise ValueError("val_examples: training on conversations holds none out; use a "
                         "corpus from `specjax features --data` to score held-out examples")
    opt = train_eagle.optimizer(cfg)
    params = eagle.init_head(target.config, jax.random.key(cfg.seed), attn_norm=cfg.attn_norm,
                             layers=cfg.head_layers)
    if init is not None:
        train_eagle.check_layout(init, cfg.attn_norm)
        init = train_eagle.grow_layers(init, params)
        params = jax.tree.map(lambda a, b: jnp.asarray(b, a.dtype), params, init)
    fresh = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0, jnp.int32),
             "reader": jnp.zeros((4,), jnp.int32)}
    train_eagle.check_run_layout(run_dir, cfg.attn_norm)
    state, mngr = loop.resume(run_dir, {"kind": "eagle", "data_kind": "conversations",
                                        "loss": loss, **(meta or {}),
                                        **train_eagle.run_fields(cfg)}, fresh, mesh)
    tparams, state = loop.on_mesh(mesh, target, tparams, state)
    step_fn = train_eagle.make_step(target, cfg, opt, mesh)
    feats = jax.jit(_features_fn(target))
    vocab_ids = None
    if cfg.ce_vocab:
        sample = vocab_sample(index, tokenizer, cfg, loss, eos, cfg.seed)
        vocab_ids = loop.replicated(mesh, train_eagle.vocab_by_frequency(
            sample, target.config.vocab_size, min(cfg.ce_vocab, target.config.vocab_size)))
    stream = conv.Stream(index, cfg.seed, position=tuple(int(x) for x in
                                                         loop.host(state["reader"])),
                         epochs=None)
    source = batches(stream, tokenizer, cfg, loss, eos, counts)

    def step(st, s):
        pos, toks, mask = next(source)
        toks, mask = loop.batch_on(mesh, (toks, mask))
        hidden, prev = feats(tparams, toks)
        st, m = step_fn({k: v for k, v in st.items() if k != "reader"}, tparams, toks,
                        hidden, prev, mask, vocab_ids)
        return {**st, "reader": loop.replicated(mesh, np.asarray(pos, np.int32))}, m

    return loop.run_steps(state, step, mngr, steps=cfg.steps, save_every=cfg.save_every,
                          stop_after=stop_after, progress=progress, log=log)
