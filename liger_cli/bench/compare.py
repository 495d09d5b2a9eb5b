"""`liger bench RECIPE`: the recipe's own training with its kernels and with all kernels off, side by side.

Why: a kernel library's speed-up is a claim to measure on the user's recipe and hardware, not to
assume (a kernel-patched run took 2h59m against 2h42m without: see
docs/field-failures.md#kernels-that-made-a-run-slower). So the bench runs the recipe's model, data
and backend twice, W warm-up steps then N measured optimizer steps each:

- `kernels_on`: the kernels as the recipe says;
- `kernels_off`: every kernel off, otherwise the same recipe.

Each run is a fresh process (`python -m liger_cli.bench --worker ...`) that trains through
`launch.launch`, the path `liger train` takes: one process in-process, several through accelerate
launch. The processes log every step to metrics.jsonl in their own output folder; the comparison is
read from there.

Memory: on a GPU, torch.cuda.max_memory_allocated (as the training loop logs it). On a CPU the
worker records its RSS after its imports, right before training starts, and the peak is the growth
of the training process's peak RSS over that baseline. A multi-process run logs rank 0's peak RSS;
rank 0 imports what the worker imported, so the worker's baseline stands in for rank 0's.

Correctness: with the same seed both runs start from the same weights and the same batch, so their
first-step losses must agree; a disagreement is reported as a correctness failure (exit 1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from liger_cli import process_state
from liger_cli.bench.report import VARIANTS, RunResult, compare, render_table, summarize, write_chart
from liger_cli.errors import UserError
from liger_cli.recipe import KernelsSection, Recipe, load_recipe

__all__ = ["RunResult", "bench", "compare", "worker"]


def variant_overrides(variant: str, steps: int, warmup: int, out_dir: Path) -> list[str]:
    """The `--set` overrides that turn the recipe into one bench run (after the user's own)."""
    overrides = [
        f"training.max_steps={steps + warmup}",
        "training.eval_every=null",
        "logging.every=1",
        "logging.jsonl=true",
        "logging.tensorboard=false",
        f"output.dir={out_dir / variant}",
        "output.overwrite=true",
        "output.resume=never",
        "output.save_every=null",
    ]
    if variant == "kernels_off":
        overrides += [f"kernels.{name}=false" for name in KernelsSection.model_fields]
    return overrides


# ---------------------------------------------------------------- the parent: two fresh processes


def _enabled_kernels(recipe: Recipe) -> list[str]:
    return [name for name, on in recipe.kernels.requested().items() if on]


def _memory_note(device: str, num_processes: int) -> str:
    if device == "cuda":
        return "torch.cuda.max_memory_allocated of rank 0"
    note = "growth of the training process's peak RSS over its RSS right before training"
    if num_processes > 1:
        note += " (rank 0's peak; the bench worker's post-import RSS stands in for rank 0's baseline)"
    return note


def run_variant(recipe_path: Path, overrides: list[str], variant: str, out_dir: Path) -> dict:
    """Run one variant in a fresh process; returns the worker's result (exit code, baseline, log path)."""
    log_path = out_dir / f"{variant}.log"
    result_path = out_dir / f"{variant}.worker.json"
    result_path.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "liger_cli.bench.compare",
        "--worker",
        str(recipe_path),
        "--result",
        str(result_path),
    ]
    for item in overrides:
        argv += ["--set", item]
    start = time.perf_counter()
    with log_path.open("w") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    worker = json.loads(result_path.read_text()) if result_path.is_file() else {}
    return {"exit_code": code, "wall_s": wall, "log": str(log_path), **worker}


def _tail(path: str, lines: int = 15) -> str:
    text = Path(path).read_text(errors="replace").splitlines() if Path(path).is_file() else []
    return "\n".join(text[-lines:])


