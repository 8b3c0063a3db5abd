"""``specjax distill`` and ``specjax features`` (training corpora) and ``specjax train``
(EAGLE, ReDrafter and exit heads, with Optax; checkpointed with Orbax and resumed).

A trainer's settings are the fields of its config dataclass (``specjax.train.glue.option``):
its flags are made from them (``common.config_flags``) and its config, which checks itself,
from the flags (``_config``); the flags here are those of the command alone (paths, ``--init``,
``--export``)."""

from __future__ import annotations

import json
from pathlib import Path

from specjax.commands import common
from specjax.commands.common import UsageError

def _config(cls, args, **given):
    """The config ``cls`` of the command's flags (``glue.from_args``); a value it refuses
    (its ``__post_init__``, in the flag's words) is a ``UsageError``, before any work."""
    from specjax.train import glue

    try:
        return glue.from_args(cls, args, **given)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _at_least(args, **lows) -> None:
    """``UsageError`` naming the first of the command's own flags (not a config's) below
    its smallest value."""
    for name, low in lows.items():
        v = getattr(args, name, None)
        if v is not None and v < low:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")


def _check_export(path: str | None, init: str | None = None) -> None:
    """``--export`` can be written, and holds nothing ``export_head`` would refuse to
    replace (only an exported head, or nothing), and is not the head ``--init`` starts
    from (the same directory resolved): refused before any work, not after training."""
    common.writable(path, "--export", directory=True)
    if path is not None and init is not None and Path(init).resolve() == Path(path).resolve():
        raise UsageError(f"--export {path} is the head --init {init} starts from; export to "
                         "another directory (the starting head would be overwritten)")
    if path is None or not Path(path).is_dir():
        return
    from specjax.heads import exported

    if not exported.replaceable(path):
        raise UsageError(f"--export {path} is a non-empty directory that is not an exported "
                         "head; give a new or empty directory")


def _check_outputs(args) -> None:
    """The run directory and the export directory can be written, and the run's
    ``run.json`` is readable, before any work."""
    common.writable(args.run, "--run", directory=True)
    _check_run_record(args.run)
    _check_export(args.export, getattr(args, "init", None))


def _check_run_record(run: str | None) -> None:
    """``run/run.json``, where there is one, is a readable record, and the run has a
    whole checkpoint step or none (``CheckpointError``)."""
    if run:
        from specjax.train import checkpoint

        checkpoint.read_run(run)
        checkpoint.check_steps(run)


def _input_dir(path: str, flag: str) -> Path:
    """``path`` as an existing directory; ``UsageError`` naming ``flag`` otherwise."""
    common.readable(path, flag, directory=True)
    return Path(path)


def _sources(args, check) -> tuple[str, ...] | None:
    """``--sources`` as a tuple (None when not given), checked by ``check`` (a module's
    ``check_sources``: ``UsageError`` naming the unknown ones); ``--prompts`` required
    unless the sources are ``sharegpt`` alone (it reads no prompt files)."""
    sources = None if args.sources is None else tuple(args.sources.split(","))
    try:
        check(sources)
    except ValueError as e:
        raise UsageError(f"--sources: {e}") from None
    if args.prompts is None and set(sources or ("text",)) != {"sharegpt"}:
        raise UsageError("--prompts DIR is required (the training prompt files) unless "
                         "--sources is sharegpt alone")
    return sources


def is_conversations(path: str | None) -> bool:
    """Whether ``--data`` names conversations (``specjax.train.conversations``: a JSON-lines
    or parquet file, a folder of parquet files or a saved ``datasets`` folder) rather than a
    corpus of shards."""
    if path is None:
        return False
    p = Path(path)
    if p.is_dir():
        return not any(p.glob("shard_*.npz")) and (
            any(p.glob("*.parquet")) or (p / "dataset_info.json").exists()
            or (p / "dataset_dict.json").exists())
    return p.suffix in (".jsonl", ".ndjson", ".parquet", ".json")


def _scan_conversations(args):
    """``--data``'s conversations checked whole (``conversations.scan``: a bad record is one
    line naming its file and line or row) before any weights load; prints their counts."""
    from specjax.train import conversations

    if getattr(args, "prompts", None) or getattr(args, "sources", None):
        raise UsageError("--data (conversations) replaces --prompts and --sources: give one")
    index = conversations.scan(args.data)
    c = index.counts
    print(f"{args.data}: {c['conversations']} conversations, {c['turns']} turns "
          f"({c['user']} user, {c['assistant']} assistant, {c['system']} system)", flush=True)
    return index


def _cmd_conversation_corpus(args, regenerate: bool) -> int:
    """``features --data`` and ``distill --data``: a corpus of the conversations' features,
    their answers kept (``features``) or the target's (``distill``, ``--answers target``)."""
    from tqdm import tqdm

    from specjax.train import chat_corpus

    common.writable(args.out, "--out", directory=True)
    index = _scan_conversations(args)
    exclude = _spec_bench_texts(args.exclude)
    lm = _load(args)
    with tqdm(total=args.tokens, desc="features", unit="tok", unit_scale=True) as bar:
        summary = chat_corpus.build(lm, index, args.out, max_tokens=args.tokens,
                                    max_len=args.max_len, loss=args.loss, seed=args.seed,
                                    regenerate_answers=regenerate,
                                    max_new_tokens=args.max_new_tokens, batch=args.batch,
                                    exclude=exclude, progress=bar)
    print(json.dumps(summary, indent=2))
    return 0


