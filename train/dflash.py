"""Training a DFlash drafter (``specjax.drafters.dflash``) on the target's own answers, with
Optax, checkpointed by Orbax.

The objective is z-lab's and SpecForge's (``OnlineDFlashModel``): each step samples up to
``anchors`` positions ``a`` per sequence, uniformly among those whose next token is a
trained (answer) token, and runs every block ``[x_a, MASK, ..., MASK]`` (at positions
``a .. a + B - 1``) in one forward. A block's queries see the context features at
positions ``< a`` (strictly: at inference the root's own features are not yet known) and
the ``B`` tokens of their own block, nothing else. Slot ``k >= 1`` of a block is scored
against the sequence's token ``x_{a+k}`` by cross-entropy through the target's frozen LM
head, weighted ``exp(-(k - 1) / gamma)`` (early slots matter most: a draft is accepted up
to its first miss), where that token is an answer token. Only the drafter trains; the
target's embedding and LM head are read, not learned.

Data: the sequences of shard stores (``specjax.train.shards``: the target's greedy
answers to training prompts, what ``specjax train onpolicy`` decodes), their features from
one cacheless forward each (``onpolicy.prefill_features``, the fused layers alone), kept
in float16 on the host. Batches are ``onpolicy.epoch_batches`` of the seed and the epoch,
so a run killed after a checkpoint resumes to the parameters of one that never stopped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.drafters import dflash
from specjax.train import glue, loop, onpolicy


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter (``layers`` decoder layers, a block of ``block_size``, fusing
    ``target_layers``, default z-lab's rule) and its optimisation: ``epochs`` passes over
    the data in minibatches of about ``batch_tokens`` tokens, ``anchors`` blocks per
    sequence per step, slot weights ``exp(-(k - 1) / gamma)``."""

    layers: int = glue.option(1, "decoder layers of the drafter", low=1)
    block_size: int = glue.option(8, "tokens of a block: its root and the masked slots "
                                     "drafted with it", low=2)
    target_layers: tuple[int, ...] | None = glue.option(
        None, "target layer ids to fuse, comma-separated (default: z-lab's rule for the "
              "drafter's layer count)", parse=glue.int_list("--target-layers", low=0),
        argparse={"type": str})
    anchors: int = glue.option(16, "blocks per sequence per step", low=1)
    gamma: float = glue.option(4.0, "slot k of a block weighs exp(-(k - 1) / gamma)",
                               above=0)
    epochs: int = glue.option(2, "passes over the data", low=1)
    batch_tokens: int = glue.batch_tokens(2048)
    lr: float = glue.lr(6e-4)
    warmup: int = glue.warmup(40)
    weight_decay: float = glue.weight_decay(0.01)
    clip: float = glue.clip(1.0)
    init_scale: float = glue.option(0.02, "standard deviation of the drafter's initial "
                                          "weights")
    seed: int = glue.seed(0)
    save_every: int = glue.save_every(100)

    def __post_init__(self):
        glue.check_fields(self)
        if self.target_layers is not None:
            glue.int_list("--target-layers", low=0)(",".join(map(str, self.target_layers)))

    def spec(self, target_cfg) -> dflash.DFlashSpec:
        return dflash.DFlashSpec.of(target_cfg, num_layers=self.layers,
                                    block_size=self.block_size,
                                    target_layers=self.target_layers)


# ----------------------------------------------------------------------------- the loss

def anchor_positions(cand, n: int, key):
    """Up to ``n`` distinct positions per row drawn uniformly among ``cand`` [B, T]
    (sorted), and which of them are real (rows with fewer candidates pad with False)."""
    score = jnp.where(cand, jax.random.uniform(key, cand.shape), -1.0)
    val, idx = jax.lax.top_k(score, n)
    order = jnp.argsort(jnp.where(val >= 0, idx, cand.shape[1]), axis=1)
    take = lambda x: jnp.take_along_axis(x, order, axis=1)  # noqa: E731
    return take(idx).astype(jnp.int32), take(val) >= 0


