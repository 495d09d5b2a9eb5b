"""What every *_vs_trl.py bench does the same way: each side in a fresh process, measured alike.

In the parent: `chosen_variants()` reads --variants and checks the TRL interpreter is there when
needed; `run_liger()` runs a liger variant as `liger bench` does (its own worker process) and reads its
figures back; `run_trl()` runs the script's own TRL worker under TRL's interpreter and reads what it
wrote. Inside the TRL process (under .venv-trl): `start()` first (it gives the process `liger train`'s
CPU allocator setting, imports what a TRL run imports and returns the RSS baseline), a `step_clock()`
callback on the trainer, then `summary()` of the steps after the warm-up: the mean step time (each
from the end of the step before to the end of its optimizer step) and the peak RSS growth.

The smaller benches (kto_vs_trl, reward_vs_trl) share more: `liger_side()` writes and runs the liger
recipe every such bench writes alike (LoRA, constant learning rate, fp32, no checkpointing, a log line
a step), `trl_side()` runs the TRL worker and stops the bench when it fails, `recording_losses()` is
a TRL trainer class that keeps its training losses, `arguments()` adds their shared options,
`parse()` checks the TRL interpreter, `compare()` runs TRL, liger with its kernels and liger without
(noting the load average around them), `report()` writes the results JSON and prints the markdown
table of bench/README.md (`table()`) with the ratios to TRL's row; inside the TRL worker `train_trl()`
trains with the settings these benches share and writes the figures.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_NOTE = (
    "\nvLLM engine: peak memory is the training process's only (its server, processes of its own, holds "
    "about 3 GiB more on a CPU); the step time includes the weight push after each step (the LoRA "
    "adapter saved and loaded by the server), not the server's start (once per run, before the first step)."
)
"""Printed under a table with liger's `rl.engine: vllm` variant (grpo_vs_trl, agent_vs_trl --vllm)."""


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
    import torch

    from liger_cli.bench.compare import run_variant, variant_overrides
    from liger_cli.bench.report import read_metrics, summarize

    worker = run_variant(recipe, variant_overrides(name, steps, warmup, out), name, out)
    if worker["exit_code"] != 0:
        return {"error": f"exit {worker['exit_code']}", "log": worker["log"]}, []
    metrics = out / name / "metrics.jsonl"
    baseline = 0.0 if torch.cuda.is_available() else worker["baseline_mb"]  # a GPU's peak: the allocator's
    result = summarize(name, [], metrics, warmup, baseline, worker["wall_s"])
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
    with `generation_s`, the measured steps' mean `time/sampling_s`, and `measured`, their metrics rows;
    exits naming the log where it failed."""
    import yaml

    path = out / "liger.yaml"
    shared = {"distributed": {"activation_checkpointing": "off"}, "output": {"dir": str(out / "liger-run"),
              "overwrite": True}, "logging": {"every": 1, "tensorboard": False}}  # fmt: skip
    path.write_text(yaml.safe_dump({**recipe, **shared}, sort_keys=False))
    figures, measured = run_liger(path, name, out, steps, warmup)
    if "error" in figures:
        raise SystemExit(f"liger {name} failed: see {figures['log']}")
    generation = sum(m["time/sampling_s"] for m in measured) / len(measured)
    return {**figures, "generation_s": generation, "measured": measured}


def run_trl(
    trl_python: Path, script: str, worker_argv: list[str], result: Path, out: Path, gpu: bool = False
) -> dict:
    """`TRL_PYTHON SCRIPT WORKER_ARGV` (the script's own TRL worker, which writes its figures to RESULT)
    in a fresh process on the CPU (GPU: where it may see the GPUs), its output in OUT/trl.log. Returns
    what it wrote, with the wall time and the log; {"error", "log"} where it failed."""
    log = out / "trl.log"
    result.unlink(missing_ok=True)
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", **({} if gpu else {"CUDA_VISIBLE_DEVICES": ""})}
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
    """A TrainerCallback that records each step's time and the process's peak memory at its end: its peak
    RSS, or where the process uses CUDA the allocator's peak (torch.cuda.max_memory_allocated)."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.last, self.steps = None, []

        def on_train_begin(self, *_, **__):
            self.last = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            now = time.perf_counter()
            if torch.cuda.is_initialized():
                peak = torch.cuda.max_memory_allocated() / 2**20
            else:
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


def liger_side(name: str, out: Path, args, model_dir: Path, lora: dict, data: dict, **sections) -> dict:
    """liger's variant NAME of a bench whose recipe differs from the others' only in `data` and the
    objective's `sections` (a "training" dict is merged over the shared training keys): written to
    OUT/liger.yaml, run by `run_liger`, its figures returned; the bench stops where it failed."""
    import yaml

    training = {"grad_accum": 1, "lr": 1e-4, "scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                "max_grad_norm": 1.0, "precision": "fp32", "seed": 0, **sections.pop("training", {})}  # fmt: skip
    recipe = out / "liger.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "dtype": "float32"},
        "adapter": {"type": "lora", **lora, "target_modules": "all-linear"},
        "data": data, "training": training, **sections,
        "distributed": {"activation_checkpointing": "off"},
        "output": {"dir": str(out / "liger-run"), "overwrite": True},
        "logging": {"every": 1, "tensorboard": False},
    }, sort_keys=False))  # fmt: skip
    figures, _ = run_liger(recipe, name, out, args.steps, args.warmup)
    if "error" in figures:
        raise SystemExit(f"liger {name} failed: see {figures['log']}")
    return figures


