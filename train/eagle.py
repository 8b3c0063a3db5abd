"""Training the EAGLE head on a self-distilled corpus with Optax, checkpointed by Orbax.

Loss per answer position ``i`` (predicting token ``i + 1``), with ``f`` the target's
feature and ``f̂`` the head's prediction from the features before ``i`` (noised) and the
tokens up to ``i``::

    w_reg · SmoothL1(f̂_i, f_i)  +  w_ce · CE(softmax(f_i Eᵀ), log_softmax(f̂_i Eᵀ))

``E`` is the output embedding restricted to the corpus's ``ce_vocab`` most frequent tokens
(the target's distribution renormalised on them): on a CPU the full 49K-row LM head would
be most of the cost of a step. The feature regression is over the whole feature.

The batch order is a function of the seed and the step alone, so a run killed after a
checkpoint resumes to the same parameters as one that never stopped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.drafters import eagle
from specjax.train import distill, glue, loop


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation of one head. ``steps`` batches of about ``batch_tokens`` tokens each.
    Each field is a flag of ``train eagle`` (``glue.option``), checked here."""

    steps: int = glue.steps(2000)
    batch_tokens: int = glue.batch_tokens(4096)
    max_len: int = glue.max_len(512)
    lr: float = glue.lr(5e-4)
    warmup: int = glue.warmup(100)
    weight_decay: float = glue.weight_decay(0.01)
    clip: float = glue.clip(1.0)
    w_reg: float = glue.w_reg(1.0)
    w_ce: float = glue.w_ce(0.1)
    noise: float = glue.noise(0.1)
    ce_vocab: int = glue.option(8192, "cross-entropy over the corpus's most frequent tokens "
                                      "(0: all)", low=0)
    seed: int = glue.seed(0)
    save_every: int = glue.save_every(200)  # `train eagle`'s default: 100
    val_examples: int = glue.val_examples(0)  # a seeded choice
    all_positions: bool = glue.option(False, "train on every position, prompts included "
                                             "(for a text corpus from `specjax features`); "
                                             "default: answer positions only")
    # False: no attention-input norm in the layer (layer 0 of a published EAGLE-1/2 head),
    # so the head has SafeAILab/EAGLE's layout (``--export-format eagle``)
    attn_norm: bool = glue.attn_norm(" (default: as the --init head has it, with the norm "
                                     "without --init)")
    head_layers: int = glue.head_layers(1)  # ``eagle.init_head(layers=...)``

    def __post_init__(self):
        glue.check_fields(self)


def run_fields(cfg) -> dict:
    """``cfg`` (a config with an ``attn_norm`` field) as ``run.json`` records it: every
    field, ``attn_norm`` only when False, ``head_layers`` only above 1, ``sources`` only
    when given and ``answers_only`` and ``fold_attn_norm`` only when True, so a run
    directory written before these fields existed still resumes (a run of the other
    layout is refused: ``check_run_layout``, or ``run.json``'s comparison)."""
    d = dataclasses.asdict(cfg)
    if d.get("attn_norm", True):
        d.pop("attn_norm", None)
    if d.get("head_layers", 1) == 1:
        d.pop("head_layers", None)
    if "sources" in d and d["sources"] is None:  # every prompt source (on-policy runs)
        d.pop("sources")
    if not d.get("answers_only", True):  # on-policy runs' default: every position
        d.pop("answers_only")
    if not d.get("fold_attn_norm", True):
        d.pop("fold_attn_norm")
    return d


def check_run_layout(run_dir: str | Path, attn_norm: bool) -> None:
    """``CheckpointError`` (one line) when ``run_dir`` holds a run (``run.json``) of an
    EAGLE-1/2 head with the layer's ``attn_norm`` where ``attn_norm`` says without, or the
    reverse (absent from ``run.json``: with it): its checkpoints hold the other tree."""
    from specjax.heads import CheckpointError
    from specjax.train.checkpoint import read_run

    run = read_run(run_dir)  # a damaged run.json: CheckpointError naming it
    saved = attn_norm if run is None else run.get("attn_norm", True)
    if saved != attn_norm:
        raise CheckpointError(f"{run_dir} holds a run of a head {'with' if saved else 'without'}"
                              f" attn_norm; {'drop' if saved else 'pass'} --no-attn-norm "
                              "to resume it, or use another directory")


def check_layout(params: dict, attn_norm: bool, what: str = "the initial head") -> None:
    """``ValueError`` (one line) unless the EAGLE-1/2 head ``params`` has the layer's
    ``attn_norm`` exactly when ``attn_norm`` says: a warm start never silently drops or
    invents the attention-input norm."""
    has = "attn_norm" in params["layer"]
    if has != attn_norm:
        raise ValueError(f"{what} {'normalizes' if has else 'does not normalize'} its "
                         "attention input (attn_norm), but this run trains a head "
                         f"{'with' if attn_norm else 'without'} it")


