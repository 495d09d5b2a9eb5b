"""Run a recipe: in this process, or in N processes through `accelerate launch`.

One process trains in-process. Several are started by exec'ing `accelerate launch` with explicit
arguments (an argv list, never a shell string) on `python -m liger_cli train RECIPE`
(`multiprocess.py`), so `accelerate launch -m liger_cli train RECIPE` and `torchrun -m liger_cli
train RECIPE` are the same path: inside a launcher, each process simply trains as one rank
(`rank.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from liger_cli import process_state
from liger_cli.plan import Applied, build_plan, render_with
from liger_cli.rank import inside_launcher, run_rank
from liger_cli.recipe import Recipe


def dry_run(recipe: Recipe, device_memory: int | None = None, as_json: bool = False) -> str:
    """The Plan of a recipe, what its kernels would patch and the memory plan per rank, from the
    model built on the meta device."""
    import json

    from liger_cli.memory_plan import plan_memory
    from liger_cli.model import build_meta_model_for, patch_kernels

    _quiet_libraries()
    model = build_meta_model_for(recipe)
    plan = build_plan(recipe, model)
    applied = Applied(kernels_patched=patch_kernels(model, plan))
    memory = plan_memory(recipe, plan, model, device_memory)
    if as_json:
        return json.dumps(
            {
                "plan": plan.to_dict(),
                "kernels_patched": list(applied.kernels_patched),
                "memory": memory.to_dict(),
            },
            indent=2,
        )
    return render_with(plan, applied) + "\n\n" + memory.render()


def launch(recipe: Recipe, recipe_path: Path, overrides: list[str]) -> int:
    """Train; returns the exit code (0 done, 1 runtime failure)."""
    plan = build_plan(recipe)
    if plan.device == "cpu":  # the ranks inherit it from here
        process_state.set_deepspeed_accelerator("cpu")
        _return_freed_memory_to_the_os()
    if plan.num_processes > 1 and not inside_launcher():
        from liger_cli.multiprocess import run_accelerate_launch

        return run_accelerate_launch(recipe, plan, recipe_path, overrides)

    from liger_cli.backends import DowngradeError
    from liger_cli.train import TrainingDiverged, run

    _quiet_libraries()
    if not inside_launcher():
        try:
            run(recipe, plan)
        except (TrainingDiverged, DowngradeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    return run_rank(lambda: run(recipe, plan))


def _return_freed_memory_to_the_os() -> None:
    """On a CPU, serve tensors of 1 MiB and more with mmap, so freeing them gives the memory back
    (see docs/fsdp-facts.md#memory-of-a-training-process): a training process's memory should be
    what it uses."""
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3  # from glibc's malloc.h
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).mallopt(m_mmap_threshold, 1 << 20)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc (musl, macOS): keep the allocator's own policy


def _quiet_libraries() -> None:
    """Our own progress and metrics lines are the run's log: silence libraries' bars and notices."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # peft still calls transformers' deprecated `is_gradient_checkpointing`: not the user's concern.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
