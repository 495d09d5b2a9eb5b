"""A vision-language SFT step: liger (kernels on, kernels off) against TRL's `SFTTrainer`, same model,
images, rows, LoRA and batch, on a CPU.

TRL lives in its own venv, never the project's (see bench/dpo_vs_trl.py for why):

    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && \\
        .venv-trl/bin/pip install -c constraints.txt -e . trl==1.16.0

    .venv/bin/python bench/vlm_vs_trl.py                 # 8 rows (8 images) a step, 1 + 3 steps, once
    .venv/bin/python bench/vlm_vs_trl.py --repeats 2     # bench/README.md's table

The same on every side: the model, a LLaVA of a small-but-real shape built here from a config
(random init, seed 0, saved once to a folder every run loads): a CLIP vision tower (4 layers, hidden
256, 64 x 64 pictures in 8 x 8 patches: 64 image tokens), a projector, and the bench Llama
(`recipes/bench/llama-8x512.json`: 8 layers, hidden 512, vocab 32000); the processor of
recipes/vision/model (its tokenizer and chat template; pictures resized to 64); the rows, the first
--rows of recipes/vision/data/train.jsonl (one picture and a question, a one-word answer); LoRA r=16
alpha 32 dropout 0 on the language model's linear layers, the projector trained in full (peft's
modules_to_save), the vision tower frozen; fp32, no gradient checkpointing, AdamW at a constant
learning rate, grad-norm clipping at 1.0. Both learn the assistant's answer only: liger's chat
format learns the assistant turns; TRL gets the same rows as prompt-completion (the user turn, the
assistant turn), so its `completion_only_loss` learns the same tokens (the answer, eos and the
template's newline). Every step trains the same --rows rows (one batch a epoch on both sides), so the
first step's loss is the same computation on both sides: it is checked (`--loss-rtol`).

Each variant is a fresh process, interleaved over --repeats: TRL (run by --trl-python, measured by
bench/trl_measure.py), liger with its kernels, liger with every kernel off (both through `liger
bench`'s worker). Measured after --warmup steps: the step time (from the end of the step before to the
end of its optimizer step) and the peak RSS growth over the RSS right before training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("trl", "liger_on", "liger_off")
LABELS = {"trl": "TRL SFTTrainer", "liger_on": "liger, kernels on", "liger_off": "liger, kernels off"}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
IMAGE_SIZE, PATCH_SIZE = 64, 8
VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4)
DATA = REPO / "recipes/vision/data"
LM_LINEAR = r"model\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def build_model(out: Path) -> Path:
    """The bench LLaVA and its processor, saved once: every run loads this folder."""
    import torch
    from transformers import (
        AutoConfig,
        AutoProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    processor = AutoProcessor.from_pretrained(REPO / "recipes/vision/model")
    processor.image_processor.size = {"shortest_edge": IMAGE_SIZE}
    processor.image_processor.crop_size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    tokenizer = processor.tokenizer
    config = LlavaConfig(
        text_config=AutoConfig.from_pretrained(REPO / "recipes/bench/llama-8x512.json"),
        vision_config=CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, **VISION),
        image_token_id=tokenizer.convert_tokens_to_ids(processor.image_token),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def write_rows(count: int, out: Path) -> Path:
    """The first `count` rows of the vision recipe's train split, their pictures beside them."""
    rows = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()[:count]]
    (out / "img").mkdir(parents=True, exist_ok=True)
    for row in rows:
        for part in row["messages"][0]["content"]:
            if part["type"] == "image":
                shutil.copy(DATA / part["path"], out / part["path"])
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- liger: `liger bench`'s worker


def liger_recipe(path: Path, model_dir: Path, rows: Path, args) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "dtype": "float32", "train_projector": True},
        "adapter": {"type": "lora", **LORA, "target_modules": "all-linear"},
        "data": {"train": str(rows), "format": "chat", "max_seq_len": 128, "packing": False},
        "training": {"micro_batch_size": args.rows, "grad_accum": 1, "lr": 1e-4, "scheduler": "constant",
                     "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0, "precision": "fp32",
                     "seed": 0},
        "kernels": {"rms_norm": True, "rope": True, "swiglu": True, "fused_linear_cross_entropy": True},
        "distributed": {"activation_checkpointing": "off"},
        "output": {"dir": str(path.parent / "liger-run"), "overwrite": True},
        "logging": {"every": 1, "tensorboard": False},
    }, sort_keys=False))  # fmt: skip
    return path


def run_liger(variant: str, recipe: Path, out: Path, args) -> dict:
    from trl_measure import run_liger as run  # bench/ is on sys.path (main)

    name = "kernels_on" if variant == "liger_on" else "kernels_off"
    figures = run(recipe, name, out, args.steps, args.warmup)[0]
    keep = ("step_time_s", "step_times_s", "peak_mem_mb", "first_step_loss", "error", "log")
    return {key: value for key, value in figures.items() if key in keep}


# ---------------------------------------------------------------- TRL: a fresh process in .venv-trl


def run_trl(model_dir: Path, rows: Path, out: Path, args) -> dict:
    from trl_measure import run_trl as run  # bench/ is on sys.path (main)

    result = out / "trl.worker.json"
    worker_argv = ["--trl-worker", str(model_dir), str(rows), str(result), "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--rows", str(args.rows), "--out", str(out / "trl")]  # fmt: skip
    return run(args.trl_python, __file__, worker_argv, result, out)


