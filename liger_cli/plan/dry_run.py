"""`liger train --dry-run`: the Plan, what the kernels would patch and the memory plan per rank, from the
model built on the meta device (no weights read, nothing launched)."""

from __future__ import annotations

import json

from liger_cli import process_state
from liger_cli.model import build_meta_model_for, patch_kernels
from liger_cli.plan.decide import Applied, build_plan, render_with
from liger_cli.plan.memory import plan_memory
from liger_cli.recipe import Recipe


def dry_run(recipe: Recipe, device_memory: int | None = None, as_json: bool = False) -> str:
    process_state.quiet_libraries()
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