def fc_rms(target, hp: dict, tparams, examples: Sequence) -> float:
    """The mean root-mean-square of the EAGLE-1/2 head ``hp``'s ``fc`` output (its layer's
    input) over every entry of EAGLE's head sequence (``eagle.head_inputs``) of
    ``examples`` (``(tokens, prompt_len, features)`` rows, features as the head reads
    them): the scale ``fold_attn_norm`` folds at."""
    total, count = 0.0, 0
    for toks, _, feats in examples:
        t, f = eagle.head_inputs(jnp.asarray(toks, jnp.int32)[None],
                                 jnp.asarray(feats, jnp.float32)[None])
        emb = hp["embed"][t] if "embed" in hp else target.embed(tparams, t)
        x = jnp.concatenate([emb.astype(jnp.float32), f], -1) @ hp["fc"] + hp["fc_b"]
        total += float(jnp.sum(jnp.sqrt(jnp.mean(jnp.square(x), -1))))
        count += int(t.shape[1])
    if count == 0:
        raise ValueError("fc_rms: the examples hold no head entry (every one is one token)")
    return total / count


def fold_attn_norm(hp: dict, scale: float) -> dict:
    """The EAGLE-1/2 head ``hp`` without its layer's attention-input norm, its weight
    ``g`` folded into the ``qkv`` columns at input RMS ``scale``
    (``qkv · diag(g) / scale``): the same attention input wherever the ``fc`` output's RMS
    is ``scale``, so the head keeps most of its drafts (``fc_rms`` gives the mean), and a
    run trains the rest away. ``ValueError`` for a head without the norm or ``scale <= 0``."""
    layer = hp["layer"]
    if "attn_norm" not in layer:
        raise ValueError("the head has no attention-input norm (attn_norm) to fold")
    if not scale > 0:
        raise ValueError(f"fold_attn_norm: scale {scale} must be > 0")
    g = jnp.asarray(layer["attn_norm"], jnp.float32)
    qkv = jnp.asarray(layer["qkv"], jnp.float32) * (g / scale)[None, :]
    rest = {k: v for k, v in layer.items() if k != "attn_norm"}
    return {**hp, "layer": {**rest, "qkv": qkv.astype(jnp.asarray(layer["qkv"]).dtype)}}


def grow_layers(init: dict, fresh: dict) -> dict:
    """The EAGLE-2 head ``init`` with the layers of ``fresh`` (a head of more layers) it
    lacks appended, which start as the identity (``eagle.init_head``), so ``init``'s
    function is kept; ``ValueError`` when ``init`` has more layers than ``fresh``."""
    have, want = eagle.num_layers(init), eagle.num_layers(fresh)
    if have > want:
        raise ValueError(f"the initial head has {have} layers, but this run trains a head of "
                         f"{want} (--head-layers {have} continues it)")
    if have == want:
        return init
    return {**init, "extra_layers": list(init.get("extra_layers", ()))
            + fresh["extra_layers"][have - 1:]}


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after global-norm clipping."""
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1),
                                               end_value=cfg.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(sched, weight_decay=cfg.weight_decay))


# ----------------------------------------------------------------------------- batches

def _bucket(n: int) -> int:
    return -(-n // 64) * 64


def batch_plan(corpus, cfg: TrainConfig) -> list[list[int]]:
    """Example indices per batch for one pass, grouped by padded length (deterministic)."""
    by_len: dict[int, list[int]] = {}
    for i, (tok, _, _) in enumerate(corpus):
        by_len.setdefault(_bucket(min(len(tok), cfg.max_len)), []).append(i)
    plan = []
    for t, idx in sorted(by_len.items()):
        b = max(1, cfg.batch_tokens // t)
        plan += [idx[j:j + b] for j in range(0, len(idx), b)]
    return plan


def batch_indices(plan, step: int, seed: int) -> list[int]:
    """The examples of ``step``: pass ``step // len(plan)`` visits the plan in a seeded order."""
    epoch, k = divmod(step, len(plan))
    return plan[np.random.default_rng((seed, epoch)).permutation(len(plan))[k]]


