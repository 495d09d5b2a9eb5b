"""An on-policy distillation step: liger's `training.objective: distill` (kernels on, kernels off)
against TRL's `GKDTrainer` with lmbda 1.0 (fully on-policy: the student generates every step), the same
student, teacher, prompts, LoRA, divergence and batch, on a CPU.

TRL lives in its own venv, never the project's (see bench/dpo_vs_trl.py for why):

    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && \\
        .venv-trl/bin/pip install -c constraints.txt -e . trl==1.16.0

    .venv/bin/python bench/distill_vs_trl.py                       # JSD beta 0.5, 8 prompts x 128 tokens, 1 + 3 steps
    .venv/bin/python bench/distill_vs_trl.py --loss reverse_kl     # liger reverse_kl = TRL beta 1.0

The same on every side: the student (`recipes/bench/llama-8x512.json`, random init, seed 0, 57.6M
parameters), the teacher (a second Llama built here from that config, wider and shallower: 6 layers,
hidden 768, 12 heads / 4 KV heads, intermediate 2048, the same vocabulary and quickstart tokenizer;
seed 0), the prompts (the quickstart's instruction prompts as text; the prompt ids are checked equal:
liger's `prompt_ids` against TRL's `tokenizer(prompt)`), one completion per prompt of --new-tokens
tokens sampled at temperature 1 with top-k and top-p off and a KV cache, the divergence at temperature
1 (GKDTrainer's `temperature` is its sampling temperature only: its loss call never passes it), LoRA
r=16 alpha 32 dropout 0 on all linear layers, fp32, no gradient checkpointing, AdamW at a constant
learning rate, grad-norm clipping at 1.0, one micro-batch of --prompts prompts a step.

The loss formula is checked on a fixed batch (sampling differs between the two engines, so the
training steps see different completions): the prompts with one fixed completion of --new-tokens
random ids, the adapter at its start (B = 0, the student is the base model). TRL's number is its own
`GKDTrainer.compute_loss` on that batch (both models' full logits, `generalized_jsd_loss`, the mean
over completion tokens); liger's is `liger_kernels.fused_linear_divergence` (what the objective calls)
on the two models' final hidden states and heads, summed over completion tokens / their count. They
must agree to 1e-4 relative, else the script exits 1.

Normalisation: liger divides a step's summed divergence by the completion tokens sampled in that step;
TRL's Trainer counts `num_items_in_batch` from the labels the collator made, before GKDTrainer
replaces them with the generated completion. The TRL collator here gives every row a placeholder
completion of --new-tokens labels, so both divide by the same count as long as no completion stops at
eos before --new-tokens (with a random 32000-token model, about 1 in 250 completions of 128 tokens).

Each variant is a fresh process: TRL (run by --trl-python), liger with its kernels, liger with every
kernel off (both through `liger bench`'s worker). Measured after --warmup steps: the step time (from
the end of the step before to the end of its optimizer step, sampling included), the part of it spent
sampling (TRL: its `generate_on_policy_outputs`; liger: `time/sampling_s`) and the peak RSS growth over
the RSS right before training. Output: the table, and distill_vs_trl-LOSS.json in --out (default
bench/results/distill_vs_trl/, ignored by git).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEACHER = {"num_hidden_layers": 6, "hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4,
           "head_dim": 64, "intermediate_size": 2048}  # fmt: skip
LOSSES = ("jsd", "reverse_kl")  # --loss: liger's distill.loss; TRL's beta 1.0 is reverse KL
LOSS_RTOL = 1e-4


def setup(out: Path) -> tuple[Path, Path, Path]:
    """The student folder and the prompts (grpo_vs_trl's), and the teacher folder, made once."""
    from dpo_vs_trl import build_model  # bench/ is on sys.path (main)
    from grpo_vs_trl import setup as student_and_prompts

    student, prompts, _ = student_and_prompts(out)
    teacher = out / "teacher"
    if not (teacher / "model.safetensors").is_file():
        config = {**json.loads((REPO / "recipes/bench/llama-8x512.json").read_text()), **TEACHER}
        (out / "teacher-config.json").write_text(json.dumps(config))
        build_model(out / "teacher-config.json", REPO / "recipes/quickstart/model", teacher)
    return student, teacher, prompts


def trl_beta(args) -> float:
    return 1.0 if args.loss == "reverse_kl" else args.beta


def fixed_batch(student: Path, prompts: Path, args) -> dict:
    """The first --prompts prompts, left-padded, each followed by the same --new-tokens random ids (seed
    0), labels on those only; the prompt ids checked the same on both sides."""
    import torch
    from transformers import AutoTokenizer

    from liger_cli.data.prompts import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(student)
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()[: args.prompts]]
    ids = []
    for i, text in enumerate(texts):
        ids.append(prompt_ids(text, tokenizer))
        if ids[-1] != tokenizer(text)["input_ids"]:
            raise SystemExit(f"prompt {i}: liger and TRL would tokenize it differently")
    completion = torch.randint(
        4, tokenizer.vocab_size, (args.new_tokens,), generator=torch.Generator().manual_seed(0)
    )
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = [[pad] * (width - len(p)) + p + completion.tolist() for p in ids]
    mask = [[0] * (width - len(p)) + [1] * (len(p) + args.new_tokens) for p in ids]
    labels = [[-100] * width + completion.tolist() for _ in ids]
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
            "prompt_tokens": [min(map(len, ids)), max(map(len, ids))]}  # fmt: skip


