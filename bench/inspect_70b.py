"""How long and how much memory `liger inspect-wrap` takes on Llama-3-70B (meta device: no weights read).

Runs the real CLI in a fresh process, so import time counts, and reads the child's wall time and peak
RSS from the OS. Usage: python bench/inspect_70b.py [--lora] [extra inspect-wrap options]
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "tests" / "configs" / "llama-3-70b"


def main() -> int:
    argv = [
        sys.executable,
        "-m",
        "liger_cli",
        "inspect-wrap",
        str(CONFIG),
        "--num-processes",
        "8",
        *sys.argv[1:],
    ]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=os.environ.copy())
    wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    if done.returncode not in (0, 3):
        print(done.stderr, file=sys.stderr)
        return done.returncode
    summary = next(line for line in done.stdout.splitlines() if line.startswith("Total:"))
    print(summary)
    print(f"inspect-wrap {CONFIG.name} {' '.join(sys.argv[1:])}".rstrip())
    print(f"wall time: {wall:.2f} s (fresh process, imports included)")
    print(f"peak RSS:  {peak_kib / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
