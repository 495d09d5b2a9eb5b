"""A reward-model step: liger (`training.objective: reward`, kernels on, kernels off) against TRL's
`RewardTrainer`, same model, pairs, LoRA, score head and batch, on a CPU.

TRL lives in its own venv, never the project's (see bench/dpo_vs_trl.py for its set-up):

    .venv/bin/python bench/reward_vs_trl.py                  # 4 pairs x 512 tokens, 1 + 3 steps
    .venv/bin/python bench/reward_vs_trl.py --trl-python /path/to/.venv-trl/bin/python --pairs 8

The same on every side: the weights (`recipes/bench/llama-8x512.json` as its sequence-classification
class, one label, `pad_token_id` the tokenizer's `<pad>`; random init with seed 0, the score head
included, saved once to a folder every run loads), the quickstart tokenizer, the preference pairs
(bench/dpo_vs_trl.py's `make_pairs`: a prompt of about half the sequence, answers that fill the rest;
its `check_same_tokens` checks that both sides train on the same ids: TRL's prompt + answer + eos
string with BOS, liger's encoded pair), LoRA r=16 alpha 32 dropout 0 on all linear layers with the
score head trained in full (peft's SEQ_CLS task: `modules_to_save`, on both sides), the Bradley-Terry
loss without margin or centering (liger `reward.center_coefficient` 0, TRL
`center_rewards_coefficient` None), fp32, a micro-batch of --pairs pairs (2x rows in one forward on
both sides), no gradient accumulation, no gradient checkpointing, AdamW with a constant learning rate,
grad-norm clipping at 1.0.

Each variant a fresh process (trl_measure): TRL (run by --trl-python), liger with its kernels, liger
with every kernel off (both through `liger bench`'s worker). Measured after --warmup steps: the step
time (from the end of the step before to the end of its optimizer step) and the peak RSS growth over
the RSS right before training. The step-1 loss must agree (relative 1e-4): the adapter's B is zero,
so both score with the same saved weights; a run where it does not exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
LOSS_RTOL = 1e-4


def setup(out: Path, args) -> tuple[Path, Path, dict]:
    """The reward model's folder and the pairs file, made once; the token counts both sides train on."""
    import torch
    from dpo_vs_trl import check_same_tokens, make_pairs  # bench/ is on sys.path (main)
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    model_dir = out / "model"
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes/quickstart/model")
    config = AutoConfig.from_pretrained(REPO / "recipes/bench/llama-8x512.json")
    config.architectures, config.num_labels = ["LlamaForSequenceClassification"], 1
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    pairs = make_pairs(tokenizer, args.pairs * (args.warmup + args.steps), args.seq_len)
    pairs_file = out / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return model_dir, pairs_file, check_same_tokens(tokenizer, pairs, args.seq_len)


def liger_variant(name: str, model_dir: Path, pairs: Path, out: Path, args) -> dict:
    import yaml
    from trl_measure import run_liger  # bench/ is on sys.path (main)

    recipe = out / "liger.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "dtype": "float32"},
        "adapter": {"type": "lora", **LORA, "target_modules": "all-linear"},
        "data": {"train": str(pairs), "format": "preference", "max_seq_len": args.seq_len},
        "training": {"objective": "reward", "micro_batch_size": args.pairs, "grad_accum": 1, "lr": 1e-4,
                     "scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0,
                     "precision": "fp32", "seed": 0},
        "distributed": {"activation_checkpointing": "off"},
        "output": {"dir": str(out / "liger-run"), "overwrite": True},
        "logging": {"every": 1, "tensorboard": False},
    }, sort_keys=False))  # fmt: skip
    figures, _ = run_liger(recipe, name, out, args.steps, args.warmup)
    if "error" in figures:
        raise SystemExit(f"liger {name} failed: see {figures['log']}")
    return figures


