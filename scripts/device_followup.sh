#!/usr/bin/env bash
# Two short runs after `bash scripts/device_check.sh` on the same accelerator host, each a
# new process on SmolLM2-135M's shape (ar, sd-ngram:7, eagle2:3,4,7; no transformers, no
# width curve beyond 1):
#   second/  the same XLA flags: the persistent compilation cache the first run filled
#            makes every compile a cache read (compile_s per method);
#   cmdbuf/  XLA:GPU command buffers over loops and conditionals too
#            (--xla_gpu_enable_command_buffer with WHILE and CONDITIONAL): time per round
#            and per ar step against second/'s, measured minutes apart on the same device.
#
#   bash scripts/device_followup.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: device_followup.sh OUT_DIR}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")/.." && pwd -P)
case "$OUT" in /*) ;; *) OUT="$HERE/$OUT";; esac
cd "$(mktemp -d)"  # the installed specjax, not the tree's folder (sys.path[0] is scripts/)
ARGS=(--shapes smollm2-135m --methods "ar,sd-ngram:7,eagle2:3,4,7" --widths 1 --no-hf
      --law-rows 0 --batch 1 --budget 60)
timeout --signal=INT 90 "$PY" "$HERE/scripts/device_check.py" "${ARGS[@]}" --out "$OUT/second"
CMDBUF=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=$CMDBUF" \
  timeout --signal=INT 90 "$PY" "$HERE/scripts/device_check.py" "${ARGS[@]}" --out "$OUT/cmdbuf"
