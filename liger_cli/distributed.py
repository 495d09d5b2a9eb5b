"""The Accelerator for a Plan, and the check that the run is what the Plan asked for.

Measured on CPU machines (../shared/context/fsdp-facts.md): `accelerate launch --use_fsdp` without
CUDA silently gives DDP, or two processes that never synchronise. We therefore build the
backend's plugin ourselves from the Plan and verify world size and distributed type after set-up:
a run that is not what the recipe asked for stops with an error instead of training wrongly.
"""

from __future__ import annotations

import os

import torch

from liger_cli.plan import Plan
from liger_cli.recipe import Recipe

PRECISION_TO_ACCELERATE = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


class DowngradeError(RuntimeError):
    """The run is not what the recipe asked for (world size, backend, sharding)."""


def make_accelerator(recipe: Recipe, plan: Plan):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    kwargs: dict = {"mixed_precision": PRECISION_TO_ACCELERATE[plan.precision]}
    if plan.device == "cpu":
        kwargs["cpu"] = True
    if plan.backend == "ddp":
        # Frozen base weights have no gradient: DDP must not wait for them.
        kwargs["kwargs_handlers"] = [DistributedDataParallelKwargs(find_unused_parameters=False)]
    accelerator = Accelerator(**kwargs)
    check_world(accelerator, plan)
    return accelerator


def check_world(accelerator, plan: Plan) -> None:
    """The number of processes must be the one the Plan launched (no silent single-process run)."""
    if accelerator.num_processes != plan.num_processes:
        raise DowngradeError(
            f"the recipe asks for {plan.num_processes} processes but this run has {accelerator.num_processes}; "
            "launch with `liger train RECIPE` (it starts the processes) or match distributed.num_processes"
        )
    if plan.num_processes > 1 and not torch.distributed.is_initialized():
        raise DowngradeError("no process group: the processes would train without synchronising")


def world_env() -> tuple[int, int]:
    """(rank, world size) as set by accelerate launch / torchrun, before any process group exists."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
