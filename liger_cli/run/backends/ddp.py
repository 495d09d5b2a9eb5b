"""DDP: every rank holds the whole model; gradients are all-reduced."""

from __future__ import annotations

from torch import nn

from liger_cli.plan.backends import BACKENDS
from liger_cli.run.backends.base import Backend, DowngradeError


class Ddp(Backend):
    facts = BACKENDS["ddp"]

    def accelerator_kwargs(self) -> dict:
        from accelerate.utils import DistributedDataParallelKwargs

        # Frozen base weights have no gradient: DDP must not wait for them.
        return {"kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=False)]}

    def check(self, model: nn.Module) -> str:
        if self.plan.num_processes == 1:
            return "single process"
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            raise DowngradeError(f"the recipe asks for DDP but the model is a {type(model).__name__}")
        return f"DDP: gradients all-reduced over {self.accelerator.num_processes} processes"
