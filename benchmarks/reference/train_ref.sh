#!/usr/bin/env bash
# usage: benchmarks/reference/train_ref.sh WORK_DIR DATA.jsonl TOKEN_BUDGET STEPS OUT_DIR [train_ref.py flags]
# Trains a SmolLM2-135M EAGLE-3 head with tails-mpt/SpecJAX (WORK_DIR from setup.sh) on the
# CPU, with every core, as specjax's own runs are timed; writes OUT_DIR/throughput.json,
# OUT_DIR/native/final (its checkpoint) and OUT_DIR/eagle3 (SafeAILab/EAGLE's layout).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
[ $# -ge 5 ] || { sed -n 2,5p "$0"; exit 2; }
work="$1"; data="$2"; budget="$3"; steps="$4"; out="$5"; shift 5
export JAX_PLATFORMS=cpu TOKENIZERS_PARALLELISM=false
mkdir -p "$out"
"$work/venv/bin/python" "$here/train_ref.py" --target "$work/smollm2-hf" --data "$data" \
    --token-budget "$budget" --steps "$steps" --out "$out" "$@" 2>&1 | tee "$out/train.log"
