"""``specjax bench``: methods side by side on the same prompts, with ratios against our
``ar`` and transformers, written as JSON (an interrupted run resumes from its ``--out``)."""

from __future__ import annotations

import os
from pathlib import Path

from specjax.commands import common
from specjax.commands.common import UsageError


def _settings(args, names) -> dict:
    """What makes two bench runs comparable, question by question (a resume must match)."""
    return {"model": args.model, "dtype": args.dtype, "compute_dtype": args.compute_dtype,
            "methods": names,
            **({"mesh": args.mesh} if args.mesh else {}),
            **({"verify_widths": args.verify_widths} if args.verify_widths != "auto" else {}),
            **({"scan_layers": True} if args.scan_layers else {}),
            "temperature": max(args.temperature, 0.0), "top_k": args.top_k, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
            "draft_checkpoint": args.draft_checkpoint, "calibration": args.calibration,
            **({"redrafter_checkpoint": args.redrafter_checkpoint}
               if args.redrafter_checkpoint else {}),
            "exit_heads": args.exit_heads,
            "questions": (f"random:{args.random_prompts}x{args.prompt_len}"
                          if args.random_prompts else
                          args.questions or "specjax/data/prompts.jsonl")}


def _specs(names: list[str]) -> dict:
    """Each method name's spec; unknown names are listed in one error."""
    from specjax import methods

    specs, bad = {}, []
    for name in names:
        try:
            specs[name] = methods.parse(name)
        except methods.SpecError as e:
            if not str(e).startswith("unknown method"):
                raise UsageError(str(e)) from None
            bad.append(name)
    if bad:
        raise UsageError(f"unknown methods {bad}; available: {', '.join(methods.FORMS)}")
    return specs


def _fits_random(args, specs: list):
    """With ``--random-prompts``: a ``load(check=...)`` hook that each prompt, its budget
    and the methods' draft slots fit the model's context (None without)."""
    if not args.random_prompts:
        return None
    slots = common.scratch(specs, args)

    def check(tokenizer, cfg):
        source = getattr(cfg, "max_source_positions", None)  # an encoder-decoder model
        if source is not None and args.prompt_len > source:
            raise UsageError(f"--prompt-len {args.prompt_len} exceeds the encoder's {source} "
                             "positions")
        need = (1 if source is not None else args.prompt_len) + args.max_new_tokens + slots
        if need > cfg.max_position_embeddings:
            what = ("the decoder start token" if source is not None else
                    f"--prompt-len {args.prompt_len}")
            draft = f" + {slots} draft slots" if slots else ""
            raise UsageError(f"{what} + --max-new-tokens {args.max_new_tokens}{draft} exceeds "
                             f"{args.model}'s context of {cfg.max_position_embeddings} "
                             "positions")
    return check


def _runners(args, lm, specs: dict, threads: int, hierarchies: dict) -> dict:
    """A bench ``Method`` per name: a peer's (``bench.peer_method``), else the built
    decoder (``ar``: ``bench.ar_method``); ``hierarchies`` gets each hsd method's hierarchy."""
    from specjax import bench, methods

    peers = [s for s in specs.values() if not s.decodes]
    hf = bench.load_hf(lm) if peers else None
    sampler = common.sampler(args)
    out = {}
    for name, spec in specs.items():
        if not spec.decodes:
            out[name] = bench.peer_method(spec, lm, threads, hf, max(args.temperature, 0.0),
                                          getattr(args, "draft_checkpoint", None))
            continue
        if spec == methods.AR():  # the reference every other method is compared with
            out[name] = bench.ar_method(lm, sampler)
            continue
        built = common.build(spec, lm, args)
        if spec.kind == "hsd":  # the report names the hierarchy a bare hsd was tuned to
            hierarchies[name] = built.spec.hierarchy.format()
        out[name] = bench.decoder_method(lm, built, sampler)
    return out


