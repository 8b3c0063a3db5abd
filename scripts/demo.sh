#!/usr/bin/env bash
# The main job: decode a real prompt with SmolLM2-135M-Instruct and print text and tokens/s.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
exec "$root/.venv/bin/specjax" demo "$@"
