#!/usr/bin/env bash
# One command for a CUDA machine: install what is needed, run every GPU test, the kernel sweep with
# its peers, a kernels on/off A/B of a real training step and (with 2 GPUs) sequence parallelism at
# 32k, and write one markdown report with the
# numbers and the GPU's name (bench/results/gpu-report.md, or $LIGER_GPU_OUT/gpu-report.md).
#
#     bash bench/gpu.sh
#
# Without a GPU it says so in one line and exits 0. Environment: LIGER_TORCH (the torch to install,
# default torch==2.13.0, whose Linux wheel is the CUDA build), LIGER_GPU_OUT (the output folder),
# LIGER_PYTHON (an interpreter that already has everything: no set-up). Arguments go to
# bench/gpu_report.py (e.g. --timeouts 150,240,150 --sweep-variants eager,ours --test-workers 4).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu.sh: no CUDA GPU here (nvidia-smi finds none): nothing to run."
  exit 0
fi

PY=.venv/bin/python
if [ -n "${LIGER_PYTHON:-}" ]; then
  # A machine with no package index, whose interpreter already holds liger's needs (PYTHONPATH
  # included, e.g. wheels carried in and installed with --target): use it as it is.
  PY=$LIGER_PYTHON
else
  export LIGER_TORCH=${LIGER_TORCH:-torch==2.13.0}
  bash scripts/setup.sh
  # The peers, where pip can install them; the report says which ran.
  $PY -m pip --disable-pip-version-check -q install liger-kernel \
    || echo "bench/gpu.sh: liger-kernel did not install; its rows are left out."
  $PY -m pip --disable-pip-version-check -q install cut-cross-entropy \
    || echo "bench/gpu.sh: cut-cross-entropy did not install; its rows are left out."
fi
if ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "bench/gpu.sh: $PY's torch cannot use the GPU (a CPU build?): remove .venv and run again." >&2
  exit 1
fi

# The tests' conftest selects Triton's CPU interpreter unless told otherwise: on a GPU, compile.
export TRITON_INTERPRET=0
exec $PY bench/gpu_report.py --out "${LIGER_GPU_OUT:-bench/results}" "$@"
