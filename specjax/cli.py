"""The ``specjax`` command: demo, generate, bench, distill, train, calibrate and tune."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path



class UsageError(Exception):
    """A mistake in the command's arguments: reported in one line, exit code 2."""


def _check_args(args) -> None:
    """Checks that need no model: sampling values, budgets, the prompt, input files."""
    if getattr(args, "temperature", 0.0) < 0:
        raise UsageError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if getattr(args, "top_k", 0) < 0:
        raise UsageError(f"--top-k must be >= 0 (0: no limit), got {args.top_k}")
    if not 0 < getattr(args, "top_p", 1.0) <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (1: no limit), got {args.top_p}")
    for name in ("max_new_tokens", "limit", "draft_len", "steps", "batch_tokens", "max_len",
                 "tokens", "num_prompts", "batch", "save_every", "threads", "t_max",
                 "max_levels", "rank", "random_prompts", "prompt_len"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if getattr(args, "prompt", None) is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty")


def _dtypes(args) -> dict:
    """``load``'s storage and compute dtypes from ``--dtype`` and ``--compute-dtype``."""
    import jax.numpy as jnp

    names = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    scan = {"scan_layers": True} if getattr(args, "scan_layers", False) else {}
    return {"dtype": names[args.dtype], "compute_dtype": names[args.compute_dtype], **scan}


def _sampler(args):
    import specjax

    if args.temperature <= 0:
        return specjax.Greedy()
    return specjax.Sample(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _decoder(lm, args):
    """``(fn(ids, **kw) -> output, drafter name or None)`` for ``--method``."""
    import specjax
    from specjax import drafters

    if args.method == "ar":
        return (lambda ids, **kw: specjax.generate(lm.model, lm.params, [ids], mesh=lm.mesh,
                                                   **kw)), None
    if args.method == "hsd":
        h, hp, name = _hsd(lm, args, args.hierarchy)
        from specjax.hsd import hsd_generate

        return (lambda ids, **kw: hsd_generate(lm.model, lm.params, h, [ids], hparams=hp,
                                               mesh=lm.mesh,
                                               widths=getattr(args, "verify_widths", None),
                                               **kw)), name
    if args.method == "eagle2":
        from specjax.drafters import eagle

        drafter, dparams = eagle.load_drafter(args.eagle, lm, args.model, args.draft_checkpoint)
        name = args.eagle
    elif args.method == "redrafter":
        from specjax.drafters import redrafter

        drafter, dparams = redrafter.load_drafter(args.redrafter, lm, args.model,
                                                  args.redrafter_checkpoint)
        name = args.redrafter
    else:
        drafter, dparams = drafters.from_spec(args.drafter, lm.model, args.draft_len), None
        name = args.drafter
    widths = getattr(args, "verify_widths", None)
    run = lambda ids, **kw: specjax.speculative_generate(lm.model, lm.params, drafter, dparams,
                                                         [ids], mesh=lm.mesh, widths=widths,
                                                         **kw)
    return run, name


def _exit_heads(lm, args, layers=None) -> tuple[dict, list[int], str | None]:
    """``(heads, layers, source)``: trained exit heads from ``--exit-heads`` (default: the
    ones shipped for the model), else plain early exits at ``layers`` (or ``--layers``)."""
    from specjax.drafters import exit_heads

    path = args.exit_heads or exit_heads.shipped_heads(args.model)
    if path is not None:
        heads, _ = exit_heads.load_heads(lm.model, path, lm.model.compute_dtype)
        # the shipped heads by name: results name no path of the machine that made them
        return heads, sorted(heads), str(args.exit_heads or Path(str(path)).name)
    if layers is None:
        layers = [int(x) for x in args.layers.split(",")]
    return {}, list(layers), None


def _hsd(lm, args, spec: str):
    """``(Hierarchy, hparams, spec)`` for ``auto`` (tuned from ``--calibration``) or a spec
    such as ``ngram:4,12:3,target``."""
    from specjax.hsd import calibrate

    if spec == "auto":
        if not args.calibration:
            raise UsageError("--hierarchy auto needs --calibration FILE (from `specjax "
                             "calibrate`)")
        calib = json.loads(Path(args.calibration).read_text())
        if calib.get("model") != args.model:
            raise UsageError(f"{args.calibration} was measured for {calib.get('model')!r}, "
                             f"not {args.model!r}; run `specjax calibrate` for this model")
        heads, layers, _ = _exit_heads(lm, args, calib["layers"])
        if layers != list(calib["layers"]):
            raise UsageError(f"{args.calibration} was measured for exit layers "
                             f"{calib['layers']}, but the exit heads have {layers}")
        lat, sigma, T, horizontal, table = calibrate.tune(calib, args.t_max, args.max_levels,
                                                          horizontal=args.horizontal)
        if len(sigma) == 1:  # the target alone is predicted fastest: run the best hierarchy
            row = min(table, key=lambda r: r["latency_ms"])
            sigma, T, horizontal = row["sigma"], row["T"], row["horizontal"]
            print(f"note: the target alone is predicted faster ({lat:.1f} ms/token) than any "
                  f"hierarchy (best {row['latency_ms']:.1f}); running that best one",
                  file=sys.stderr)
    else:
        heads, layers, _ = _exit_heads(lm, args)
        try:
            sigma, T = calibrate.parse_hierarchy(spec, layers)
        except ValueError as e:
            raise UsageError(str(e)) from None
        horizontal = calibrate.horizontal_of(spec)[1]
    temps = calibrate.level_temperatures(spec) if spec != "auto" else _draft_temps(calib,
                                                                                   len(sigma))
    h, hp = calibrate.hierarchy_from(sigma, T, layers, heads, temps, horizontal)
    h.check(lm.model)
    return h, hp, calibrate.format_hierarchy(sigma, T, layers, temps, horizontal)


def _generate_once(lm, ids, args) -> dict:
    import jax

    run, drafter = _decoder(lm, args)
    kw = dict(max_new_tokens=args.max_new_tokens, sampler=_sampler(args),
              key=jax.random.key(args.seed), eos_ids=lm.eos_ids)
    out = run(ids, **kw)
    out.tokens.block_until_ready()
    compile_s = out.compile_s
    t = time.perf_counter()
    out = run(ids, **kw)  # timed: already compiled
    out.tokens.block_until_ready()
    dt = time.perf_counter() - t
    toks = out.to_lists()[0]
    res = {"method": args.method, "drafter": drafter, "model": args.model, "dtype": args.dtype,
           "compute_dtype": args.compute_dtype,
           "text": lm.decode(toks), "token_ids": toks,
           "prompt_tokens": len(ids), "new_tokens": len(toks), "seconds": dt,
           "tokens_per_s": len(toks) / dt, "compile_s": compile_s, "tau": 1.0,
           "target_forwards": len(toks), "acceptance_by_position": None}
    if args.method == "hsd":
        res.update(tau=out.tau, target_forwards=int(out.forwards[-1]),
                   levels={"forwards": out.forwards.tolist(), "drafted": out.drafted.tolist(),
                           "accepted": out.accepted.tolist()})
    elif drafter is not None:
        res.update(tau=out.tau, target_forwards=int(out.target_forwards[0]),
                   acceptance_by_position=out.acceptance_by_position().tolist())
    return res


def _fits_context(args, prompt: str, chat: bool | None):
    """A ``load(check=...)`` hook: the prompt and its budget fit the model's context.
    ``chat=None``: the chat template where the tokenizer has one."""
    def check(tokenizer, cfg):
        from specjax.models.registry import encode

        if tokenizer is None:
            raise UsageError(f"{args.model} has no tokenizer files: give the prompt as "
                             "--prompt-ids 37,8,15")
        wrap = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        try:
            n = len(encode(tokenizer, prompt, wrap))
        except ValueError as e:  # --chat on a model without a chat template
            raise UsageError(str(e)) from None
        if getattr(cfg, "max_source_positions", None) is not None:  # encoder-decoder
            if n > cfg.max_source_positions:
                raise UsageError(f"a source of {n} tokens exceeds the encoder's "
                                 f"{cfg.max_source_positions} positions")
            n = 1  # the decoder starts from its start token
        if n + args.max_new_tokens > cfg.max_position_embeddings:
            raise UsageError(f"a prompt of {n} tokens + --max-new-tokens {args.max_new_tokens} "
                             f"exceeds {args.model}'s context of {cfg.max_position_embeddings} "
                             f"positions")
    return check


def _prompt_ids(spec: str) -> list[int]:
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {spec!r}") from None
    if not ids or min(ids) < 0:
        raise UsageError(f"--prompt-ids needs at least one id, all >= 0; got {spec!r}")
    return ids


def _check_ids(lm, ids: list[int], args) -> None:
    """Prompt ids against the loaded model: vocabulary, context (decoder or encoder)."""
    cfg = lm.model.config
    if max(ids) >= cfg.vocab_size:
        raise UsageError(f"--prompt-ids has id {max(ids)}, outside the vocabulary of "
                         f"{cfg.vocab_size}")
    if lm.is_encoder_decoder:
        if len(ids) > cfg.max_source_positions:
            raise UsageError(f"a source of {len(ids)} tokens exceeds the encoder's "
                             f"{cfg.max_source_positions} positions")
        need, what = 1 + args.max_new_tokens, "the decoder start token"
    else:
        need, what = len(ids) + args.max_new_tokens, f"a prompt of {len(ids)} tokens"
    if need > cfg.max_position_embeddings:
        raise UsageError(f"{what} + --max-new-tokens {args.max_new_tokens} exceeds "
                         f"{args.model}'s context of {cfg.max_position_embeddings} positions")


def _mesh(args, rows: int | None = 1):
    """The ``--mesh``, or None; ``rows``: the batch it must divide (None: any, as training
    pads its batches)."""
    if not getattr(args, "mesh", None):
        return None
    from specjax import sharding

    try:
        mesh = sharding.mesh_from_spec(args.mesh)
        if rows is not None:  # generate and bench decode one prompt at a time
            sharding.check_batch(rows, mesh)
    except ValueError as e:
        raise UsageError(f"--mesh {args.mesh}: {e}") from None
    return mesh


def _on_mesh(lm, mesh, args):
    if mesh is None:
        return lm
    try:
        return lm.on_mesh(mesh)
    except ValueError as e:
        raise UsageError(f"--mesh {args.mesh}: {e}") from None


def cmd_generate(args) -> int:
    from specjax.models import load

    mesh = _mesh(args)
    if args.prompt_ids is not None:
        ids = _prompt_ids(args.prompt_ids)
        lm = load(args.model, **_dtypes(args))
        _check_ids(lm, ids, args)
    else:
        lm = load(args.model, **_dtypes(args),
                  check=_fits_context(args, args.prompt, args.chat))
        if lm.tokenizer is None:
            raise UsageError(f"{args.model} has no tokenizer files: give the prompt as "
                             "--prompt-ids 37,8,15")
        ids = lm.encode(args.prompt, chat=args.chat)
    res = _generate_once(_on_mesh(lm, mesh, args), ids, args)
    if args.json:
        print(json.dumps(res))
    else:
        print(res["text"] if res["text"] is not None else " ".join(map(str, res["token_ids"])))
        print(f"\n[{res['method']}] {res['new_tokens']} tokens in {res['seconds']:.2f} s = "
              f"{res['tokens_per_s']:.1f} tok/s (compile {res['compile_s']:.1f} s, excluded)",
              file=sys.stderr)
    return 0


def _demo_run(lm, ids, args, cand) -> dict:
    args.method, args.drafter, args.eagle = cand.method, cand.drafter, cand.eagle
    args.redrafter = cand.redrafter
    print(f"[{cand.name}] compiling and decoding {args.max_new_tokens} tokens ...", flush=True)
    return _generate_once(lm, ids, args)


def cmd_demo(args) -> int:
    from specjax import bench, demo
    from specjax.drafters import eagle, redrafter
    from specjax.models import load

    print(f"loading {args.model} ...", flush=True)
    prompt = args.prompt or next(q.text for q in bench.load_questions()
                                 if q.category == "summarization")
    lm = load(args.model, **_dtypes(args), check=_fits_context(args, prompt, None))
    ids = lm.encode(prompt, chat=lm.has_chat_template)
    print(f"prompt ({len(ids)} tokens): {prompt[:200]}{'...' if len(prompt) > 200 else ''}")
    heads = {"eagle2": eagle.shipped_head, "redrafter": redrafter.shipped_head}
    cands = [c for c in demo.CANDIDATES
             if c.method not in heads or heads[c.method](args.model) is not None]
    greedy = args.temperature <= 0
    choice = None if (args.remeasure or not greedy) else demo.read_choice(args.model, cands)
    if args.method != "auto":  # an explicit method: run it, record nothing
        drafter = args.drafter + (f":{args.draft_len}" if args.draft_len else "")
        choice = demo.Candidate(args.method, drafter, args.eagle, args.redrafter)
    elif choice is not None:
        print(f"fastest lossless method measured here before: {choice.name} "
              f"(record: {demo.cache_file(args.model)}; --remeasure to measure again)")
    elif greedy:
        print(f"measuring {len(cands)} lossless configurations on this prompt (once per "
              f"machine; the fastest is recorded)")
    ar = _demo_run(lm, ids, args, demo.Candidate("ar"))
    runs = {}
    for cand in ([choice] if choice is not None else cands if greedy else cands[-1:]):
        r = _demo_run(lm, ids, args, cand)
        r.update(lossless=r["token_ids"] == ar["token_ids"], ar_tokens_per_s=ar["tokens_per_s"])
        runs[cand.name] = r
    if choice is None and greedy:
        choice = demo.write_choice(args.model, runs, cands)
    elif choice is None:
        choice = cands[-1]
    best = runs[choice.name]
    print("\n" + best["text"] + "\n")
    for name, r in [("ar", ar), *runs.items()]:
        mark = "*" if name == choice.name else " "
        print(f"{mark} {name:<16} {r['new_tokens']} tokens in {r['seconds']:.2f} s = "
              f"{r['tokens_per_s']:6.1f} tok/s  {r['tokens_per_s'] / ar['tokens_per_s']:.2f}x ar, "
              f"tau {r['tau']:.2f} tokens/forward (compile {r['compile_s']:.1f} s, excluded)")
    print(f"speedup of {choice.name} over ar: {best['tokens_per_s'] / ar['tokens_per_s']:.2f}x")
    if not greedy:
        return 0
    bad = [n for n, r in runs.items() if not r["lossless"]]
    print(f"greedy output of {', '.join(runs)} is "
          f"{'identical to' if not bad else 'DIFFERENT FROM'} ar" + (f" ({bad})" if bad else ""))
    return 0 if not bad else 1


def split_methods(spec: str) -> list[str]:
    """``"ar,eagle2:4,4,8:conf,vocab=4096,hf"`` -> ``["ar", "eagle2:4,4,8:conf,vocab=4096", "hf"]``:
    a comma starts a new method only where a method name follows."""
    parts = re.split(r",(?=\s*(?:ar\b|hf\b|hf-pld\b|sd-|eagle2|redrafter|hsd))", spec)
    return [m.strip() for m in parts if m.strip()]


def cmd_calibrate(args) -> int:
    import platform

    import specjax
    from tqdm import tqdm

    from specjax import bench, hsd
    from specjax.hsd import calibrate
    from specjax.models import load

    if args.draft_temperature is not None and args.draft_temperature < 0:
        raise UsageError(f"--draft-temperature must be >= 0, got {args.draft_temperature}")
    qs = bench.load_questions(args.prompts, None, args.limit)  # checked before the model loads
    lm = load(args.model, **_dtypes(args))
    heads, layers, source = _exit_heads(lm, args)
    sampler = _sampler(args)
    seqs, pls = [], []
    for q in tqdm(qs, desc="target outputs", unit="prompt"):
        ids = lm.encode(q.text, chat=lm.has_chat_template)
        out = specjax.generate(lm.model, lm.params, [ids], max_new_tokens=args.max_new_tokens,
                               eos_ids=lm.eos_ids, **bench._sampling_kw(sampler))
        seqs.append(ids + out.to_lists()[0])
        pls.append(len(ids))
    with tqdm(total=len(seqs), desc="agreement", unit="prompt") as bar:
        draft = None if args.draft_temperature is None else hsd.Exit(
            1, temperature=args.draft_temperature).draws(sampler)
        alpha, n = calibrate.agreement(lm.model, lm.params, heads, layers, seqs, pls, sampler,
                                       progress=bar, draft_sampler=draft)
    widths = [int(w) for w in args.widths.split(",")]
    filled = calibrate.decode_position(seqs, pls)  # costs at the decode's own cache length
    with tqdm(total=len(widths) * (len(layers) + 1), desc="costs", unit="forward") as bar:
        cost = calibrate.forward_costs(lm.model, lm.params, heads, layers, widths,
                                       filled=filled, progress=bar)
    round_ = calibrate.round_overhead(lm.model, lm.params, filled=filled)
    hit = calibrate.ngram_hit_rate(seqs, pls)
    per_width = isinstance(specjax.core.widths.Auto().policy(), specjax.core.widths.PerWidth)
    res = {"model": args.model, "dtype": args.dtype, "compute_dtype": args.compute_dtype,
           "layers": layers, "exit_heads": source,
           "candidates": calibrate.names(layers), "alpha": alpha.tolist(), "positions": n,
           "prompts": len(seqs), "temperature": max(args.temperature, 0.0),
           "draft_temperature": args.draft_temperature, "top_k": args.top_k, "top_p": args.top_p,
           "cost_ms": cost, "filled": filled, "round": round_, "ngram_hit": hit,
           "verify_widths": "per-width" if per_width else "padded",
           "machine": {"platform": platform.platform(),
                                        "cpu_count": os.cpu_count()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    names = calibrate.names(layers)
    print("alpha (row drafts, column verifies):")
    for i, name in enumerate(names):
        print(f"  {name:>8} " + " ".join(f"{alpha[i, j]:5.2f}" if j > i else "    -"
                                         for j in range(len(names))))
    print("cost (ms) at width 1 / 5 / 17: " + "; ".join(
        f"{k} " + "/".join(f"{calibrate._cost_at(v, w):.1f}" for w in (1, 5, 17))
        for k, v in cost.items() if k != "ngram") + f"; ngram lookup {cost['ngram'][1]:.2f}")
    print(f"at cache length {filled}; a round adds {round_['round_ms']:.2f} ms beyond its "
          f"forwards")
    print(f"wrote {args.out}")
    return 0


def _draft_temps(calib: dict, n_levels: int) -> tuple | None:
    """The draft levels' own temperature a calibration was measured at (None: the
    target's); ``hierarchy_from`` and ``format_hierarchy`` apply it to exit levels only."""
    t = calib.get("draft_temperature")
    if t is None:
        return None
    return tuple([t] * (n_levels - 1) + [None])


def _sizes(text: str) -> tuple[int, ...]:
    """``"0,10"`` -> ``(0, 10)``: non-negative ints (argparse type)."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative ints like 0,10, got {text!r}")
    return out


def cmd_tune(args) -> int:
    from specjax.hsd import calibrate

    calib = json.loads(Path(args.calibration).read_text())
    t = time.perf_counter()
    lat, sigma, T, h, table = calibrate.tune(calib, args.t_max, args.max_levels,
                                             horizontal=args.horizontal)
    dt = time.perf_counter() - t
    layers = calib["layers"]
    ar = calibrate.predicted_latency(calib, (len(layers) + 1,), ())
    table.sort(key=lambda r: r["latency_ms"])
    spec = lambda sg, tt, h: calibrate.format_hierarchy(sg, tt, layers,
                                                        _draft_temps(calib, len(sg)), h)
    for r in table[:10]:
        print(f"{r['latency_ms']:8.2f} ms/token  {spec(r['sigma'], r['T'], r['horizontal'])}")
    best = spec(sigma, T, h)
    print(f"best: {best}: {lat:.2f} ms/token predicted vs {ar:.2f} for the target alone "
          f"({ar / lat:.2f}x); {len(table)} hierarchies searched in {dt:.2f} s")
    if args.out:
        rows = [{**r, "spec": spec(r["sigma"], r["T"], r["horizontal"])} for r in table]
        Path(args.out).write_text(json.dumps({"best": best, "latency_ms": lat,
                                              "target_alone_ms": ar, "ranking": rows}, indent=1))
    return 0


def _bench_settings(args, methods) -> dict:
    """What makes two bench runs comparable, question by question (a resume must match)."""
    return {"model": args.model, "dtype": args.dtype, "compute_dtype": args.compute_dtype,
            "methods": methods,
            **({"mesh": args.mesh} if args.mesh else {}),
            **({"verify_widths": args.verify_widths}
               if getattr(args, "verify_widths", "auto") != "auto" else {}),
            **({"scan_layers": True} if getattr(args, "scan_layers", False) else {}),
            "temperature": max(args.temperature, 0.0), "top_k": args.top_k, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
            "draft_checkpoint": args.draft_checkpoint, "calibration": args.calibration,
            **({"redrafter_checkpoint": args.redrafter_checkpoint}
               if args.redrafter_checkpoint else {}),
            "exit_heads": args.exit_heads,
            "questions": (f"random:{args.random_prompts}x{args.prompt_len}"
                          if args.random_prompts else
                          args.questions or "specjax/data/prompts.jsonl")}


def _bench_runners(args, lm, methods, threads, hierarchies) -> dict:
    from specjax import bench, drafters

    hf = bench.load_hf(lm) if {"hf", "hf-pld"} & set(methods) else None
    sampler = _sampler(args)
    widths = getattr(args, "verify_widths", None)  # specjax.core.widths; None: auto
    runners = {"ar": lambda: bench.ar_method(lm, sampler),
               "hf": lambda: bench.hf_method(lm, threads, hf, max(args.temperature, 0.0)),
               "hf-pld": lambda: bench.hf_pld_method(lm, threads, hf)}
    for m in methods:
        if m.startswith("sd-"):
            d = drafters.from_spec(m[3:], lm.model, args.draft_len)
            d.check(lm.model)
            runners[m] = lambda d=d: bench.sd_method(lm, d, None, sampler, widths)
        elif m.startswith("eagle2"):
            from specjax.drafters import eagle

            d, dp = eagle.load_drafter(m, lm, args.model, args.draft_checkpoint)
            d.check(lm.model)
            runners[m] = lambda d=d, dp=dp: bench.sd_method(lm, d, dp, sampler, widths)
        elif m.startswith("redrafter"):
            from specjax.drafters import redrafter

            d, dp = redrafter.load_drafter(m, lm, args.model, args.redrafter_checkpoint)
            runners[m] = lambda d=d, dp=dp: bench.sd_method(lm, d, dp, sampler, widths)
        elif m.startswith("hsd"):
            h, hp, hierarchies[m] = _hsd(lm, args, m.partition(":")[2] or "auto")
            runners[m] = lambda h=h, hp=hp: bench.hsd_method(lm, h, hp, sampler, widths)
    return {m: runners[m]() for m in methods}


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from specjax import bench
    from specjax.models import load

    methods = split_methods(args.methods)
    known = {"ar", "hf", "hf-pld"}
    bad = [m for m in methods if m not in known and m != "hsd"
           and not m.startswith(("sd-", "eagle2", "redrafter", "hsd:"))]
    if bad:
        raise UsageError(f"unknown methods {bad}; available: {sorted(known)}, sd-ngram, "
                         f"sd-early-exit:L, eagle2[:depth,topk,total][:opts], "
                         f"redrafter[:W,L][:nodedup], hsd[:SPEC]")
    greedy = args.temperature <= 0
    if not greedy and "hf-pld" in methods:
        raise UsageError("hf-pld is greedy only; drop it when --temperature > 0")
    if args.random_prompts and args.questions:
        raise UsageError("give --questions or --random-prompts, not both")
    questions = (None if args.random_prompts else  # checked before the model loads
                 bench.load_questions(args.questions, args.categories, args.limit))
    mesh = _mesh(args)
    settings = _bench_settings(args, methods)
    done = bench.restore_runs(args.out, settings)  # an interrupted bench resumes here
    lm = _on_mesh(load(args.model, **_dtypes(args), tokenizer=not args.random_prompts), mesh,
                  args)
    if args.random_prompts:
        questions = bench.random_questions(args.random_prompts, args.prompt_len,
                                           lm.model.config.vocab_size)
    elif lm.tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer files: bench it on token ids with "
                         "--random-prompts N [--prompt-len L]")
    threads = args.threads or os.cpu_count() or 1
    hierarchies = {}  # hsd method -> the hierarchy it runs, as a spec
    run = _bench_runners(args, lm, methods, threads, hierarchies)
    results = {m: [] for m in methods}
    mismatches = []
    report = {"model": args.model, "dtype": args.dtype, "compute_dtype": args.compute_dtype,
              "batch": 1, "greedy": greedy,
              "temperature": max(args.temperature, 0.0),
              "max_new_tokens": args.max_new_tokens, "threads": threads,
              "questions": settings["questions"], "n_questions": len(questions),
              "machine": bench.machine_info(), "draft_len": args.draft_len,
              "settings": settings, "complete": False}
    resumed = sum(all(q.qid in done.get(m, {}) for m in methods) for q in questions)
    if resumed:
        print(f"resuming {args.out}: {resumed} of {len(questions)} questions already done")
    bar = tqdm(total=len(questions) * len(methods), desc="bench", unit="run")
    for q in questions:
        old = [done.get(m, {}).get(q.qid) for m in methods]
        ids = list(q.ids) if q.ids is not None else (
            None if all(old) else lm.encode(q.text, chat=lm.has_chat_template))
        for m, r in zip(methods, old):
            bar.set_postfix_str(f"{q.category} {m}")
            results[m].append((q, r if all(old) else run[m](ids, args.max_new_tokens)))
            bar.update()
        if "ar" in results and greedy:
            for m in methods:  # every greedy method must reproduce ar
                if results[m][-1][1].tokens != results["ar"][-1][1].tokens:
                    mismatches.append({"question": q.qid, "method": m})
        if args.out:  # what an interruption keeps
            bench.write_json(args.out, {**report, "runs": bench.run_records(results)})
    bar.close()
    summary = bench.summarize(results)
    print(bench.format_table(summary))
    report.update(methods=summary, greedy_mismatch_vs_ar=mismatches, complete=True)
    if hierarchies:
        from specjax.drafters import exit_heads

        heads = args.exit_heads or exit_heads.shipped_heads(args.model)
        report["hsd"] = {"hierarchies": hierarchies, "calibration": args.calibration,
                         "exit_heads": Path(heads).name if heads else None}
    if "ar" in summary:
        report["bandwidth"] = _bandwidth(lm, summary["ar"]["tokens_per_s"])
    if mismatches:
        print(f"note: greedy outputs differ from ar: {mismatches}")
    if args.out:
        bench.write_json(args.out, {**report, "runs": bench.run_records(results)})
        print(f"wrote {args.out}")
    return 0


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


def _spec_bench_texts(path: str) -> list[str]:
    rows = [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]
    return [t for r in rows for t in r["turns"]]


def cmd_distill(args) -> int:
    from tqdm import tqdm

    from specjax.models import load
    from specjax.train import distill

    lm = load(args.model)
    exclude = _spec_bench_texts(args.exclude) if args.exclude else []
    prompts, info = distill.select_prompts(args.prompts, args.num_prompts, exclude, args.seed)
    print(f"{len(prompts)} prompts ({info['dropped_overlapping_spec_bench']} dropped for "
          f"overlapping {args.exclude or 'nothing'})", flush=True)
    with tqdm(total=len(prompts), desc="distill", unit="prompt") as bar:
        summary = distill.distill(lm, prompts, args.out, max_new_tokens=args.max_new_tokens,
                                  batch=args.batch, progress=bar)
    summary.update(info)
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


def cmd_features(args) -> int:
    from tqdm import tqdm

    from specjax.models import load
    from specjax.train import text_corpus

    lm = load(args.model)
    exclude = _spec_bench_texts(args.exclude) if args.exclude else []
    pairs, info = text_corpus.reference_pairs(args.prompts, exclude, args.seed)
    print(f"{info['pairs']} (prompt, reference answer) pairs "
          f"({info['dropped_overlapping_exclude']} dropped for overlapping "
          f"{args.exclude or 'nothing'}); taking {args.tokens} tokens", flush=True)
    with tqdm(total=args.tokens, desc="features", unit="tok", unit_scale=True) as bar:
        summary = text_corpus.build(lm, pairs, args.out, max_tokens=args.tokens,
                                    max_len=args.max_len, progress=bar)
    summary.update(info)
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


def _run_log(run_dir: str):
    """``run_dir/log.jsonl``, rewound to the checkpoint a resumed run starts from."""
    from specjax.train.loop import RunLog

    return RunLog(run_dir)


def cmd_train_exits(args) -> int:
    import dataclasses

    from tqdm import tqdm

    from specjax.models import load
    from specjax.train import checkpoint, distill
    from specjax.train import exit_heads as train_exits

    lm = load(args.model)
    corpus = distill.load_shards(args.data)
    layers = tuple(int(x) for x in args.layers.split(","))
    cfg = train_exits.ExitConfig(layers=layers, rank=args.rank, steps=args.steps,
                                 batch_tokens=args.batch_tokens, max_len=args.max_len,
                                 lr=args.lr, seed=args.seed, save_every=args.save_every,
                                 kl_vocab=args.kl_vocab)
    log = _run_log(args.run)
    print(f"{len(corpus)} examples, {sum(len(t) for t, _, _ in corpus)} tokens; {cfg}", flush=True)
    def feats():
        with tqdm(total=len(corpus), desc="target features", unit="example") as bar:
            return train_exits.layer_features(lm.model, lm.params, corpus, cfg, progress=bar)

    with tqdm(total=cfg.steps, desc="train exit heads", unit="step") as bar:
        state = train_exits.train(lm.model, lm.params, corpus, cfg, args.run, feats=feats,
                                  progress=bar, log=log, mesh=_mesh(args, rows=None),
                                  meta={"model": args.model, "data": str(Path(args.data))})
    if args.export:
        summary = Path(args.data, "summary.json")
        meta = {"kind": "exit-heads", "model": args.model, "layers": list(cfg.layers),
                "rank": cfg.rank, "train": dataclasses.asdict(cfg),
                "steps_done": int(state["step"]),
                "data": json.loads(summary.read_text()) if summary.exists() else None}
        ids = train_exits.vocab_ids(corpus, lm.model.config.vocab_size, cfg)
        if ids is not None:  # the exits propose only tokens the KL was taken over
            meta["vocab_ids"] = ids.tolist()
        out = checkpoint.export_head(state["params"], args.export, meta)
        print(f"exported the exit heads (bfloat16) to {out}")
    return 0


def cmd_train(args) -> int:
    import dataclasses

    import jax
    from tqdm import tqdm

    from specjax.models import load
    from specjax.train import checkpoint, distill
    from specjax.train import eagle as train_eagle

    lm = load(args.model)
    corpus = distill.load_shards(args.data)
    cfg = train_eagle.TrainConfig(steps=args.steps, batch_tokens=args.batch_tokens,
                                  max_len=args.max_len, lr=args.lr, seed=args.seed,
                                  save_every=args.save_every, ce_vocab=args.ce_vocab,
                                  val_examples=args.val_examples, warmup=args.warmup,
                                  w_reg=args.w_reg, w_ce=args.w_ce, noise=args.noise,
                                  all_positions=args.all_positions)
    log = _run_log(args.run)
    n_tok = sum(len(t) - (0 if cfg.all_positions else pl) for t, pl, _ in corpus)
    print(f"{len(corpus)} examples, {n_tok} trained tokens; {cfg}", flush=True)
    init = None
    if args.init:
        from specjax.drafters import eagle

        init, _ = checkpoint.load_head(args.init, "eagle",
                                       like=eagle.init_head(lm.model.config, jax.random.key(0)))
    with tqdm(total=cfg.steps, desc="train eagle", unit="step") as bar:
        state = train_eagle.train(lm.model, lm.params, corpus, cfg, args.run, progress=bar, log=log,
                                  mesh=_mesh(args, rows=None),
                                  meta={"model": args.model, "data": Path(args.data).name,
                                        "init": args.init and Path(args.init).name},
                                  init=init)
    if args.export:
        ids = train_eagle.vocab_by_frequency(corpus, lm.model.config.vocab_size, 32768)
        summary = Path(args.data, "summary.json")
        meta = {"kind": "eagle", "model": args.model, "draft_vocab": args.draft_vocab,
                "train": dataclasses.asdict(cfg), "steps_done": int(state["step"]),
                "data": json.loads(summary.read_text()) if summary.exists() else None,
                "vocab_ids": ids.tolist()}
        out = checkpoint.export_head(state["params"], args.export, meta)
        print(f"exported the head (bfloat16) to {out}")
    return 0


def cmd_train_redrafter(args) -> int:
    import dataclasses

    import jax
    import numpy as np
    from tqdm import tqdm

    from specjax import export
    from specjax.drafters import redrafter
    from specjax.models import load
    from specjax.train import distill
    from specjax.train import redrafter as train_rd

    cfg = train_rd.TrainConfig(steps=args.steps, batch_tokens=args.batch_tokens,
                               max_len=args.max_len, unroll=args.unroll, blocks=args.blocks,
                               draft_vocab=args.draft_vocab, loss=args.loss, lr=args.lr,
                               warmup=args.warmup, seed=args.seed, save_every=args.save_every,
                               val_examples=args.val_examples,
                               all_positions=not args.answers_only)
    lm = load(args.model)
    corpus = distill.load_shards(args.data)
    d = corpus[0][2].shape[-1]
    if d != lm.model.config.hidden_size:
        raise ValueError(f"{args.data} holds features of width {d}, but {args.model} has hidden "
                         f"size {lm.model.config.hidden_size}: it was built for another model")
    print(f"{len(corpus)} examples, {sum(len(t) for t, _, _ in corpus)} tokens; {cfg}",
          flush=True)
    init = None
    if args.init:  # fine-tune an exported head: its parameters and its draft vocabulary
        meta = export.read_meta(args.init, "redrafter")
        like = redrafter.exportable(redrafter.init_head(
            meta["hidden_size"], meta["draft_vocab"], jax.random.key(0), meta["blocks"]))
        head, meta = export.load_head(args.init, "redrafter", like=like)
        ids = meta.get("vocab_ids")
        init = (head, None if ids is None else np.asarray(ids, np.int32))
    with tqdm(total=cfg.steps, desc="train redrafter", unit="step") as bar:
        state, ids = train_rd.train(lm.model, lm.params, corpus, cfg, args.run, progress=bar,
                                    log=_run_log(args.run), init=init,
                                    mesh=_mesh(args, rows=None),
                                    meta={"model": args.model, "data": Path(args.data).name,
                                          "init": args.init and Path(args.init).name})
    if args.export:
        summary = Path(args.data, "summary.json")
        meta = {"kind": "redrafter", "model": args.model,
                "hidden_size": lm.model.config.hidden_size, "blocks": cfg.blocks,
                "draft_vocab": lm.model.config.vocab_size if ids is None else len(ids),
                "train": dataclasses.asdict(cfg), "steps_done": int(state["step"]),
                "data": json.loads(summary.read_text()) if summary.exists() else None,
                "init": args.init and Path(args.init).name,
                "vocab_ids": None if ids is None else ids.tolist()}
        out = export.export_head(redrafter.exportable(state["params"]), args.export, meta)
        print(f"exported the head (bfloat16) to {out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``specjax: error: ...``, exit code 2."""

    def error(self, message):
        self.exit(2, f"specjax: error: {message} (see `{self.prog} -h`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specjax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s, max_new=128):
        s.add_argument("--model", default="smollm2-135m",
                       help="registered name, .gguf file or HF directory")
        s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="weights and KV cache")
        s.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                       help="inputs of every product (default float32: bfloat16 weights "
                            "then keep greedy output equal to ar's as in float32; bfloat16 "
                            "is faster on bfloat16 hardware and can leave ar on near-ties)")
        s.add_argument("--max-new-tokens", type=int, default=max_new)
        s.add_argument("--scan-layers", action="store_true",
                       help="Llama models: run the layers under one lax.scan over stacked "
                            "weights (one layer compiles, not all; the accelerator layout; "
                            "slower per token on CPU)")

    def verify_widths_option(s):
        s.add_argument("--verify-widths", default="auto",
                       help="verification widths compiled for speculative methods: auto "
                            "(padded off CPU, merged on CPU), padded (one forward at the "
                            "full draft), per-width (the drafter's own), merged (per-width, "
                            "widths with equal product padding merged) or widths, e.g. 1,8")

    def mesh_option(s):
        s.add_argument("--mesh", help="run on a device mesh, e.g. model=3: weights split by "
                       "heads and MLP columns (data=D needs batches of D rows; these commands "
                       "decode one prompt at a time)")

    def redrafter_checkpoint(s):
        s.add_argument("--redrafter-checkpoint", help="an exported ReDrafter head directory "
                                                      "(default: the head shipped for --model)")

    def sampling(s):
        s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        s.add_argument("--top-k", type=int, default=0)
        s.add_argument("--top-p", type=float, default=1.0)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--method", default="ar", choices=["ar", "sd", "eagle2", "redrafter", "hsd"],
                       help="ar: one token per forward; sd: speculative decoding with "
                            "--drafter; eagle2: the EAGLE-2 head and dynamic tree; redrafter: "
                            "the recurrent head's beams as one tree (--redrafter); hsd: "
                            "a hierarchy of drafters (--hierarchy)")
        s.add_argument("--eagle", default="eagle2", help="EAGLE spec: "
                       "eagle2[:depth,topk,total][:conf,norerank,fullvocab,vocab=N]")
        s.add_argument("--draft-checkpoint", help="an exported EAGLE head directory (default: "
                                                  "the head shipped for --model)")
        s.add_argument("--redrafter", default="redrafter",
                       help="ReDrafter spec: redrafter[:W,L][:nodedup] (W beams of L tokens)")
        redrafter_checkpoint(s)
        s.add_argument("--drafter", default="ngram", help="for sd: ngram[:depth] | early-exit:L")
        s.add_argument("--draft-len", type=int, help="draft tokens per round (default: the "
                                                      "drafter's own)")
        s.add_argument("--hierarchy", default="auto", help="for hsd: auto (tuned from "
                       "--calibration) or a spec such as ngram:4,12:3,target")
        hsd_options(s)
        verify_widths_option(s)

    def exit_options(s):
        s.add_argument("--exit-heads", help="exported exit heads (default: the ones shipped "
                                            "for --model, else plain early exits)")
        s.add_argument("--layers", default="4,8,12,16,20,24",
                       help="exit layers when no exit heads are given or shipped")

    def hsd_options(s):
        exit_options(s)
        s.add_argument("--calibration", help="JSON from `specjax calibrate` (hsd auto)")
        s.add_argument("--t-max", type=int, default=8, help="largest T the tuner tries")
        s.add_argument("--max-levels", type=int, default=4, help="most levels the tuner tries")
        horizontal_option(s)

    def horizontal_option(s):
        s.add_argument("--horizontal", type=_sizes, default=(0,), help="horizontal-heuristic "
                       "sizes the tuner tries, e.g. 0,10 (default: 0, off)")

    g = sub.add_parser("generate", help="decode one prompt")
    common(g)
    mesh_option(g)
    sampling(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", help="the prompt as token ids, e.g. 37,8,15 (the "
                     "encoder input of an encoder-decoder model; for models without a tokenizer)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="decode a real prompt and show tokens/s")
    common(d)
    sampling(d)
    d.add_argument("--prompt", help="default: the built-in summarization prompt")
    d.add_argument("--remeasure", action="store_true",
                   help="measure every candidate again instead of using the recorded fastest")
    d.set_defaults(method="auto")  # auto: the fastest lossless configuration measured here
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="tokens/s of methods side by side")
    common(b)
    mesh_option(b)
    b.add_argument("--methods", default="ar,hf",
                   help="comma-separated: ar, hf, hf-pld, sd-ngram, sd-early-exit:L, "
                        "eagle2[:depth,topk,total][:conf,norerank,fullvocab,vocab=N], "
                        "redrafter[:W,L][:nodedup]")
    b.add_argument("--draft-len", type=int, help="draft tokens per round for sd-* methods")
    verify_widths_option(b)
    b.add_argument("--draft-checkpoint", help="exported EAGLE head for eagle2 methods "
                                              "(default: the shipped one)")
    redrafter_checkpoint(b)
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
    hsd_options(b)
    b.set_defaults(fn=cmd_bench)

    c = sub.add_parser("calibrate", help="HSD: measure each candidate drafter's cost and "
                                         "every pair's acceptance rate here; writes JSON")
    common(c)
    exit_options(c)
    c.add_argument("--prompts", help="Spec-Bench-format question.jsonl (default: built-in)")
    c.add_argument("--limit", type=int, help="prompts to use, spread over categories")
    c.add_argument("--temperature", type=float, default=0.0,
                   help="0: agreement of argmaxes; > 0: 1 - TV of the tempered distributions")
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--widths", default="1,2,3,4,5,6,8,10,12,16,20,25",
                   help="forward widths to time (tokens)")
    c.add_argument("--draft-temperature", type=float, help="the draft levels' own "
                   "temperature (default: the target's); `tune` then picks hierarchies whose "
                   "exit levels draft at it")
    c.add_argument("--out", required=True)
    c.set_defaults(fn=cmd_calibrate)

    tu = sub.add_parser("tune", help="HSD: the hierarchy with the least predicted latency")
    tu.add_argument("--calibration", required=True, help="JSON from `specjax calibrate`")
    tu.add_argument("--t-max", type=int, default=8)
    tu.add_argument("--max-levels", type=int, default=4)
    horizontal_option(tu)
    tu.add_argument("--out", help="write the ranking as JSON")
    tu.set_defaults(fn=cmd_tune)

    ds = sub.add_parser("distill", help="self-distilled training data: the target answers "
                                         "training prompts; its features are kept")
    common(ds, max_new=192)
    ds.add_argument("--prompts", required=True, help="directory of training prompt files")
    ds.add_argument("--exclude", help="Spec-Bench question.jsonl: overlapping prompts are dropped")
    ds.add_argument("--num-prompts", type=int, default=2000)
    ds.add_argument("--batch", type=int, default=16)
    ds.add_argument("--seed", type=int, default=0)
    ds.add_argument("--out", required=True, help="corpus directory (resumes if it exists)")
    ds.set_defaults(fn=cmd_distill)

    fe = sub.add_parser("features", help="a fixed training corpus: reference (prompt, answer) "
                                          "texts and the target's features, one prefill each")
    fe.add_argument("--model", default="smollm2-135m")
    fe.add_argument("--prompts", required=True, help="directory of training prompt files")
    fe.add_argument("--exclude", help="Spec-Bench question.jsonl: overlapping prompts are dropped")
    fe.add_argument("--tokens", type=int, default=2_000_000, help="corpus size in tokens")
    fe.add_argument("--max-len", type=int, default=512, help="tokens per text (left-truncated)")
    fe.add_argument("--seed", type=int, default=0)
    fe.add_argument("--out", required=True, help="corpus directory (resumes if it exists)")
    fe.set_defaults(fn=cmd_features)

    t = sub.add_parser("train", help="train a draft head")
    tsub = t.add_subparsers(dest="head", required=True)
    te = tsub.add_parser("eagle", help="the EAGLE head, on a corpus from `specjax distill`")
    te.add_argument("--model", default="smollm2-135m")
    te.add_argument("--data", required=True)
    te.add_argument("--run", required=True, help="run directory: checkpoints; resumes")
    te.add_argument("--steps", type=int, default=2000)
    te.add_argument("--batch-tokens", type=int, default=4096)
    te.add_argument("--max-len", type=int, default=512)
    te.add_argument("--lr", type=float, default=5e-4)
    te.add_argument("--warmup", type=int, default=100)
    te.add_argument("--w-reg", type=float, default=1.0, help="weight of the feature regression")
    te.add_argument("--w-ce", type=float, default=0.1,
                    help="weight of the cross-entropy against the target's distribution")
    te.add_argument("--noise", type=float, default=0.1,
                    help="uniform noise on the input features, relative to their RMS")
    te.add_argument("--seed", type=int, default=0)
    te.add_argument("--save-every", type=int, default=100)
    te.add_argument("--ce-vocab", type=int, default=8192,
                    help="cross-entropy over the corpus's most frequent tokens (0: all)")
    te.add_argument("--val-examples", type=int, default=0,
                    help="examples held out and scored at every checkpoint (val_acc in the log)")
    te.add_argument("--init", help="start from this exported EAGLE head (fine-tuning); "
                                   "default: a random head")
    te.add_argument("--all-positions", action="store_true",
                    help="train on every position, prompts included (for a text corpus "
                         "from `specjax features`); default: answer positions only")
    te.add_argument("--draft-vocab", type=int, default=0,
                    help="default draft vocabulary size of the exported head (0: full)")
    te.add_argument("--export", help="write the trained head (bfloat16) here")
    te.set_defaults(fn=cmd_train)
    tr = tsub.add_parser("redrafter", help="the ReDrafter head, on a corpus from "
                                           "`specjax features` or `specjax distill`")
    tr.add_argument("--model", default="smollm2-135m")
    tr.add_argument("--data", required=True)
    tr.add_argument("--run", required=True, help="run directory: checkpoints; resumes")
    tr.add_argument("--steps", type=int, default=600)
    tr.add_argument("--batch-tokens", type=int, default=1024)
    tr.add_argument("--max-len", type=int, default=512)
    tr.add_argument("--unroll", type=int, default=3, help="recurrent steps trained per position")
    tr.add_argument("--blocks", type=int, default=2, help="residual blocks of the head")
    tr.add_argument("--draft-vocab", type=int, default=8192,
                    help="the corpus's most frequent tokens (0: the whole vocabulary)")
    tr.add_argument("--loss", choices=["kd", "ce"], default="kd",
                    help="kd: the target's distribution (the paper); ce: dataset tokens")
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--warmup", type=int, default=50)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--save-every", type=int, default=100)
    tr.add_argument("--val-examples", type=int, default=0,
                    help="examples held out and scored at every checkpoint")
    tr.add_argument("--export", help="write the trained head (bfloat16) here")
    tr.add_argument("--init", help="an exported ReDrafter head to fine-tune (keeps its draft "
                                   "vocabulary and blocks)")
    tr.add_argument("--answers-only", action="store_true",
                    help="train on answer positions only (a corpus from `specjax distill`); "
                         "default: every position")
    tr.set_defaults(fn=cmd_train_redrafter)
    tx = tsub.add_parser("exit-heads", help="early-exit adapters distilled from the final "
                                            "layer, on a corpus from `specjax distill`")
    tx.add_argument("--model", default="smollm2-135m")
    tx.add_argument("--data", required=True)
    tx.add_argument("--run", required=True, help="run directory: checkpoints; resumes")
    tx.add_argument("--layers", default="4,8,12,16,20,24", help="exit layers, comma-separated")
    tx.add_argument("--rank", type=int, default=64, help="adapter rank")
    tx.add_argument("--steps", type=int, default=400)
    tx.add_argument("--batch-tokens", type=int, default=1024)
    tx.add_argument("--max-len", type=int, default=512)
    tx.add_argument("--lr", type=float, default=2e-3)
    tx.add_argument("--seed", type=int, default=0)
    tx.add_argument("--save-every", type=int, default=50)
    tx.add_argument("--kl-vocab", type=int, default=4096,
                    help="KL over the corpus's most frequent tokens (0: all)")
    tx.add_argument("--export", help="write the trained heads (bfloat16) here")
    tx.set_defaults(fn=cmd_train_exits)
    for t in (te, tr, tx):
        t.add_argument("--mesh", help="data-parallel training on a device mesh, e.g. data=8 "
                       "(rows split over data, gradients summed by XLA)")
    p.set_defaults(debug=False)
    for sp in [*(v for k, v in sub.choices.items() if k != "train"), *tsub.choices.values()]:
        sp.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (or SPECJAX_DEBUG=1)")
    return p


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    text = msg[0] if msg else ""
    if not isinstance(e, (UsageError, ValueError, FileNotFoundError)) or not text:
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text


def main(argv=None) -> int:
    """Runs one command. Errors print one line, ``specjax: error: ...``, and exit with 2 for
    a usage mistake and 1 otherwise; ``--debug`` or ``SPECJAX_DEBUG=1`` shows the traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("SPECJAX_DEBUG", "") not in ("", "0")
    try:
        _check_args(args)
        return args.fn(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("specjax: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- the CLI's one place that reports errors
        if debug:
            raise
        clean = isinstance(e, (UsageError, ValueError, FileNotFoundError))
        hint = "" if clean else " (--debug shows the traceback)"
        print(f"specjax: error: {_one_line(e)}{hint}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
