#!/usr/bin/env bash
# What to run first on a machine with a GPU (see scripts/gpu_check.py): the CUDA tests, then every
# method on one GPU in fp32 and bf16, as a table. Without CUDA: one line, exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=python3
if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
exec "$PYTHON" scripts/gpu_check.py "$@"
