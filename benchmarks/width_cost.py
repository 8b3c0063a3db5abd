"""The width-cost curve: what one target forward over ``w`` new tokens costs, with ``filled``
tokens already cached, relative to a 1-token forward (median of repeats, one process).

For each width it times the whole forward (logits included) with the shipped layout
(weights as the left operand, columns padded to ``specjax.models.ops.fast_width``) and, for comparison,
the same forward with padding switched off. At ``--breakdown`` widths it also reads an XLA
profile of the forward and sums device time per kind of operation (products with the
weights, LM head included; attention over the cache; the rest), which is where a wide round's time goes. Writes JSON and
a plot.

    .venv/bin/python benchmarks/width_cost.py --out docs/results/width_cost_cpu.json \
        --plot docs/results/width_cost_cpu.png
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import specjax  # noqa: F401
from specjax.core import encdec, tree
from specjax.models import load, ops
from specjax._timing import median_ms

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache


def _forward_fn(model):
    def fwd(params, toks, cache):
        parents = tree.chain(1, toks.shape[1] - 1)
        logits, _, c = model.forward(params, toks, tree.positions(cache.length, parents), cache,
                                     tree.attention_mask(parents))
        return logits, c.length
    return fwd


def _kind(shape: str, cfg, capacity: int) -> str:
    """Which part of the model a dot with this output shape belongs to."""
    dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0])]
    if capacity in dims or (len(dims) == 3 and dims[-1] == cfg.head_dim) \
            or (len(dims) == 4 and dims[1] == cfg.num_kv_heads):
        return "attention"
    return "weight_matmuls"


def _breakdown(fwd, args, cfg, capacity: int) -> dict[str, float]:
    """Device time (ms) per kind of operation, from an XLA profile of 5 forwards."""
    hlo = fwd.lower(*args).compile().as_text()
    shape_of = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) (?:fusion|dot)\(", line)
        if m and ("dot" in line.split("=")[1] or "ynn" in m.group(1) or "xnn" in m.group(1)):
            shape_of[m.group(1)] = m.group(2)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(5):
                jax.block_until_ready(fwd(*args))
        events = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))
    total = collections.Counter()
    for e in events["traceEvents"]:
        if e.get("ph") != "X" or "dur" not in e or e["name"].startswith(("$", "end:")):
            continue
        name = e["name"]
        if name in shape_of:
            total[_kind(shape_of[name], cfg, capacity)] += e["dur"] / 5e3
        elif name.endswith("_fusion") or re.match(r"^[a-z_\-]+(\.\d+)?$", name):
            if not name.startswith(("ThunkExecutor", "SlinkyThreadPool")):
                total["other"] += e["dur"] / 5e3
    return {k: round(v, 2) for k, v in total.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--filled", type=int, default=800)
    p.add_argument("--widths", default=",".join(map(str, range(1, 33))))
    p.add_argument("--breakdown", default="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--source-len", type=int, default=512,
                   help="encoder-decoder models: tokens of the (random) source the decoder reads")
    p.add_argument("--out")
    p.add_argument("--plot")
    args = p.parse_args()
    lm = load(args.model, tokenizer=False)
    params = lm.params
    if lm.is_encoder_decoder:  # the decoder reads a source of --source-len tokens
        ids = np.random.default_rng(0).integers(2, lm.model.config.vocab_size, args.source_len)
        params = encdec.encode(lm.model, params, [ids.tolist()])
    cache = lm.model.init_cache(1, args.capacity).replace(length=jnp.asarray([args.filled]))
    widths = [int(w) for w in args.widths.split(",")]
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "model": lm.source.name if lm.source.is_dir() else args.model,
           "source_len": args.source_len if lm.is_encoder_decoder else None,
           "capacity": args.capacity, "filled": args.filled, "padded_ms": {},
           "unpadded_ms": {}, "fast_width": {}, "breakdown_ms": {}}
    shipped = ops.fast_width  # project() reads it at trace time
    for variant, fw in (("padded_ms", shipped), ("unpadded_ms", lambda n: n)):
        ops.fast_width = fw
        fwd = jax.jit(_forward_fn(lm.model))  # a fresh trace per variant
        for w in widths:
            toks = jnp.ones((1, w), jnp.int32)
            res[variant][w] = median_ms(fwd, params, toks, cache, repeats=args.repeats)
            res["fast_width"][w] = shipped(w)
            print(f"{variant[:-3]:>8} width {w:>2}: {res[variant][w]:6.1f} ms "
                  f"({res[variant][w] / res[variant][widths[0]]:.2f}x)", flush=True)
        if variant == "padded_ms":
            for w in [int(x) for x in args.breakdown.split(",") if x]:
                toks = jnp.ones((1, w), jnp.int32)
                res["breakdown_ms"][w] = _breakdown(fwd, (params, toks, cache),
                                                    lm.model.config, args.capacity)
                print(f"breakdown width {w}: {res['breakdown_ms'][w]}", flush=True)
    ops.fast_width = shipped
    one = res["padded_ms"][widths[0]]
    res["relative_to_1"] = {w: t / one for w, t in res["padded_ms"].items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")
    if args.plot:
        _plot(res, args.plot)


def _plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split = bool(res["breakdown_ms"])  # the second panel only when there is a breakdown
    fig, axes = plt.subplots(1, 2 if split else 1, figsize=(11 if split else 6, 4))
    a, b = (axes if split else (axes, None))
    one = res["padded_ms"][min(res["padded_ms"])]
    for key, label in (("padded_ms", "shipped (weights left, padded widths)"),
                       ("unpadded_ms", "weights left, no padding")):
        ws = sorted(res[key])
        a.plot(ws, [res[key][w] / one for w in ws], marker="o", ms=3, label=label)
    a.axhline(1.3, color="gray", ls="--", lw=1, label="1.3x target")
    a.set_xlabel("new tokens in the forward (width)")
    a.set_ylabel("cost / 1-token forward")
    a.set_title(f"{res['model']}, {res['filled']} tokens cached, {res['device']}")
    a.legend(fontsize=8)
    if b is None:
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        print(f"wrote {path}")
        return
    ws = sorted(res["breakdown_ms"], key=int)
    kinds = ["weight_matmuls", "attention", "other"]
    bottom = np.zeros(len(ws))
    for k in kinds:
        v = np.array([res["breakdown_ms"][w].get(k, 0.0) for w in ws])
        b.bar([str(w) for w in ws], v, bottom=bottom, label=k)
        bottom += v
    b.set_xlabel("width")
    b.set_ylabel("device time per forward (ms)")
    b.set_title("where a forward's time goes")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