def block_batch(spec: dflash.DFlashSpec, tokens, anchors, keep):
    """The blocks' tokens, positions, context visibility and block mask, flattened to
    ``N * B`` queries per row."""
    b, t = tokens.shape
    n, bs = anchors.shape[1], spec.block_size
    first = jnp.take_along_axis(tokens, anchors, axis=1)
    toks = jnp.concatenate([first[..., None],
                            jnp.full((b, n, bs - 1), spec.mask_id, jnp.int32)], -1)
    pos = anchors[..., None] + jnp.arange(bs)
    vis = jnp.arange(t)[None, None, None] < anchors[..., None, None]  # [B, N, 1, T]
    vis = jnp.broadcast_to(vis & keep[..., None, None], (b, n, bs, t)).reshape(b, n * bs, t)
    blk = jnp.repeat(jnp.arange(n), bs)
    mask = jnp.broadcast_to(blk[:, None] == blk[None, :], (b, n * bs, n * bs))
    return toks.reshape(b, n * bs), pos.reshape(b, n * bs), vis, mask


def loss_fn(params, tparams, tokens, feats, trained, key, *, target, spec: dflash.DFlashSpec,
            cfg: DFlashConfig):
    """Weighted cross-entropy of the block slots (module docstring) and metrics: ``acc1``
    (slot 1's top-1 equals the token), ``acc`` (every scored slot), ``tokens`` (the
    batch's real tokens). ``trained[b, t]``: token ``t`` is scored; ``tokens`` past a
    row's end are 0 with ``trained`` False."""
    b, t = tokens.shape
    bs = spec.block_size
    nxt = jnp.pad(trained[:, 1:], ((0, 0), (0, 1)))
    anchors, keep = anchor_positions(nxt > 0, min(cfg.anchors, t), key)
    toks, pos, vis, mask = block_batch(spec, tokens, anchors, keep)
    caches = dflash.context_kv(spec, params, feats,
                               jnp.broadcast_to(jnp.arange(t), (b, t)))
    h = dflash.block_hidden(spec, params, target.embed(tparams, toks), pos, caches, None,
                            vis, mask)
    logits = dflash.draft_logits(target, tparams, h)  # [B, N*bs, V]
    lab_pos = jnp.minimum(pos, t - 1)
    labels = jnp.take_along_axis(tokens, lab_pos, axis=1)
    slot = jnp.tile(jnp.arange(bs), anchors.shape[1])[None]
    w = jnp.take_along_axis(trained, lab_pos, axis=1) * (pos < t) * (slot > 0)
    w = w * jnp.repeat(keep, bs, axis=1) * jnp.exp(-(slot - 1) / cfg.gamma)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-6)
    hit = (jnp.argmax(logits, -1) == labels) & (w > 0)
    scored, first = w > 0, (w > 0) & (slot == 1)
    return loss, {"loss": loss,
                  "acc1": jnp.sum(hit & first) / jnp.maximum(jnp.sum(first), 1),
                  "acc": jnp.sum(hit) / jnp.maximum(jnp.sum(scored), 1),
                  "tokens": jnp.sum(tokens > 0)}


