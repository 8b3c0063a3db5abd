#!/usr/bin/env bash
# The prepared check of a GPU or TPU host (scripts/device_check.py): random weights of real
# shapes (SmolLM2-135M, Llama-3.1-8B, Gemma-3-270M, Gemma-4-E4B, Gemma-4-31B: the Gemma 4
# ones best apart, --shapes gemma4-e4b,gemma4-31b), offline, within a time budget (default
# 520 s of phases, first compiles included; a hard stop 90 s later), results rewritten
# after every measurement in a staging directory and moved, at the end, to
# OUT/device_check_<device>.json with a plot beside it (OUT: --out,
# else a new temporary directory, printed; committed results change only when --out names
# docs/results).
# `complete` is true only when every listed measurement ran; the summary lists the rest.
#
#   bash scripts/device_check.sh                       # on the accelerator host
#   bash scripts/device_check.sh --small --out DIR     # the same code path on a CPU (~2 min)
#   bash scripts/device_check.sh --out "$OUT"          # results elsewhere (relative: to the tree)
#   bash scripts/device_check.sh --budget 200 --shapes smollm2-135m,llama3.1-8b
#   bash scripts/device_check.sh --specbench [N]       # real weights only (not on random-
#       # weight hosts): Spec-Bench's N questions (default 60) with ar, hf, sd-ngram, eagle2,
#       # redrafter on this device, then bfloat16 against float32; files named by the device
#
# specjax is installed without dependencies and without the network (jax with its GPU/TPU
# plugin, transformers, torch and matplotlib must be there already), unless the
# interpreter's specjax is already this tree (an editable install). PYTHON picks the
# interpreter (default: .venv/bin/python, else the first of python3, python with jax).
# Python runs outside the tree (`python scripts/device_check.py` from a temporary directory
# puts scripts/ first on sys.path, not the tree), so that the tree's specjax/ folder does not
# shadow the installed package (whose specjax.models lives in models/).
set -euo pipefail
cd "$(dirname "$0")/.."
HERE=$(pwd -P)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import jax" >/dev/null 2>&1; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "no python with jax found (set PYTHON)" >&2; exit 1; }
PY=$(command -v "$PY")
case "$PY" in /*) ;; *) PY="$HERE/$PY";; esac
ELSEWHERE=$(mktemp -d)
trap 'rm -rf "$ELSEWHERE"' EXIT
INSTALLED=$(cd "$ELSEWHERE" && "$PY" -c "import pathlib, specjax; print(pathlib.Path(specjax.__file__).resolve().parent.parent)" 2>/dev/null || true)
if [ "$INSTALLED" != "$HERE" ]; then  # absent, or installed from another copy of the tree
  echo "installing specjax from $HERE (no dependencies, offline)" >&2
  "$PY" -m pip install -q --no-deps --no-build-isolation . >&2
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch share the device
# JAX may grow to 95% of the device (default 75%): Gemma-4-31B's 57.2 GiB on an 80 GB card
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}

if [ "${1:-}" = "--specbench" ]; then
  N=${2:-60}
  TAG=$(cd "$ELSEWHERE" && "$PY" -c "from specjax import bench; print(bench.device_tag())")
  if [ "$TAG" = cpu ]; then
    echo "no accelerator visible to JAX; use the CPU benchmarks (docs/results/README.md)" >&2
    exit 1
  fi
  echo "Spec-Bench on $TAG -> docs/results/*_${TAG}.json" >&2
  (cd "$ELSEWHERE" && "$PY" -m specjax.cli bench --methods "ar,hf,sd-ngram:7,eagle2:3,4,7" \
      --questions "$HERE/../shared/data/spec_bench/question.jsonl" --limit "$N" \
      --max-new-tokens 128 --out "$HERE/docs/results/specbench_${TAG}.json")
  "$PY" benchmarks/plot_bench.py "docs/results/specbench_${TAG}.json" "docs/results/specbench_${TAG}"
  "$PY" benchmarks/dtype_bench.py --limit 12 --out "docs/results/bf16_${TAG}.json"
  exit 0
fi

# A hard limit above the phases' budget: a compile that overruns its phase still ends, and
# the JSON written so far stays (SIGINT lets the check record that it was cut short).
BUDGET=520
OUT=
ARGS=()
PREV=
for a in "$@"; do
  if [ "$a" = "--small" ]; then BUDGET=300; fi
  if [ "$PREV" = "--budget" ]; then EXPLICIT=$a; fi
  if [ "$PREV" = "--out" ]; then
    case "$a" in /*) OUT=$a;; *) OUT="$HERE/$a";; esac
  elif [ "$a" != "--out" ]; then
    ARGS+=("$a")
  fi
  PREV=$a
done
BUDGET=${EXPLICIT:-$BUDGET}
if [ -z "$OUT" ]; then
  OUT=$(mktemp -d -t specjax-device-check.XXXXXX)
  echo "results go to $OUT (--out DIR to choose)" >&2
fi
HARD=$(( ${BUDGET%.*} + 90 ))
cd "$ELSEWHERE"
timeout --signal=INT --kill-after=30 "$HARD" "$PY" "$HERE/scripts/device_check.py" \
  ${ARGS[@]+"${ARGS[@]}"} --out "$OUT"