def _check_prompts(path: str | None) -> None:
    """``--prompts`` names a directory holding training prompt files
    (``distill.read_prompts``); nothing to check without it (``--sources sharegpt``)."""
    from specjax.train import distill

    if path is None:
        return
    if not distill.prompt_files(_input_dir(path, "--prompts")):
        raise UsageError(f"--prompts {path} holds no prompt files: give the directory of "
                         "training prompt files (gsm8k_train.jsonl, self_instruct_*.jsonl, "
                         "t0/*.jsonl, or self_written.jsonl from `specjax self-prompts`)")


def _vocab_check(args, mesh=None):
    """``load(check=...)``: ``--draft-vocab`` fits the target's vocabulary and ``--mesh``
    can split the target (``sharding.check_model``), read from its configuration before any
    weight is."""
    def check(tokenizer, cfg):
        if args.draft_vocab > cfg.vocab_size:
            raise UsageError(f"--draft-vocab {args.draft_vocab} exceeds the {cfg.vocab_size} "
                             f"ids of {args.model}'s vocabulary")
        if mesh is not None:
            from specjax import sharding

            try:
                sharding.check_model(cfg, mesh)
            except ValueError as e:
                raise UsageError(f"--mesh {args.mesh}: {e}") from None
    return check


def _load(args, vocab: bool = False, mesh=None):
    """``--model`` (``vocab``: with ``_vocab_check``, which also checks ``mesh`` against its
    configuration), once every input is checked. Loaded unsharded: the trainers shard it."""
    from specjax.models import load

    return load(args.model, check=_vocab_check(args, mesh)) if vocab else load(args.model)


def _main() -> bool:
    """Whether this process writes the command's files and prints its results: process 0
    of a multi-process run (``specjax.distributed``), or the only process."""
    import jax

    return jax.process_index() == 0


def _on_host(state: dict) -> dict:
    """A trained ``state`` without its optimizer moments, as numpy on every process
    (``loop.host``: gathered where it spans processes; every process calls it), ready
    for an export that process 0 alone writes."""
    from specjax.train import loop

    return loop.host({k: v for k, v in state.items() if k != "opt_state"})


def RunLog(run_dir: str):
    """``run_dir/log.jsonl`` (``specjax.train.loop.RunLog``; the trainer rewinds it to the
    checkpoint a resumed run starts from). Imported here, not at module level, so the CLI
    pulls in training code only when it trains."""
    from specjax.train.loop import RunLog as Log

    return Log(run_dir)


def _spec_bench_texts(path: str | None) -> list[str]:
    """Every turn of the ``--exclude`` questions (none without it); a missing file is a
    ``UsageError``, a malformed line a ``ValueError`` naming it."""
    if not path:
        return []
    if not Path(path).is_file():
        raise UsageError(f"--exclude {path} is not a file (Spec-Bench question.jsonl)")
    from specjax.train import distill

    return [t for r in distill.read_jsonl(Path(path), ["turns"]) for t in r["turns"]]


def cmd_self_prompts(args) -> int:
    """``specjax self-prompts``: requests the target writes itself
    (``specjax.train.self_prompts``), as a prompt directory ``train onpolicy`` reads."""
    from tqdm import tqdm

    from specjax.train import self_prompts

    if args.n < 1:
        raise UsageError(f"--n {args.n}: it must be >= 1")
    common.writable(args.out, "--out", directory=True)
    exclude = _spec_bench_texts(args.exclude)
    lm = _load(args)
    with tqdm(total=args.n, desc="self-written prompts", unit="prompt") as bar:
        counts = self_prompts.write(lm, args.n, args.out, exclude=exclude, seed=args.seed,
                                    batch=args.batch, max_tokens=args.max_new_tokens,
                                    temperature=args.temperature, top_p=args.top_p,
                                    progress=bar)
    print(json.dumps({"file": str(Path(args.out, self_prompts.FILE)), **counts}))
    return 0