def liger_fixed_loss(student: Path, teacher: Path, batch: dict, args) -> float:
    """liger's divergence on the fixed batch: fused_linear_divergence on both models' final hidden
    states and heads, summed over the completion tokens / their count."""
    import torch
    from liger_kernels import fused_linear_divergence
    from transformers import AutoModelForCausalLM

    inputs = {k: torch.tensor(batch[k]) for k in ("input_ids", "attention_mask")}
    labels = torch.tensor(batch["labels"])
    hidden, heads = [], []
    for path in (student, teacher):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            hidden.append(model.model(**inputs).last_hidden_state)
        heads.append(model.lm_head.weight.detach())
    divergence, learned = fused_linear_divergence(hidden[0], heads[0], hidden[1], heads[1], labels,
                                                  loss=args.loss, beta=args.beta, temperature=1.0)  # fmt: skip
    return float((divergence * learned).sum() / learned.sum())


def liger_variant(name: str, student: Path, teacher: Path, prompts: Path, out: Path, args) -> dict:
    from grpo_vs_trl import prompt_recipe  # bench/ is on sys.path (main)
    from trl_measure import run_liger_online

    figures = run_liger_online({
        **prompt_recipe(student, prompts, "distill", args),
        "distill": {"teacher": str(teacher), "loss": args.loss, "temperature": 1.0,
                    **({"beta": args.beta} if args.loss == "jsd" else {})},
        "rl": {"num_generations": 1, "max_new_tokens": args.new_tokens, "temperature": 1.0},
    }, name, out, args.steps, args.warmup)  # fmt: skip
    return {k: figures[k] for k in ("step_time_s", "peak_mem_mb", "generation_s", "first_step_loss")}


def trl_variant(student: Path, teacher: Path, prompts: Path, fixed: Path, out: Path, args) -> dict:
    from trl_measure import run_trl  # bench/ is on sys.path (main)

    result = out / "trl.json"
    worker_argv = ["--trl-worker", str(student), str(teacher), str(prompts), str(fixed), str(result),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
                   "--new-tokens", str(args.new_tokens), "--loss", args.loss, "--beta", str(args.beta)]  # fmt: skip
    found = run_trl(args.trl_python, __file__, worker_argv, result, out)
    if "error" in found:
        raise SystemExit(f"TRL failed: see {found['log']}")
    return found


