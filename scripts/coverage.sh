#!/usr/bin/env bash
# Line and branch coverage of liger_cli/ and kernels/ by the whole suite, every process counted: the
# test workers, each `liger` subprocess and each torchrun rank (coverage's `patch = subprocess, _exit`
# in pyproject.toml). Takes the suite's time plus about a third.
#
#   bash scripts/coverage.sh            # prints the table's total line; full table in .coverage-report.txt
#   bash scripts/coverage.sh -x tests/test_train.py   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export COVERAGE_FILE=$PWD/.coverage  # absolute: subprocesses run in other folders
rm -f .coverage .coverage.*
"$PY" -m coverage run -m pytest -q "$@" || status=$?
"$PY" -m coverage combine -q
"$PY" -m coverage report --skip-covered > .coverage-report.txt
"$PY" - <<'PY'
import json, subprocess, sys
subprocess.run([sys.executable, "-m", "coverage", "json", "-q", "-o", ".coverage.json"], check=True)
t = json.load(open(".coverage.json"))["totals"]
print(f"coverage: lines {t['covered_lines']}/{t['num_statements']} = {100 * t['covered_lines'] / t['num_statements']:.2f}%, "
      f"branches {t['covered_branches']}/{t['num_branches']} = {100 * t['covered_branches'] / t['num_branches']:.2f}%")
PY
exit "${status:-0}"
