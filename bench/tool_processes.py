"""What running the tools in processes of their own costs: the agent recipe's GRPO steps with its tool calls
in `rl.tool_workers` processes (liger's way: a tool that hangs, crashes or exhausts memory is an error the
model reads) against the same calls on threads inside the training process (the way before, where such
a tool stalled or ended the run), measured in the same run.

    .venv/bin/python bench/tool_processes.py --steps 8 --rounds 2

Each variant is a `liger train recipes/agent.yaml` process (no eval, logging every step), the two
alternated `--rounds` times; the first step of each run is left out (it starts the tool processes and
warms the caches). Prints the mean step time and the time in tool calls per step of each, and their
ratio. The threads variant swaps the tool pool for a thread pool that calls the same functions the same
way (`liger_cli.generate.tool_calls.run_one`), nothing else.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


class ThreadTools:
    """The ToolPool's interface on threads in this process: the way tools ran before they had processes."""

    def __init__(self, tools, workers: int, timeout: float, memory_mb: int):
        self.tools, self.workers, self.handles = tools, workers, 0

    def open(self, fields: dict, row: int) -> int:
        self.handles += 1
        return self.handles

    def run(self, batches):
        from liger_cli.generate.tool_calls import run_one

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(lambda b: [run_one(c, self.tools.functions) for c in b[1]], batches))

    def state(self, handle: int):
        return None

    def close(self, handles) -> None:
        pass

    def shutdown(self) -> None:
        pass


def one_run(variant: str, recipe: Path) -> None:
    """`liger train RECIPE` in this process, with the tool pool swapped for threads if asked."""
    if variant == "threads":
        import liger_cli.run.online as online

        online.ToolPool = ThreadTools
    from liger_cli.cli import main

    sys.argv = ["liger", "train", str(recipe)]
    main()


def measured(out: Path) -> tuple[list[float], list[float]]:
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "step_time_s" in m][1:]
    return [m["step_time_s"] for m in steps], [m["time/tools_s"] for m in steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "RECIPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_run(args.one[0], Path(args.one[1]))
        return
    root = Path(tempfile.mkdtemp(prefix="liger-tool-bench-"))
    recipe = yaml.safe_load((REPO / "recipes" / "agent.yaml").read_text())
    agent = REPO / "recipes" / "agent"
    recipe["model"]["path"] = str(agent / "model")
    recipe["data"] = {**recipe["data"], "train": str(agent / "train.jsonl")}
    recipe["data"].pop("eval")
    recipe["training"] |= {"max_steps": args.steps, "eval_every": None}
    recipe["rl"]["tools"] = [f"{agent / 'tools.py'}:lookup"]
    recipe["rl"]["rewards"] = [{"function": f"{agent / 'rewards.py'}:correct"}]
    recipe["logging"] = {"every": 1, "tensorboard": False}
    found: dict[str, tuple[list[float], list[float]]] = {"threads": ([], []), "processes": ([], [])}
    for k in range(args.rounds):
        for variant in found:
            out = root / f"{variant}-{k}"
            recipe["output"] = {"dir": str(out), "overwrite": True}
            path = root / f"{variant}-{k}.yaml"
            path.write_text(yaml.safe_dump(recipe))
            subprocess.run([sys.executable, __file__, "--one", variant, str(path)], check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
            steps, tools = measured(out)
            found[variant][0].extend(steps)
            found[variant][1].extend(tools)
    print(
        f"agent recipe, {args.rounds} x {args.steps - 1} measured steps each (4 prompts x 8 trajectories a step)"
    )
    print(f"{'tools on':<12}{'step time (s)':>16}{'in tool calls (s)':>20}")
    for variant, (steps, tools) in found.items():
        print(f"{variant:<12}{statistics.mean(steps):>16.3f}{statistics.mean(tools):>20.4f}")
    ratio = statistics.mean(found["processes"][0]) / statistics.mean(found["threads"][0])
    print(f"step time, processes / threads: {ratio:.3f}x")


if __name__ == "__main__":
    main()