def trl_worker(student: str, teacher: str, prompts: str, fixed: str, result: str, args) -> int:
    """Under .venv-trl: TRL's GKDTrainer (lmbda 1.0), each step timed, its generation timed apart; first
    its own loss on the fixed batch."""
    sys.path.insert(0, str(Path(__file__).parent))
    from grpo_vs_trl import LORA
    from trl_measure import start, step_clock, summary

    baseline = start()  # the imports done, nothing of the run exists yet
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tokenizer = AutoTokenizer.from_pretrained(student)
    generation: list[float] = []

    class Timed(GKDTrainer):
        @staticmethod
        def generate_on_policy_outputs(*a, **k):
            began = time.perf_counter()
            found = GKDTrainer.generate_on_policy_outputs(*a, **k)
            generation.append(time.perf_counter() - began)
            return found

    def collate(rows: list[dict]) -> dict:
        """Prompts left-padded for generate; a placeholder completion of --new-tokens labels per row, so the
        Trainer's num_items_in_batch (counted before GKD swaps in the generated labels) is the count of
        tokens generated when none stops early."""
        ids = [tokenizer(r["prompt"])["input_ids"] for r in rows]
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        prompt = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        labels = torch.cat([torch.full_like(prompt, -100), torch.full((len(ids), args.new_tokens), pad)], 1)
        return {"prompts": prompt, "prompt_attention_mask": prompt_mask, "labels": labels,
                "input_ids": torch.cat([prompt, labels[:, width:]], 1),
                "attention_mask": torch.cat([prompt_mask, torch.ones_like(labels[:, width:])], 1)}  # fmt: skip

    torch.manual_seed(0)
    rows = [json.loads(line) for line in Path(prompts).read_text().splitlines()]
    config = GKDConfig(
        output_dir=str(Path(result).parent / "trl-run"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.prompts, lmbda=1.0, beta=trl_beta(args), temperature=1.0,
        max_new_tokens=args.new_tokens, learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=1.0,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no",
        report_to=[], disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    clock = step_clock()
    trainer = Timed(
        model=AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32),
        teacher_model=AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32),
        args=config, train_dataset=datasets.Dataset.from_list(rows), data_collator=collate,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                               task_type="CAUSAL_LM"),
        callbacks=[clock],
    )  # fmt: skip
    batch = {
        k: torch.tensor(v) for k, v in json.loads(Path(fixed).read_text()).items() if k != "prompt_tokens"
    }
    with torch.no_grad():
        fixed_loss = float(trainer.compute_loss(trainer.model, batch))
    trainer.train()
    generated = generation[args.warmup :]
    Path(result).write_text(json.dumps({**summary(clock, args.warmup, baseline), "fixed_batch_loss": fixed_loss,
                                        "generation_s": sum(generated) / len(generated)}))  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-worker", nargs=5, metavar=("STUDENT", "TEACHER", "PROMPTS", "FIXED", "RESULT"))
    parser.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--loss", choices=LOSSES, default="jsd", help="the divergence, the same on each side")
    parser.add_argument("--beta", type=float, default=0.5, help="jsd's beta (TRL GKD's)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/distill_vs_trl")
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(*args.trl_worker, args)
    if not args.trl_python.is_file():
        parser.error(f"{args.trl_python} not found: set up TRL's venv (see this script's docstring)")
    args.out.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()[0]]
    student, teacher, prompts = setup(args.out)
    batch = fixed_batch(student, prompts, args)
    fixed = args.out / "fixed-batch.json"
    fixed.write_text(json.dumps(batch))
    found = {"TRL GKDTrainer": trl_variant(student, teacher, prompts, fixed, args.out, args)}
    found["liger, kernels on"] = liger_variant("kernels_on", student, teacher, prompts, args.out, args)
    found["liger, kernels off"] = liger_variant("kernels_off", student, teacher, prompts, args.out, args)
    load.append(os.getloadavg()[0])
    trl = found["TRL GKDTrainer"]
    check = {"liger": liger_fixed_loss(student, teacher, batch, args), "trl": trl["fixed_batch_loss"]}
    agree = abs(check["liger"] - check["trl"]) <= LOSS_RTOL * abs(check["trl"])
    name = f"jsd beta {args.beta}" if args.loss == "jsd" else "reverse KL (TRL beta 1.0)"
    rows = args.prompts * (batch["prompt_tokens"][1] + args.new_tokens)
    (args.out / f"distill_vs_trl-{args.loss}.json").write_text(json.dumps({
        "loss": name, "prompts": args.prompts, "new_tokens": args.new_tokens, "prompt_tokens": batch["prompt_tokens"],
        "steps": args.steps, "warmup": args.warmup, "load_average": load, "machine": platform.processor(),
        "fixed_batch_loss": check, "variants": found,
    }, indent=2))  # fmt: skip
    print(f"\n{name}, temperature 1; {args.prompts} prompts ({batch['prompt_tokens'][0]}-{batch['prompt_tokens'][1]} "
          f"tokens) x 1 completion x {args.new_tokens} new tokens; {args.warmup} warm-up + {args.steps} measured "
          f"steps; load average {load[0]:.1f} -> {load[1]:.1f}; TRL {trl['versions']['trl']}\n")  # fmt: skip
    print("| | step time (s) | of which sampling (s) | peak memory | time / TRL | memory / TRL |")
    print("|---|---|---|---|---|---|")
    for label, r in found.items():
        print(f"| {label} | {r['step_time_s']:.2f} | {r['generation_s']:.2f} | {r['peak_mem_mb']:.0f} MiB | "
              f"{r['step_time_s'] / trl['step_time_s']:.2f}x | {r['peak_mem_mb'] / trl['peak_mem_mb']:.2f}x |")  # fmt: skip
    print(
        f"\nOne model's fp32 logits for a step's batch: up to {rows * 32000 * 4 / 2**20:.0f} MiB "
        f"({rows} positions x 32000)."
    )
    print(
        f"Fixed batch (B = 0, the same ids): liger {check['liger']:.6f}, TRL {check['trl']:.6f}: "
        f"{'agree' if agree else 'DIFFER'} (relative {LOSS_RTOL:g})"
    )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
