"""The claim of recipes/grpo.yaml, measured: as shipped (200 steps from its SFT adapter), GRPO raises
the exact answers on the 100 held-out numbers (eval_reward, greedy) well above where they started.

The test suite runs the recipe for one step (tests/test_grpo_train.py: it trains end to end and starts
at the documented 0.47); the 200 steps (about a minute on a quiet CPU, several on a loaded one) are
measured here, and the result is written in docs/rl.md.

    python scripts/check_grpo_recipe.py              # exit 0: 6 evals, the last >= the first + 0.15
    python scripts/check_grpo_recipe.py --out DIR    # keep the run's folder (default: a temporary one)

recipes/agent.yaml's claim (agentic RL: docs/agents.md) is measured the same way:

    python scripts/check_grpo_recipe.py --recipe recipes/agent.yaml --evals 5

and the GRPO recipe with another loss (any recipe key, as `liger train --set` takes it):

    python scripts/check_grpo_recipe.py --set rl.loss=gspo --set rl.epsilon=3.0e-4 --set rl.epsilon_high=4.0e-4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAISE = 0.15  # what the recipe's claim needs: the last eval at least this much above step 0's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the run's output folder (default: a temporary one)")
    parser.add_argument(
        "--recipe", type=Path, default=REPO / "recipes" / "grpo.yaml", help="the recipe to run"
    )
    parser.add_argument("--evals", type=int, default=6, help="evaluations the run makes (step 0 included)")
    parser.add_argument(
        "--gain", type=float, default=RAISE, help="how far the last eval must be above the first"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="a recipe key for this run, as `liger train --set` takes it (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="liger-grpo-claim-") as tmp:
        out = (args.out or Path(tmp) / "grpo").resolve()
        argv = [sys.executable, "-m", "liger_cli", "train", str(args.recipe.resolve()),
                "--set", f"output.dir={out}"]  # fmt: skip
        argv += [arg for override in args.overrides for arg in ("--set", override)]
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            print(proc.stdout[-2000:] + proc.stderr[-3000:])
            print(f"{args.recipe.name}: FAILED, exit {proc.returncode}")
            return 1
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(m["step"], m["eval_reward"]) for m in rows if "eval_reward" in m]
    print("eval_reward by step: " + ", ".join(f"{step}: {value:.2f}" for step, value in evals))
    ok = len(evals) == args.evals and evals[-1][1] >= evals[0][1] + args.gain
    print(f"{args.recipe.name}{''.join(' ' + o for o in args.overrides)}: {'passed' if ok else 'FAILED'}: "
          f"{evals[0][1]:.2f} -> {evals[-1][1]:.2f} "
          f"(needs +{args.gain}), {len(evals)} evals, {wall:.0f} s")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
