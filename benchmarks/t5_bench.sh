#!/usr/bin/env bash
# T5 on random weights in public shapes (no T5 weights install here): ar tok/s against
# transformers' generate in the same interleaved run, and the decoder's verification
# width-cost curve. Speed only: random weights say nothing about acceptance.
#   bash benchmarks/t5_bench.sh [runs/t5]    # writes docs/results/t5_*_cpu.json and plots
set -euo pipefail
cd "$(dirname "$0")/.."
DIRS=${1:-runs/t5}
PY=.venv/bin/python
for shape in t5-small flan-t5-base; do
  dir="$DIRS/$shape-random"
  [ -f "$dir/model.safetensors" ] || $PY -c "from specjax.models.t5_random import save_random; save_random('$dir', '$shape', seed=0)"
  tag=${shape//-/_}
  .venv/bin/specjax bench --model "$dir" --methods ar,hf --random-prompts 8 --prompt-len 256 \
      --max-new-tokens 64 --out "docs/results/${tag}_random_bench_cpu.json"
  $PY benchmarks/width_cost.py --model "$dir" --widths 1,2,3,4,6,8,12,16 --breakdown "" \
      --repeats 5 --capacity 256 --filled 64 --source-len 256 \
      --out "docs/results/${tag}_width_cost_cpu.json" --plot "docs/results/${tag}_width_cost_cpu.png"
done
