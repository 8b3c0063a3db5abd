"""On-policy throughput on an accelerator: the target's batched greedy decoding with the
head's features kept, then the head's training on what was decoded, on random weights of a
real shape (Llama-3.1-8B, bfloat16; its layers unrolled, as ``load`` makes them, or under
one ``lax.scan`` with ``--scan-layers``).

Decoding is ``specjax.train.onpolicy.decode_round`` (what ``specjax train onpolicy`` runs
each round) at each ``--batches`` size, on random prompts of ``--prompt-len`` tokens and
``--max-new-tokens`` new tokens (no EOS in random weights: every row runs to its budget),
with the streams an EAGLE-3 head reads. Training is the run's own jitted step
(``onpolicy.make_step``: an EAGLE-3 head of the published Llama-3.1-8B head's shapes,
float32, AdamW, training-time test ``k = 3``, draft vocabulary ``--draft-vocab``) over the
largest batch's examples, one pass in minibatches of each ``--batch-tokens``. Every
shape runs once before it is timed (compile excluded; the first call's time is kept as
``first_call_s``). Plain ``ar`` (``specjax.generate``: no features) at ``--ar-batches``
is the reference for decoding. A round's throughput is its answer tokens over decoding plus one pass
of training. Results are rewritten after every measurement; what the ``--budget`` left
out is listed under ``not_run`` and ``complete`` is false.

    python benchmarks/onpolicy_device.py --out docs/results/onpolicy_device_h200.json
    python benchmarks/onpolicy_device.py --small --out /tmp/op.json   # the same path on a CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from specjax.train import onpolicy, ttt

import specjax
from specjax import bench

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def failed(rep, what: str, e: Exception) -> None:
    """Records a measurement that raised (out of device memory) in ``rep`` (the device
    check's ``Report``); the others still run."""
    rep.data["not_run"].append(what)
    rep.data.setdefault("errors", {})[what] = f"{type(e).__name__}: {str(e)[:400]}"
    rep.save()
    print("failed", what, rep.data["errors"][what], flush=True)


def timed(fn):
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t


def device_and_host(lm, prompts, new: int, layers) -> dict:
    """``decode_round``'s parts: the jitted loop on the device, then its outputs' copy to
    host memory (the rest is building the examples on the host)."""
    from specjax.train import distill

    x = distill.prepare(lm.model, prompts, new, eos_ids=lm.eos_ids, chunk=64)
    outs, dev = timed(lambda: distill._ANSWER(
        lm.params, x.tokens, x.lengths, x.budgets, x.eos, model=lm.model, capacity=x.capacity,
        max_out=x.max_out, chunk=64, layers=tuple(layers))[0])
    _, host = timed(lambda: [np.asarray(a) for a in outs])
    return {"device_loop_s": round(dev, 3), "copy_to_host_s": round(host, 3)}


def rate_rows(rep, key: str, lm, batches, prompt_len: int, deadline: float, run, answers,
              extra=None) -> dict:
    """``rep.data[key]``'s rows: ``run(prompts)`` at each batch size of random prompts, once
    to compile, then timed; ``answers(out)`` counts its answer tokens and ``extra(prompts)``
    adds fields. Returns each batch size's output."""
    vocab, outs = lm.model.config.vocab_size, {}
    for b in batches:
        if time.perf_counter() > deadline:
            rep.data["not_run"].append(f"{key} batch {b}")
            continue
        prompts = [list(q.ids) for q in bench.random_questions(b, prompt_len, vocab, seed=b)]
        try:
            _, first = timed(lambda p=prompts: run(p))
            out, s = timed(lambda p=prompts: run(p))
        except jax.errors.JaxRuntimeError as e:
            failed(rep, f"{key} batch {b}", e)
            continue
        outs[b] = out
        n = answers(out)
        row = {"batch": b, "answer_tokens": n, "seconds": round(s, 3),
               "tokens_per_s": round(n / s, 1), "first_call_s": round(first, 1),
               **(extra(prompts) if extra else {})}
        rep.data[key].append(row)
        rep.save()
        print(key, row, flush=True)
    return outs


def one_pass(step, state, tparams, arrays, vids):
    """``(state, metrics, first step's seconds, seconds of a pass after it)``: the host
    arrays go to the device at each step, as in a run."""
    (state, _), first = timed(lambda: step(state, tparams, *arrays[0], vids))
    t = time.perf_counter()
    for a in arrays:
        state, metrics = step(state, tparams, *a, vids)
    jax.block_until_ready(state)
    return state, metrics, first, time.perf_counter() - t


def train_rows(lm, examples, batch_tokens, draft_vocab: int, deadline: float, rep):
    """One pass of the head's training over ``examples`` at each minibatch size."""
    kind, target = ttt.EAGLE3, lm.model
    vids = jnp.arange(draft_vocab, dtype=jnp.int32)
    for bt in batch_tokens:
        if time.perf_counter() > deadline:
            rep.data["not_run"].append(f"train batch_tokens {bt}")
            continue
        cfg = onpolicy.OnPolicyConfig(batch_tokens=bt, draft_vocab=draft_vocab,
                                      loss=ttt.LossConfig(k=3))
        opt = onpolicy.optimizer(cfg)
        params = onpolicy.init_params(kind, target.config, cfg)
        state = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0)}
        step = onpolicy.make_step(kind, target, cfg, opt)
        plan = onpolicy.minibatches(examples, bt, 0)
        arrays = [onpolicy.batch_arrays(examples, idx) for idx in plan]
        try:
            state, metrics, first, s = one_pass(step, state, lm.params, arrays, vids)
        except jax.errors.JaxRuntimeError as e:  # out of device memory: recorded; others run
            failed(rep, f"train batch_tokens {bt}", e)
            continue
        trained = int(sum(a[2].sum() for a in arrays))
        row = {"batch_tokens": bt, "steps": len(arrays), "rows_per_step": len(plan[0]),
               "trained_tokens": trained, "seconds": round(s, 3),
               "tokens_per_s": round(trained / s, 1), "first_step_s": round(first, 1),
               "loss": round(float(metrics["loss"]), 3),
               "head_params": int(sum(x.size for x in jax.tree.leaves(params)))}
        rep.data["train"].append(row)
        rep.save()
        print("train", row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b")
    ap.add_argument("--small", action="store_true", help="a tiny Llama (CPU test of the path)")
    ap.add_argument("--batches", default="1,64,256,128")
    ap.add_argument("--batch-tokens", default="8192,16384")
    ap.add_argument("--ar-batches", default="1,256", help="plain ar's batch sizes ('' for none)")
    ap.add_argument("--parts", action="store_true",
                    help="also time decoding's device loop and its copy to the host")
    ap.add_argument("--scan-layers", action="store_true", help="the layers under one lax.scan")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--budget", type=float, default=330.0, help="seconds; then stop starting")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    deadline = time.perf_counter() + args.budget
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the device check
    from device_check import Report, _shapes, random_model

    name = "tiny-llama" if args.small else args.shape
    shape = _shapes(args.small)[name]
    lm, init_s = timed(lambda: random_model(name, shape, scan_layers=args.scan_layers))
    layers = ttt.EAGLE3.layers(lm.model.config)
    draft_vocab = min(args.draft_vocab, lm.model.config.vocab_size)
    rep = Report(Path(args.out), {
        "shape": name, "device": bench.device_info(), "weights": "random, real shape",
        "dtype": str(np.dtype(shape["dtype"])), "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens, "feature_layers": list(layers),
        "head": {"kind": "eagle3", "ttt_k": 3, "draft_vocab": draft_vocab, "dtype": "float32"},
        "scan_layers": args.scan_layers,
        "init_s": round(init_s, 1), "ar": [], "decode": [], "train": [], "not_run": [],
        "complete": False})  # written now, and after every measurement
    ints = lambda text: [int(x) for x in text.split(",") if x]
    new = args.max_new_tokens
    decode_end = time.perf_counter() + 0.55 * (deadline - time.perf_counter())
    decoded = rate_rows(rep, "decode", lm, ints(args.batches), args.prompt_len, decode_end,
                        lambda p: onpolicy.decode_round(lm, p, new, layers),
                        lambda ex: sum(len(t) - pl for t, pl, _ in ex),
                        (lambda p: device_and_host(lm, p, new, layers)) if args.parts else None)
    if not decoded:
        rep.data["not_run"] += [f"train batch_tokens {bt}" for bt in ints(args.batch_tokens)]
    else:  # the largest batch's examples
        train_rows(lm, decoded[max(decoded)], ints(args.batch_tokens), draft_vocab, deadline,
                   rep)
    rate_rows(rep, "ar", lm, ints(args.ar_batches), args.prompt_len, deadline,
              lambda p: specjax.generate(lm.model, lm.params, p, max_new_tokens=new,
                                         eos_ids=lm.eos_ids).to_lists(),
              lambda out: sum(len(t) for t in out))
    d = {r["batch"]: r for r in rep.data["decode"]}
    if rep.data["train"] and d:
        big = d[max(d)]
        rep.data["round"] = [
            {"batch": big["batch"], "batch_tokens": t["batch_tokens"],
             "answer_tokens_per_s": round(big["answer_tokens"]
                                          / (big["seconds"] + t["seconds"]), 1)}
            for t in rep.data["train"]]
    rep.data["complete"] = not rep.data["not_run"]
    rep.save()
    print(json.dumps({k: rep.data[k] for k in ("ar", "decode", "train", "not_run", "complete")}
                     | {"round": rep.data.get("round")}, indent=1))


if __name__ == "__main__":
    main()
