#!/usr/bin/env bash
# The GPU check (issue 34): Triton kernels compiled for real against the torch reference, a
# bootstrap's steps/s and its held-out τ. Runs from a checkout without installing it, so it works
# in a GPU image that already has torch/Triton. Usage and stages: scripts/gpu_check.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-$( [ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3 )}"
exec "$py" "$root/scripts/gpu_check.py" "$@"
