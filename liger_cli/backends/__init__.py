"""One object per distributed backend; `backend_for` picks it from the Plan.

| backend | class | module |
|---|---|---|
| none | SingleProcess | base.py |
| ddp | Ddp | ddp.py |
| fsdp1, fsdp2 | Fsdp1, Fsdp2 | fsdp.py |
| deepspeed | DeepSpeed | zero.py |

accelerate and DeepSpeed are imported only when a backend builds its Accelerator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from liger_cli.backends.base import Backend, DowngradeError, SingleProcess
from liger_cli.backends.ddp import Ddp
from liger_cli.backends.fsdp import Fsdp1, Fsdp2
from liger_cli.backends.zero import DeepSpeed

if TYPE_CHECKING:
    from liger_cli.plan import Plan
    from liger_cli.recipe import Recipe

BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (SingleProcess, Ddp, Fsdp1, Fsdp2, DeepSpeed)}
FSDP_BACKENDS = tuple(name for name, cls in BACKENDS.items() if cls.fsdp_version)


def display_name(backend: str) -> str:
    return BACKENDS[backend].display


def backend_for(recipe: Recipe, plan: Plan) -> Backend:
    return BACKENDS[plan.backend](recipe, plan)


__all__ = ["BACKENDS", "FSDP_BACKENDS", "Backend", "DowngradeError", "backend_for", "display_name"]
