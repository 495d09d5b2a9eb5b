"""QLoRA against LoRA on the same model, data and batch: weight bytes, step time, the peak memory of a
training step (weights included), and the memory plan's estimate against it. Ratios come from one run.

    .venv/bin/python bench/qlora_vs_lora.py                                   # 8 x 512 model, about 2 min
    .venv/bin/python bench/qlora_vs_lora.py --config recipes/bench/llama-3.2-1b.json --steps 2 --warmup 1

Both variants train `recipes/bench/train.jsonl` (full 1024-token rows; `--seq-len`, `--batch`) through
`liger train` in fresh processes, run by `liger bench`'s worker; step time is the mean over the steps
after the warm-up. Memory, on a CPU, in MiB:

- step peak: what the run's final_metrics.json records as `peak_mem_growth_mb`, the largest resident
  memory (Linux's VmHWM, reset as each step begins) during a step, over the process's RSS before the
  model was built: the weights, the adapter and its optimizer state, and the step's activations, loss
  and transients. This is what the memory plan (`liger train --dry-run`) estimates, and what the 0.5x
  goal compares.
- process peak: the process's lifetime peak RSS (loading included) over the worker's RSS after its
  imports, for comparison; loading a 4-bit base reads the full-precision checkpoint first.

The model is built once from the config (seed 0, fp32) and saved, so every variant loads the same
weights; LoRA r=16 on all linear layers, kernels on. Variants: LoRA and QLoRA computing in fp32
(`model.dtype`), and QLoRA computing in bf16 (`model.dtype: bfloat16`, as QLoRA usually runs; peft's
k-bit preparation keeps what stays unquantized in fp32), each against fp32 LoRA. Weight bytes are counted on
the loaded model: the base's parameters and buffers as stored (4-bit packed weights, their scales,
everything left unquantized), against the same model at 2 bytes a parameter (bf16). Results go to
bench/results/qlora_vs_lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# name -> (model.quantize, model.dtype): fp32 LoRA, QLoRA computing in fp32 (the same numbers as LoRA
# but for the quantization), and QLoRA computing in bf16, as QLoRA is usually run
VARIANTS = {"lora": ("none", "float32"), "qlora": ("nf4", "float32"), "qlora-bf16": ("nf4", "bfloat16")}
GOAL_PEAK = 0.5  # QLoRA's step peak at most this much of fp32 LoRA's
GOAL_WEIGHTS = 0.28  # QLoRA's base at about this much of its bf16 bytes


def build_model(config: Path, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config), dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(REPO / "recipes" / "quickstart" / "model").save_pretrained(out)
    return out


def write_recipe(path: Path, model_dir: Path, quantize: str, dtype: str, args) -> Path:
    import yaml

    recipe = {
        "model": {"path": str(model_dir), "dtype": dtype, "quantize": quantize},
        "adapter": {"type": "lora", "r": 16, "alpha": 32, "target_modules": "all-linear"},
        "data": {"train": str(REPO / "recipes" / "bench" / "train.jsonl"), "format": "text",
                 "max_seq_len": args.seq_len, "cache": False},
        "training": {"micro_batch_size": args.batch, "precision": "fp32", "lr": 1e-4, "seed": 0},
        "distributed": {"activation_checkpointing": "off"},
        "output": {"dir": str(path.parent / "run"), "verify": False},
    }  # fmt: skip
    if quantize == "none":
        del recipe["model"]["quantize"]
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def weight_bytes(recipe_path: Path) -> dict:
    """Bytes of the loaded base as stored, and what bf16 would take for the same parameters."""
    code = (
        "import json, sys\n"
        "from liger_cli.model.build import load_base_model\n"
        "from liger_cli.recipe import load_recipe\n"
        "m = load_base_model(load_recipe(sys.argv[1], []))\n"
        "tensors = {t.data_ptr(): t for t in m.state_dict().values()}\n"  # a tied weight once
        "stored = sum(t.numel() * t.element_size() for t in tensors.values())\n"
        "params = m.num_parameters()\n"  # 4-bit layers report their real parameter count
        "four = [x for x in m.modules() if getattr(x, 'quant_state', None) is not None]\n"
        "linear = sum(t.numel() * t.element_size() for x in four for t in x.state_dict().values())\n"
        "linear_bf16 = sum(2 * x.quant_state.shape.numel() for x in four)\n"
        "print(json.dumps({'stored_bytes': stored, 'parameters': params, 'linear_4bit_bytes': linear,\n"
        "                  'linear_bf16_bytes': linear_bf16}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(recipe_path)], capture_output=True, text=True, check=True
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    found["bf16_bytes"] = 2 * found["parameters"]
    return found


def estimate_bytes(recipe_path: Path) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "liger_cli", "train", str(recipe_path), "--dry-run", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)["memory"]["total_bytes"]


def measure(recipe_path: Path, out: Path, args) -> dict:
    from liger_cli.bench.compare import run_variant, variant_overrides
    from liger_cli.bench.report import summarize
    from liger_cli.run.train import FINAL_METRICS

    overrides = variant_overrides("kernels_on", args.steps, args.warmup, out)
    worker = run_variant(recipe_path, overrides, "kernels_on", out)
    if worker["exit_code"] != 0:
        raise SystemExit(f"{recipe_path} failed (exit {worker['exit_code']}); see {worker['log']}")
    run = out / "kernels_on"
    # summarize's peak: the lifetime peak RSS (metrics.jsonl) over the worker's post-import baseline
    result = summarize(
        "kernels_on", [], run / "metrics.jsonl", args.warmup, worker["baseline_mb"], worker["wall_s"]
    )
    final = json.loads((run / FINAL_METRICS).read_text())
    return {"step_time_s": result.step_time_s, "step_peak_mb": final["peak_mem_growth_mb"],
            "process_peak_mb": result.peak_mem_mb, "first_step_loss": result.first_step_loss}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "recipes" / "bench" / "llama-8x512.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args(argv)

    results: dict = {"config": str(args.config), "batch": args.batch, "seq_len": args.seq_len,
                     "load_before": os.getloadavg()[0]}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="liger-qlora-bench-") as tmp:
        root = Path(tmp)
        model_dir = build_model(args.config, root / "model")
        for name, (quantize, dtype) in VARIANTS.items():
            folder = root / name
            folder.mkdir()
            recipe = write_recipe(folder / "recipe.yaml", model_dir, quantize, dtype, args)
            results[name] = {**weight_bytes(recipe), **measure(recipe, folder, args),
                             "estimate_mb": estimate_bytes(recipe) / 2**20}  # fmt: skip
    results["load_after"] = os.getloadavg()[0]
    lora, qlora, bf16 = results["lora"], results["qlora"], results["qlora-bf16"]
    for name in VARIANTS:
        r = results[name]
        r["estimate_vs_step_peak"] = r["estimate_mb"] / r["step_peak_mb"]
    ratios = {
        "weights": qlora["stored_bytes"] / lora["stored_bytes"],
        "qlora_weights_vs_bf16": qlora["stored_bytes"] / qlora["bf16_bytes"],
        "step_time": qlora["step_time_s"] / lora["step_time_s"],
        "step_peak": qlora["step_peak_mb"] / lora["step_peak_mb"],
        "estimate": qlora["estimate_mb"] / lora["estimate_mb"],
        "process_peak": qlora["process_peak_mb"] / lora["process_peak_mb"],
        "linear_4bit_vs_bf16": qlora["linear_4bit_bytes"] / qlora["linear_bf16_bytes"],
        "bf16_step_time": bf16["step_time_s"] / lora["step_time_s"],
        "bf16_step_peak": bf16["step_peak_mb"] / lora["step_peak_mb"],
        "bf16_estimate": bf16["estimate_mb"] / lora["estimate_mb"],
    }
    results["qlora_over_lora"] = ratios
    print(
        f"model {args.config.name}, {args.batch} x {args.seq_len} tokens, LoRA r=16 all-linear; "
        "MiB; step peak: RSS high-water during a step over the RSS before the model was built"
    )
    print(f"{'':10} {'weights':>8} {'vs bf16':>8} {'step s':>7} {'step peak':>10} {'plan':>7} "
          f"{'plan/peak':>9} {'process peak':>12} {'loss 1':>8}")  # fmt: skip
    for name in VARIANTS:
        r = results[name]
        print(f"{name:10} {r['stored_bytes'] / 2**20:8.0f} {r['stored_bytes'] / r['bf16_bytes']:7.2f}x "
              f"{r['step_time_s']:7.2f} {r['step_peak_mb']:10.0f} {r['estimate_mb']:7.0f} "
              f"{r['estimate_vs_step_peak']:8.2f}x {r['process_peak_mb']:12.0f} {r['first_step_loss']:8.4f}")  # fmt: skip
    met = {True: "met", False: "NOT met"}
    print(f"qlora / lora: weights {ratios['weights']:.2f}x, step time {ratios['step_time']:.2f}x, "
          f"step peak {ratios['step_peak']:.2f}x (goal <= {GOAL_PEAK}x: {met[ratios['step_peak'] <= GOAL_PEAK]}; "
          f"plan {ratios['estimate']:.2f}x), process peak {ratios['process_peak']:.2f}x")  # fmt: skip
    print(f"qlora-bf16 / lora (fp32): step time {ratios['bf16_step_time']:.2f}x, step peak "
          f"{ratios['bf16_step_peak']:.2f}x (goal <= {GOAL_PEAK}x: {met[ratios['bf16_step_peak'] <= GOAL_PEAK]}; "
          f"plan {ratios['bf16_estimate']:.2f}x)")  # fmt: skip
    print(f"qlora's 4-bit linear layers vs their bf16 bytes: {ratios['linear_4bit_vs_bf16']:.2f}x "
          f"(goal about {GOAL_WEIGHTS}x: {met[ratios['linear_4bit_vs_bf16'] <= GOAL_WEIGHTS + 0.02]}); "
          f"the whole base (embeddings unquantized) vs bf16: {ratios['qlora_weights_vs_bf16']:.2f}x; "
          f"load average {results['load_before']:.1f} -> {results['load_after']:.1f}")  # fmt: skip
    out = REPO / "bench" / "results" / "qlora_vs_lora.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
