#!/usr/bin/env python3
"""Reference EAGLE-3 training of a SmolLM2-135M draft head with tails-mpt/SpecJAX on CPU.

Drives SpecJAX's own trainer (specjax.train.train) in-process and adds only:
  * a token budget: conversations are taken in file order until the budget of
    (chat-templated, truncated) tokens is reached, written to OUT/data_subset.jsonl;
  * --steps -> SpecJAX --max-steps, with enough epochs over the subset to reach it;
  * --draft-vocab-size (SpecJAX hard-codes 32000 for llama targets);
  * a wall-clock timer around every jitted micro-step (blocks on the loss), so that
    tokens/s is measured here, excluding the first two calls of each sequence bucket
    (the first compiles; the second compiles again: SpecJAX retraces once);
  * conversion of the final head into SafeAILab EAGLE-3 layout (to_eagle3.py).

Outputs in OUT/: native/final (SpecJAX checkpoint), eagle3/ (SafeAILab layout),
throughput.json, data_subset.jsonl.  Run through train_ref.sh.
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="ShareGPT JSONL ({'conversations': [...]}) ")
    p.add_argument("--token-budget", type=int, required=True,
                   help="take conversations until this many real (unpadded) tokens")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--out", required=True)
    p.add_argument("--target", required=True, help="the HF-format target (setup.sh)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--lr", type=float, default=8e-4, help="SpecJAX llama_3b config uses 8e-4")
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--keep-epoch-ckpts", action="store_true")
    return p.parse_args()


def select_subset(args, tokenizer, out_dir):
    """Same tokenisation as specjax.data.dataset.Eagle3Dataset (chat template, truncation)."""
    from specjax.data.dataset import Eagle3Dataset
    parse_msgs = Eagle3Dataset._parse_messages
    kept, n_tok = [], 0
    with open(args.data) as f:
        for line in f:
            if n_tok >= args.token_budget:
                break
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            msgs = parse_msgs(None, obj)
            if not msgs:
                continue
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
            n = len(tokenizer(text, truncation=True, max_length=args.max_length)["input_ids"])
            kept.append((line, n))
            n_tok += n
    path = out_dir / "data_subset.jsonl"
    path.write_text("".join(l + "\n" for l, _ in kept))
    return path, [n for _, n in kept]


def main():
    args = parse()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    import specjax.train as st  # runs configure_tpu_env(): only setdefault()s TPU env vars
    import jax
    from transformers import AutoTokenizer
    from specjax.data.dataset import _pad_to_bucket

    assert jax.default_backend() == "cpu", jax.default_backend()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    data_path, lens = select_subset(args, tokenizer, out_dir)
    buckets = {}
    for n in lens:
        buckets[_pad_to_bucket(n)] = buckets.get(_pad_to_bucket(n), 0) + 1
    batches_per_epoch = sum(c // args.batch_size for c in buckets.values())  # drop_last=True
    if batches_per_epoch == 0:
        sys.exit(f"budget gives {len(lens)} conversations in buckets {buckets}: "
                 f"no full batch of {args.batch_size}")
    opt_steps_per_epoch = batches_per_epoch // args.grad_accum
    if opt_steps_per_epoch == 0:
        sys.exit("fewer micro-batches per epoch than --grad-accum")
    epochs = math.ceil(args.steps / opt_steps_per_epoch)
    print(f"[ref] {len(lens)} conversations, {sum(lens)} tokens, buckets {buckets}, "
          f"{batches_per_epoch} micro-batches/epoch -> {epochs} epoch(s)", flush=True)

    # --- draft vocab override (SpecJAX hard-codes 32000) ---
    orig_cfg_fn = st._eagle3_config_from_target

    def cfg_fn(target_cfg, target_type):
        cfg = orig_cfg_fn(target_cfg, target_type)
        cfg.draft_vocab_size = args.draft_vocab_size
        return cfg
    st._eagle3_config_from_target = cfg_fn

    # --- timing wrapper around the jitted micro-step ---
    records = []

    def timed(make):
        def maker(*a, **k):
            step = make(*a, **k)

            def run(params, target_params, d2t, t2d, batch):
                jax.block_until_ready(params)  # previous optimizer update is not timed here
                t0 = time.perf_counter()
                out = step(params, target_params, d2t, t2d, batch)
                jax.block_until_ready(out)
                dt = time.perf_counter() - t0
                ids = batch["input_ids"]
                records.append({"shape": list(ids.shape), "real": int(batch["attention_mask"].sum()),
                                "padded": int(ids.size), "dt": dt, "t_end": time.perf_counter(),
                                "loss": float(out[0])})
                return out
            return run
        return maker
    st.make_train_step_ttt = timed(st.make_train_step_ttt)
    st.make_train_step = timed(st.make_train_step)

    # --- skip the per-epoch checkpoints unless asked (final/ is always written) ---
    if not args.keep_epoch_ckpts:
        orig_save = st.save_eagle3_checkpoint

        def save(params, buffers, path, *a, **k):
            if os.path.basename(path).startswith("epoch_"):
                return
            return orig_save(params, buffers, path, *a, **k)
        st.save_eagle3_checkpoint = save

    ns = argparse.Namespace(
        config=None, target_model_path=args.target, target_model_type="llama",
        draft_init_path=None, data_path=str(data_path), output_dir=str(out_dir / "native"),
        exp_name="smollm2-135m-eagle3-ref", num_epochs=epochs, learning_rate=args.lr,
        max_length=args.max_length, warmup_ratio=args.warmup_ratio, batch_size=args.batch_size,
        grad_accum_steps=args.grad_accum, log_every=args.log_every, save_every=0,
        max_steps=args.steps, ttt_length=args.ttt_length, tp=1,
        wandb_project=None, wandb_run_name=None,
    )
    t_all = time.perf_counter()
    st.train(ns)
    wall = time.perf_counter() - t_all

    # warm-up = first two calls per bucket shape: the 1st compiles, and the 2nd compiles
    # again (SpecJAX's jitted step retraces once its params come out of the optimizer)
    seen, steady = {}, []
    for r in records:
        key = tuple(r["shape"])
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 2:
            steady.append(r)
    compile_calls = [r for r in records if r not in steady]
    res = {
        "micro_steps": len(records), "optimizer_steps": len(records) // args.grad_accum,
        "batch_size": args.batch_size, "ttt_length": args.ttt_length,
        "draft_vocab_size": args.draft_vocab_size,
        "tokens_real": sum(r["real"] for r in records),
        "tokens_padded": sum(r["padded"] for r in records),
        "warmup_calls_s": [[r["shape"], round(r["dt"], 2)] for r in compile_calls],
        "steady_micro_steps": len(steady),
        "wall_s_total_incl_load": round(wall, 1),
        "losses": [round(r["loss"], 4) for r in records],
        "step_s": [round(r["dt"], 2) for r in records],
    }
    # end-to-end (train step + optimizer update + host work) after two warm-up calls;
    # only meaningful with a single bucket shape (later shapes compile inside the span)
    if len(records) > 2:
        span = records[-1]["t_end"] - records[1]["t_end"]
        res["e2e_tokens_per_s_real"] = round(sum(r["real"] for r in records[2:]) / span, 1)
        res["e2e_tokens_per_s_padded"] = round(sum(r["padded"] for r in records[2:]) / span, 1)
    if steady:
        t = sum(r["dt"] for r in steady)
        res["steady_s"] = round(t, 3)
        res["tokens_per_s_real"] = round(sum(r["real"] for r in steady) / t, 1)
        res["tokens_per_s_padded"] = round(sum(r["padded"] for r in steady) / t, 1)
    (out_dir / "throughput.json").write_text(json.dumps(res, indent=2))
    print("[ref] " + json.dumps({k: v for k, v in res.items() if k not in ("losses", "step_s")}), flush=True)
    print(f"[ref] step seconds: {res['step_s']}", flush=True)
    print(f"[ref] loss first/last: {res['losses'][0]} / {res['losses'][-1]}", flush=True)

    # --- SafeAILab EAGLE-3 layout ---
    sys.path.insert(0, str(HERE))
    import to_eagle3
    to_eagle3.convert(str(out_dir / "native" / "final"), str(out_dir / "eagle3"), args.target)
    print(f"[ref] SafeAILab-layout head -> {out_dir / 'eagle3'}", flush=True)


if __name__ == "__main__":
    main()
