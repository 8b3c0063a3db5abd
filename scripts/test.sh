#!/usr/bin/env bash
# Runs the whole test suite (about 30 minutes on 2 CPU cores).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
exec .venv/bin/python -m pytest -q --durations=30 "$@"
