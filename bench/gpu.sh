#!/usr/bin/env bash
# One command for a CUDA machine: install what is needed, run every GPU test, the kernel sweep with
# its peers and a kernels on/off A/B of a real training step, and write one markdown report with the
# numbers and the GPU's name (bench/results/gpu-report.md, or $LIGER_GPU_OUT/gpu-report.md).
#
#     bash bench/gpu.sh
#
# Without a GPU it says so in one line and exits 0. Environment: LIGER_TORCH (the torch to install,
# default torch==2.13.0, whose Linux wheel is the CUDA build), LIGER_GPU_OUT (the output folder).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu.sh: no CUDA GPU here (nvidia-smi finds none): nothing to run."
  exit 0
fi

export LIGER_TORCH=${LIGER_TORCH:-torch==2.13.0}
bash scripts/setup.sh
if ! .venv/bin/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "bench/gpu.sh: .venv's torch cannot use the GPU (a CPU build?): remove .venv and run again." >&2
  exit 1
fi
# The peers, where pip can install them; the report says which ran.
.venv/bin/python -m pip --disable-pip-version-check -q install liger-kernel \
  || echo "bench/gpu.sh: liger-kernel did not install; its rows are left out."
.venv/bin/python -m pip --disable-pip-version-check -q install cut-cross-entropy \
  || echo "bench/gpu.sh: cut-cross-entropy did not install; its rows are left out."

# The tests' conftest selects Triton's CPU interpreter unless told otherwise: on a GPU, compile.
export TRITON_INTERPRET=0
exec .venv/bin/python bench/gpu_report.py --out "${LIGER_GPU_OUT:-bench/results}"
