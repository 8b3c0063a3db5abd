"""An on-policy store's first rounds as conversations (ShareGPT JSON lines): each prompt
with the target's own answer to it, so another trainer reads the same data specjax trains
on (``docs/results/reference_trainer.md``).

    .venv/bin/python benchmarks/reference/store_conversations.py \
        --store data/onpolicy/smollm2-135m --prompts ../shared/data/train_prompts \
        --rounds 8 --out runs/ref/conversations.jsonl --subset runs/ref/store

``--subset`` also writes a store of those rounds alone (its manifest cut to them; the
shards linked), for ``specjax train onpolicy --shards`` to replay without decoding.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--prompts", required=True, help="the prompt files the store was made from")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--subset")
    args = ap.parse_args()
    from specjax.models import load
    from specjax.train import onpolicy

    store = Path(args.store)
    man = json.loads((store / "manifest.json").read_text())
    shards = man["shards"][:args.rounds]
    if len(shards) < args.rounds:
        raise SystemExit(f"{store} holds {len(man['shards'])} rounds, not {args.rounds}")
    text = dict(onpolicy.prompt_pool(args.prompts, sources=man.get("prompts", {}).get("sources")))
    tok = load(args.model).tokenizer
    rows, tokens = [], 0
    for s in shards:
        z = np.load(store / s["file"])
        ends = np.cumsum(z["lengths"])
        for pid, e, n, pl in zip(s["prompt_ids"], ends, z["lengths"], z["prompt_lens"]):
            answer = z["tokens"][e - n + pl:e].astype(int).tolist()
            prompt = text[pid]
            turns = ([{"from": "human", "value": prompt}] if isinstance(prompt, str) else
                     [{"from": "human" if m["role"] == "user" else m["role"],
                       "value": m["content"]} for m in prompt])
            turns.append({"from": "gpt", "value": tok.decode(answer, skip_special_tokens=True)})
            rows.append({"id": pid, "conversations": turns})
            tokens += int(n)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} conversations, {tokens} tokens in the store's rendering -> {args.out}")
    if args.subset:
        sub = Path(args.subset)
        sub.mkdir(parents=True, exist_ok=True)
        for f in [s["file"] for s in shards] + ([man["val"]["file"]] if "val" in man else []):
            if not (sub / f).exists():
                os.symlink((store / f).resolve(), sub / f)
        (sub / "manifest.json").write_text(json.dumps({**man, "shards": shards}, indent=1))


if __name__ == "__main__":
    main()
