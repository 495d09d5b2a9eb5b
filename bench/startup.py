"""How long `liger --help` takes to start, against `python -c "import typer"` measured in the same run.

    python bench/startup.py              # best of 7 runs each, interleaved
    python bench/startup.py --runs 3 --json

`--help` must not import torch, transformers or the other heavy libraries: its start time should stay
within 2x of typer's own import (the baseline: the least a typer program can cost). Each command runs
in a fresh interpreter; the runs alternate between the two so machine load hits both alike, and the
best (smallest) wall time of each is kept, the least noisy estimate on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(runs: int) -> dict:
    liger = shutil.which("liger", path=str(Path(sys.executable).parent)) or "liger"
    commands = {"typer_import": [sys.executable, "-c", "import typer"], "liger_help": [liger, "--help"]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            times[name].append(_wall(argv))
    best = {name: min(values) for name, values in times.items()}
    return {"runs": runs, "best_s": best, "ratio": best["liger_help"] / best["typer_import"], "all_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = measure(args.runs)
    if args.json:
        print(json.dumps(result))
        return
    best = result["best_s"]
    print(f"python -c 'import typer': {best['typer_import']:.3f} s (best of {args.runs})")
    print(f"liger --help:              {best['liger_help']:.3f} s (best of {args.runs})")
    print(f"ratio: {result['ratio']:.2f}x (target: at most 2x)")


if __name__ == "__main__":
    main()
