"""What every *_vs_trl.py bench does the same way: each side in a fresh process, measured alike.

In the parent: `chosen_variants()` reads --variants and checks the TRL interpreter is there when
needed; `run_liger()` runs a liger variant as `liger bench` does (its own worker process) and reads its
figures back; `run_trl()` runs the script's own TRL worker under TRL's interpreter and reads what it
wrote. Inside the TRL process (under .venv-trl): `start()` first (it gives the process `liger train`'s
CPU allocator setting, imports what a TRL run imports and returns the RSS baseline), a `step_clock()`
callback on the trainer, then `summary()` of the steps after the warm-up: the mean step time (each
from the end of the step before to the end of its optimizer step) and the peak RSS growth.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def run_liger(recipe: Path, name: str, out: Path, steps: int, warmup: int) -> tuple[dict, list[dict]]:
    """RECIPE as `liger bench` runs its variant NAME ("kernels_on", "kernels_off"), in its own worker
    process, WARMUP steps then STEPS measured, output in OUT/NAME. Returns the figures (step time, each
    step's, peak memory over the worker's baseline, first-step loss, tokens a step, wall time, log) and
    the measured steps' metrics rows; the figures are {"error", "log"} where the worker failed."""
    from liger_cli.bench.compare import run_variant, variant_overrides
    from liger_cli.bench.report import read_metrics, summarize

    worker = run_variant(recipe, variant_overrides(name, steps, warmup, out), name, out)
    if worker["exit_code"] != 0:
        return {"error": f"exit {worker['exit_code']}", "log": worker["log"]}, []
    metrics = out / name / "metrics.jsonl"
    result = summarize(name, [], metrics, warmup, worker["baseline_mb"], worker["wall_s"])
    _, measured = read_metrics(metrics, warmup)
    figures = {
        "step_time_s": result.step_time_s,
        "step_times_s": [r["step_time_s"] for r in measured],
        "peak_mem_mb": result.peak_mem_mb,
        "baseline_mb": worker["baseline_mb"],
        "first_step_loss": result.first_step_loss,
        "tokens_per_step": result.tokens_per_s * result.step_time_s,
        "measured_steps": result.measured_steps,
        "wall_s": worker["wall_s"],
        "log": worker["log"],
    }
    return figures, measured


def run_liger_online(recipe: dict, name: str, out: Path, steps: int, warmup: int) -> dict:
    """An online objective's RECIPE (model, adapter, data, training and its own sections), completed with
    what every bench run of one shares (no activation checkpointing, output in OUT/liger-run, logging
    every step), written to OUT/liger.yaml and run as `run_liger` runs variant NAME. Returns its figures
    with `generation_s`, the measured steps' mean `time/sampling_s`; exits naming the log where it failed."""
    import yaml

    path = out / "liger.yaml"
    shared = {"distributed": {"activation_checkpointing": "off"}, "output": {"dir": str(out / "liger-run"),
              "overwrite": True}, "logging": {"every": 1, "tensorboard": False}}  # fmt: skip
    path.write_text(yaml.safe_dump({**recipe, **shared}, sort_keys=False))
    figures, measured = run_liger(path, name, out, steps, warmup)
    if "error" in figures:
        raise SystemExit(f"liger {name} failed: see {figures['log']}")
    return {**figures, "generation_s": sum(m["time/sampling_s"] for m in measured) / len(measured)}


def run_trl(trl_python: Path, script: str, worker_argv: list[str], result: Path, out: Path) -> dict:
    """`TRL_PYTHON SCRIPT WORKER_ARGV` (the script's own TRL worker, which writes its figures to RESULT)
    in a fresh process on the CPU, its output in OUT/trl.log. Returns what it wrote, with the wall time
    and the log; {"error", "log"} where it failed."""
    log = out / "trl.log"
    result.unlink(missing_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRL_EXPERIMENTAL_SILENCE": "1"}
    start = time.perf_counter()
    with log.open("w") as f:
        argv = [str(trl_python), str(Path(script).resolve()), *worker_argv]
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
    wall = time.perf_counter() - start
    if code != 0 or not result.is_file():
        return {"error": f"exit {code}", "log": str(log)}
    return {**json.loads(result.read_text()), "wall_s": wall, "log": str(log)}


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
