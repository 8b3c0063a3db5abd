"""The ``specjax`` command: demo, generate and bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path



def _dtype(name: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


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
        return (lambda ids, **kw: specjax.generate(lm.model, lm.params, [ids], **kw)), None
    drafter = drafters.from_spec(args.drafter, lm.model, args.draft_len)
    run = lambda ids, **kw: specjax.speculative_generate(lm.model, lm.params, drafter, None,
                                                         [ids], **kw)
    return run, args.drafter


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
           "text": lm.tokenizer.decode(toks, skip_special_tokens=True), "token_ids": toks,
           "prompt_tokens": len(ids), "new_tokens": len(toks), "seconds": dt,
           "tokens_per_s": len(toks) / dt, "compile_s": compile_s, "tau": 1.0,
           "target_forwards": len(toks), "acceptance_by_position": None}
    if drafter is not None:
        res.update(tau=out.tau, target_forwards=int(out.target_forwards[0]),
                   acceptance_by_position=out.acceptance_by_position().tolist())
    return res


def cmd_generate(args) -> int:
    from specjax.models import load

    lm = load(args.model, _dtype(args.dtype))
    ids = lm.encode(args.prompt, chat=args.chat)
    res = _generate_once(lm, ids, args)
    if args.json:
        print(json.dumps(res))
    else:
        print(res["text"])
        print(f"\n[{res['method']}] {res['new_tokens']} tokens in {res['seconds']:.2f} s = "
              f"{res['tokens_per_s']:.1f} tok/s (compile {res['compile_s']:.1f} s, excluded)",
              file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from specjax import bench
    from specjax.models import load

    print(f"loading {args.model} ...", flush=True)
    lm = load(args.model, _dtype(args.dtype))
    prompt = args.prompt or next(q.text for q in bench.load_questions()
                                 if q.category == "summarization")
    ids = lm.encode(prompt, chat=True)
    print(f"prompt ({len(ids)} tokens): {prompt[:200]}{'...' if len(prompt) > 200 else ''}")
    runs = {}
    for method in ("ar", "sd"):
        args.method = method
        print(f"[{method}] compiling and decoding {args.max_new_tokens} tokens ...", flush=True)
        runs[method] = _generate_once(lm, ids, args)
    ar, sd = runs["ar"], runs["sd"]
    print("\n" + sd["text"] + "\n")
    for r in (ar, sd):
        name = r["method"] + (f" ({r['drafter']} drafter)" if r["drafter"] else "")
        print(f"{name:<22} {r['new_tokens']} tokens in {r['seconds']:.2f} s = "
              f"{r['tokens_per_s']:.1f} tok/s, tau {r['tau']:.2f} tokens/forward "
              f"(compile {r['compile_s']:.1f} s, excluded)")
    print(f"speedup of sd over ar: {sd['tokens_per_s'] / ar['tokens_per_s']:.2f}x")
    if args.temperature > 0:
        return 0
    same = ar["token_ids"] == sd["token_ids"]
    print(f"greedy sd output is {'identical to' if same else 'DIFFERENT FROM'} ar")
    return 0 if same else 1


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from specjax import bench
    from specjax.models import load

    from specjax import drafters

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    known = {"ar", "hf", "hf-pld"}
    bad = [m for m in methods if m not in known and not m.startswith("sd-")]
    if bad:
        raise SystemExit(f"unknown methods {bad}; available: {sorted(known)} and "
                         f"sd-ngram, sd-early-exit:L")
    questions = bench.load_questions(args.questions, args.categories, args.limit)
    lm = load(args.model, _dtype(args.dtype))
    threads = args.threads or os.cpu_count() or 1
    hf = bench.load_hf(lm) if {"hf", "hf-pld"} & set(methods) else None
    runners = {"ar": lambda: bench.ar_method(lm), "hf": lambda: bench.hf_method(lm, threads, hf),
               "hf-pld": lambda: bench.hf_pld_method(lm, threads, hf)}
    for m in methods:
        if m.startswith("sd-"):
            d = drafters.from_spec(m[3:], lm.model, args.draft_len)
            d.check(lm.model)
            runners[m] = lambda d=d: bench.sd_method(lm, d)
    run = {m: runners[m]() for m in methods}
    results = {m: [] for m in methods}
    mismatches = []
    bar = tqdm(total=len(questions) * len(methods), desc="bench", unit="run")
    for q in questions:
        ids = lm.encode(q.text, chat=True)
        for m in methods:
            bar.set_postfix_str(f"{q.category} {m}")
            results[m].append((q, run[m](ids, args.max_new_tokens)))
            bar.update()
        if "ar" in results:
            for m in methods:  # every greedy method must reproduce ar
                if results[m][-1][1].tokens != results["ar"][-1][1].tokens:
                    mismatches.append({"question": q.qid, "method": m})
    bar.close()
    summary = bench.summarize(results)
    print(bench.format_table(summary))
    report = {"model": args.model, "dtype": args.dtype, "batch": 1, "greedy": True,
              "max_new_tokens": args.max_new_tokens, "threads": threads,
              "questions": args.questions or "specjax/data/prompts.jsonl",
              "n_questions": len(questions), "machine": bench.machine_info(),
              "methods": summary, "greedy_mismatch_vs_ar": mismatches,
              "draft_len": args.draft_len}
    if "ar" in summary:
        import jax

        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(lm.params))
        # the tied embedding is read once as the LM head; lookups read single rows
        bw = bench.copy_bandwidth()
        bound = bw / weight_bytes
        report["bandwidth"] = {"copy_GBps": bw / 1e9, "weight_bytes": int(weight_bytes),
                               "bound_tokens_per_s": bound,
                               "ar_fraction_of_bound": summary["ar"]["tokens_per_s"] / bound,
                               "method": "best of 5 multi-threaded numpy copies of 256 MiB, "
                                         "read + written bytes"}
        print(f"\nbandwidth: {bw / 1e9:.1f} GB/s copy; weights {weight_bytes / 1e6:.0f} MB/token "
              f"-> bound {bound:.1f} tok/s; ar reaches {100 * summary['ar']['tokens_per_s'] / bound:.0f}%")
    if mismatches:
        print(f"note: greedy outputs differ from ar: {mismatches}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specjax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s, max_new=128):
        s.add_argument("--model", default="smollm2-135m",
                       help="registered name, .gguf file or HF directory")
        s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
        s.add_argument("--max-new-tokens", type=int, default=max_new)

    def sampling(s):
        s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        s.add_argument("--top-k", type=int, default=0)
        s.add_argument("--top-p", type=float, default=1.0)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--method", default="ar", choices=["ar", "sd"],
                       help="ar: one token per forward; sd: speculative decoding")
        s.add_argument("--drafter", default="ngram", help="for sd: ngram | early-exit:L")
        s.add_argument("--draft-len", type=int, help="draft tokens per round (default: the "
                                                      "drafter's own)")

    g = sub.add_parser("generate", help="decode one prompt")
    common(g)
    sampling(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="decode a real prompt and show tokens/s")
    common(d)
    sampling(d)
    d.add_argument("--prompt", help="default: the built-in summarization prompt")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="tokens/s of methods side by side")
    common(b)
    b.add_argument("--methods", default="ar,hf",
                   help="comma-separated: ar, hf, hf-pld, sd-ngram, sd-early-exit:L")
    b.add_argument("--draft-len", type=int, help="draft tokens per round for sd-* methods")
    b.add_argument("--questions", help="Spec-Bench question.jsonl (default: built-in prompts)")
    b.add_argument("--categories", nargs="*", help="e.g. mt_bench translation summarization qa "
                                                   "math_reasoning rag")
    b.add_argument("--limit", type=int, help="questions in total, spread over categories")
    b.add_argument("--threads", type=int, help="torch threads for hf (default: all cores)")
    b.add_argument("--out", help="write the JSON report here")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