def trl_side(script: str, out: Path, args, inputs: list[str], options: dict) -> dict:
    """The TRL worker of SCRIPT (`--trl-worker *INPUTS RESULT`, then --steps, --warmup and OPTIONS) under
    args.trl_python; what it wrote, or the bench stops."""
    result = out / "trl.json"
    argv = ["--trl-worker", *inputs, str(result), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += [str(part) for key, value in options.items() for part in (key, value)]
    found = run_trl(args.trl_python, script, argv, result, out)
    if "error" in found:
        raise SystemExit(f"TRL failed: see {found['log']}")
    return found


def recording_losses(trainer_class):
    """(a subclass of TRL's TRAINER_CLASS that keeps each training loss, the list it appends to)."""
    losses: list[float] = []

    class Recorded(trainer_class):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                losses.append(float((out[0] if return_outputs else out).detach()))
            return out

    return Recorded, losses


def table(found: dict[str, dict], trl_name: str) -> str:
    """The markdown table: each variant's step time, peak memory and step-1 loss, and its ratios to TRL's."""
    trl = found[trl_name]
    lines = [
        "| | step time (s) | peak memory | step-1 loss | time / TRL | memory / TRL |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in found.items():
        lines.append(
            f"| {name} | {r['step_time_s']:.2f} | {r['peak_mem_mb']:.0f} MiB | {r['first_step_loss']:.6f} | "
            f"{r['step_time_s'] / trl['step_time_s']:.2f}x | {r['peak_mem_mb'] / trl['peak_mem_mb']:.2f}x |"
        )
    return "\n".join(lines)


def arguments(parser, name: str, steps: int = 3, seq_len: int = 512) -> None:
    """The options every such bench takes: the TRL interpreter, steps, warm-up, sequence length, output."""
    parser.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    parser.add_argument("--steps", type=int, default=steps, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the measured ones")
    parser.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence, about half prompt")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results" / name)


def compare(trl_label: str, trl_run, liger_run) -> tuple[dict[str, dict], list[float]]:
    """{label: figures} of `trl_run()`, `liger_run("kernels_on")` and `liger_run("kernels_off")`, one after
    the other; the 1-minute load average before and after them."""
    load = [round(os.getloadavg()[0], 2)]
    found = {trl_label: trl_run()}
    found["liger, kernels on"] = liger_run("kernels_on")
    found["liger, kernels off"] = liger_run("kernels_off")
    load.append(round(os.getloadavg()[0], 2))
    return found, load


def parse(parser):
    """The parsed arguments; outside the TRL worker, --trl-python must exist."""
    args = parser.parse_args()
    if not args.trl_worker and not args.trl_python.is_file():
        parser.error(f"{args.trl_python} not found: set up TRL's venv (bench/dpo_vs_trl.py's docstring)")
    return args


def report(
    path: Path, args, tokens: dict, found: dict, load: list[float], trl_label: str, batch: str
) -> None:
    """The results JSON (the settings, the token counts, the load average, every variant's figures), and on
    stdout a line of what was measured (BATCH: what a step holds) over the table."""
    settings = {k: str(v) for k, v in vars(args).items() if k != "trl_worker"}
    path.write_text(
        json.dumps({"settings": settings, "tokens": tokens, "load_average": load, "runs": found}, indent=2)
    )
    print(f"\n{batch} x {args.seq_len} tokens a step (sequences of {tokens['sequence_tokens']} tokens, the same ids "
          f"on both sides); {args.warmup} warm-up + {args.steps} measured steps; TRL "
          f"{found[trl_label]['versions']['trl']}; load average {load[0]} -> {load[1]}\n\n{table(found, trl_label)}\n"
          f"wrote {path}")  # fmt: skip


def train_trl(
    trainer_class,
    config_class,
    model,
    rows: str,
    result: str,
    args,
    baseline: float,
    lora: dict,
    task_type: str,
    check=None,
    **options,
) -> int:
    """Inside the TRL worker: TRAINER_CLASS on MODEL and the rows file ROWS with the settings every such
    bench shares (constant learning rate 1e-4, no weight decay, clipping at 1.0, fp32 on the CPU, no
    gradient checkpointing, no eval, no save, a log line a step) and its own OPTIONS, LoRA on all linear
    layers; CHECK(trainer) before training. Writes the summary and the first loss to RESULT."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer

    recorded, losses = recording_losses(trainer_class)
    torch.manual_seed(0)
    config = config_class(
        output_dir=str(Path(result).parent / "trl-run"), max_steps=args.warmup + args.steps,
        gradient_accumulation_steps=1, learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", seed=0, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, max_length=args.seq_len, logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, **options,
    )  # fmt: skip
    clock = step_clock()
    trainer = recorded(
        model=model, args=config, processing_class=AutoTokenizer.from_pretrained(model.name_or_path),
        train_dataset=datasets.Dataset.from_list([json.loads(line) for line in Path(rows).read_text().splitlines()]),
        peft_config=LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                               target_modules="all-linear", task_type=task_type),
        callbacks=[clock],
    )  # fmt: skip
    if check is not None:
        check(trainer)
    trainer.train()
    Path(result).write_text(
        json.dumps({**summary(clock, args.warmup, baseline), "first_step_loss": losses[0]})
    )
    return 0
