"""Sampling ahead (`rl.max_staleness`) against synchronous steps: K = 0, 1 and 2 side by side, for the GRPO
and the agent recipes, each a fresh `liger train` process of the shipped recipe, one after the other.

    .venv/bin/python bench/async_rl.py                              # both recipes, K = 0, 1, 2 (CPU: ~25 min)
    .venv/bin/python bench/async_rl.py --recipes grpo --steps 40    # shorter
    .venv/bin/python bench/async_rl.py --engine vllm                # sampling on vLLM (a GPU: bench/gpu.sh)

For each run: the training time (the sum of every step's `step_time_s`: sampling the trainer waited for,
scoring, training, the weight push; evaluations left out), steps per hour from it, the seconds per step
the trainer waited for its batch (`time/wait_s`), and the held-out reward (`eval_reward`, greedy, every
--eval-every steps) against steps and against the training time at that step. Written as a table to
stdout and, with --out, as JSON. Nothing here is a claim beyond the machine it ran on: on 2 CPU cores the
background sampler and the trainer share the cores (and Python's lock) in one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"grpo": REPO / "recipes" / "grpo.yaml", "agent": REPO / "recipes" / "agent.yaml"}
STEPS = {"grpo": 100, "agent": 40}
EVERY = {"grpo": 20, "agent": 10}


def run(recipe: str, k: int, steps: int, every: int, engine: str, out: Path) -> dict:
    """One `liger train` of the recipe with max_staleness k; its metrics, reduced."""
    sets = {"rl.max_staleness": k, "training.max_steps": steps, "training.eval_every": every,
            "logging.every": 1, "output.dir": out, "rl.engine": engine}  # fmt: skip
    command = [sys.executable, "-m", "liger_cli", "train", str(RECIPES[recipe])]
    command += [x for key, value in sets.items() for x in ("--set", f"{key}={value}")]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{recipe} K={k} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained, clock, curve = [r for r in rows if "loss" in r], {0: 0.0}, []
    for r in trained:
        clock[r["step"]] = clock[r["step"] - 1] + r["step_time_s"]
    for r in rows:
        if "eval_reward" in r:
            curve.append(
                {"step": r["step"], "train_s": round(clock[r["step"]], 1), "eval_reward": r["eval_reward"]}
            )
    seconds = clock[max(clock)]
    waits = [r.get("time/wait_s", 0.0) for r in trained]
    return {"recipe": recipe, "max_staleness": k, "steps": len(trained), "train_s": round(seconds, 1),
            "steps_per_hour": round(3600 * len(trained) / seconds), "wait_s_per_step": round(sum(waits) / len(waits), 3),
            "sampling_s_per_step": round(sum(r["time/sampling_s"] for r in trained) / len(trained), 3),
            "curve": curve}  # fmt: skip


def table(results: list[dict]) -> str:
    lines = ["| recipe | K | steps | training s | steps/hour | vs K=0 | wait s/step | eval_reward by step (training s) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    base = {r["recipe"]: r["steps_per_hour"] for r in results if r["max_staleness"] == 0}
    for r in results:
        curve = ", ".join(f"{c['step']}: {c['eval_reward']:.2f} ({c['train_s']:.0f})" for c in r["curve"])
        ratio = r["steps_per_hour"] / base[r["recipe"]] if r["recipe"] in base else float("nan")
        lines.append(f"| {r['recipe']} | {r['max_staleness']} | {r['steps']} | {r['train_s']} | {r['steps_per_hour']} | "
                     f"{ratio:.2f}x | {r['wait_s_per_step']} | {curve} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["grpo", "agent"])
    parser.add_argument("--staleness", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="Optimizer steps per run (default: grpo 100, agent 40).")
    parser.add_argument(
        "--eval-every", type=int, help="Steps between evaluations (default: grpo 20, agent 10)."
    )
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--out", type=Path, help="Write the results as JSON here too.")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="liger-async-") as tmp:
        for recipe in args.recipes:
            for k in args.staleness:
                steps, every = args.steps or STEPS[recipe], args.eval_every or EVERY[recipe]
                results.append(run(recipe, k, steps, every, args.engine, Path(tmp) / f"{recipe}-{k}"))
                print(
                    f"{recipe} K={k}: {results[-1]['steps_per_hour']} steps/hour", file=sys.stderr, flush=True
                )
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