def _write_summary(out: str, summary: dict, info: dict) -> None:
    """A corpus's ``summary.json`` (what was built, with how its inputs were selected)."""
    summary.update(info)
    Path(out, "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


def cmd_distill(args) -> int:
    from tqdm import tqdm

    from specjax.train import distill

    if args.data:
        return _cmd_conversation_corpus(args, regenerate=True)
    if not args.prompts:
        raise UsageError("give --prompts DIR (training prompt files) or --data FILE "
                         "(conversations)")
    common.writable(args.out, "--out", directory=True)
    _check_prompts(args.prompts)
    exclude = _spec_bench_texts(args.exclude)
    prompts, info = distill.select_prompts(args.prompts, args.num_prompts, exclude, args.seed)
    if not prompts:
        raise UsageError(f"--prompts {args.prompts} holds no prompts")
    lm = _load(args)
    print(f"{len(prompts)} prompts ({info['dropped_overlapping_spec_bench']} dropped for "
          f"overlapping {args.exclude or 'nothing'})", flush=True)
    with tqdm(total=len(prompts), desc="distill", unit="prompt") as bar:
        summary = distill.distill(lm, prompts, args.out, max_new_tokens=args.max_new_tokens,
                                  batch=args.batch, progress=bar)
    _write_summary(args.out, summary, info)
    return 0


def cmd_features(args) -> int:
    from tqdm import tqdm

    from specjax.train import sharegpt, text_corpus

    if args.data:
        return _cmd_conversation_corpus(args, regenerate=args.answers == "target")
    common.writable(args.out, "--out", directory=True)
    sources = _sources(args, text_corpus.check_sources)
    _check_prompts(args.prompts)
    exclude = _spec_bench_texts(args.exclude)
    # sharegpt: prompts of at most about half the --max-len window
    pairs, info = text_corpus.reference_pairs(
        args.prompts, exclude, args.seed, sources,
        max_prompt_chars=sharegpt.CHARS_PER_TOKEN * args.max_len // 2)
    if not pairs:
        have = f"--prompts {args.prompts}" if args.prompts else f"--sources {args.sources}"
        raise UsageError(f"{have} holds no (prompt, answer) pairs")
    if sources is not None:
        info["sources"] = list(sources)
    lm = _load(args)
    sg = info.get("sharegpt")
    sg = "" if sg is None else (f", and {sg['dropped_conversations_overlapping_exclude']} "
                                f"ShareGPT conversations of {sg['conversations']}")
    print(f"{info['pairs']} (prompt, reference answer) pairs "
          f"({info['dropped_overlapping_exclude']} dropped for overlapping "
          f"{args.exclude or 'nothing'}{sg}); taking {args.tokens} tokens", flush=True)
    with tqdm(total=args.tokens, desc="features", unit="tok", unit_scale=True) as bar:
        summary = text_corpus.build(lm, pairs, args.out, max_tokens=args.tokens,
                                    max_len=args.max_len, progress=bar)
    _write_summary(args.out, summary, info)
    return 0


def cmd_train_exits(args) -> int:
    from tqdm import tqdm

    from specjax.train import distill, glue
    from specjax.train import exit_heads as train_exits

    cfg = _config(train_exits.ExitConfig, args)
    _check_outputs(args)
    corpus = distill.load_shards(_input_dir(args.data, "--data"))
    lm = _load(args)
    log = RunLog(args.run)
    print(f"{len(corpus)} examples, {sum(len(t) for t, _, _ in corpus)} tokens; {cfg}", flush=True)
    def feats():
        with tqdm(total=len(corpus), desc="target features", unit="example") as bar:
            return train_exits.layer_features(lm.model, lm.params, corpus, cfg, progress=bar)

    with tqdm(total=cfg.steps, desc="train exit heads", unit="step") as bar:
        state = train_exits.train(lm.model, lm.params, corpus, cfg, args.run, feats=feats,
                                  progress=bar, log=log, mesh=common.mesh(args, rows=None),
                                  meta={"model": args.model, "data": str(Path(args.data))})
    state = _on_host(state)
    if args.export and _main():
        out = glue.export_exit_heads(state, cfg, args.export, model=args.model, corpus=corpus,
                                     vocab_size=lm.model.config.vocab_size, data_dir=args.data)
        print(f"exported the exit heads (bfloat16) to {out}")
    return 0


def cmd_train(args) -> int:
    from tqdm import tqdm

    from specjax.train import distill, glue
    from specjax.train import eagle as train_eagle

    _resolve_attn_norm(args)
    cfg = _config(train_eagle.TrainConfig, args)
    _at_least(args, draft_vocab=0)
    _check_outputs(args)
    _check_export_format(args)
    _check_init_layout(args.init, args.attn_norm, "leave out --init")
    if is_conversations(args.data):
        return _train_eagle_online(args, cfg)
    corpus = distill.load_shards(_input_dir(args.data, "--data"))
    mesh = common.mesh(args, rows=None)
    lm = _load(args, vocab=True, mesh=mesh)
    log = RunLog(args.run)
    n_tok = sum(len(e[0]) if cfg.all_positions else int(distill.loss_mask(e).sum())
                for e in corpus)
    print(f"{len(corpus)} examples, {n_tok} trained tokens; {cfg}", flush=True)
    init = glue.eagle_init(args.init, lm.model.config) if args.init else None
    with tqdm(total=cfg.steps, desc="train eagle", unit="step") as bar:
        state = train_eagle.train(lm.model, lm.params, corpus, cfg, args.run, progress=bar, log=log,
                                  mesh=mesh,
                                  meta={"model": args.model, "data": Path(args.data).name,
                                        "init": args.init and Path(args.init).name},
                                  init=init)
    state = _on_host(state)
    if args.export and _main():
        out = glue.export_eagle(state, cfg, args.export, model=args.model, corpus=corpus,
                                vocab_size=lm.model.config.vocab_size,
                                draft_vocab=args.draft_vocab, data_dir=args.data,
                                order=glue.eagle_order(args.init) if args.init else None)
        print(f"exported the head (bfloat16) to {out}")
        _export_published(args, out, lm.model.config)
    return 0


def _train_eagle_online(args, cfg) -> int:
    """``train eagle --data CONVERSATIONS``: the head trained on the conversations
    (``specjax.train.online``), the stream's position checkpointed with it."""
    from tqdm import tqdm

    from specjax.train import glue, online

    if args.val_examples:
        raise UsageError("--val-examples needs a corpus: training on conversations holds "
                         "none out (build one with `specjax features --data`)")
    index = _scan_conversations(args)
    mesh = common.mesh(args, rows=None)
    lm = _load(args, vocab=True, mesh=mesh)
    eos = lm.eos_ids[0] if lm.eos_ids else None
    init = glue.eagle_init(args.init, lm.model.config) if args.init else None
    counts: dict = {}
    with tqdm(total=cfg.steps, desc="train eagle (conversations)", unit="step") as bar:
        state = online.train(lm.model, lm.params, lm.tokenizer, index, cfg, args.run,
                             loss=args.loss, eos=eos, progress=bar, log=RunLog(args.run),
                             mesh=mesh, counts=counts, init=init,
                             meta={"model": args.model, "data": Path(args.data).name,
                                   "init": args.init and Path(args.init).name})
    print(json.dumps({"stream": counts}), flush=True)
    state = _on_host({k: v for k, v in state.items() if k != "reader"})
    if args.export and _main():
        sample = online.vocab_sample(index, lm.tokenizer, cfg, args.loss, eos, cfg.seed)
        out = glue.export_eagle(state, cfg, args.export, model=args.model, corpus=sample,
                                vocab_size=lm.model.config.vocab_size,
                                draft_vocab=args.draft_vocab, data_dir=None,
                                order=glue.eagle_order(args.init) if args.init else None)
        print(f"exported the head (bfloat16) to {out}")
        _export_published(args, out, lm.model.config)
    return 0


def cmd_train_redrafter(args) -> int:
    from tqdm import tqdm

    from specjax.train import distill, glue, shards
    from specjax.train import redrafter as train_rd

    cfg = _config(train_rd.TrainConfig, args)
    _check_outputs(args)
    if args.shards:  # every shard present and unaltered before the target loads
        shards.check_store(_input_dir(args.shards, "--shards"), required=True)
    corpus = None if args.shards else distill.load_shards(_input_dir(args.data, "--data"))
    mesh = common.mesh(args, rows=None)
    lm = _load(args, vocab=True, mesh=mesh)
    if args.shards:  # self-distilled token shards: features from one prefill of each batch
        from specjax.train import onpolicy

        with tqdm(desc="target features", unit="shard") as bar:
            corpus = onpolicy.store_corpus(lm, args.shards, progress=bar)
    d = corpus[0][2].shape[-1]
    if d != lm.model.config.hidden_size:
        raise ValueError(f"{args.data or args.shards} holds features of width {d}, but "
                         f"{args.model} has hidden size {lm.model.config.hidden_size}: it was "
                         "built for another model")
    print(f"{len(corpus)} examples, {sum(len(t) for t, _, _ in corpus)} tokens; {cfg}",
          flush=True)
    # --init: fine-tune an exported head, its parameters and its draft vocabulary
    init = glue.redrafter_init(args.init) if args.init else None
    with tqdm(total=cfg.steps, desc="train redrafter", unit="step") as bar:
        state, ids = train_rd.train(lm.model, lm.params, corpus, cfg, args.run, progress=bar,
                                    log=RunLog(args.run), init=init, mesh=mesh,
                                    meta={"model": args.model,
                                          "data": Path(args.data or args.shards).name,
                                          "init": args.init and Path(args.init).name})
    state = _on_host(state)
    if args.export and _main():
        out = glue.export_redrafter(state, cfg, ids, args.export, model=args.model,
                                    data_dir=args.data, shards=args.shards, init=args.init)
        print(f"exported the head (bfloat16) to {out}")
    return 0


def _onpolicy_start(args, kind):
    """``--init`` as a ``glue.Start`` (``shipped``: the head that ships for the model;
    ``none``: a random head), read from head.json alone, before the target loads;
    ``UsageError`` for ``shipped`` where no head ships."""
    from specjax.heads import shipped_head
    from specjax.train import glue

    shipped = shipped_head("eagle", args.model)
    if args.init == "shipped" and shipped is None:
        raise UsageError(f"--init shipped: no EAGLE head ships for {args.model!r}; "
                         "give --init none or a head directory")
    return glue.onpolicy_start(args.init, shipped, kind)


def _onpolicy_vocab(args, cfg, order):
    """The run's draft vocabulary: ``vocab_ids.npy`` of a resumed run, else the first
    ``--draft-vocab`` ids of ``order``; ``UsageError`` when ``order`` cannot give them.
    Reads the run directory only, before the target loads."""
    import numpy as np

    vfile = Path(args.run, "vocab_ids.npy")
    if vfile.exists():
        return np.load(vfile)
    if order is None:
        raise UsageError("a random head needs a vocabulary order, and no EAGLE head ships for "
                         f"{args.model!r}: give --init with an exported head of this model")
    if len(order) < cfg.draft_vocab:
        raise UsageError(f"--draft-vocab {cfg.draft_vocab} exceeds the {len(order)} ids of the "
                         f"vocabulary order --init {args.init} gives")
    return np.asarray(order[:cfg.draft_vocab], np.int32)


def _onpolicy_inputs(args, kind):
    """``(config, prompt pool, glue.Start, draft vocabulary, mesh)``: every flag and input
    of ``train onpolicy`` checked, the store's shards to replay among them, before the
    target loads (``UsageError`` for a flag, ``ShardError`` for the store)."""
    from specjax.train import onpolicy

    cfg, pool, mesh = _onpolicy_settings(args)
    start = _onpolicy_start(args, kind)
    vocab_ids = _onpolicy_vocab(args, cfg, start.order)
    onpolicy.check_store(args.shards, args.run, cfg, _exclude_name(args), args.stop_after)
    return cfg, pool, start, vocab_ids, mesh


def _onpolicy_settings(args):
    """``(config, prompt pool, mesh)`` of ``train onpolicy`` (``--decode-only`` too): the
    config, the mesh, the directories to write and the prompts checked, and the pool long
    enough for every round (``UsageError``), before the target loads."""
    from specjax.train import onpolicy, ttt

    cfg = _config(onpolicy.OnPolicyConfig, args, loss=_config(ttt.LossConfig, args),
                  data_file=Path(args.data).name if args.data else None)
    _at_least(args, stop_after=1)
    mesh = common.mesh(args, rows=None)  # any batch: decode rounds and minibatches are padded
    common.writable(args.run, "--run", directory=True)
    _check_run_record(args.run)
    common.writable(args.shards, "--shards", directory=True)
    _check_export(args.export, None if args.init in ("shipped", "none") else args.init)
    if args.data:
        index, sources = _scan_conversations(args), None
    else:
        sources = _sources(args, onpolicy.check_sources)
        _check_prompts(args.prompts)
    if args.data:
        pool = onpolicy.conversation_pool(index, _spec_bench_texts(args.exclude), args.seed,
                                          cfg.max_prompt_tokens)
    else:
        pool = onpolicy.prompt_pool(args.prompts, _spec_bench_texts(args.exclude), args.seed,
                                    sources, cfg.max_prompt_tokens)
    need = cfg.val_prompts + cfg.rounds * cfg.batch
    if need > len(pool):
        have = f"--prompts {args.prompts}" if args.prompts else f"--sources {args.sources}"
        raise UsageError(f"--rounds {cfg.rounds} of --batch {cfg.batch} prompts and "
                         f"--val-prompts {cfg.val_prompts} need {need} prompts; "
                         f"{have} has {len(pool)}")
    return cfg, pool, mesh


def _open_store(args, lm, cfg):
    """The shard store ``--shards`` for the loaded target ``lm``, and the target's hash."""
    from specjax.train import onpolicy, shards

    thash = shards.target_hash(lm.model.config, lm.params)
    return shards.ShardStore(args.shards, onpolicy.store_header(
        lm, cfg, _exclude_name(args), thash), lm.model.config.vocab_size), thash


def _exclude_name(args) -> str:
    return Path(args.exclude).name if args.exclude else "none"


def cmd_train_onpolicy(args) -> int:
    """``specjax train onpolicy``: every input checked before the target loads; an error
    while training leaves the last finished round complete on disk (``onpolicy.train``)."""
    import numpy as np
    from tqdm import tqdm

    from specjax.train import glue, onpolicy, shards, ttt
    from specjax.train.feature_cache import FeatureCache

    _resolve_attn_norm(args)
    if args.decode_only:
        return _decode_only(args)
    if not args.run:
        raise UsageError("--run DIR is required (the run's checkpoints), unless --decode-only")
    kind = ttt.EAGLE3 if args.kind == "eagle3" else ttt.EAGLE2
    _check_export_format(args)
    _check_onpolicy_layout(args)
    _check_mix(args)
    cfg, pool, start, vocab_ids, mesh = _onpolicy_inputs(args, kind)
    if args.feature_cache:  # truncated files, found before the target loads
        target = (shards.read_manifest(args.shards) or {}).get("target")
        FeatureCache(args.feature_cache).check(
            target.get("hash") if isinstance(target, dict) else None)
    lm = _load(args, vocab=True, mesh=mesh)  # unsharded: the store's hash is the weights'
    store, thash = _open_store(args, lm, cfg)
    mix = []
    for d, n in map(_mix_arg, args.mix_shards or ()):
        s = shards.ShardStore.open(d, onpolicy.store_target(lm, thash),
                                   lm.model.config.vocab_size)
        mix.append((s, len(s) if n is None else n))
    head = glue.onpolicy_head(start, lm.model.config, kind)
    if cfg.fold_attn_norm:
        head = glue.folded_head(lm, head, store, kind.layers(lm.model.config))
    vfile = Path(args.run, "vocab_ids.npy")
    if not vfile.exists() and _main():  # the others hold the same ids (_onpolicy_vocab)
        vfile.parent.mkdir(parents=True, exist_ok=True)
        tmp = vfile.with_name("tmp_vocab_ids.npy")
        np.save(tmp, vocab_ids)
        tmp.replace(vfile)
    print(f"{len(pool)} prompts; the store holds {len(store)} rounds ({store.tokens()} tokens) "
          f"of target {thash}; {cfg}", flush=True)
    with tqdm(total=cfg.rounds + cfg.epochs, desc=f"on-policy {kind.name}",
              unit="round" if not cfg.epochs else "round|epoch") as bar:
        state = onpolicy.train(lm, kind, cfg, args.run, store, pool, vocab_ids, init=head,
                               progress=bar, log=RunLog(args.run),
                               stop_after=args.stop_after, mesh=mesh,
                               feature_cache=FeatureCache(args.feature_cache)
                               if args.feature_cache else None, mix=mix)
    state = _on_host(state)
    if args.export and _main():
        out = glue.export_onpolicy(state, kind, cfg, args.export, model=args.model,
                                   target_cfg=lm.model.config, start=start,
                                   shards=args.shards, vocab_ids=vocab_ids)
        print(f"exported the head (bfloat16) to {out}")
        _export_published(args, out, lm.model.config)
    return 0


def _mix_arg(text: str) -> tuple[str, int | None]:
    """``DIR`` or ``DIR:ROUNDS`` of ``--mix-shards``: the store, and how many of its first
    rounds (None: all)."""
    d, sep, n = text.rpartition(":")
    return (d, int(n)) if sep and n.isdigit() else (text, None)


def _check_mix(args) -> None:
    """``--mix-shards``: each a store holding the rounds asked, each matching its SHA-256,
    and epochs to mix them into; checked before the target loads."""
    from specjax.train import shards

    if args.mix_shards and not args.epochs:
        raise UsageError("--mix-shards joins the epochs: give --epochs")
    for d, n in map(_mix_arg, args.mix_shards or ()):
        if Path(d).resolve() == Path(args.shards).resolve():
            raise UsageError(f"--mix-shards {d} is the --shards store itself")
        m = shards.read_manifest(d)
        if m is None:
            raise UsageError(f"--mix-shards {d} holds no shard store (no manifest.json)")
        if n is not None and not 1 <= n <= len(m["shards"]):
            raise UsageError(f"--mix-shards {d}:{n}: the store holds {len(m['shards'])} "
                             "rounds")
        shards.check_store(d, range(len(m["shards"]) if n is None else n))


def _decode_only(args) -> int:
    """``train onpolicy --decode-only``: the store extended to ``--rounds`` rounds
    (``onpolicy.extend_store``), every input checked before the target loads."""
    from tqdm import tqdm

    from specjax.train import onpolicy, shards

    given = [f for f in ("export", "export_format", "epochs", "stop_after", "feature_cache",
                         "mix_shards") if getattr(args, f)]
    if given:
        raise UsageError(f"--decode-only trains nothing: drop --{given[0].replace('_', '-')}")
    cfg, pool, mesh = _onpolicy_settings(args)
    shards.check_store(args.shards, [], onpolicy.store_settings(cfg, _exclude_name(args)))
    lm = _load(args, vocab=True, mesh=mesh)
    store, thash = _open_store(args, lm, cfg)
    print(f"the store holds {len(store)} rounds ({store.tokens()} tokens) of target {thash}; "
          f"decoding up to {cfg.rounds}", flush=True)
    with tqdm(total=max(0, cfg.rounds - len(store)) + (not store.has("val")),
              desc="decoding rounds", unit="round") as bar:
        done = onpolicy.extend_store(lm, store, pool, cfg, progress=bar, mesh=mesh)
    print(f"decoded {len(done)} shards; the store holds {len(store)} rounds, "
          f"{store.tokens()} tokens, {store.answer_tokens()} of them answer tokens")
    return 0


def _export_published(args, out, target_cfg) -> None:
    """With ``--export-format``, the head just exported to ``out`` written again in
    SafeAILab/EAGLE's layout, to ``out-KIND`` (``glue.export_published``)."""
    if args.export_format:
        from specjax.train import glue

        print(f"and in SafeAILab/EAGLE's layout to {glue.export_published(out, target_cfg)}")


_LAYOUTS = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3"}


def _check_export_format(args) -> None:
    """``--export-format KIND`` goes with a head of that kind (``--kind``; ``train eagle``
    trains ``eagle`` heads) and ``--export DIR``; ``eagle`` also with ``--no-attn-norm``
    (EAGLE-1/2's layer 0 has no input norm) and, for ``train eagle``, ``--draft-vocab 0``
    (the layout drafts over the whole vocabulary). Its directory (``DIR-KIND``) is new,
    empty or an earlier conversion. Each refused in one line before any work."""
    from specjax.heads import published
    from specjax.train import glue

    fmt, kind = args.export_format, getattr(args, "kind", "eagle")
    if fmt is None:
        return
    if not args.export:
        raise UsageError(f"--export-format {fmt} needs --export DIR (the published copy goes "
                         f"to DIR-{fmt})")
    if kind != fmt:
        raise UsageError(f"--export-format {fmt} needs --kind {fmt}: the {_LAYOUTS[fmt]} "
                         f"layout cannot express a head of kind {kind!r}")
    if fmt == "eagle" and args.attn_norm:
        raise UsageError("--export-format eagle needs --no-attn-norm: EAGLE-1/2's layer 0 "
                         "has no input_layernorm, so only a head trained without attn_norm "
                         "has that layout")
    if fmt == "eagle" and args.head == "eagle" and args.draft_vocab:
        raise UsageError(f"--export-format eagle needs --draft-vocab 0, got "
                         f"{args.draft_vocab}: the EAGLE-1/2 layout drafts over the target's "
                         "whole vocabulary")
    try:
        published.check_out_dir(glue.published_dir(args.export, fmt))
    except FileExistsError as e:
        raise UsageError(f"--export-format: {e}") from None


def _resolve_attn_norm(args) -> None:
    """``args.attn_norm`` where ``--no-attn-norm`` is absent (None): the layout of the
    EAGLE-2 warm start (``--init``; ``shipped``: the model's shipped head), read from its
    ``head.json`` alone, or with the norm for a random head, an unreadable ``--init`` (the
    loader reports it) and an EAGLE-3 run. A warm start thus keeps its layout unless a flag
    says otherwise, and ``_check_init_layout`` refuses what cannot be done."""
    if args.attn_norm is not None:
        return
    from specjax.train import glue

    path = _init_path(args) if getattr(args, "kind", "eagle") == "eagle" else None
    has = None if path is None else glue.eagle_attn_norm(path)
    args.attn_norm = True if has is None else has


def _init_path(args):
    """The head directory ``--init`` names (``shipped``: the model's shipped EAGLE head),
    or None for a random head (``none``, or no ``--init``)."""
    from specjax.heads import shipped_head

    init = getattr(args, "init", None)
    if init in (None, "none"):
        return None
    return shipped_head("eagle", args.model) if init == "shipped" else init


def _check_init_layout(path, attn_norm: bool, random: str, what: str | None = None) -> None:
    """The EAGLE-1/2 head a run starts from (``path``; None: a random head) has the
    layer's ``attn_norm`` exactly when the run trains one (``--no-attn-norm`` absent):
    refused in one line naming it (``what``, default ``--init PATH``) and how to start
    from a random head instead (``random``), from ``head.json`` alone, before the target
    loads. A path that holds no readable ``eagle`` head is left
    to the loader to report."""
    from specjax.train import glue

    has = None if path is None else glue.eagle_attn_norm(path)
    if has is None or has == attn_norm:
        return
    what = what or f"--init {path}: its head"
    if has:
        raise UsageError(f"{what} normalizes its attention input (attn_norm), which "
                         "--no-attn-norm leaves out: start from a head trained with "
                         f"--no-attn-norm, or a random one ({random})")
    raise UsageError(f"{what} has no attn_norm (trained with --no-attn-norm): pass "
                     "--no-attn-norm to fine-tune it")


def _check_onpolicy_layout(args) -> None:
    """``--no-attn-norm`` goes with ``--kind eagle``, and the EAGLE-2 head ``--init``
    names (``shipped``: the model's shipped head, which has ``attn_norm``) agrees with it
    (``_check_init_layout``): refused in one line before any work."""
    if args.kind != "eagle":
        if not args.attn_norm:
            raise UsageError(f"--no-attn-norm needs --kind eagle: an {args.kind} head's layer "
                             "normalizes its inputs with embed_norm and hidden_norm")
        if args.head_layers != 1:
            raise UsageError(f"--head-layers needs --kind eagle: an {args.kind} head has one "
                             "layer (the published EAGLE-3 layouts' midlayer)")
        return
    if args.fold_attn_norm:
        _check_fold(args)
        return
    if args.init == "none":
        return
    if args.init == "shipped":
        from specjax.heads import shipped_head

        path = shipped_head("eagle", args.model)
        _check_init_layout(path, args.attn_norm, "--init none",
                           f"--init shipped: the shipped head ({path})")
        return
    _check_init_layout(args.init, args.attn_norm, "--init none")


def _check_fold(args) -> None:
    """``--fold-attn-norm``: with ``--no-attn-norm``, a warm start whose head has the norm,
    and a store holding its first round (the fold's scale is measured on it); refused in
    one line before the target loads."""
    from specjax.train import glue, shards

    if args.attn_norm:
        raise UsageError("--fold-attn-norm trains a head without the norm: add --no-attn-norm")
    path = _init_path(args)
    if path is None or glue.eagle_attn_norm(path) is not True:
        raise UsageError(f"--fold-attn-norm folds the norm of a warm start that has one; "
                         f"--init {args.init} gives none to fold")
    if not (shards.read_manifest(args.shards) or {}).get("shards"):
        raise UsageError(f"--fold-attn-norm measures its scale on the store's first round, "
                         f"and {args.shards} holds none yet: decode it first "
                         "(--decode-only --rounds 1)")


def _add_onpolicy(tsub):
    from specjax.train import onpolicy, ttt

    to = tsub.add_parser("onpolicy", help="an EAGLE-2 or EAGLE-3 head trained online on the "
                                          "target's own batched answers (self-distillation)")
    to.add_argument("--model", default="smollm2-135m")
    to.add_argument("--kind", choices=["eagle", "eagle3"], default="eagle")
    to.add_argument("--prompts", help="directory of training prompt files (required unless "
                                      "--sources sharegpt alone, or --data)")
    to.add_argument("--data", help="the prompts from conversations instead: every user turn "
                    "an answer follows, with the turns before it (JSON lines with ShareGPT "
                    "'conversations' or OpenAI 'messages', parquet, a datasets folder)")
    to.add_argument("--exclude", help="Spec-Bench question.jsonl: overlapping prompts are dropped")
    to.add_argument("--shards", required=True,
                    help="token shard store (manifest.json): replayed, then extended")
    to.add_argument("--run", help="run directory: checkpoints; resumes (required unless "
                                  "--decode-only)")
    to.add_argument("--decode-only", action="store_true",
                    help="decode the rounds the store lacks up to --rounds and train nothing "
                         "(no --run): a later run with the same settings replays them")
    to.add_argument("--feature-cache", metavar="DIR",
                    help="keep replayed rounds' features here (float32, 4 x F bytes a "
                         "token) and read them back in later runs and epochs instead of "
                         "prefilling again")
    to.add_argument("--mix-shards", metavar="DIR", action="append",
                    help="DIR or DIR:ROUNDS: another store of the same target (other prompt "
                         "sources or settings) whose rounds (all, or the first ROUNDS) join "
                         "the epochs, shuffled with this run's; repeatable; the run records "
                         "them")
    to.add_argument("--init", default="shipped",
                    help="shipped (the model's shipped head), none, or an exported head; "
                         "EAGLE-3 takes only its vocabulary order")
    to.add_argument("--stop-after", type=int,
                    help="stop after this many rounds (then epochs) of this call")
    to.add_argument("--export", help="write the trained head (bfloat16) here")
    to.add_argument("--export-format", choices=["eagle", "eagle3"],
                    help="also write the exported head in SafeAILab/EAGLE's published "
                         "layout, to EXPORT-eagle or EXPORT-eagle3 (the --kind of the same "
                         "name; eagle needs --no-attn-norm; `specjax convert-head`)")
    common.config_flags(to, onpolicy.OnPolicyConfig)
    common.config_flags(to, ttt.LossConfig)
    to.set_defaults(fn=cmd_train_onpolicy)
    return to


def _add_data(p, what: str) -> None:
    """``--data`` (a user's conversations) and ``--loss``."""
    p.add_argument("--data", help="conversations: JSON lines with ShareGPT 'conversations' "
                   "(from/value) or OpenAI 'messages' (role/content), parquet files or a "
                   "datasets folder (pip install 'specjax[data]'); " + what)
    p.add_argument("--loss", choices=["assistant", "all"], default="assistant",
                   help="with --data: the loss on the assistant's tokens (default) or on all")


# the CLI's own defaults of config fields, where they differ from the Python API's
EAGLE_DEFAULTS = {"save_every": 100}


def register(sub) -> list:
    """Adds this module's commands to ``sub``; returns their parsers."""
    ds = sub.add_parser("distill", help="self-distilled training data: the target answers "
                                         "training prompts; its features are kept")
    common.add_model(ds, max_new=192)
    ds.add_argument("--prompts", help="directory of training prompt files")
    _add_data(ds, "the target answers their user turns, turn by turn (instead of --prompts)")
    ds.add_argument("--tokens", type=int, default=2_000_000,
                    help="with --data: corpus size in tokens")
    ds.add_argument("--max-len", type=int, default=1024,
                    help="with --data: tokens per conversation (cut there)")
    ds.add_argument("--exclude", help="Spec-Bench question.jsonl: overlapping prompts are dropped")
    ds.add_argument("--num-prompts", type=int, default=2000)
    ds.add_argument("--batch", type=int, default=16)
    ds.add_argument("--seed", type=int, default=0)
    ds.add_argument("--out", required=True, help="corpus directory (resumes if it exists)")
    ds.set_defaults(fn=cmd_distill)

    sp = sub.add_parser("self-prompts", help="prompts the target writes itself (sampled from "
                                             "the opening of a user turn), for train onpolicy")
    common.add_model(sp, max_new=128)
    sp.add_argument("--n", type=int, default=2000, help="requests to keep")
    sp.add_argument("--exclude", help="Spec-Bench question.jsonl: overlapping requests are "
                                      "dropped")
    sp.add_argument("--batch", type=int, default=64)
    sp.add_argument("--temperature", type=float, default=1.0)
    sp.add_argument("--top-p", type=float, default=0.95)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--out", required=True,
                    help="directory: writes self_written.jsonl (--prompts of train onpolicy)")
    sp.set_defaults(fn=cmd_self_prompts)

    fe = sub.add_parser("features", help="a fixed training corpus: reference (prompt, answer) "
                                          "texts and the target's features, one prefill each")
    fe.add_argument("--model", default="smollm2-135m")
    fe.add_argument("--prompts", help="directory of training prompt files (required unless "
                                      "--sources sharegpt alone)")
    fe.add_argument("--sources", help="comma-separated sources, in turn (gsm8k, self_instruct, "
                                      "t0, sharegpt; default all but sharegpt). sharegpt: "
                                      "ShareGPT's conversations and answers, multi-turn "
                                      "prefixes as messages (pip install 'specjax[data]')")
    fe.add_argument("--exclude", help="Spec-Bench question.jsonl: overlapping prompts are "
                                      "dropped (sharegpt: whole conversations)")
    _add_data(fe, "their answers kept (--answers data) or the target's (--answers target); "
                  "instead of --prompts and --sources")
    fe.add_argument("--answers", choices=["data", "target"], default="data",
                    help="with --data: the conversations' own answers (off-policy), or the "
                         "target's, regenerated turn by turn (on-policy)")
    fe.add_argument("--max-new-tokens", type=int, default=512,
                    help="with --answers target: tokens per regenerated answer")
    fe.add_argument("--batch", type=int, default=32,
                    help="with --answers target: prompts decoded together")
    fe.add_argument("--tokens", type=int, default=2_000_000, help="corpus size in tokens")
    fe.add_argument("--max-len", type=int, default=512, help="tokens per text (left-truncated)")
    fe.add_argument("--seed", type=int, default=0)
    fe.add_argument("--out", required=True, help="corpus directory (resumes if it exists)")
    fe.set_defaults(fn=cmd_features)

    from specjax.train import eagle as train_eagle
    from specjax.train import exit_heads as train_exits
    from specjax.train import redrafter as train_rd

    t = sub.add_parser("train", help="train a draft head")
    tsub = t.add_subparsers(dest="head", required=True)
    te = tsub.add_parser("eagle", help="the EAGLE head, on a corpus from `specjax distill`")
    te.add_argument("--model", default="smollm2-135m")
    te.add_argument("--data", required=True,
                    help="a corpus from `specjax features`/`distill`, or conversations "
                         "(JSON lines with ShareGPT 'conversations' or OpenAI 'messages', "
                         "parquet, a datasets folder): trained on directly, the target's "
                         "features computed per step and the stream's place checkpointed")
    te.add_argument("--loss", choices=["assistant", "all"], default="assistant",
                    help="with conversations: the loss on the assistant's tokens or on all")
    te.add_argument("--run", required=True, help="run directory: checkpoints; resumes")
    common.config_flags(te, train_eagle.TrainConfig, defaults=EAGLE_DEFAULTS)
    te.add_argument("--init", help="start from this exported EAGLE head (fine-tuning); "
                                   "default: a random head")
    te.add_argument("--draft-vocab", type=int, default=0,
                    help="default draft vocabulary size of the exported head (0: full)")
    te.add_argument("--export", help="write the trained head (bfloat16) here")
    te.add_argument("--export-format", choices=["eagle"],
                    help="also write the exported head in SafeAILab/EAGLE's published "
                         "EAGLE-1/2 layout, to EXPORT-eagle (needs --no-attn-norm and "
                         "--draft-vocab 0; `specjax convert-head`)")
    te.set_defaults(fn=cmd_train)
    tr = tsub.add_parser("redrafter", help="the ReDrafter head, on a corpus from "
                                           "`specjax features` or `specjax distill`")
    tr.add_argument("--model", default="smollm2-135m")
    src = tr.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a corpus from `specjax features` or `specjax distill`")
    src.add_argument("--shards", help="a token shard store from `specjax train onpolicy` "
                                      "(the target's own answers; features by prefill)")
    tr.add_argument("--run", required=True, help="run directory: checkpoints; resumes")
    common.config_flags(tr, train_rd.TrainConfig)
    tr.add_argument("--export", help="write the trained head (bfloat16) here")
    tr.add_argument("--init", help="an exported ReDrafter head to fine-tune (keeps its draft "
                                   "vocabulary and blocks)")
    tr.set_defaults(fn=cmd_train_redrafter)
    tx = tsub.add_parser("exit-heads", help="early-exit adapters distilled from the final "
                                            "layer, on a corpus from `specjax distill`")
    tx.add_argument("--model", default="smollm2-135m")
    tx.add_argument("--data", required=True)
    tx.add_argument("--run", required=True, help="run directory: checkpoints; resumes")
    common.config_flags(tx, train_exits.ExitConfig)
    tx.add_argument("--export", help="write the trained heads (bfloat16) here")
    tx.set_defaults(fn=cmd_train_exits)
    to = _add_onpolicy(tsub)
    from specjax.commands import train_dflash

    train_dflash.add_parser(tsub)
    for t in (te, tr, tx, to):
        t.add_argument("--mesh", help="train on a device mesh, e.g. data=8 or data=2,model=4: "
                       "the target split over model as for decoding, batch rows over data "
                       "(gradients summed by XLA), the optimizer state sharded ZeRO-1 style; "
                       "the one-device result up to float rounding")
        common.add_distributed(t)
    return [ds, sp, fe, te, tr, tx, to]
