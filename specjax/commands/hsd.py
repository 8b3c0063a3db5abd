"""``specjax calibrate`` (HSD: each candidate drafter's cost and every pair's acceptance
rate, measured here) and ``specjax tune`` (the hierarchy they predict to be fastest)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from specjax.commands import common
from specjax.commands.common import UsageError


def cmd_calibrate(args) -> int:
    import platform

    from tqdm import tqdm

    import specjax

    from specjax import bench, hsd, methods
    from specjax.hsd import calibrate
    from specjax.models import load

    if args.draft_temperature is not None and args.draft_temperature < 0:
        raise UsageError(f"--draft-temperature must be >= 0, got {args.draft_temperature}")
    common.writable(args.out, "--out")
    common.readable(args.prompts, "--prompts")
    qs = bench.load_questions(args.prompts, None, args.limit)  # checked before the model loads
    lm = load(args.model, **common.dtypes(args))
    heads, layers, source = methods.exit_heads(lm, common.options(args))
    sampler = common.sampler(args)
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


def cmd_tune(args) -> int:
    from specjax import methods
    from specjax.hsd import calibrate

    common.writable(args.out, "--out")
    try:
        calib = methods.read_calibration(args.calibration)
    except methods.SpecError as e:
        raise UsageError(str(e)) from None
    t = time.perf_counter()
    lat, sigma, T, h, table = calibrate.tune(calib, args.t_max, args.max_levels,
                                             horizontal=args.horizontal)
    dt = time.perf_counter() - t
    layers = calib["layers"]
    ar = calibrate.predicted_latency(calib, (len(layers) + 1,), ())
    table.sort(key=lambda r: r["latency_ms"])
    spec = lambda sg, tt, h: calibrate.format_hierarchy(
        sg, tt, layers, methods.draft_temperatures(calib, len(sg)), h)
    for r in table[:10]:
        print(f"{r['latency_ms']:8.2f} ms/token  {spec(r['sigma'], r['T'], r['horizontal'])}")
    best = spec(sigma, T, h)
    print(f"best: {best}: {lat:.2f} ms/token predicted vs {ar:.2f} for the target alone "
          f"({ar / lat:.2f}x); {len(table)} hierarchies searched in {dt:.2f} s")
    if args.out:
        rows = [{**r, "spec": spec(r["sigma"], r["T"], r["horizontal"])} for r in table]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"best": best, "latency_ms": lat,
                                              "target_alone_ms": ar, "ranking": rows}, indent=1))
    return 0


def register(sub) -> list:
    """Adds this module's commands to ``sub``; returns their parsers."""
    c = sub.add_parser("calibrate", help="HSD: measure each candidate drafter's cost and "
                                         "every pair's acceptance rate here; writes JSON")
    common.add_model(c)
    common.add_exits(c)
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
    common.add_horizontal(tu)
    tu.add_argument("--out", help="write the ranking as JSON")
    tu.set_defaults(fn=cmd_tune)
    return [c, tu]