def trl_worker(model_dir: str, rows_file: str, result: str, args) -> int:
    """Under .venv-trl: TRL's SFTTrainer with its vision collation, each step timed."""
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import start, step_clock, summary

    baseline = start()  # the imports done, nothing of the run exists yet
    import datasets
    import torch
    from peft import LoraConfig
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    losses: list[float] = []

    class Measured(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((out[0] if return_outputs else out).detach()))
            return out

    base = Path(rows_file).parent
    rows = []
    for line in Path(rows_file).read_text().splitlines():
        user, assistant = json.loads(line)["messages"]
        images = [
            Image.open(base / p["path"]).convert("RGB") for p in user["content"] if p["type"] == "image"
        ]
        content = [{"type": p["type"]} if p["type"] == "image" else p for p in user["content"]]
        rows.append(
            {"prompt": [{"role": "user", "content": content}], "completion": [assistant], "images": images}
        )
    torch.manual_seed(0)
    config = SFTConfig(
        output_dir=args.out, max_steps=args.warmup + args.steps, per_device_train_batch_size=args.rows,
        gradient_accumulation_steps=1, learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", seed=0, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=False, max_length=None, completion_only_loss=True, logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    clock = step_clock()
    trainer = Measured(
        model=AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32),
        args=config, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoProcessor.from_pretrained(model_dir),
        peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                               target_modules=LM_LINEAR, modules_to_save=["multi_modal_projector"]),
        callbacks=[clock],
    )  # fmt: skip
    trainer.train()
    Path(result).write_text(
        json.dumps({**summary(clock, args.warmup, baseline), "first_step_loss": losses[0]})
    )
    return 0


# ---------------------------------------------------------------- the parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-worker", nargs=3, metavar=("MODEL", "ROWS", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the measured ones")
    parser.add_argument("--rows", type=int, default=8, help="rows (each one picture) a step")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the variants, interleaved")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS)
    )
    parser.add_argument("--loss-rtol", type=float, default=1e-3, help="step-1 loss agreement with TRL's")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/vlm_vs_trl")
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(*args.trl_worker, args)
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import chosen_variants

    variants = chosen_variants(parser, args, VARIANTS)

    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model_dir = build_model(out / "model")
    rows = write_rows(args.rows, out / "data")
    recipe = liger_recipe(out / "vlm-bench.yaml", model_dir, rows, args)
    load = {"before": round(os.getloadavg()[0], 2)}
    runs = []
    for repeat in range(args.repeats):
        for variant in variants:
            where = out / f"repeat-{repeat}"
            where.mkdir(exist_ok=True)
            run = (
                run_trl(model_dir, rows, where, args)
                if variant == "trl"
                else run_liger(variant, recipe, where, args)
            )
            runs.append({"variant": variant, "repeat": repeat, **run})
            shown = f"failed, see {run['log']}" if "error" in run else (
                f"step {run['step_time_s']:.2f} s, peak {run['peak_mem_mb']:.0f} MiB, "
                f"step-1 loss {run['first_step_loss']:.6f}")  # fmt: skip
            print(f"vlm_vs_trl: repeat {repeat} {variant}: {shown}", flush=True)
    load["after"] = round(os.getloadavg()[0], 2)

    table = {}
    for variant in variants:
        done = [r for r in runs if r["variant"] == variant and "error" not in r]
        if done:
            table[variant] = {
                key: sum(r[key] for r in done) / len(done) for key in ("step_time_s", "peak_mem_mb")
            }
            table[variant]["best_step_time_s"] = min(t for r in done for t in r["step_times_s"])
            table[variant]["first_step_loss"] = done[0]["first_step_loss"]
    print(f"\n{args.rows} rows (one 64x64 picture each, 64 image tokens) a step; {args.warmup} warm-up + "
          f"{args.steps} measured steps x {args.repeats}; {os.cpu_count()} CPUs, load average "
          f"{load['before']} -> {load['after']}\n")  # fmt: skip
    print("| | step time (s) | best step (s) | peak memory | time / TRL | memory / TRL | step-1 loss |")
    print("|---|---|---|---|---|---|---|")
    trl = table.get("trl")
    for variant, r in table.items():
        ratios = (f"{r['step_time_s'] / trl['step_time_s']:.2f}x | {r['peak_mem_mb'] / trl['peak_mem_mb']:.2f}x"
                  if trl else "- | -")  # fmt: skip
        print(f"| {LABELS[variant]} | {r['step_time_s']:.2f} | {r['best_step_time_s']:.2f} | "
              f"{r['peak_mem_mb']:.0f} MiB | {ratios} | {r['first_step_loss']:.6f} |")  # fmt: skip
    report = {"settings": {k: str(v) for k, v in vars(args).items() if k != "trl_worker"},
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "load_average": load, "runs": runs, "table": table}  # fmt: skip
    (out / "vlm_vs_trl.json").write_text(json.dumps(report, indent=2) + "\n")
    failed = [r for r in runs if "error" in r]
    off = [
        v
        for v, r in table.items()
        if trl and abs(r["first_step_loss"] / trl["first_step_loss"] - 1) > args.loss_rtol
    ]
    for r in failed:
        print(f"error: {r['variant']} (repeat {r['repeat']}) failed; its log: {r['log']}", file=sys.stderr)
    for v in off:
        print(f"error: {v}'s step-1 loss {table[v]['first_step_loss']:.6f} is not TRL's", file=sys.stderr)
    return 1 if failed or off else 0


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU bench: no worker sees a GPU
    sys.exit(main())