def batch_at(corpus, plan, step: int, cfg: TrainConfig):
    """The batch of ``step`` (see ``batch_indices``): tokens, features, the previous
    position's features and the loss mask."""
    idx = batch_indices(plan, step, cfg.seed)
    t = _bucket(min(max(len(corpus[i][0]) for i in idx), cfg.max_len))
    d = corpus[idx[0]][2].shape[-1]
    toks = np.zeros((len(idx), t), np.int32)
    feats = np.zeros((len(idx), t, d), np.float32)
    prev = np.zeros((len(idx), t, d), np.float32)  # hidden state of the previous position
    mask = np.zeros((len(idx), t), np.float32)
    for r, i in enumerate(idx):
        tok, pl, f = corpus[i]
        cut = max(0, len(tok) - cfg.max_len)  # keep the answer: drop the prompt's start
        n = len(tok) - cut
        toks[r, :n], feats[r, :n] = tok[cut:], np.asarray(f[cut:], np.float32)
        prev[r, 1:n] = feats[r, :n - 1]
        if cut:
            prev[r, 0] = np.asarray(f[cut - 1], np.float32)
        own = getattr(corpus[i], "loss_mask", None)  # a conversation's assistant turns
        if own is not None and not cfg.all_positions:
            mask[r, :n - 1] = own[cut + 1:cut + n]  # positions whose next token is trained
        else:
            lo = 0 if cfg.all_positions else max(pl - 1 - cut, 0)
            mask[r, lo:n - 1] = 1.0  # positions whose next token is an answer token
    return toks, feats, prev, mask


# ----------------------------------------------------------------------------- the step

def loss_fn(hp, tparams, toks, hidden, prev_hidden, mask, key, vocab_ids, *, target,
            cfg: TrainConfig):
    """Mean loss over masked positions, and metrics (top-1 agreement with the target).

    ``prev_hidden[:, i]`` is the target's hidden state at position ``i - 1`` (zero at a
    sequence's true start)."""
    # the head's sequence (``eagle.head_inputs``): entry t pairs token t + 1 with feature t
    # and predicts feature t + 1, so position 0 of the batch has no entry
    toks, hidden, prev_hidden, mask = toks[:, 1:], hidden[:, 1:], prev_hidden[:, 1:], mask[:, 1:]
    f = eagle.features(target, tparams, hidden)
    prev = eagle.features(target, tparams, prev_hidden)
    rms = jnp.sqrt(jnp.mean(prev * prev, axis=-1, keepdims=True))
    prev = prev + cfg.noise * rms * jax.random.uniform(key, prev.shape, minval=-1, maxval=1)
    out = eagle.training_forward(target, hp, tparams, toks, prev)
    emb = eagle.output_embedding(target, tparams)
    emb = emb if vocab_ids is None else emb[vocab_ids]
    # b batch, t position, d model, v vocabulary
    t_logits = target.unembed(tparams, f, emb)
    h_logits = target.unembed(tparams, out, emb)
    p = jax.nn.softmax(t_logits, -1)
    ce = -jnp.sum(p * jax.nn.log_softmax(h_logits, -1), -1)
    reg = jnp.mean(optax.huber_loss(out, f, delta=1.0), -1)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    loss = jnp.sum((cfg.w_reg * reg + cfg.w_ce * ce) * mask) / n
    acc = jnp.sum((jnp.argmax(h_logits, -1) == jnp.argmax(t_logits, -1)) * mask) / n
    return loss, {"loss": loss, "ce": jnp.sum(ce * mask) / n, "reg": jnp.sum(reg * mask) / n,
                  "acc": acc, "tokens": jnp.sum(mask)}


def split(corpus: Sequence, cfg: TrainConfig) -> tuple[list, list]:
    """``(train, val)``: ``cfg.val_examples`` examples held out by a seeded permutation."""
    n = len(corpus)
    if not 0 <= cfg.val_examples < n:
        raise ValueError(f"val_examples={cfg.val_examples} must lie in [0, {n}) for {n} examples")
    held = set(np.random.default_rng((cfg.seed, 1)).permutation(n)[:cfg.val_examples].tolist())
    return ([e for i, e in enumerate(corpus) if i not in held],
            [e for i, e in enumerate(corpus) if i in held])


def make_eval(target, cfg: TrainConfig):
    """Jitted ``(params, tparams, batch..., vocab_ids) -> (sums of loss and agreement, count)``
    without input noise."""
    quiet = dataclasses.replace(cfg, noise=0.0)

    @jax.jit
    def evaluate(params, tparams, toks, hidden, prev_hidden, mask, vocab_ids):
        _, m = loss_fn(params, tparams, toks, hidden, prev_hidden, mask, jax.random.key(0),
                       vocab_ids, target=target, cfg=quiet)
        n = jnp.maximum(jnp.sum(mask), 1.0)
        return m["loss"] * n, m["acc"] * n, jnp.sum(mask)

    return evaluate


