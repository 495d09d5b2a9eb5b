"""Start a run: in this process, or in N processes through `accelerate launch`.

One process trains in-process. Several are started by exec'ing `accelerate launch` with explicit
arguments (an argv list, never a shell string) on `python -m liger_cli train RECIPE`
(`multiprocess.py`), so `accelerate launch -m liger_cli train RECIPE` and `torchrun -m liger_cli
train RECIPE` are the same path: inside a launcher, each process simply trains as one rank
(`rank.py`). What a process trains is handed in (`train`), so this stage never imports the run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from liger_cli import process_state
from liger_cli.errors import RunFailed
from liger_cli.launch.rank import inside_launcher, run_rank
from liger_cli.plan import Plan, build_plan
from liger_cli.recipe import Recipe

Train = Callable[[Recipe, Plan], object]
"""One process's run (`liger_cli.run.train.run`)."""


def launch(recipe: Recipe, recipe_path: Path, overrides: list[str], train: Train) -> int:
    """Train; returns the exit code (0 done, 1 runtime failure)."""
    plan = build_plan(recipe)
    if plan.device == "cpu":  # the ranks inherit it from here
        process_state.set_deepspeed_accelerator("cpu")
        _return_freed_memory_to_the_os()
    if plan.num_processes > 1 and not inside_launcher():
        from liger_cli.launch.multiprocess import run_accelerate_launch

        return run_accelerate_launch(recipe, plan, recipe_path, overrides)

    process_state.quiet_libraries()
    if not inside_launcher():
        try:
            train(recipe, plan)
        except RunFailed as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    return run_rank(lambda: train(recipe, plan))


def _return_freed_memory_to_the_os() -> None:
    """On a CPU, serve tensors of 256 KiB and more with mmap, so freeing them gives the memory back
    (see docs/fsdp-facts.md#memory-of-a-training-process): a training process's memory should be
    what it uses. 1 MiB was too high for a real model's short sequences: SmolLM2-135M's [204, 576]
    fp32 activations (470 KiB) came from the heap, whose fragments grew the process by 460 MiB over
    what it held (1,251 MiB peak, 832 MiB at 256 KiB, steps no slower; tests/test_real_model_train.py)."""
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3  # from glibc's malloc.h
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).mallopt(m_mmap_threshold, 256 << 10)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc (musl, macOS): keep the allocator's own policy
