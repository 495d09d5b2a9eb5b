"""Every backend's generation check in ONE set of processes, for tests/test_generate_backends.py.

A 2-process launch costs 10-20 s of imports, so the backends share one: for each backend in the
spec's order, its recipes train through `liger_cli.run.train.run` (as `liger train` does in each rank)
and then `dist_driver.generation_gathers` runs the engine through its `Backend.generation`. Each
backend's output starts after a `=== backend NAME` line on stdout (rank 0), so a test can read its own.
Usage:
    python -m torch.distributed.run --nproc_per_node 2 tests/generation_driver.py SPEC.json
SPEC: {"backends": [{"name": NAME, "cases": [RECIPE_PATH, ...], "generation": RECIPE_PATH}, ...]};
each generation's result is written beside its recipe as .generation.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from check_memo import memoize_twin_checks
from dist_driver import generation_gathers

from liger_cli.launch.rank import end_process_group, exit_now
from liger_cli.plan import build_plan
from liger_cli.recipe import load_recipe
from liger_cli.run import train


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    main_process = os.environ.get("RANK", "0") == "0"
    memoize_twin_checks()  # the cases share the twin checks of equal inputs (tests/check_memo.py)
    for backend in spec["backends"]:
        if main_process:
            print(f"=== backend {backend['name']}", flush=True)
        for path in backend["cases"]:
            recipe = load_recipe(path)
            train.run(recipe, build_plan(recipe))
        result = generation_gathers(backend["generation"])
        if main_process:
            Path(backend["generation"]).with_suffix(".generation.json").write_text(json.dumps(result))
        sys.stdout.flush()
    end_process_group()
    exit_now(0)  # as a `liger train` rank ends: no C++ teardown that could abort a finished rank


if __name__ == "__main__":
    main()