def trl_variant(model_dir: Path, pairs: Path, out: Path, args) -> dict:
    from trl_measure import run_trl  # bench/ is on sys.path (main)

    result = out / "trl.json"
    worker_argv = ["--trl-worker", str(model_dir), str(pairs), str(result), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--pairs", str(args.pairs), "--seq-len", str(args.seq_len)]  # fmt: skip
    found = run_trl(args.trl_python, __file__, worker_argv, result, out)
    if "error" in found:
        raise SystemExit(f"TRL failed: see {found['log']}")
    return found


def trl_worker(model_dir: str, pairs: str, result: str, args) -> int:
    """Under .venv-trl: TRL's RewardTrainer, each step timed, its first loss kept."""
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import start, step_clock, summary

    baseline = start()  # the imports done, nothing of the run exists yet
    import datasets
    import peft
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    losses: list[float] = []

    class Measured(RewardTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                losses.append(float((out[0] if return_outputs else out).detach()))
            return out

    torch.manual_seed(0)
    rows = [json.loads(line) for line in Path(pairs).read_text().splitlines()]
    config = RewardConfig(
        output_dir=str(Path(result).parent / "trl-run"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.pairs, gradient_accumulation_steps=1, learning_rate=1e-4,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        seed=0, bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False, max_length=args.seq_len,
        center_rewards_coefficient=None, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    clock = step_clock()
    trainer = Measured(
        model=AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32), args=config,
        train_dataset=datasets.Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                               target_modules="all-linear", task_type="SEQ_CLS"),
        callbacks=[clock],
    )  # fmt: skip
    assert isinstance(trainer.model, peft.PeftModel)
    trained = {
        n.split(".modules_to_save.")[0] for n, p in trainer.model.named_parameters() if p.requires_grad
    }
    assert any(n.endswith("score") for n in trained), "TRL's score head is not trained"
    trainer.train()
    Path(result).write_text(
        json.dumps({**summary(clock, args.warmup, baseline), "first_step_loss": losses[0]})
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-worker", nargs=3, metavar=("MODEL", "PAIRS", "RESULT"))
    parser.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the measured ones")
    parser.add_argument("--pairs", type=int, default=4, help="pairs per micro-batch (2x rows)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence, about half prompt")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/reward_vs_trl")
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(*args.trl_worker, args)
    if not args.trl_python.is_file():
        parser.error(f"{args.trl_python} not found: set up TRL's venv (bench/dpo_vs_trl.py's docstring)")
    sys.path.insert(0, str(Path(__file__).parent))
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, pairs, tokens = setup(args.out, args)
    load = [round(os.getloadavg()[0], 2)]
    found = {"TRL RewardTrainer": trl_variant(model_dir, pairs, args.out, args)}
    found["liger, kernels on"] = liger_variant("kernels_on", model_dir, pairs, args.out, args)
    found["liger, kernels off"] = liger_variant("kernels_off", model_dir, pairs, args.out, args)
    load.append(round(os.getloadavg()[0], 2))
    (args.out / "reward_vs_trl.json").write_text(json.dumps(
        {"settings": {k: str(v) for k, v in vars(args).items() if k != "trl_worker"}, "tokens": tokens,
         "load_average": load, "runs": found}, indent=2))  # fmt: skip
    trl = found["TRL RewardTrainer"]
    print(f"\n{args.pairs} pairs x {args.seq_len} tokens a step (sequences of {tokens['sequence_tokens']} tokens, "
          f"the same ids on both sides); {args.warmup} warm-up + {args.steps} measured steps; TRL "
          f"{trl['versions']['trl']}; load average {load[0]} -> {load[1]}\n")  # fmt: skip
    print("| | step time (s) | peak memory | step-1 loss | time / TRL | memory / TRL |")
    print("|---|---|---|---|---|---|")
    for name, r in found.items():
        print(f"| {name} | {r['step_time_s']:.2f} | {r['peak_mem_mb']:.0f} MiB | {r['first_step_loss']:.6f} | "
              f"{r['step_time_s'] / trl['step_time_s']:.2f}x | {r['peak_mem_mb'] / trl['peak_mem_mb']:.2f}x |")  # fmt: skip
    print(f"wrote {args.out / 'reward_vs_trl.json'}")
    off = [
        n
        for n, r in found.items()
        if abs(r["first_step_loss"] - trl["first_step_loss"]) > LOSS_RTOL * trl["first_step_loss"]
    ]
    for name in off:
        print(
            f"error: {name}'s step-1 loss differs from TRL's: not the same model, pairs or loss",
            file=sys.stderr,
        )
    return 1 if off else 0


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU bench: no worker sees a GPU
    sys.exit(main())
