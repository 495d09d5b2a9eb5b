"""Sweep every image-text-to-text family of the installed transformers: its wrap plan (meta device) and
our kernels in its tiny twin fed an image batch. The tests check one family per code path
(tests/test_vlm_wrap.py, tests/test_vlm_kernels.py); this runs their checks on every family.

    python scripts/vlm_sweep.py                     # exit 0: no wrong plan, no kernel wrong or crashing
    python scripts/vlm_sweep.py --only llava,gemma3 --json rows.json
    python scripts/vlm_sweep.py --skip kernels      # the plans only (about 25 s on 2 cores)

On transformers 5.23 (2 cores): 97 families, 87 planned, 0 wrong plans; 29 with kernels proven in their
language model, the rest left off with a reason, 0 wrong (docs/distributed.md, docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: our kernels on a CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' own checks, on every family


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated families (default: every family)")
    parser.add_argument("--skip", choices=("plans", "kernels"), help="leave one sweep out")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    import test_vlm_kernels
    import test_vlm_wrap

    families = args.only.split(",") if args.only else test_vlm_wrap._families()
    every = not args.only
    rows, problems = {}, []
    if args.skip != "plans":
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as root:
            plans = test_vlm_wrap.sweep_of(
                families, lambda name: Path(tempfile.mkdtemp(dir=root, prefix=name))
            )
        print(f"plans ({time.perf_counter() - start:.0f} s): {test_vlm_wrap.summary(plans)}")
        problems += [f"plan: {p}" for p in test_vlm_wrap.every_family_wrong(plans, every)]
        rows["plans"] = plans
    if args.skip != "kernels":
        start = time.perf_counter()
        kernels = test_vlm_kernels.sweep_of(families)
        seconds = round(time.perf_counter() - start, 1)
        print(f"kernels: {test_vlm_kernels.summary(kernels, seconds)}")
        problems += [f"kernels: {p}" for p in test_vlm_kernels.every_family_wrong(kernels, every)]
        rows["kernels"] = kernels
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    for problem in problems:
        print(f"WRONG {problem}")
    print(f"vlm sweep: {len(families)} families, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
