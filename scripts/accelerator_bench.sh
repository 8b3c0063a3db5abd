#!/usr/bin/env bash
# Spec-Bench on a GPU or TPU host: the same interleaved benchmark as on CPU (ar, HF
# transformers on the same device, the n-gram drafter, EAGLE-2; outputs checked against
# ar), then bfloat16 against float32. No ReDrafter head ships; add redrafter:1,3 to the
# methods and --redrafter-checkpoint DIR for a head of your own. Results name the device
# in their JSON ("machine": backend, device_kind, jax_devices) and in their file names.
#   bash scripts/accelerator_bench.sh [N_QUESTIONS]     # default 60 (all of Spec-Bench's here)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-60}
bash scripts/env.sh
PY=.venv/bin/python
JAXV=$($PY -c "import jax; print(jax.__version__)")
if command -v nvidia-smi >/dev/null 2>&1; then
  $PY -m pip install -q "jax[cuda12]==$JAXV"       # the CUDA plugin of the same JAX
elif [ -e /dev/accel0 ] || [ -n "${TPU_NAME:-}" ]; then
  $PY -m pip install -q "jax[tpu]==$JAXV"
fi
KIND=$($PY -c "import jax; d = jax.devices()[0]; print(jax.default_backend(), d.device_kind)")
case "$KIND" in
  cpu*) echo "no accelerator visible to JAX (backend: $KIND); use the CPU benchmarks" >&2; exit 1;;
esac
TAG=$(echo "$KIND" | tr 'A-Z ' 'a-z_' | tr -cd 'a-z0-9_-')
echo "benchmarking on: $KIND -> docs/results/*_${TAG}.json" >&2
.venv/bin/specjax bench --methods "ar,hf,sd-ngram:7,eagle2:3,4,7" \
    --questions ../shared/data/spec_bench/question.jsonl --limit "$N" --max-new-tokens 128 \
    --out "docs/results/specbench_${TAG}.json"
$PY scripts/plot_bench.py "docs/results/specbench_${TAG}.json" "docs/results/specbench_${TAG}"
$PY scripts/dtype_bench.py --limit 12 --out "docs/results/bf16_${TAG}.json"
