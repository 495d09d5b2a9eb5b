"""A DPO step: liger (kernels on, kernels off) against TRL's `DPOTrainer`, same model, pairs, LoRA and batch.

TRL is never installed into the project's own environment or CI. Set it up once, in its own venv
(torch first, from local disk, or pip pulls a multi-GB CUDA build):

    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && \\
        .venv-trl/bin/pip install -c constraints.txt -e . trl==1.16.0

(trl 1.16.0 resolves with the pinned transformers 5.23.0, peft 0.21.2, accelerate 1.15.0.) Then, from
the repository root, with the project's own venv:

    .venv/bin/python bench/dpo_vs_trl.py                         # 4 pairs x 512 tokens, 1 + 2 steps, once
    .venv/bin/python bench/dpo_vs_trl.py --steps 3 --repeats 2   # bench/README.md's table (~20 min)
    .venv/bin/python bench/dpo_vs_trl.py --pairs 8 --seq-len 1024 --variants liger_on,liger_off

What is the same on every side: the weights (`recipes/bench/llama-8x512.json`, random init with seed
0, saved once to a folder that every run loads), the quickstart tokenizer, the preference pairs
(number lists to write in words, made here: a prompt of about half the sequence, answers that fill
the rest, no pair truncated; the token ids each side trains on are checked to be the same), LoRA r=16
alpha 32 dropout 0 on all linear layers, DPO sigmoid with beta 0.1, the reference = the model with
its adapter disabled (TRL's default with a PEFT config, `precompute_ref_log_probs` off), fp32, a
micro-batch of `--pairs` pairs, no gradient accumulation, no gradient checkpointing (TRL turns it on
by default: turned off), no eval, AdamW with a constant learning rate, grad-norm clipping at 1.0.

Three variants, each in a fresh process, interleaved over `--repeats` (trl, liger_on, liger_off,
trl, ...): TRL's `DPOTrainer` (run by `--trl-python`), liger with its kernels, and liger with every
kernel off. The liger runs go through `liger bench`'s own worker and overrides
(`liger_cli.bench.compare.run_variant` / `variant_overrides`, read back by `report.summarize`); the
TRL worker measures the same two things the same way:

- step time: the mean over the steps after `--warmup`, each from the end of the step before it to
  the end of its optimizer step (liger: metrics.jsonl's step_time_s with logging every step);
- peak memory: the process's peak RSS (ru_maxrss) at the end of the measured steps minus its RSS
  right before training, after its imports. The TRL process serves blocks of 1 MiB and more with
  mmap, as `liger train` does on a CPU (`launch.start._return_freed_memory_to_the_os`), so neither
  side's number holds what glibc keeps after frees.

The first step's loss must be ln 2 on every side (policy == reference: the adapter's B is zero);
it is printed, and a run where it is not exits 1. CPU only: the workers see no GPU.

Output: a table with the ratios against TRL, and `dpo_vs_trl.json` in `--out` (default
bench/results/dpo_vs_trl/, ignored by git) with every run, the versions on each side and the
machine's load average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("trl", "liger_on", "liger_off")
LABELS = {"trl": "TRL DPOTrainer", "liger_on": "liger, kernels on", "liger_off": "liger, kernels off"}
GOAL = {"peak_mem": 0.5, "step_time": 0.9}  # liger with kernels on, as a share of TRL's
LOSS_RTOL = 1e-4
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
PROMPT = "### Instruction:\nWrite each number of the list in words.\n\n### Context:\n{context}\n\n### Input:\n{numbers}\n\n### Response:\n"


# ---------------------------------------------------------------- shared set-up: one model folder, one pairs file


def build_model(config_path: Path, tokenizer_path: Path, out: Path) -> Path:
    """The model from its config (seed 0, fp32) and the tokenizer, saved once: every run loads this folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)
    return out


