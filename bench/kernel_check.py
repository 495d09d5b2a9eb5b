"""How long the pre-training kernel check takes on published 70B-class configs (target: under 10 s).

For each config: a fresh process imports liger, reads the config, builds the tiny twin and compares
every requested kernel on one training step (`liger_cli.twin.kernel_check.check_kernels`); the check's own
time and the process's wall time (imports included) are printed.

    python bench/kernel_check.py            # tests/configs/llama-3-70b and mixtral-8x7b
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = [REPO / "tests" / "configs" / "llama-3-70b", REPO / "tests" / "configs" / "mixtral-8x7b"]

CHILD = """
import json, sys, time
from transformers import AutoConfig
from liger_cli.twin.kernel_check import check_kernels
config = AutoConfig.from_pretrained(sys.argv[1])
kernels = dict(rms_norm=True, rope=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
check = check_kernels(config, kernels)
print(json.dumps({"seconds": check.seconds, "off": check.switched_off, "not_run": check.not_run,
                  "report": check.twin_report}))
"""


def main() -> int:
    for config in CONFIGS:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, str(config)], capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{config.name}: check {result['seconds']:.2f} s, process {wall:.1f} s (imports included)")
        print(f"  switched off: {result['off'] or 'none'}; not run: {result['not_run'] or '-'}")
        for line in result["report"]:
            print(f"  twin: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
