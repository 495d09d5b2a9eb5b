#!/usr/bin/env bash
# Run liger on the NEWEST releases of transformers, peft and accelerate, in a second environment.
#
# Why: CI runs on the versions pinned in constraints.txt; users install whatever is newest. A new
# transformers can move what our patches read (5.24 wrapped every attention forward in a decorator,
# which hid the RoPE call from our patch). This script installs the newest releases, past the upper
# bounds pyproject.toml declares, and runs the kernel sweeps (causal LMs, then every vision-language
# family's wrap plan and kernels) and the fast tests on them:
#
#   bash scripts/compat.sh            # exit 0: no kernel silently wrong or crashing, every test passed
#
# The environment is .venv-newest (LIGER_COMPAT_VENV to change; reused, packages upgraded each run),
# torch is installed first (LIGER_TORCH, default the CPU build torch==2.13.0, as scripts/setup.sh).
# The sweep's table goes to $LIGER_COMPAT_VENV/compat/ (docs/kernel-coverage.md stays the pin's), and
# the result is written to docs/compat.md, pass or fail: the last result.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LIGER_COMPAT_VENV:-.venv-newest}
OUT=$VENV/compat
PY=$VENV/bin/python
# Tests that exercise transformers, peft and accelerate (8-10 minutes on 2 cores; no benchmarks):
# single-process, but for test_qlora.py's 2-process backends (a 4-bit base leans on all three; its
# ZeRO cases skip here unless DeepSpeed is installed). The sweep runs through scripts/kernel_coverage.py.
# The real-model files (SmolLM2-135M-Instruct: users fine-tune real checkpoints on the newest releases)
# share the main environment's folder: scripts/real_model.py's folder() is .venv/models/ under the repo
# whichever Python runs it (LIGER_REAL_MODEL overrides), built there the first time. Their `liger export`
# tests need llama-cpp-python, installed below from the wheel scripts/setup.sh built.
FAST_TESTS=(
  tests/test_compat.py tests/test_patch.py tests/test_kernel_check.py tests/test_kernels_torch.py
  tests/test_flce_numerics.py tests/test_wrap.py tests/test_inspect.py tests/test_plan.py tests/test_cli.py
  tests/test_user_errors.py tests/test_recipe.py tests/test_data.py tests/test_data_command.py
  tests/test_chat_templates.py tests/test_train.py tests/test_saved_is_trained.py tests/test_preference_loss.py
  tests/test_logprob_kernel.py tests/test_qlora.py tests/test_generate.py tests/test_generate_cli.py
  tests/test_grpo.py tests/test_grpo_train.py tests/test_agent_episodes.py tests/test_agent_train.py
  tests/test_real_model_train.py tests/test_real_model_commands.py tests/test_real_model_recipes.py
)

[ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$VENV"
PIP=("$PY" -m pip --disable-pip-version-check -q)
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "compat: installing ${LIGER_TORCH:-torch==2.13.0} first (a bare torch requirement pulls CUDA)"
  "${PIP[@]}" install "${LIGER_TORCH:-torch==2.13.0}"
fi
# llama-cpp-python (the export extra) has no wheel on PyPI: pip would compile llama.cpp (minutes). The
# wheel scripts/setup.sh built for .venv (pure py3, its own libraries inside) installs here as it is; without
# one it is built as setup.sh builds it (scripts/llama-cmake-args.sh), into $VENV/llama-wheel.
if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
  wheel=$(ls .venv/llama-wheel/llama_cpp_python-*.whl "$VENV"/llama-wheel/llama_cpp_python-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    echo "compat: building llama-cpp-python (llama.cpp from source, minutes; no wheel in .venv/llama-wheel)"
    CMAKE_ARGS="$(bash scripts/llama-cmake-args.sh)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "${PIP[@]}" wheel --no-deps --no-cache-dir -c constraints.txt -w "$VENV/llama-wheel" llama-cpp-python
    wheel=$(ls "$VENV"/llama-wheel/llama_cpp_python-*.whl | head -n 1)
  fi
  echo "compat: installing $wheel"
  "${PIP[@]}" install --no-deps "$wheel"
fi
echo "compat: installing liger (editable, no constraints), then the newest transformers, peft, accelerate"
"${PIP[@]}" install -e ".[test,export]"
# Upgraded on their own so pyproject's upper bounds do not hold them back (pip may say they are outside
# the declared range: that is what this run is for).
"${PIP[@]}" install --upgrade transformers peft accelerate

mkdir -p "$OUT"
"$PY" - >"$OUT/versions.txt" <<'PY'
from importlib.metadata import requires, version

from packaging.requirements import Requirement

declared = {Requirement(r).name: Requirement(r).specifier for r in requires("liger-cli") if "extra" not in r}
for name in ("transformers", "peft", "accelerate", "torch", "datasets", "tokenizers"):
    spec = declared.get(name)
    inside = "" if spec is None or version(name) in spec else f"  (outside the declared {spec}: widen it after a passing run)"
    print(f"{name} {version(name)}{inside}")
PY
cat "$OUT/versions.txt"

status=0
echo "compat: kernel sweep (scripts/kernel_coverage.py)"
"$PY" scripts/kernel_coverage.py --check --json "$OUT/kernel-coverage.json" --markdown "$OUT/kernel-coverage.md" \
  | tee "$OUT/sweep.txt" || status=1
echo "compat: vision-language sweep (scripts/vlm_sweep.py: every family's wrap plan and kernels)"
"$PY" scripts/vlm_sweep.py | tee "$OUT/vlm-sweep.txt" || status=1
echo "compat: fast tests"
"$PY" -m pytest -q -p no:cacheprovider "${FAST_TESTS[@]}" 2>&1 | tee "$OUT/tests.txt" || status=1

sweep=$(head -n 1 "$OUT/sweep.txt")
tests=$(grep -E "^=*.*[0-9]+ (passed|failed|error)" "$OUT/tests.txt" | tail -n 1 | tr -d '=' | sed 's/^ *//;s/ *$//')
{
  echo "# Compatibility with the newest releases"
  echo
  echo "Written by \`bash scripts/compat.sh\` ($(date -u +%Y-%m-%d)): the newest transformers, peft and accelerate"
  echo "installed into a second environment, past the upper bounds in pyproject.toml; the kernel sweep"
  echo "(\`scripts/kernel_coverage.py\`, table not committed) and the fast tests run there. The pinned versions"
  echo "(constraints.txt) are CI's: docs/kernel-coverage.md is their sweep. Do not edit by hand."
  echo
  echo "**Result: $([ "$status" = 0 ] && echo passed || echo FAILED).**"
  echo
  echo "Versions:"
  echo
  sed 's/^/- /' "$OUT/versions.txt"
  echo
  echo "Kernel sweep: $sweep"
  grep "^  " "$OUT/sweep.txt" | sed 's/^  /- /' || true
  echo
  echo "Vision-language sweep: $(tail -n 1 "$OUT/vlm-sweep.txt")"
  grep "^WRONG " "$OUT/vlm-sweep.txt" | sed 's/^/- /' || true
  echo
  echo "Fast tests (${#FAST_TESTS[@]} files): $tests"
} >docs/compat.md
echo "compat: $([ "$status" = 0 ] && echo passed || echo FAILED) (docs/compat.md)"
exit "$status"