def bench(
    recipe_path: Path,
    overrides: list[str],
    steps: int,
    warmup: int,
    out_dir: Path | None = None,
    off_overrides: list[str] | None = None,
    echo=print,
) -> int:
    """Run the recipe with its kernels and with none, compare, write bench.json and bench.png.

    Returns the exit code: 0 when both runs finished and their first-step losses agree, else 1.
    `off_overrides` are extra `--set` items for the kernels-off run only (tests use them to force a
    disagreement).
    """
    from liger_cli.plan import build_plan

    if steps < 1:
        raise UserError(f"--steps {steps}: measure at least 1 step")
    if warmup < 0:
        raise UserError(f"--warmup {warmup}: must be 0 or more")
    recipe = load_recipe(recipe_path, overrides)
    kernels = _enabled_kernels(recipe)
    if not kernels:
        raise UserError(
            "every kernel is off in this recipe, so both runs would be the same: turn some on in kernels:"
        )
    plan = build_plan(recipe)
    out = Path(out_dir) if out_dir else recipe.output.dir.with_name(recipe.output.dir.name + "-bench")
    out = out.resolve()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: give a folder for the bench's runs and report")
    out.mkdir(parents=True, exist_ok=True)
    for variant in VARIANTS:  # validate both runs' recipes before spending minutes on the first
        load_recipe(recipe_path, _run_overrides(overrides, variant, steps, warmup, out, off_overrides))

    echo(
        f"bench: {recipe_path} on {plan.device}, {plan.num_processes} process(es), {plan.precision}; "
        f"{warmup} warm-up + {steps} measured steps per run; kernels on: {', '.join(kernels)}"
    )
    load_before = _load_average()
    results: dict[str, RunResult] = {}
    for variant in VARIANTS:
        echo(f"bench: running {variant} in a fresh process (log: {out / (variant + '.log')}) ...")
        worker = run_variant(
            recipe_path, _run_overrides(overrides, variant, steps, warmup, out, off_overrides), variant, out
        )
        if worker["exit_code"] != 0:
            echo(
                f"error: the {variant} run failed (exit {worker['exit_code']}); the end of its log:\n"
                f"{_tail(worker['log'])}"
            )
            return 1
        baseline = worker["baseline_mb"] if plan.device == "cpu" else 0.0
        results[variant] = summarize(
            variant,
            kernels if variant == "kernels_on" else [],
            out / variant / "metrics.jsonl",
            warmup,
            baseline,
            worker["wall_s"],
        )
        echo(f"bench: {variant} done in {worker['wall_s']:.0f} s")

    on, off = results["kernels_on"], results["kernels_off"]
    comparison = compare(on, off, plan.precision)
    report = {
        "recipe": str(Path(recipe_path).resolve()),
        "overrides": overrides,
        "device": plan.device,
        "device_name": _device_name(plan.device),
        "backend": plan.backend,
        "num_processes": plan.num_processes,
        "precision": plan.precision,
        "steps": steps,
        "warmup": warmup,
        "load_average": {"before": load_before, "after": _load_average()},
        "memory": _memory_note(plan.device, plan.num_processes),
        "runs": {variant: asdict(result) for variant, result in results.items()},
        "ratios": comparison.ratios,
        "first_step_loss": {
            "kernels_on": on.first_step_loss,
            "kernels_off": off.first_step_loss,
            "rel_diff": comparison.loss_rel_diff,
            "rtol": comparison.loss_rtol,
            "agree": comparison.losses_agree,
        },
        "verdict": comparison.verdict,
        "exit_code": comparison.exit_code,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    chart = write_chart(report, out / "bench.png")
    echo(render_table(on, off, comparison, report))
    if chart is None:
        echo(
            f"bench: wrote {out / 'bench.json'} (no chart: matplotlib is not installed; pip install 'liger-cli[bench]')"
        )
    else:
        echo(f"bench: wrote {out / 'bench.json'} and {chart}")
    echo(("verdict: " if comparison.losses_agree else "error: ") + comparison.verdict)
    return comparison.exit_code


def _run_overrides(overrides, variant, steps, warmup, out, off_overrides) -> list[str]:
    extra = list(off_overrides or []) if variant == "kernels_off" else []
    return [*overrides, *extra, *variant_overrides(variant, steps, warmup, out)]


def _load_average() -> float | None:
    """The 1-minute load average: other work on the machine slows both runs unevenly."""
    import os

    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    import platform

    return f"{platform.processor() or platform.machine()}, {_cpu_count()} cores"


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---------------------------------------------------------------- the worker: one fresh process per run


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def worker(recipe_path: Path, overrides: list[str], result_path: Path) -> int:
    """Import what training imports, record the RSS baseline, then train exactly as `liger train`."""
    recipe = load_recipe(recipe_path, overrides)
    process_state.hide_bitsandbytes_unless_quantized(
        recipe.model.quantize, recipe.model.path or recipe.model.config
    )
    process_state.hide_deepspeed_unless_used(recipe.distributed.backend)
    import liger_kernels  # noqa: F401
    import peft  # noqa: F401  (imported before the baseline, as training would import them)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from liger_cli.launch import launch
    from liger_cli.run.train import run

    baseline = _rss_mb()
    code = launch(recipe, recipe_path=recipe_path, overrides=overrides, train=run)
    result_path.write_text(json.dumps({"baseline_mb": baseline, "train_exit_code": code}))
    return code


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m liger_cli.bench.compare", description="One `liger bench` run."
    )
    parser.add_argument("--worker", type=Path, required=True, help="the recipe")
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        return worker(args.worker, args.overrides, args.result)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
