"""``specjax train dflash``: a DFlash drafter trained on the target's own answers (shard
stores of ``specjax train onpolicy``), checkpointed by Orbax, exported in z-lab's hub layout.

Every training setting is a field of ``specjax.train.dflash.DFlashConfig``; the flags are
made from its fields (``common.config_flags``: ``--block-size`` for ``block_size``), so
the CLI and the Python API take the same options, checked by the same ``__post_init__``,
before the model loads."""

from __future__ import annotations

from pathlib import Path

from specjax.commands import common
from specjax.commands.common import UsageError


def add_parser(tsub):
    """The ``train dflash`` subcommand, its settings flags made from ``DFlashConfig``."""
    p = tsub.add_parser("dflash", help="a DFlash block drafter, on shard stores of the "
                                       "target's own answers (`specjax train onpolicy`)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--shards", action="append", required=True, metavar="DIR",
                   help="a token shard store (repeat for several); features by prefill")
    p.add_argument("--run", required=True, help="run directory: checkpoints; resumes")
    p.add_argument("--export", help="write the trained drafter here (z-lab's hub layout, "
                                    "bfloat16)")
    p.add_argument("--stop-after", type=int, help="stop after this many steps of this call")
    p.add_argument("--tokens", type=int, help="read whole shards until this many tokens "
                                              "(default: every shard)")
    from specjax.train.dflash import DFlashConfig

    common.config_flags(p, DFlashConfig)
    p.set_defaults(fn=cmd_train_dflash)
    return p


def _check(args):
    """The config and the stores, checked before the target loads (``UsageError``)."""
    from specjax.commands.train import _at_least, _check_outputs, _config
    from specjax.train import shards
    from specjax.train.dflash import DFlashConfig

    cfg = _config(DFlashConfig, args)
    _at_least(args, stop_after=1, tokens=1)
    for root in args.shards:
        if not Path(root).is_dir():
            raise UsageError(f"--shards {root}: no such directory")
        try:
            shards.check_store(root, required=True)
        except shards.ShardError as e:
            raise UsageError(str(e)) from None
    if args.export and Path(args.export).exists() and not Path(args.export).is_dir():
        raise UsageError(f"--export {args.export} exists and is not a directory")
    _check_outputs(args)  # --run writable, its record readable, a whole step or none
    return cfg


def cmd_train_dflash(args) -> int:
    cfg = _check(args)
    from tqdm import tqdm

    from specjax.heads import dflash as heads
    from specjax.models import load
    from specjax.train import dflash as train_df
    from specjax.train import loop

    lm = load(args.model)
    spec = cfg.spec(lm.model.config)
    bad = [l for l in spec.target_layers if l >= lm.model.config.num_layers]
    if bad:
        raise UsageError(f"--target-layers {list(spec.target_layers)}: {args.model} has "
                         f"{lm.model.config.num_layers} layers")
    layers = tuple(l + 1 for l in spec.target_layers)
    with tqdm(desc="target features", unit="shard") as bar:
        examples = train_df.store_examples(lm, args.shards, layers, progress=bar,
                                              max_tokens=args.tokens)
    n_tok = sum(len(t) for t, _, _ in examples)
    print(f"{len(examples)} sequences, {n_tok} tokens; {cfg}", flush=True)
    total = len(train_df.plan(examples, cfg))
    with tqdm(total=total, desc="train dflash", unit="step") as bar:
        state, spec = train_df.train(
            lm, examples, cfg, args.run, progress=bar, log=loop.RunLog(args.run),
            stop_after=args.stop_after,
            meta={"model": args.model, "shards": [Path(s).name for s in args.shards],
                  "tokens": n_tok})
    if args.export:
        params = loop.host(state["params"])
        out = heads.save(spec, params, args.export, lm.model.config)
        print(f"exported the drafter (bfloat16, z-lab's hub layout) to {out}")
    return 0
