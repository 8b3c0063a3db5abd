#!/usr/bin/env bash
# Creates or refreshes .venv-dflash: the reference environment for the DFlash fixtures
# (tests/data/dflash_ref), separate from the project's .venv. It holds torch 2.13.0 (CPU),
# transformers 4.57.1 (z-lab's pin) and z-lab/dflash at commit 44947fb.
#
# PyPI's dflash 0.1.0 is NOT that code (its model.py is a later rewrite: sdpa only, rejection
# sampling, DFlash2, transformers 5.x), so dflash is installed from a z-lab/dflash source:
#   DFLASH_SRC=<a checkout, or a (bare) git repository holding the commit>  (optional), else
#   the GitHub repository at that commit.
# Only dflash/model.py is used (dflash/__init__.py imports lazily), so dflash goes in with
# --no-deps: its benchmark dependencies (datasets, rich, loguru, ...) are not needed.
# Re-installs only when this script changed since the last run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
commit=44947fbf71114e241c96de194f4b382b5dd330d0
venv=.venv-dflash
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
stamp="$venv/.dflash-ref-installed"
want="$(cat scripts/dflash_ref_env.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[dflash-ref-env] installing torch, transformers 4.57.1 and z-lab/dflash@${commit:0:7} into $venv ..." >&2
  log="$(mktemp)"; tmp="$(mktemp -d)"
  trap 'rm -rf "$log" "$tmp"' EXIT
  pipq() {  # quiet pip: prints its log only when it fails
    if ! "$venv/bin/python" -m pip "$@" >"$log" 2>&1; then
      grep -v "is ignored: it is neither" "$log" >&2; return 1
    fi
  }
  pipq install -q --upgrade pip
  # torch first and pinned, so that nothing later pulls a (CUDA) build of a newer torch.
  pipq install -q "torch==2.13.0" numpy
  pipq install -q "transformers==4.57.1" "torch==2.13.0"
  src="${DFLASH_SRC:-}"
  if [ -n "$src" ] && git -C "$src" cat-file -e "$commit^{commit}" 2>/dev/null; then
    git -C "$src" archive "$commit" | tar -x -C "$tmp"
    pipq install -q --no-deps "$tmp"
  elif [ -n "$src" ]; then
    pipq install -q --no-deps "$src"
  else
    pipq install -q --no-deps "git+https://github.com/z-lab/dflash.git@$commit"
  fi
  echo "$want" > "$stamp"
fi
