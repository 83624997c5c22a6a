#!/usr/bin/env bash
# GPU check: run from the repository root on a machine with an NVIDIA GPU (a few minutes).
# Installs the package without touching an existing CUDA build of torch, then runs the checks.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps -e . 2>/dev/null || true
python3 -m pip install -q optuna pandas nvidia-ml-py 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py
