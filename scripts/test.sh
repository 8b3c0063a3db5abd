#!/usr/bin/env bash
# Runs the whole test suite in two pytest workers (pytest-xdist; each test file stays in one
# worker, so module-scoped compiled fixtures are shared). XLA compiles on one thread, so two
# workers keep both cores busy. SPECJAX_TEST_WORKERS=0 runs it in one process.
# Tests marked "extended" are opt-in (tests/conftest.py deselects them when no -m is given):
# `bash scripts/test.sh -m slow` runs every real-weight test including those,
# `-m "extended or not extended"` everything.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
workers="${SPECJAX_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest -q --durations=30 "$@"
fi
exec .venv/bin/python -m pytest -q --durations=30 -n "$workers" --dist loadfile "$@"
