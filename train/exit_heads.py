"""Training early-exit heads (``specjax.drafters.exit_heads``) by distillation, with Optax and Orbax.

For every exit layer ``l`` the adapter is trained so that the exit's next-token
distribution matches the final layer's: the loss is the mean over layers and token
positions of ``KL(p_final || p_l)``, both distributions restricted to (and renormalised on)
the corpus's ``kl_vocab`` most frequent tokens, since on a CPU the full 49K-row LM head
would be most of a step. The target is frozen: its residual streams at the exit layers and
its final feature are computed once per corpus (``layer_features``), so a step costs only
the adapters and the restricted LM head.

Batches are a function of the seed and the step, so a killed run resumes to the same
parameters as one that never stopped (``train.loop``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.drafters import eagle, exit_heads
from specjax.train import eagle as train_eagle
from specjax.train import checkpoint, glue, loop


@dataclasses.dataclass(frozen=True)
class ExitConfig:
    """Which exits, how big the adapters, and how to optimise them. Each field is a flag of
    ``train exit-heads`` (``glue.option``), checked here."""

    layers: tuple[int, ...] = glue.option((4, 8, 12, 16, 20, 24), "exit layers, "
                                          "comma-separated", parse=glue.int_list("--layers"))
    rank: int = glue.option(64, "adapter rank", low=1)
    steps: int = glue.steps(400)
    batch_tokens: int = glue.batch_tokens(1024)
    max_len: int = glue.max_len(512)
    lr: float = glue.lr(2e-3)
    warmup: int = glue.warmup(40)
    weight_decay: float = glue.weight_decay(0.0)
    clip: float = glue.clip(1.0)
    kl_vocab: int = glue.option(4096, "KL over the corpus's most frequent tokens (0: all)",
                                low=0)
    seed: int = glue.seed(0)
    save_every: int = glue.save_every(50)

    def __post_init__(self):
        glue.check_fields(self)


def layer_features(target, tparams, corpus: Sequence, cfg: ExitConfig, progress=None
                   ) -> list[np.ndarray]:
    """Per example, ``[n, len(layers) + 1, D]`` bfloat16: the residual stream after each exit
    layer and, last, the final feature (after the final norm). Sequences longer than
    ``max_len`` keep their last ``max_len`` tokens."""
    layers = tuple(cfg.layers)

    @jax.jit
    def run(tparams, toks):
        b, t = toks.shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        _, hid, _ = target.forward(tparams, toks, pos, target.init_cache(b, t),
                                   return_layers=layers, compute_logits=False)
        final = eagle.features(target, tparams, hid[target.config.num_layers])
        return jnp.stack([hid[l] for l in layers] + [final], axis=2).astype(jnp.bfloat16)

    toks = [np.asarray(t[-cfg.max_len:], np.int32) for t, _, _ in corpus]
    plan = train_eagle.batch_plan([(t, 0, None) for t in toks], cfg)
    out: list = [None] * len(toks)
    for idx in plan:
        width = train_eagle._bucket(max(len(toks[i]) for i in idx))
        batch = np.zeros((len(idx), width), np.int32)
        for r, i in enumerate(idx):
            batch[r, :len(toks[i])] = toks[i]
        feats = np.asarray(run(tparams, jnp.asarray(batch)))
        for r, i in enumerate(idx):
            out[i] = feats[r, :len(toks[i])]
        if progress is not None:
            progress.update(len(idx))
    return out


def batch_at(feats: Sequence[np.ndarray], plan, step: int, cfg: ExitConfig):
    """``(hidden [B, T, L+1, D] float32, mask [B, T])`` of ``step``."""
    idx = train_eagle.batch_indices(plan, step, cfg.seed)
    t = train_eagle._bucket(max(len(feats[i]) for i in idx))
    shape = feats[idx[0]].shape[1:]
    hid = np.zeros((len(idx), t, *shape), np.float32)
    mask = np.zeros((len(idx), t), np.float32)
    for r, i in enumerate(idx):
        hid[r, :len(feats[i])] = feats[i]
        mask[r, :len(feats[i])] = 1.0
    return hid, mask


def loss_fn(heads: dict, tparams, hid, mask, vocab_ids, *, target, cfg: ExitConfig):
    """Mean KL over layers and positions, and per-layer top-1 agreement with the target."""
    emb = eagle.output_embedding(target, tparams)
    emb = emb if vocab_ids is None else emb[vocab_ids]
    eps = target.config.rms_norm_eps
    # b batch, t position, d model width, v (restricted) vocabulary
    t_logp = jax.nn.log_softmax(target.unembed(tparams, hid[:, :, -1], emb), -1)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    metrics, total = {}, 0.0
    for k, l in enumerate(cfg.layers):
        z = exit_heads.adapt(heads[str(l)], hid[:, :, k], eps)
        z = target.final_norm(tparams, z)
        s_logp = jax.nn.log_softmax(target.unembed(tparams, z, emb), -1)
        kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), -1)
        total = total + jnp.sum(kl * mask) / n
        agree = jnp.argmax(s_logp, -1) == jnp.argmax(t_logp, -1)
        metrics[f"acc_{l}"] = jnp.sum(agree * mask) / n
    loss = total / len(cfg.layers)
    metrics["loss"] = loss
    metrics["acc"] = sum(metrics[f"acc_{l}"] for l in cfg.layers) / len(cfg.layers)
    return loss, metrics


def make_step(target, cfg: ExitConfig, opt: optax.GradientTransformation, mesh=None):
    """The jitted training step; with ``mesh``, its new state keeps ``loop.state_specs``."""
    @jax.jit
    def step(state, tparams, hid, mask, vocab_ids):
        grads, metrics = jax.grad(loss_fn, has_aux=True)(
            state["params"], tparams, hid, mask, vocab_ids, target=target, cfg=cfg)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return loop.constrain_state(mesh, {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state, "step": state["step"] + 1}), metrics

    return step


def vocab_ids(corpus, vocab_size: int, cfg: ExitConfig):
    """The restricted vocabulary of the KL (None: all of it)."""
    if not cfg.kl_vocab or cfg.kl_vocab >= vocab_size:
        return None
    return jnp.asarray(train_eagle.vocab_by_frequency(corpus, vocab_size, cfg.kl_vocab))


def train(target, tparams, corpus: Sequence, cfg: ExitConfig, run_dir: str | Path, *,
          feats: Sequence[np.ndarray] | None = None, meta: dict | None = None,
          stop_after: int | None = None, progress=None, log=None, mesh=None) -> dict:
    """Trains (or resumes) the adapters of ``cfg.layers`` in ``run_dir``; returns the state.
    ``feats`` are ``layer_features(...)`` of ``corpus``, or a function returning them, called
    only when steps remain (computed here when omitted, on each process's own device).
    With ``mesh``, data-parallel over its ``data`` axis (``loop.on_mesh``), also across
    processes (every process calls ``train`` with the same arguments)."""
    opt = train_eagle.optimizer(cfg)
    params = exit_heads.init_heads(target.config, cfg.layers, jax.random.key(cfg.seed),
                                   cfg.rank)
    fresh = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0, jnp.int32)}
    state, mngr = loop.resume(run_dir, {"kind": "exit-heads", **(meta or {}),
                                        **dataclasses.asdict(cfg)}, fresh, mesh)
    if int(state["step"]) >= cfg.steps:  # already trained: no features to compute
        checkpoint.finish(mngr)
        return state
    feats = feats() if callable(feats) else feats
    feats = layer_features(target, tparams, corpus, cfg) if feats is None else feats
    plan = train_eagle.batch_plan([(f, 0, None) for f in feats], cfg)
    ids = vocab_ids(corpus, target.config.vocab_size, cfg)
    ids = None if ids is None else loop.replicated(mesh, np.asarray(ids))
    step_fn = make_step(target, cfg, opt, mesh)
    tparams, state = loop.on_mesh(mesh, target, tparams, state)
    step = lambda st, s: step_fn(st, tparams, *loop.batch_on(mesh, batch_at(feats, plan, s, cfg)),
                                 ids)
    return loop.run_steps(state, step, mngr, steps=cfg.steps, save_every=cfg.save_every,
                          stop_after=stop_after, progress=progress, log=log)
