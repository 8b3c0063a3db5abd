"""Training the ReDrafter head on a fixed-feature corpus with Optax, checkpointed by Orbax.

For each position ``t`` of a text, the head reads the target's feature ``f_t`` and unrolls
``steps`` recurrent steps over the text's next tokens (the first is the token ``f_t``
predicted, the root at decoding time); step ``i`` predicts token ``t + i + 1``. Two losses:

* ``"kd"`` (the paper's): cross-entropy against the target's distribution at position
  ``t + i``, renormalised on the draft vocabulary;
* ``"ce"`` (Apple's released trainer): cross-entropy against the dataset token
  ``t + i + 1`` (positions whose token lies outside the draft vocabulary are skipped).

Batches are EAGLE's (``specjax.train.eagle.batch_at``): the order is a function of the seed
and the step alone, so a killed run resumes to the same parameters.
"""

from __future__ import annotations

import dataclasses
import operator
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.drafters import redrafter
from specjax.train import eagle as train_eagle
from specjax.train import glue, loop


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation of one ReDrafter head. Each field is a flag of ``train redrafter``
    (``glue.option``), checked here."""

    steps: int = glue.steps(600)
    batch_tokens: int = glue.batch_tokens(1024)
    max_len: int = glue.max_len(512)
    unroll: int = glue.option(3, "recurrent steps trained per position", low=1)
    blocks: int = glue.option(2, "residual blocks of the head", low=0)
    draft_vocab: int = glue.option(8192, "the corpus's most frequent tokens (0: the whole "
                                         "vocabulary)", low=0)
    loss: str = glue.option("kd", "kd: the target's distribution (the paper); ce: dataset "
                                  "tokens", argparse={"choices": ["kd", "ce"]})
    lr: float = glue.lr(1e-3)
    warmup: int = glue.warmup(50)
    weight_decay: float = glue.weight_decay(0.0)
    clip: float = glue.clip(1.0)
    seed: int = glue.seed(0)
    save_every: int = glue.save_every(100)
    val_examples: int = glue.val_examples(0)
    all_positions: bool = glue.option(
        True, "train on answer positions only (a corpus from `specjax distill`); default: "
              "every position", flag="--answers-only", parse=operator.not_,
        argparse={"action": "store_true", "default": False})

    def __post_init__(self):
        glue.check_fields(self)
        if self.loss not in ("kd", "ce"):
            raise ValueError(f"loss must be 'kd' or 'ce', got {self.loss!r}")


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after global-norm clipping."""
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup,
                                               max(cfg.steps, cfg.warmup + 1),
                                               end_value=cfg.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(sched, weight_decay=cfg.weight_decay))


def _shift(x, k: int):
    """``out[:, t] = x[:, t + k]`` (zero past the end)."""
    pad = [(0, 0), (0, k)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad)[:, k:]


def loss_fn(hp, tparams, toks, hidden, mask, vocab_ids, index_of, *, target, cfg: TrainConfig):
    """Mean loss over (position, step) pairs and metrics: ``acc{i}`` is the head's top-1
    agreement with the target's argmax (over the draft vocabulary) at step ``i``."""
    L = cfg.unroll
    f = redrafter.features(target, tparams, hidden)  # [B, T, D]
    emb = jnp.stack([target.embed(tparams, _shift(toks, i)) for i in range(1, L + 1)], 2)
    logits = redrafter.unroll(hp, f, emb.astype(f.dtype))  # [B, T, L, V']
    logq = jax.nn.log_softmax(logits, -1)
    h_next = jnp.stack([_shift(hidden, i) for i in range(1, L + 1)], 2)  # [B, T, L, D]
    rows = target.output_head(tparams)
    rows = rows if vocab_ids is None else rows[vocab_ids]
    p = jax.nn.softmax(target.logits(tparams, h_next, head=rows), -1)  # [B, T, L, V']
    valid = jnp.stack([mask * _shift(mask, i) for i in range(1, L + 1)], 2)  # [B, T, L]
    if cfg.loss == "kd":
        per = -jnp.sum(p * logq, -1)
    else:
        label = index_of[jnp.stack([_shift(toks, i + 1) for i in range(1, L + 1)], 2)]
        valid = valid * (label >= 0)
        per = -jnp.take_along_axis(logq, jnp.maximum(label, 0)[..., None], -1)[..., 0]
    n = jnp.maximum(jnp.sum(valid), 1.0)
    loss = jnp.sum(per * valid) / n
    agree = (jnp.argmax(logq, -1) == jnp.argmax(p, -1)) * valid
    metrics = {"loss": loss}
    for i in range(L):
        metrics[f"acc{i + 1}"] = jnp.sum(agree[:, :, i]) / jnp.maximum(jnp.sum(valid[:, :, i]), 1)
    metrics["acc"] = metrics["acc1"]
    return loss, metrics


def _batch(corpus, plan, step, cfg):
    toks, hidden, _, mask = train_eagle.batch_at(corpus, plan, step, _eagle_cfg(cfg))
    return toks, hidden, mask


def _eagle_cfg(cfg: TrainConfig) -> train_eagle.TrainConfig:
    return train_eagle.TrainConfig(batch_tokens=cfg.batch_tokens, max_len=cfg.max_len,
                                   seed=cfg.seed, all_positions=cfg.all_positions)


def draft_vocabulary(corpus, vocab_size: int, n: int) -> tuple[np.ndarray | None, np.ndarray]:
    """``(vocab_ids, index_of)``: the ``n`` most frequent ids (None for the whole
    vocabulary) and each target id's draft index (-1 outside it)."""
    if not n or n >= vocab_size:
        return None, np.arange(vocab_size, dtype=np.int32)
    ids = train_eagle.vocab_by_frequency(corpus, vocab_size, n)
    index_of = np.full(vocab_size, -1, np.int32)
    index_of[ids] = np.arange(n, dtype=np.int32)
    return ids, index_of


