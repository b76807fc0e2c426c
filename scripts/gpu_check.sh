#!/usr/bin/env bash
# What to run first on a machine with GPUs (see scripts/gpu_check.py): the CUDA tests, then torchrun
# jobs over NCCL training a tied GPT with every method family, a checkpoint resumed, compiled
# stages, bf16, sharded replicas and tensor-parallel stages, as one table judged against one
# process. Without CUDA: one line, exit 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=python3
if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
exec "$PYTHON" scripts/gpu_check.py "$@"