def validate(evaluate, params, tparams, val: Sequence, cfg: TrainConfig, vocab_ids,
             mesh=None) -> dict:
    """Token-weighted loss and top-1 agreement over the held-out examples; with ``mesh``,
    each batch's rows over its ``data`` axis (``loop.batch_on``; every process calls it)."""
    plan = batch_plan(val, cfg)
    tot = np.zeros(3)
    for k in range(len(plan)):
        batch = loop.batch_on(mesh, batch_at(val, plan, k, cfg))
        tot += np.asarray([float(x) for x in loop.host(evaluate(params, tparams, *batch,
                                                                vocab_ids))])
    n = max(tot[2], 1.0)
    return {"val_loss": tot[0] / n, "val_acc": tot[1] / n, "val_tokens": int(tot[2])}


def make_step(target, cfg: TrainConfig, opt: optax.GradientTransformation, mesh=None):
    """The jitted training step; with ``mesh``, its new state keeps ``loop.state_specs``."""
    @jax.jit
    def step(state, tparams, toks, hidden, prev_hidden, mask, vocab_ids):
        key = jax.random.fold_in(jax.random.key(cfg.seed), state["step"])
        grads, metrics = jax.grad(loss_fn, has_aux=True)(
            state["params"], tparams, toks, hidden, prev_hidden, mask, key, vocab_ids,
            target=target, cfg=cfg)
        updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
        return loop.constrain_state(mesh, {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state, "step": state["step"] + 1}), metrics

    return step


def train(target, tparams, corpus: Sequence, cfg: TrainConfig, run_dir: str | Path, *,
          meta: dict | None = None, stop_after: int | None = None, progress=None,
          log=None, init: dict | None = None, mesh=None) -> dict:
    """Trains (or resumes) the head in ``run_dir`` up to ``cfg.steps``; returns the state.
    With ``mesh``, the target sharded over it, rows over its ``data`` axis and the
    optimizer state sharded (``loop.on_mesh``): the one-device result up to float rounding.
    A mesh spanning several processes (``specjax.distributed``) gives that result too: every
    process calls ``train`` with the same arguments, process 0 alone writes ``run.json``
    and ``log``, and all of them write the checkpoints together.

    ``init`` (head parameters) starts a new run from an existing head instead of a random
    one (fine-tuning); a resumed run ignores it. ``cfg.attn_norm`` says whether the head
    has the layer's attention-input norm; ``init`` must agree (``check_layout``). The head
    has ``cfg.head_layers`` layers; an ``init`` of fewer gains identity layers
    (``grow_layers``).

    ``stop_after`` stops after that many steps of this call (for tests of resume); the
    latest checkpoint is always written before returning.
    """
    opt = optimizer(cfg)
    params = eagle.init_head(target.config, jax.random.key(cfg.seed), attn_norm=cfg.attn_norm,
                             layers=cfg.head_layers)
    if init is not None:
        check_layout(init, cfg.attn_norm)
        init = grow_layers(init, params)
        params = jax.tree.map(lambda a, b: jnp.asarray(b, a.dtype), params, init)
    fresh = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0, jnp.int32)}
    check_run_layout(run_dir, cfg.attn_norm)
    state, mngr = loop.resume(run_dir, {"kind": "eagle", **(meta or {}), **run_fields(cfg)},
                              fresh, mesh)
    tparams, state = loop.on_mesh(mesh, target, tparams, state)
    step_fn = make_step(target, cfg, opt, mesh)
    corpus, val = split(corpus, cfg)
    evaluate = make_eval(target, cfg) if val else None
    plan = batch_plan(corpus, cfg)
    vocab_ids = None
    if cfg.ce_vocab:
        vocab_ids = loop.replicated(mesh, vocab_by_frequency(
            corpus, target.config.vocab_size, min(cfg.ce_vocab, target.config.vocab_size)))
    step = lambda st, s: step_fn(st, tparams, *loop.batch_on(mesh, batch_at(corpus, plan, s, cfg)),
                                 vocab_ids)
    on_save = None if evaluate is None else (
        lambda st: validate(evaluate, st["params"], tparams, val, cfg, vocab_ids, mesh))
    return loop.run_steps(state, step, mngr, steps=cfg.steps, save_every=cfg.save_every,
                          stop_after=stop_after, progress=progress, log=log, on_save=on_save)


def vocab_by_frequency(corpus, vocab_size: int, n: int) -> np.ndarray:
    """The ``n`` most frequent token ids of the corpus's answers (``distill.loss_mask``:
    the tokens the loss covers; ties: lower id first)."""
    counts = np.zeros(vocab_size, np.int64)
    for e in corpus:
        np.add.at(counts, e[0][distill.loss_mask(e).astype(bool)], 1)
    return np.argsort(-counts, kind="stable")[:n].astype(np.int32)
