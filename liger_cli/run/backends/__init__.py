"""One object per distributed backend; `backend_for` picks it from the Plan.

| backend | class | module |
|---|---|---|
| none | SingleProcess | base.py |
| ddp | Ddp | ddp.py |
| fsdp1, fsdp2 | Fsdp1, Fsdp2 | fsdp.py |
| deepspeed | DeepSpeed | zero.py |

Each class carries its backend's facts from `liger_cli.plan.backends` (what the plan decided with).
accelerate and DeepSpeed are imported only when a backend builds its Accelerator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from liger_cli.run.backends.base import Backend, DowngradeError, SingleProcess
from liger_cli.run.backends.ddp import Ddp
from liger_cli.run.backends.fsdp import Fsdp1, Fsdp2
from liger_cli.run.backends.zero import DeepSpeed

if TYPE_CHECKING:
    from liger_cli.plan import Plan
    from liger_cli.recipe import Recipe

_CLASSES: dict[str, type[Backend]] = {
    cls.facts.name: cls for cls in (SingleProcess, Ddp, Fsdp1, Fsdp2, DeepSpeed)
}


def backend_for(recipe: Recipe, plan: Plan) -> Backend:
    return _CLASSES[plan.backend](recipe, plan)


__all__ = ["Backend", "DowngradeError", "backend_for"]