def make_pairs(tokenizer, count: int, seq_len: int, seed: int = 0) -> list[dict]:
    """`count` pairs of close to `seq_len` tokens: a prompt (a list of numbers in digits, context numbers
    before it) of a little over half, the chosen answer the list in words, the rejected one with near
    misses (scripts/make_dpo_data.py's). Every sequence, BOS and eos included, fits in `seq_len`."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from make_dpo_data import near_miss
        from make_quickstart_assets import number_words
    finally:
        sys.path.remove(str(REPO / "scripts"))

    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(context: list[int], numbers: list[int]) -> str:
        return PROMPT.format(context=" ".join(map(str, context)), numbers=", ".join(map(str, numbers)))

    rng = random.Random(seed)
    room = seq_len - 2  # bos and eos
    pairs = []
    for _ in range(count):
        numbers, chosen, rejected = [], [], []
        while True:  # the list grows the prompt (digits) and both answers (words) about equally
            n = rng.randrange(1000)
            c, r = [*chosen, number_words(n)], [*rejected, number_words(near_miss(rng, n))]
            answer = max(length(", ".join(c)), length(", ".join(r)))
            if length(prompt([], [*numbers, n])) + answer > room:
                break
            numbers, chosen, rejected = [*numbers, n], c, r
        if not numbers:
            raise SystemExit(f"--seq-len {seq_len} is too short for a pair")
        answer = max(length(", ".join(chosen)), length(", ".join(rejected)))
        context: list[int] = []
        while length(prompt([*context, 0], numbers)) + answer <= room:  # then context numbers fill the rest
            context.append(rng.randrange(1000))
        while context and length(prompt(context, numbers)) + answer > room:
            context.pop()
        pairs.append(
            {"prompt": prompt(context, numbers), "chosen": ", ".join(chosen), "rejected": ", ".join(rejected)}
        )
    return pairs


def check_same_tokens(tokenizer, pairs: list[dict], seq_len: int) -> dict:
    """What each side trains on, checked equal: liger's encoding (prompt with BOS, answer, eos) against
    TRL's (the text prompt + answer + eos string, tokenized with BOS; the answer starts where the prompt's
    own tokens end). Returns the token counts."""
    from liger_cli.data.preference import encode_pair, prompt_length

    lengths, learned = [], []
    for i, row in enumerate(pairs):
        pair = encode_pair(row, tokenizer)
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        for side, enc in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            trl_ids = tokenizer(row["prompt"] + row[side] + tokenizer.eos_token)["input_ids"]
            if trl_ids != enc.input_ids or trl_ids[: len(prompt_ids)] != prompt_ids:
                raise SystemExit(f"pair {i} {side}: liger and TRL would tokenize it differently")
            if len(trl_ids) > seq_len:
                raise SystemExit(f"pair {i} {side}: {len(trl_ids)} tokens > --seq-len {seq_len}")
            if prompt_length(enc) != len(prompt_ids):
                raise SystemExit(f"pair {i} {side}: the prompts differ in length")
            lengths.append(len(trl_ids))
            learned.append(len(trl_ids) - len(prompt_ids))
    return {
        "sequence_tokens": [min(lengths), max(lengths)],
        "learned_tokens": [min(learned), max(learned)],
        "prompt_tokens": [min(lengths) - max(learned), max(lengths) - min(learned)],
    }


# ---------------------------------------------------------------- liger: `liger bench`'s worker


def liger_recipe(path: Path, model_dir: Path, pairs_file: Path, args) -> Path:
    import yaml

    recipe = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "adapter": {"type": "lora", "r": LORA["r"], "alpha": LORA["alpha"], "dropout": LORA["dropout"],
                    "target_modules": "all-linear"},
        "data": {"train": str(pairs_file), "format": "preference", "max_seq_len": args.seq_len},
        "training": {"objective": "dpo", "micro_batch_size": args.pairs, "grad_accum": 1, "lr": args.lr,
                     "scheduler": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0,
                     "precision": "fp32", "seed": args.seed},
        "preference": {"beta": args.beta, "loss_type": "sigmoid"},
        "kernels": {"rms_norm": True, "rope": True, "swiglu": True, "fused_linear_cross_entropy": True},
        "distributed": {"activation_checkpointing": "off"},
        "output": {"dir": str(path.parent / "liger-run"), "overwrite": True},
        "logging": {"every": 1, "tensorboard": False},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run_liger(variant: str, recipe: Path, out: Path, args) -> dict:
    from trl_measure import run_liger as run  # bench/ is on sys.path (main)

    name = "kernels_on" if variant == "liger_on" else "kernels_off"
    return run(recipe, name, out, args.steps, args.warmup)[0]


# ---------------------------------------------------------------- TRL: a fresh process in .venv-trl


def run_trl(model_dir: Path, pairs_file: Path, out: Path, args) -> dict:
    from trl_measure import run_trl as run  # bench/ is on sys.path (main)

    result = out / "trl.worker.json"
    worker_argv = ["--trl-worker", "--model-dir", str(model_dir), "--pairs-file", str(pairs_file), "--result",
                   str(result), "--out", str(out / "trl"), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--pairs", str(args.pairs), "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--beta",
                   str(args.beta), "--seed", str(args.seed)]  # fmt: skip
    return run(args.trl_python, __file__, worker_argv, result, out)


def trl_worker(args) -> int:
    """Runs under .venv-trl: TRL's DPOTrainer on the shared model and pairs, timed and measured per step."""
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import start, step_clock, summary

    baseline = start()  # the imports done, nothing of the run exists yet
    import datasets
    import peft
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class Measured(DPOTrainer):
        losses: list[float] = []
        tokens: list[int] = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                Measured.losses.append(float((out[0] if return_outputs else out).detach()))
                Measured.tokens.append(int(inputs["input_ids"].numel()))
            return out

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    rows = [json.loads(line) for line in Path(args.pairs_file).read_text().splitlines()]
    config = DPOConfig(
        output_dir=str(args.out), max_steps=args.warmup + args.steps, per_device_train_batch_size=args.pairs,
        gradient_accumulation_steps=1, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", seed=args.seed, bf16=False, fp16=False,
        use_cpu=True, gradient_checkpointing=False, beta=args.beta, loss_type=["sigmoid"],
        max_length=args.seq_len, precompute_ref_log_probs=False, logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    clock = step_clock()
    trainer = Measured(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
        peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                               target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[clock],
    )  # fmt: skip
    assert trainer.ref_model is None and isinstance(trainer.model, peft.PeftModel)  # reference: adapter off
    trainer.train()
    tokens = Measured.tokens[args.warmup :]
    Path(args.result).write_text(json.dumps({
        **summary(clock, args.warmup, baseline),
        "first_step_loss": Measured.losses[0],
        "tokens_per_step": sum(tokens) / len(tokens),
    }))  # fmt: skip
    return 0


# ---------------------------------------------------------------- the parent


def _versions() -> dict:
    import peft
    import torch
    import transformers

    return {"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__}


def summarize_runs(runs: list[dict]) -> dict:
    """Per variant: the mean over its repeats of step time and peak memory, and the ratios to TRL's."""
    table = {}
    for variant in VARIANTS:
        done = [r for r in runs if r["variant"] == variant and "error" not in r]
        if not done:
            continue
        table[variant] = {
            "step_time_s": sum(r["step_time_s"] for r in done) / len(done),
            "best_step_time_s": min(t for r in done for t in r["step_times_s"]),
            "peak_mem_mb": sum(r["peak_mem_mb"] for r in done) / len(done),
            "peak_mem_mb_range": [min(r["peak_mem_mb"] for r in done), max(r["peak_mem_mb"] for r in done)],
            "first_step_loss": [r["first_step_loss"] for r in done],
            "tokens_per_step": done[0]["tokens_per_step"],
            "repeats": len(done),
        }
    if "trl" in table:
        trl = table["trl"]
        for row in table.values():
            row["time_vs_trl"] = row["step_time_s"] / trl["step_time_s"]
            row["best_time_vs_trl"] = row["best_step_time_s"] / trl["best_step_time_s"]
            row["mem_vs_trl"] = (
                row["peak_mem_mb"] / trl["peak_mem_mb"] if trl["peak_mem_mb"] > 0 else math.nan
            )
    return table


def render(table: dict, load: dict) -> str:
    head = (
        f"{'':<20} {'step time (s)':>13} {'best step':>9} {'peak MiB':>9} {'tokens/step':>11} "
        f"{'step-1 loss':>11} {'time/TRL':>8} {'best/TRL':>8} {'mem/TRL':>8}"
    )
    lines = [head]
    for variant, row in table.items():
        ratios = (
            f"{row['time_vs_trl']:>7.2f}x {row['best_time_vs_trl']:>7.2f}x {row['mem_vs_trl']:>7.2f}x"
            if "time_vs_trl" in row
            else f"{'-':>8} {'-':>8} {'-':>8}"
        )
        lines.append(
            f"{LABELS[variant]:<20} {row['step_time_s']:>13.2f} {row['best_step_time_s']:>9.2f} "
            f"{row['peak_mem_mb']:>9.0f} {row['tokens_per_step']:>11.0f} {row['first_step_loss'][0]:>11.6f} {ratios}"
        )
    lines.append(
        f"(step time: the mean over {max(r['repeats'] for r in table.values())} repeat(s) of each run's mean; best "
        f"step: the fastest measured step of any run, the least disturbed by other load; ln 2 = "
        f"{math.log(2):.6f}; load average {load['before']} -> {load['after']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the measured ones")
    parser.add_argument("--pairs", type=int, default=4, help="pairs per micro-batch (2x rows)")
    parser.add_argument(
        "--seq-len", type=int, default=512, help="tokens per sequence, about half of them prompt"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the variants, interleaved")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS)
    )
    parser.add_argument("--model-config", type=Path, default=REPO / "recipes/bench/llama-8x512.json")
    parser.add_argument("--tokenizer", type=Path, default=REPO / "recipes/quickstart/model")
    parser.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/dpo_vs_trl")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    # the TRL worker's own arguments (it is this file, run by --trl-python)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pairs-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args)

    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import chosen_variants

    variants = chosen_variants(parser, args, VARIANTS)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.pairs < 1:
        parser.error("--steps, --repeats and --pairs must be at least 1, --warmup at least 0")

    from transformers import AutoTokenizer

    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model_dir = build_model(args.model_config, args.tokenizer, out / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = make_pairs(tokenizer, args.pairs * (args.warmup + args.steps), args.seq_len, args.seed)
    pairs_file = out / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    tokens = check_same_tokens(tokenizer, pairs, args.seq_len)
    recipe = liger_recipe(out / "dpo-bench.yaml", model_dir, pairs_file, args)
    print(
        f"dpo_vs_trl: {len(pairs)} pairs, sequences of {tokens['sequence_tokens']} tokens "
        f"({tokens['learned_tokens']} learned), the same ids on both sides; {args.pairs} pairs a step, "
        f"{args.warmup} warm-up + {args.steps} measured steps; variants {', '.join(variants)} x {args.repeats}",
        flush=True,
    )

    load = {"before": round(os.getloadavg()[0], 2)}
    runs = []
    for repeat in range(args.repeats):
        for variant in variants:
            where = out / f"repeat-{repeat}"
            where.mkdir(exist_ok=True)
            if variant == "trl":
                result = run_trl(model_dir, pairs_file, where, args)
            else:
                result = run_liger(variant, recipe, where, args)
            runs.append({"variant": variant, "repeat": repeat, **result})
            shown = (
                f"failed ({result['error']}), log: {result['log']}" if "error" in result else
                f"step {result['step_time_s']:.2f} s, peak {result['peak_mem_mb']:.0f} MiB, "
                f"step-1 loss {result['first_step_loss']:.6f}"
            )  # fmt: skip
            print(f"dpo_vs_trl: repeat {repeat} {variant}: {shown}", flush=True)
    load["after"] = round(os.getloadavg()[0], 2)

    table = summarize_runs(runs)
    failed = [r for r in runs if "error" in r]
    wrong_loss = [
        r
        for r in runs
        if "error" not in r and abs(r["first_step_loss"] - math.log(2)) > LOSS_RTOL * math.log(2)
    ]
    report = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("trl_worker", "model_dir", "pairs_file", "result")},
        "tokens": tokens,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0))},
        "load_average": load,
        "versions": {"liger_env": _versions(),
                     "trl_env": next((r["versions"] for r in runs if "versions" in r), None)},
        "runs": runs,
        "table": table,
        "goal": GOAL,
    }  # fmt: skip
    if table:
        print(render(table, load))
    if {"trl", "liger_on"} <= table.keys():
        on = table["liger_on"]
        met = {
            "memory": on["mem_vs_trl"] <= GOAL["peak_mem"],
            "time_mean": on["time_vs_trl"] <= GOAL["step_time"],
            "time_best": on["best_time_vs_trl"] <= GOAL["step_time"],
        }
        report["goal_met"] = met
        print(
            f"goal (liger kernels on <= {GOAL['peak_mem']}x TRL's memory and <= {GOAL['step_time']}x its step "
            f"time): memory {on['mem_vs_trl']:.2f}x ({'met' if met['memory'] else 'MISSED'}), mean step time "
            f"{on['time_vs_trl']:.2f}x ({'met' if met['time_mean'] else 'MISSED'}), best step "
            f"{on['best_time_vs_trl']:.2f}x ({'met' if met['time_best'] else 'MISSED'})"
        )
    (out / "dpo_vs_trl.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"dpo_vs_trl: wrote {out / 'dpo_vs_trl.json'}")
    for r in failed:
        print(f"error: {r['variant']} (repeat {r['repeat']}) failed; its log: {r['log']}", file=sys.stderr)
    for r in wrong_loss:
        print(
            f"error: {r['variant']} (repeat {r['repeat']}) started at loss {r['first_step_loss']:.6f}, not ln 2: "
            "policy and reference differ at step 1",
            file=sys.stderr,
        )
    return 1 if failed or wrong_loss else 0


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU bench: no worker sees a GPU
    sys.exit(main())
