"""Sequence parallelism on the CPU: 1 process at length L against 2 processes with
`sequence_parallel: 2` at length 2L (each then holds L tokens of each sequence), both measured in
this run on recipes/bench-cpu.yaml's model (8 layers, hidden 512, 8 heads / 4 KV heads, LoRA r=16).

    python bench/sequence_parallel.py                  # L = 512, 4 measured steps after 1 warm-up
    python bench/sequence_parallel.py --length 1024 --steps 6
    python bench/sequence_parallel.py --recipe recipes/bench-llama-1b.yaml --length 16384   # 2 GPUs: 32k split

Each run is a real `liger train` (its own processes; the 2-process one through accelerate launch,
FSDP-2, gloo) with micro-batch 1 of full rows (the recipe's texts joined 8 at a time: no packing, no mask); the table gives tokens per second (every token of every
measured step, over all processes), the mean step time, rank 0's peak RSS and its growth over the
process's memory before the model was built (as `liger train` logs it), the memory plan's estimate of
that growth (`liger train --dry-run`), and the ratios of the split run to the 1-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "bench-cpu.yaml"
ROWS = REPO / "recipes" / "bench" / "train.jsonl"  # 16 texts of about 1,100 tokens (both bench recipes')


def run(recipe: Path, out: Path, length: int, steps: int, warmup: int, split: bool) -> dict:
    sets = [f"data.max_seq_len={length}", "training.micro_batch_size=1", f"training.max_steps={steps + warmup}",
            f"output.dir={out}", "logging.every=1", f"data.train={out.parent / 'train.jsonl'}"]  # fmt: skip
    if split:
        sets += [
            "distributed.backend=fsdp2",
            "distributed.num_processes=2",
            "distributed.sequence_parallel=2",
        ]
    args = [x for s in sets for x in ("--set", s)]
    liger = [sys.executable, "-m", "liger_cli", "train", str(recipe), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if split else str(os.cpu_count() or 1)}
    plan = subprocess.run(
        [*liger, "--dry-run", "--json"], capture_output=True, text=True, env=env, check=True
    )
    estimate = json.loads(plan.stdout)["memory"]["total_bytes"] / 2**20
    proc = subprocess.run(liger, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    measured = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][warmup:]
    peak = re.search(r"memory: peak ([\d.]+) MiB over", proc.stdout)  # rank 0's, as --dry-run estimates it
    return {
        "tokens_per_s": statistics.mean(m["tokens_per_s"] for m in measured),
        "step_time_s": statistics.mean(m["step_time_s"] for m in measured),
        "peak_mem_mb": float(peak.group(1)),
        "rss_mb": max(m["peak_mem_mb"] for m in measured),
        "estimate_mb": estimate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=512, help="L: the 1-process run's sequence length")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--recipe", type=Path, default=RECIPE, help="an SFT recipe (default: recipes/bench-cpu.yaml)"
    )
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # The recipe's texts joined 8 at a time (about 8,800 tokens a row), so no row needs packing: no
        # mask, so sdpa runs causal with its memory-efficient kernel, as on a GPU without packing.
        texts = [json.loads(line)["text"] for line in ROWS.read_text().splitlines()]
        rows = [" ".join(texts[(i + k) % len(texts)] for k in range(8)) for i in range(len(texts))]
        (Path(tmp) / "train.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
        a.recipe = a.recipe.resolve()
        one = run(a.recipe, Path(tmp) / "one", a.length, a.steps, a.warmup, split=False)
        two = run(a.recipe, Path(tmp) / "split", 2 * a.length, a.steps, a.warmup, split=True)
    print("| run | length | tokens/s | step (s) | peak RSS, rank 0 (MiB) | its growth in a step (MiB) "
          "| the plan's estimate of it (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, length, r in (
        ("1 process", a.length, one),
        ("2 processes, sequence_parallel 2", 2 * a.length, two),
    ):
        print(f"| {name} | {length} | {r['tokens_per_s']:.0f} | {r['step_time_s']:.2f} | {r['rss_mb']:.0f} "
              f"| {r['peak_mem_mb']:.0f} | {r['estimate_mb']:.0f} |")  # fmt: skip
    print(f"split / 1 process: tokens/s {two['tokens_per_s'] / one['tokens_per_s']:.2f}x, peak growth "
          f"{two['peak_mem_mb'] / one['peak_mem_mb']:.2f}x at twice the length; estimate / measured growth: "
          f"{one['estimate_mb'] / one['peak_mem_mb']:.2f} (1 process), {two['estimate_mb'] / two['peak_mem_mb']:.2f} (split)")  # fmt: skip


if __name__ == "__main__":
    main()
