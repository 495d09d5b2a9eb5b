"""Run a recipe: in this process, or in N processes through `accelerate launch`.

One process trains in-process. Several are started by exec'ing `accelerate launch` with explicit
arguments (an argv list, never a shell string) on `python -m liger_cli train RECIPE`, so
`accelerate launch -m liger_cli train RECIPE` and `torchrun -m liger_cli train RECIPE` are the
same path: inside a launcher, each process simply trains as one rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from liger_cli.plan import build_plan
from liger_cli.recipe import Recipe


def inside_launcher() -> bool:
    """True in a process started by accelerate launch or torchrun (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def launch(recipe: Recipe, recipe_path: Path, overrides: list[str]) -> int:
    """Train; returns the exit code (0 done, 1 runtime failure)."""
    plan = build_plan(recipe)
    if plan.num_processes > 1 and not inside_launcher():
        from liger_cli.multiprocess import run_accelerate_launch

        return run_accelerate_launch(recipe, plan, recipe_path, overrides)

    from liger_cli.distributed import DowngradeError
    from liger_cli.train import TrainingDiverged, run

    try:
        run(recipe, plan)
    except (TrainingDiverged, DowngradeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
