"""Compile time and steady-state speed of every decoding method, by verification-width
policy (``specjax.core.widths``) and layer layout (unrolled vs ``lax.scan``).

For each method, width policy and layout it decodes the prompts through the host wrappers
(``generate``, ``speculative_generate``, ``hsd_generate``) at one pinned cache size, so the
first call compiles once: ``compile_s`` is that call's ahead-of-time lowering plus XLA
compilation (``specjax._compile.AotCache``); the prompts are then decoded again, already
compiled, for ms per round and per token. Executables are dropped between
configurations. EAGLE-2 uses the shipped head when it loads (else a random one, noted);
ReDrafter a random head (none ships), so its tau is not meaningful, only its costs.

    .venv/bin/python benchmarks/compile_times.py --out docs/results/compile_times_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

import specjax
from specjax import _compile, bench, methods
from specjax.core import widths as width_policy
from specjax.drafters import eagle, redrafter
from specjax.hsd import calibrate, hsd_generate
from specjax.models import llama, load

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

METHODS = ("ar,sd-ngram:7,eagle2:2,2,3,eagle2:3,4,7,redrafter:1,3,redrafter:4,4,"
           "hsd:ngram:7,target,hsd:ngram:4,12:3,target")


def split_methods(spec: str) -> list[str]:
    """The CLI's own splitting of ``--methods`` (commas inside a method's sizes)."""
    return methods.split(spec)


def scanned(lm):
    """``lm`` with its layers stacked and run under ``lax.scan``."""
    model = dataclasses.replace(lm.model, scan_layers=True)
    return dataclasses.replace(lm, model=model, params=llama.stack_layers(lm.params))


def drafter_for(method: str, lm):
    """``(drafter, dparams, note)`` for an ``sd-``, ``eagle2`` or ``redrafter`` method, as
    ``specjax.methods`` builds them, heads aside."""
    spec = methods.parse(method)
    if spec.kind == "sd":
        built = methods.build(spec, lm)
        return built.decoder.drafter, None, None
    if spec.kind == "eagle2":
        try:
            d, dp = methods.load_drafter(spec, lm, lm.name)
            return d, dp, "shipped head"
        except Exception as e:  # noqa: BLE001 -- heads are optional here: costs are what we time
            head = eagle.init_head(lm.model.config, jax.random.key(0))
            return (eagle.EagleDrafter(lm.model, **spec.drafter_kwargs()),
                    eagle.draft_params(head, lm.model, lm.params),
                    f"random head ({type(e).__name__})")
    opts = spec.drafter_kwargs()
    head = redrafter.init_head(lm.model.config.hidden_size, 8192, jax.random.key(0))
    ids = np.arange(8192, dtype=np.int32)
    return (redrafter.RedrafterDrafter(lm.model, **opts), redrafter.draft_params(head, ids),
            "random head, 8192-token draft vocabulary")


def runner(method: str, lm, policy: str | None, cache_size: int, budget: int):
    """``(fn(ids) -> output, info)`` decoding one prompt with ``method``."""
    kw = dict(max_new_tokens=budget, eos_ids=(), cache_size=cache_size)
    if method == "ar":
        return (lambda ids: specjax.generate(lm.model, lm.params, [ids], **kw)), {}
    if method.startswith("hsd:"):
        spec = method.partition(":")[2]
        layers = [4, 8, 12, 16, 20, 24]
        sigma, T = calibrate.parse_hierarchy(spec, layers)
        h, hp = calibrate.hierarchy_from(sigma, T, layers, {})
        h.check(lm.model)
        info = {"levels": [type(l).__name__ + (f"({l.layer})" if getattr(l, "layer", None)
                                               else "") for l in h.levels],
                "T": list(h.T), "verify_width_per_level": [m + 1 for m in h.buffer[1:]]}
        return (lambda ids: hsd_generate(lm.model, lm.params, h, [ids], hparams=hp, **kw)), info
    d, dp, note = drafter_for(method, lm)
    d.check(lm.model)
    ws = width_policy.resolve(d, policy)
    info = {"widths": list(ws), "head": note}
    return (lambda ids: specjax.speculative_generate(lm.model, lm.params, d, dp, [ids],
                                                     widths=policy, **kw)), info


def measure(fn, prompts, repeats: int) -> tuple[list, dict]:
    """Compile on the first prompt, then time every prompt already compiled, ``repeats``
    times over: the fastest pass is reported (the one least disturbed by other work on a
    shared machine), and the median next to it."""
    t = time.perf_counter()
    first = fn(prompts[0])
    first.tokens.block_until_ready()
    wall_first = time.perf_counter() - t
    passes = []
    for _ in range(repeats):
        secs, toks, rounds, outs = 0.0, 0, 0, []
        for ids in prompts:
            t = time.perf_counter()
            out = fn(ids)
            out.tokens.block_until_ready()
            secs += time.perf_counter() - t
            assert out.compile_s == 0.0, "recompiled for another prompt"
            n = int(out.lengths[0])
            fwd = int(out.forwards[-1]) if hasattr(out, "forwards") else int(
                getattr(out, "target_forwards", out.lengths)[0])
            toks, rounds = toks + n, rounds + fwd
            outs.append(out.to_lists()[0])
        passes.append(secs)
    secs, med = min(passes), float(np.median(passes))
    return outs, {"compile_s": round(first.compile_s, 2), "first_call_s": round(wall_first, 2),
                  "new_tokens": toks, "target_forwards": rounds, "tau": round(toks / rounds, 3),
                  "ms_per_token": round(1000 * secs / toks, 2),
                  "ms_per_token_median": round(1000 * med / toks, 2),
                  "ms_per_target_forward": round(1000 * secs / rounds, 2),
                  "tokens_per_s": round(toks / secs, 2), "repeats": repeats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--widths", default="per-width,padded,auto",
                   help="width policies for speculative methods (a policy that resolves to "
                        "widths already measured for the method is skipped)")
    p.add_argument("--layers", default="unrolled,scan")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--cache-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts "
                   "(the fastest is reported, the median too)")
    p.add_argument("--note", default="", help="recorded as is (e.g. that the machine was shared)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    base = load(a.model)
    lms = {"unrolled": base, "scan": scanned(base)}
    qs = bench.load_questions(None, None, a.prompts)
    prompts = [base.encode(q.text, chat=base.has_chat_template) for q in qs]
    report = {"model": a.model, "backend": jax.default_backend(),
              "devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
              "machine": {"platform": platform.platform(), "cpu_count": __import__("os").cpu_count()},
              "note": a.note, "prompts": [q.qid for q in qs], "prompt_tokens": [len(x) for x in prompts],
              "max_new_tokens": a.max_new_tokens, "cache_size": a.cache_size,
              "runs": []}
    ar_tokens = {}
    for method in split_methods(a.methods):
        spec_method = not (method == "ar" or method.startswith("hsd"))
        for layers in a.layers.split(","):
            lm = lms[layers]
            policies = a.widths.split(",") if spec_method else [None]
            seen = set()
            for policy in policies:
                fn, info = runner(method, lm, policy, a.cache_size, a.max_new_tokens)
                key = tuple(info.get("widths", ()))
                if spec_method and key in seen:
                    continue  # resolves to widths already measured for this method
                seen.add(key)
                toks, m = measure(fn, prompts, a.repeats)
                r = {"method": method, "layers": layers, "widths_policy": policy, **info, **m}
                if method == "ar":
                    ar_tokens.setdefault(layers, toks)
                r["equals_ar"] = toks == ar_tokens.get("unrolled", toks)
                report["runs"].append(r)
                print(json.dumps(r), flush=True)
                _compile.clear_all()
                Path(a.out).write_text(json.dumps(report, indent=1))
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
