#!/usr/bin/env bash
# One command for a CUDA machine: install what is needed, run every GPU test, the kernel sweep with
# its peers, a kernels on/off A/B of a real training step, (with 2 GPUs) sequence parallelism at 32k,
# a GRPO step on liger's vLLM engine against TRL's use_vllm=True (issue 60), and (given a fifth time
# limit) sampling ahead on vLLM, rl.max_staleness 0, 1 and 2 (bench/async_rl.py), and write one
# markdown report with the numbers and the GPU's name (bench/results/gpu-report.md, or
# $LIGER_GPU_OUT/gpu-report.md).
#
#     bash bench/gpu.sh
#     bash bench/gpu.sh --dry-run      # what it would install and run, in order; GPU or not, runs nothing
#
# Without a GPU it says so in one line and exits 0. Environment: LIGER_TORCH (the torch to install,
# default torch==2.13.0, whose Linux wheel is the CUDA build), LIGER_GPU_OUT (the output folder),
# LIGER_PYTHON (an interpreter that already has everything: no set-up), LIGER_VLLM_PYTHON (a Python
# with CUDA vllm for the vLLM step, else .venv-vllm). Arguments go to bench/gpu_report.py (e.g.
# --timeouts 150,240,150,600 --sweep-variants eager,ours --test-workers 4).
#
# --timeouts is seconds for the tests, the sweep, the A/B, the vLLM step and sampling ahead, in the order
# they run; 0 leaves a step out, and so does a fifth left out. The defaults (1 h and more each) suit a machine of one's own. A lease of about 15
# minutes, the machine's start and this script's set-up included (on a fresh machine the set-up alone
# installs two CUDA torches, .venv's and vLLM's, minutes each): run the vLLM step only,
#
#     bash bench/gpu.sh --timeouts 0,0,0,540
#
# or, where .venv and .venv-vllm are already set up, everything with short limits and the vLLM step
# last with the most time: --timeouts 90,120,90,420 --sweep-variants eager,ours --ab-steps 3 --test-workers 4.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ " $* " == *" --dry-run "* ]]; then
  if [ -n "${LIGER_PYTHON:-}" ]; then
    echo "bench/gpu.sh --dry-run: no set-up (LIGER_PYTHON=$LIGER_PYTHON)"
  else
    echo "bench/gpu.sh --dry-run: set-up, first: LIGER_TORCH=${LIGER_TORCH:-torch==2.13.0} bash scripts/setup.sh" \
      "(with scripts/setup-vllm.sh: CUDA vllm into .venv-vllm), then .venv/bin/python -m pip install liger-kernel," \
      "then cut-cross-entropy"
  fi
  PY=${LIGER_PYTHON:-.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  exec $PY bench/gpu_report.py --out "${LIGER_GPU_OUT:-bench/results}" "$@"
fi

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
