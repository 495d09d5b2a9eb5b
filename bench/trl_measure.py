"""TRL's side of a *_vs_trl.py bench, measured as `liger bench`'s worker measures liger's.

Run inside the TRL process (under .venv-trl): `start()` first (it gives the process `liger train`'s CPU
allocator setting, imports what a TRL run imports and returns the RSS baseline), a `step_clock()`
callback on the trainer, then `summary()` of the steps after the warm-up: the mean step time (each
from the end of the step before to the end of its optimizer step) and the peak RSS growth. In the
parent, `chosen_variants()` reads --variants and checks the TRL interpreter is there when needed.
"""

from __future__ import annotations

import resource
import time


def chosen_variants(parser, args, known: tuple[str, ...]) -> list[str]:
    """--variants as a list, each one of `known`; --trl-python must exist when "trl" is among them."""
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := set(variants) - set(known):
        parser.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    if "trl" in variants and not args.trl_python.is_file():
        parser.error(
            f"{args.trl_python} not found: set up TRL's venv (see this script's docstring) or leave out trl"
        )
    return variants


def start() -> float:
    """Blocks of 1 MiB and more served by mmap, as `liger train` does on a CPU
    (`launch.start._return_freed_memory_to_the_os`); then the imports (as liger's worker imports before
    its baseline); the RSS in MiB after them, the baseline of the peak."""
    from liger_cli.launch.start import _return_freed_memory_to_the_os

    _return_freed_memory_to_the_os()
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    from liger_cli.bench.compare import _rss_mb

    return _rss_mb()


def step_clock():
    """A TrainerCallback that records each step's time and the process's peak RSS at its end."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.last, self.steps = None, []

        def on_train_begin(self, *_, **__):
            self.last = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            now = time.perf_counter()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            self.steps.append(
                {"step": state.global_step, "step_time_s": now - self.last, "peak_mem_mb": peak}
            )
            self.last = now

    return StepClock()


def summary(clock, warmup: int, baseline: float) -> dict:
    """Step time (mean and each) and peak memory over the measured steps, the versions of TRL's side."""
    import peft
    import torch
    import transformers
    import trl

    measured = [s for s in clock.steps if s["step"] > warmup]
    return {
        "step_time_s": sum(s["step_time_s"] for s in measured) / len(measured),
        "step_times_s": [s["step_time_s"] for s in measured],
        "peak_mem_mb": max(s["peak_mem_mb"] for s in measured) - baseline,
        "baseline_mb": baseline,
        "measured_steps": len(measured),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
            "torch": torch.__version__,
        },
    }