def cmd_bench(args) -> int:
    from specjax import bench, methods

    names = methods.split(args.methods)
    specs = _specs(names)
    peers = sorted(s.format() for s in specs.values() if not s.decodes)
    if peers:  # checked before the model loads
        from specjax._optional import require

        require("torch", f"benchmarking {', '.join(peers)} (transformers)")
    greedy = args.temperature <= 0
    greedy_only = [s.name for s in specs.values() if s.kind == "peer" and s.name != "hf"]
    if not greedy and greedy_only:
        raise UsageError(f"{greedy_only[0]} is greedy only; drop it when --temperature > 0")
    if args.random_prompts and args.questions:
        raise UsageError("give --questions or --random-prompts, not both")
    common.writable(args.out, "--out")
    for spec in specs.values():  # head directories and calibration, before the model loads
        if spec.decodes or spec.kind == "peer" and spec.name == "hf-mtp":
            common.check_method(spec, args)
    common.readable(args.questions, "--questions")
    questions = (None if args.random_prompts else  # checked before the model loads
                 bench.load_questions(args.questions, args.categories, args.limit))
    m = common.mesh(args)
    settings = _settings(args, names)
    done = bench.restore_runs(args.out, settings)  # an interrupted bench resumes here
    # each method against the model's config, and random prompts' length, before any
    # weight is read
    lm = common.load(args, m, tokenizer=not args.random_prompts,
                     check=common.config_check(args, list(specs.values()),
                                               _fits_random(args, list(specs.values()))))
    if args.random_prompts:
        questions = bench.random_questions(args.random_prompts, args.prompt_len,
                                           lm.model.config.vocab_size)
    elif lm.tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer files: bench it on token ids with "
                         "--random-prompts N [--prompt-len L]")
    threads = args.threads or os.cpu_count() or 1
    hierarchies = {}  # hsd method -> the hierarchy it runs, as a spec
    run = _runners(args, lm, specs, threads, hierarchies)
    report = {"model": args.model, "dtype": args.dtype, "compute_dtype": args.compute_dtype,
              "batch": 1, "greedy": greedy, "temperature": max(args.temperature, 0.0),
              "max_new_tokens": args.max_new_tokens, "threads": threads,
              "questions": settings["questions"], "n_questions": len(questions),
              "machine": bench.machine_info(), "draft_len": args.draft_len,
              "settings": settings, "complete": False}
    results, mismatches = _decode_all(args, lm, names, questions, run, done, report, greedy)
    summary = bench.summarize(results)
    classified = _classify(lm, results, run, greedy)
    for name, rep in classified.items():
        summary[name]["greedy_vs_ar"] = rep
    print(bench.format_table(summary))
    report.update(methods=summary, greedy_mismatch_vs_ar=mismatches, complete=True)
    if hierarchies:
        from specjax.heads import shipped_head

        path = args.exit_heads or shipped_head("exit-heads", args.model)
        report["hsd"] = {"hierarchies": hierarchies, "calibration": args.calibration,
                         "exit_heads": Path(path).name if path else None}
    if "ar" in summary:
        report["bandwidth"] = _bandwidth(lm, summary["ar"]["tokens_per_s"])
    if mismatches:
        print(f"note: greedy outputs differ from ar: {mismatches}")
    if args.out:
        bench.write_json(args.out, {**report, "runs": bench.run_records(results)})
        print(f"wrote {args.out}")
    return _verdict(classified)


def _classify(lm, results, run, greedy: bool) -> dict:
    """Greedy: each specjax method's divergences from ``ar`` classified as near ties or
    real mismatches (``bench.classify_greedy``); empty when sampling or without ``ar``."""
    from specjax import bench

    if not greedy or "ar" not in results:
        return {}
    return bench.classify_greedy(
        lm, results, run, lambda q: list(q.ids) if q.ids is not None else
        lm.encode(q.text, chat=lm.has_chat_template))


