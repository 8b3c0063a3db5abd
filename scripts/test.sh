#!/usr/bin/env bash
# Runs the whole test suite in two pytest workers (pytest-xdist; each test file stays in one
# worker, so module-scoped compiled fixtures are shared). XLA compiles on one thread, so two
# workers keep both cores busy. SPECJAX_TEST_WORKERS=0 runs it in one process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
workers="${SPECJAX_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest -q --durations=30 "$@"
fi
exec .venv/bin/python -m pytest -q --durations=30 -n "$workers" --dist loadfile "$@"
