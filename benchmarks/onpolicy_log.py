"""Appends one on-policy training run to the training log: tokens seen, held-out top-1 per
draft step on the target's own answers, and tau and speed on a fixed 12-question
Spec-Bench subset (greedy, 128 new tokens, ``ar`` and the head's method in one
interleaved ``specjax bench`` run on this machine).

    python benchmarks/onpolicy_log.py --run RUN --head HEAD --method eagle2:3,4,6:vocab=8192 \\
        --label plain --out docs/results/onpolicy_train_log.jsonl

``--head shipped`` scores the shipped head (no run: tokens seen 0). The bench report goes
next to the log, as ``onpolicy_bench/<label>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

def last_rows(run: Path) -> tuple[dict, dict]:
    """The run log's last row, and its last row with held-out scores."""
    rows = [json.loads(l) for l in (run / "log.jsonl").read_text().splitlines() if l.strip()]
    return rows[-1], [r for r in rows if "val_top1" in r][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--run", help="the run directory (`specjax train onpolicy --run`)")
    ap.add_argument("--head", required=True, help="the exported head, or 'shipped'")
    ap.add_argument("--method", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    out = Path(args.out)
    bench_out = out.parent / "onpolicy_bench" / f"{args.label}.json"
    bench_out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).with_name("specjax")), "bench", "--model", args.model, "--methods",
           f"ar,{args.method}", "--questions", args.questions, "--limit", str(args.limit),
           "--max-new-tokens", "128", "--out", str(bench_out)]
    if args.head != "shipped":
        flag = "--redrafter-checkpoint" if args.method.startswith("redrafter") else \
            "--draft-checkpoint"
        cmd += [flag, args.head]
    subprocess.run(cmd, check=True)
    rep = json.loads(bench_out.read_text())
    m, ar = rep["methods"][args.method], rep["methods"]["ar"]
    row = {"date": datetime.date.today().isoformat(), "label": args.label,
           "method": args.method, "machine": f"{platform.machine()} CPU",
           "tau_12q": round(m["tau"], 3),
           "speedup_vs_ar_12q": round(m["tokens_per_s"] / ar["tokens_per_s"], 3),
           "greedy_mismatch_vs_ar": rep.get("greedy_mismatch_vs_ar"),
           "bench": str(bench_out.relative_to(out.parent))}
    if args.run and args.method.startswith("redrafter"):  # `specjax train redrafter`'s log
        rows = [json.loads(l) for l in (Path(args.run) / "log.jsonl").read_text().splitlines()]
        val = [r for r in rows if any(k.startswith("val_acc") for k in r)][-1]
        head = json.loads((Path(args.head) / "head.json").read_text())
        accs = sorted(k for k in val if k.startswith("val_acc") and k[7:].isdigit())
        row.update(steps=rows[-1]["step"],
                   steps_x_batch_tokens=rows[-1]["step"] * head["train"]["batch_tokens"],
                   val_top1=[round(val[k], 4) for k in accs], store=head["data"])
    elif args.run:
        last, val = last_rows(Path(args.run))
        head = json.loads((Path(args.head) / "head.json").read_text())
        row.update(tokens_seen=last["tokens_seen"], rounds=last["round"],
                   epochs=last.get("epoch", 0), steps=last["step"],
                   val_top1=val["val_top1"], val_tokens=val["val_tokens"],
                   ttt=head["train"]["loss"]["k"], init=head.get("init"),
                   store=head["data"])
    else:
        row.update(tokens_seen=0)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