def _verdict(classified: dict) -> int:
    """0, or 1 with one line on stderr naming the first real mismatch's method and place."""
    import sys

    from specjax import bench, divergence

    bad = bench.first_mismatch(classified)
    if bad is None:
        return 0
    name, rec = bad
    d = divergence.Divergence.from_dict(rec)
    n = sum(r["mismatch"] for r in classified.values())
    print(f"specjax: error: {name} left ar's greedy output on question {rec['prompt']} at "
          f"{d.line()}: a real mismatch, not a near tie ({n} in all)", file=sys.stderr)
    return 1


def _decode_all(args, lm, names, questions, run, done, report, greedy):
    """Every method on every question (resumed ones are kept); the report is rewritten
    after each question, which is what an interruption keeps."""
    from tqdm import tqdm

    from specjax import bench

    results, mismatches = {m: [] for m in names}, []
    resumed = sum(all(q.qid in done.get(m, {}) for m in names) for q in questions)
    if resumed:
        print(f"resuming {args.out}: {resumed} of {len(questions)} questions already done")
    bar = tqdm(total=len(questions) * len(names), desc="bench", unit="run")
    for q in questions:
        old = [done.get(m, {}).get(q.qid) for m in names]
        ids = list(q.ids) if q.ids is not None else (
            None if all(old) else lm.encode(q.text, chat=lm.has_chat_template))
        for m, r in zip(names, old):
            bar.set_postfix_str(f"{q.category} {m}")
            results[m].append((q, r if all(old) else run[m](ids, args.max_new_tokens)))
            bar.update()
        if "ar" in results and greedy:
            for m in names:  # every greedy method must reproduce ar
                if results[m][-1][1].tokens != results["ar"][-1][1].tokens:
                    mismatches.append({"question": q.qid, "method": m})
        if args.out:
            bench.write_json(args.out, {**report, "runs": bench.run_records(results)})
    bar.close()
    return results, mismatches


def _bandwidth(lm, ar_tokens_per_s: float) -> dict:
    """The device's memory bandwidth (measured on a GPU/TPU itself; host copies on the CPU),
    bytes of weights per token, and ``ar``'s share of that bound."""
    from specjax import bench

    b = bench.bandwidth_bound(lm.params, ar_tokens_per_s)
    print(f"\nbandwidth: {b['copy_GBps']:.1f} GB/s on {b['device']['device_kind']} "
          f"({b['method'].split(':')[0]}); weights {b['weight_bytes'] / 1e6:.0f} MB/token "
          f"-> bound {b['bound_tokens_per_s']:.1f} tok/s; ar reaches "
          f"{100 * b['ar_fraction_of_bound']:.0f}%")
    return b


def register(sub) -> list:
    """Adds this module's commands to ``sub``; returns their parsers."""
    from specjax import methods

    b = sub.add_parser("bench", help="tokens/s of methods side by side")
    common.add_model(b)
    common.add_mesh(b)
    b.add_argument("--methods", default="ar,hf",
                   help="comma-separated: " + "; ".join(c.usage for c in methods.registered()))
    b.add_argument("--draft-len", type=int, help="draft tokens per round for sd-* methods")
    common.add_verify_widths(b)
    common.add_heads(b)
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (outputs checked against ar); > 0 samples (seed 0)")
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--questions", help="Spec-Bench question.jsonl (default: built-in prompts)")
    b.add_argument("--categories", nargs="*", help="e.g. mt_bench translation summarization qa "
                                                   "math_reasoning rag")
    b.add_argument("--limit", type=int, help="questions in total, spread over categories")
    b.add_argument("--random-prompts", type=int, help="N prompts of seeded random token ids "
                   "instead of questions (random-weight models without a tokenizer: speed only)")
    b.add_argument("--prompt-len", type=int, default=128, help="tokens per random prompt")
    b.add_argument("--threads", type=int, help="torch threads for hf (default: all cores)")
    b.add_argument("--out", help="write the JSON report here")
    common.add_check_weights(b)
    common.add_hsd(b)
    b.set_defaults(fn=cmd_bench)
    return [b]
