"""The Plan's twin checks computed once per distinct input, for a process that runs many recipes.

A driver (tests/dist_driver.py, test_train.liger_in_one_process) runs
several recipes in one process; most differ only in what the twin checks never read (the output
folder, the data, the backend, the number of steps), yet each ran the kernel check (three tiny
twins built, two steps and two greedy generations when every kernel agrees) and the pipeline check
again. The checks are deterministic functions of their inputs, so the second call with
the same inputs returns the first's result: what the Plan says, and what the run then patches, is
what a fresh process computes. The key holds everything the checks are given or read from the recipe
(liger_cli/plan/decide.py: `_check_kernels`, `_check_pipeline`): the model's config, the requested
kernels, the processes, and the recipe's model, adapter, training, preference, rl sections and
data.packing whole. Tests about the checks themselves never use it (they call the checks directly).
"""

from __future__ import annotations

import contextlib
import json


def _key(recipe, config, *extra) -> str:
    sections = recipe.model_dump(mode="json", include={"model", "adapter", "training", "preference", "rl"})
    return json.dumps(
        [config.to_json_string(), sections, recipe.data.packing, *extra], sort_keys=True, default=str
    )


def memoize_twin_checks() -> None:
    """Replace decide's two check calls, in this process, by memoized ones (see above)."""
    from liger_cli.plan import decide

    if getattr(decide._check_kernels, "memoized", False):
        return
    real_kernels, real_pipeline = decide._check_kernels, decide._check_pipeline
    found: dict[str, object] = {}

    def check_kernels(recipe, config, kernels):
        key = "kernels" + _key(recipe, config, sorted(kernels.items()))
        if key not in found:
            found[key] = real_kernels(recipe, config, kernels)
        return found[key]

    def check_pipeline(recipe, config, kernels, world):
        key = "pipeline" + _key(recipe, config, sorted(kernels.items()), world)
        if key not in found:
            found[key] = list(real_pipeline(recipe, config, kernels, world))
        return found[key]

    check_kernels.memoized = True
    decide._check_kernels, decide._check_pipeline = check_kernels, check_pipeline


@contextlib.contextmanager
def twin_checks_memoized():
    """memoize_twin_checks for the block only: a test worker's later checks are computed afresh."""
    from liger_cli.plan import decide

    saved = decide._check_kernels, decide._check_pipeline
    memoize_twin_checks()
    try:
        yield
    finally:
        decide._check_kernels, decide._check_pipeline = saved