def validate(evaluate, params, val: Sequence, cfg: TrainConfig, mesh=None) -> dict:
    """Held-out loss and per-step agreement, weighted by (position, step) pairs; with
    ``mesh``, each batch's rows over its ``data`` axis (every process calls it)."""
    plan = train_eagle.batch_plan(val, _eagle_cfg(cfg))
    sums: dict[str, float] = {}
    for k in range(len(plan)):
        m, w = loop.host(evaluate(params, *loop.batch_on(mesh, _batch(val, plan, k, cfg))))
        for name, v in m.items():
            sums[name] = sums.get(name, 0.0) + float(v) * float(w)
        sums["_w"] = sums.get("_w", 0.0) + float(w)
    w = max(sums.pop("_w", 0.0), 1.0)
    return {f"val_{k}": v / w for k, v in sums.items()}


def train(target, tparams, corpus: Sequence, cfg: TrainConfig, run_dir: str | Path, *,
          meta: dict | None = None, stop_after: int | None = None, progress=None,
          log=None, init: tuple[dict, np.ndarray | None] | None = None, mesh=None
          ) -> tuple[dict, np.ndarray | None]:
    """Trains (or resumes) the head in ``run_dir`` up to ``cfg.steps``; returns the state
    and the draft vocabulary ids (None: the whole vocabulary).

    ``init = (head, vocab_ids)`` fine-tunes an existing head: training starts from its
    parameters (in float32) and keeps its draft vocabulary, whatever ``cfg.draft_vocab``.
    With ``mesh``, data-parallel over its ``data`` axis (``loop.on_mesh``), also across
    processes (every process calls ``train`` with the same arguments)."""
    train_set, val = train_eagle.split(corpus, _split_cfg(cfg))
    if init is None:
        ids, index_of = draft_vocabulary(train_set, target.config.vocab_size, cfg.draft_vocab)
        v = target.config.vocab_size if ids is None else len(ids)
        params = redrafter.init_head(target.config.hidden_size, v, jax.random.key(cfg.seed),
                                     cfg.blocks)
    else:
        params, ids = _from_head(init, target.config, cfg)
        index_of = np.arange(target.config.vocab_size, dtype=np.int32)
        if ids is not None:
            index_of = np.full(target.config.vocab_size, -1, np.int32)
            index_of[ids] = np.arange(len(ids), dtype=np.int32)
    opt = optimizer(cfg)
    fresh = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0, jnp.int32)}
    state, mngr = loop.resume(run_dir, {"kind": "redrafter", **(meta or {}),
                                        **dataclasses.asdict(cfg)}, fresh, mesh)
    tparams, state = loop.on_mesh(mesh, target, tparams, state)
    vid = loop.replicated(mesh, ids)
    idx = loop.replicated(mesh, index_of)
    # the target's weights are arguments, not constants captured by the trace: embedded in
    # the program they cost a large model seconds per step on XLA:CPU
    lf = lambda p, tp, *b: loss_fn(p, tp, *b, vid, idx, target=target, cfg=cfg)

    @jax.jit
    def step_fn(st, tp, toks, hidden, mask):
        grads, m = jax.grad(lf, has_aux=True)(st["params"], tp, toks, hidden, mask)
        updates, opt_state = opt.update(grads, st["opt_state"], st["params"])
        return loop.constrain_state(mesh, {
            "params": optax.apply_updates(st["params"], updates), "opt_state": opt_state,
            "step": st["step"] + 1}), m

    @jax.jit
    def evaluate_tp(p, tp, toks, hidden, mask):
        _, m = lf(p, tp, toks, hidden, mask)
        return m, jnp.sum(mask)

    evaluate = lambda p, *b: evaluate_tp(p, tparams, *b)
    plan = train_eagle.batch_plan(train_set, _eagle_cfg(cfg))
    step = lambda st, s: step_fn(st, tparams, *loop.batch_on(mesh, _batch(train_set, plan, s, cfg)))
    on_save = None if not val else lambda st: validate(evaluate, st["params"], val, cfg, mesh)
    state = loop.run_steps(state, step, mngr, steps=cfg.steps, save_every=cfg.save_every,
                           stop_after=stop_after, progress=progress, log=log, on_save=on_save)
    return state, ids


def _from_head(init, tcfg, cfg: TrainConfig) -> tuple[dict, np.ndarray | None]:
    """The float32 parameters and vocabulary of a head to fine-tune; a clear error when it
    was built for another target or another number of blocks."""
    head, ids = init
    params = redrafter._as_state(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), head))
    d, v, blocks = redrafter.head_sizes(params)
    want_v = tcfg.vocab_size if ids is None else len(ids)
    if d != tcfg.hidden_size or v != want_v:
        raise ValueError(f"the initial head has hidden size {d} and draft vocabulary {v}; this "
                         f"target needs hidden size {tcfg.hidden_size} and {want_v}")
    if blocks != cfg.blocks:
        raise ValueError(f"the initial head has {blocks} residual blocks, not {cfg.blocks}")
    return params, None if ids is None else np.asarray(ids, np.int32)


def _split_cfg(cfg: TrainConfig) -> train_eagle.TrainConfig:
    return train_eagle.TrainConfig(seed=cfg.seed, val_examples=cfg.val_examples)


__all__ = ["TrainConfig", "train", "loss_fn", "draft_vocabulary", "optimizer"]
