"""QLoRA against LoRA on the same model, data and batch: weight bytes, step time, peak memory, and the
memory plan's estimate against the measured peak. Ratios come from one run of this script.

    .venv/bin/python bench/qlora_vs_lora.py                                   # 8 x 512 model, about 3 min
    .venv/bin/python bench/qlora_vs_lora.py --config recipes/bench/llama-3.2-1b.json --steps 2

Both variants train `recipes/bench/train.jsonl` (full 1024-token rows; `--seq-len`, `--batch`) through
`liger train` in fresh processes, the way `liger bench` measures (its worker: step time over the steps
after the warm-up, peak RSS growth over the process's RSS right before training on a CPU). The model is
built once from the config (seed 0, fp32) and saved, so both load the same weights; LoRA r=16 on all
linear layers, kernels on, compute in fp32 (`model.dtype`). Weight bytes are counted on the loaded
model: the base's parameters and buffers as stored (4-bit packed weights, their scales, everything left
unquantized), against the same model at 2 bytes a parameter (bf16). Results go to
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
VARIANTS = {"lora": "none", "qlora": "nf4"}


def build_model(config: Path, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config), dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(REPO / "recipes" / "quickstart" / "model").save_pretrained(out)
    return out


def write_recipe(path: Path, model_dir: Path, quantize: str, args) -> Path:
    import yaml

    recipe = {
        "model": {"path": str(model_dir), "dtype": "float32", "quantize": quantize},
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
        "print(json.dumps({'stored_bytes': stored, 'parameters': params}))\n"
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

    overrides = variant_overrides("kernels_on", args.steps, args.warmup, out)
    worker = run_variant(recipe_path, overrides, "kernels_on", out)
    if worker["exit_code"] != 0:
        raise SystemExit(f"{recipe_path} failed (exit {worker['exit_code']}); see {worker['log']}")
    metrics = out / "kernels_on" / "metrics.jsonl"
    result = summarize("kernels_on", [], metrics, args.warmup, worker["baseline_mb"], worker["wall_s"])
    return {"step_time_s": result.step_time_s, "peak_mem_mb": result.peak_mem_mb,
            "first_step_loss": result.first_step_loss}  # fmt: skip


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
        for name, quantize in VARIANTS.items():
            folder = root / name
            folder.mkdir()
            recipe = write_recipe(folder / "recipe.yaml", model_dir, quantize, args)
            results[name] = {**weight_bytes(recipe), **measure(recipe, folder, args),
                             "estimate_mb": estimate_bytes(recipe) / 2**20}  # fmt: skip
    results["load_after"] = os.getloadavg()[0]
    lora, qlora = results["lora"], results["qlora"]
    print(
        f"model {args.config.name}, {args.batch} x {args.seq_len} tokens, fp32 compute, LoRA r=16 all-linear"
    )
    print(
        f"{'':8} {'weights':>10} {'vs bf16':>8} {'step s':>8} {'peak MiB':>9} {'plan MiB':>9} {'loss 1':>8}"
    )
    for name in VARIANTS:
        r = results[name]
        print(f"{name:8} {r['stored_bytes'] / 2**20:9.0f}M {r['stored_bytes'] / r['bf16_bytes']:7.2f}x "
              f"{r['step_time_s']:8.2f} {r['peak_mem_mb']:9.0f} {r['estimate_mb']:9.0f} {r['first_step_loss']:8.4f}")  # fmt: skip
    print(f"qlora / lora: weights {qlora['stored_bytes'] / lora['stored_bytes']:.2f}x, "
          f"step time {qlora['step_time_s'] / lora['step_time_s']:.2f}x, "
          f"peak memory {qlora['peak_mem_mb'] / lora['peak_mem_mb']:.2f}x "
          f"(load {results['load_before']:.1f} -> {results['load_after']:.1f})")  # fmt: skip
    out = REPO / "bench" / "results" / "qlora_vs_lora.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