def optimizer(cfg: DFlashConfig, steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay to 5% over ``steps``, after clipping."""
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup,
                                               max(steps, cfg.warmup + 1), cfg.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(sched, weight_decay=cfg.weight_decay))


def make_step(target, spec, cfg: DFlashConfig, opt):
    @jax.jit
    def step(state, tparams, toks, feats, trained):
        key = jax.random.fold_in(jax.random.key(cfg.seed), state["step"])
        grads, metrics = jax.grad(loss_fn, has_aux=True)(
            state["params"], tparams, toks, feats.astype(jnp.float32), trained, key,
            target=target, spec=spec, cfg=cfg)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return step


# ----------------------------------------------------------------------------- data

def store_examples(lm, roots: Sequence[str | Path], layers: tuple[int, ...], progress=None,
                   batch: int = 16, max_tokens: int | None = None) -> list[tuple]:
    """The sequences of the shard stores ``roots`` (held-out sets excepted; in store and
    shard order, whole shards, until ``max_tokens`` tokens are read) with the residual
    streams after ``layers`` (float16), from cacheless forwards."""
    from specjax.train.shards import ShardStore, target_hash

    target = onpolicy.store_target(lm, target_hash(lm.model.config, lm.params))
    out, seen = [], 0
    for root in roots:
        store = ShardStore.open(root, target, lm.model.config.vocab_size)
        for i in range(len(store)):
            if max_tokens is not None and seen >= max_tokens:
                return out
            rows = store.read(i)
            seen += sum(len(t) for t, _ in rows)
            for j in range(0, len(rows), batch):
                out += [(t, pl, f.astype(np.float16)) for t, pl, f in
                        onpolicy.prefill_features(lm, rows[j:j + batch], layers)]
            if progress is not None:
                progress.update(1)
    return out


def batch_arrays(examples, idx) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, feats float16, trained)`` of the chosen examples: ``trained`` marks answer
    tokens (a conversation's ``loss_mask`` where the example carries one)."""
    toks, feats, mask = onpolicy.batch_arrays(examples, idx, answers_only=True)
    trained = np.zeros_like(mask)
    trained[:, 1:] = mask[:, :-1]  # mask[t]: the prediction of token t + 1
    for r, i in enumerate(idx):
        own = getattr(examples[i], "loss_mask", None)
        if own is not None:
            trained[r] = 0
            trained[r, :len(own)] = own
    return toks, feats.astype(np.float16), trained


def plan(examples, cfg: DFlashConfig) -> list[list[int]]:
    """Every step's example indices: ``cfg.epochs`` epochs of ``onpolicy.epoch_batches``."""
    return [idx for e in range(cfg.epochs)
            for idx in onpolicy.epoch_batches(examples, cfg.batch_tokens, cfg.seed, e)]


def train(lm, examples: Sequence[tuple], cfg: DFlashConfig, run_dir: str | Path, *,
          meta: dict | None = None, stop_after: int | None = None, progress=None,
          log=None) -> tuple[dict, dflash.DFlashSpec]:
    """Trains (or resumes) the drafter in ``run_dir``; returns the final state and its
    spec. ``stop_after``: stop after that many steps of this call (the last checkpoint is
    always written before returning)."""
    if not examples:
        raise ValueError("DFlash training: no examples (the stores hold no sequences)")
    spec = cfg.spec(lm.model.config)
    steps = plan(examples, cfg)
    opt = optimizer(cfg, len(steps))
    params = dflash.init_params(spec, jax.random.key(cfg.seed), scale=cfg.init_scale)
    # the final norm starts as the target's (read through its final_norm of a unit-RMS
    # vector), so the first logits are on the target's scale rather than far sharper
    d = spec.layer.width
    params["norm"] = jnp.asarray(lm.model.final_norm(lm.params, jnp.ones((d,), jnp.float32)),
                                 jnp.float32)
    fresh = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0, jnp.int32)}
    fields = {k: (list(v) if isinstance(v, tuple) else v)
              for k, v in dataclasses.asdict(cfg).items()}
    state, mngr = loop.resume(run_dir, {"kind": "dflash", **(meta or {}), **fields,
                                        "target_layers": list(spec.target_layers)}, fresh)
    step_fn = make_step(lm.model, spec, cfg, opt)
    step = lambda st, s: step_fn(st, lm.params, *batch_arrays(examples, steps[s]))  # noqa: E731
    state = loop.run_steps(state, step, mngr, steps=len(steps), save_every=cfg.save_every,
                           stop_after=stop_after, progress=progress, log=log)
    return state, spec


__all__ = ["DFlashConfig", "anchor_positions", "batch_arrays", "block_batch", "loss_fn",
           "make_step", "optimizer", "plan", "store_examples", "train"]
