"""A GRPO step: liger (kernels on, kernels off) against TRL's `GRPOTrainer`, same model, prompts, G,
max_new_tokens, LoRA, reward and batch, on a CPU.

TRL lives in its own venv, never the project's (see bench/dpo_vs_trl.py for why):

    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && \\
        .venv-trl/bin/pip install -c constraints.txt -e . trl==1.16.0

    .venv/bin/python bench/grpo_vs_trl.py                     # 4 prompts x 8 completions x 64 tokens, 1 + 3 steps
    .venv/bin/python bench/grpo_vs_trl.py --loss gspo         # the same with GSPO on both sides (or cispo)
    .venv/bin/python bench/grpo_vs_trl.py --vllm              # and liger sampling on vLLM (`rl.engine: vllm`)

The same on every side: the weights (`recipes/bench/llama-8x512.json`: 8 layers, hidden 512, vocab
32000; random init, seed 0, saved once to a folder every run loads), the quickstart tokenizer, the
prompts (the quickstart's instruction prompts, as text), a reward with spread (the completion's
length in characters / 100: a random model never answers exactly, and a constant reward would train
nothing), LoRA r=16 alpha 32 on all linear layers, G = 8 completions of at most --new-tokens tokens
at temperature 1 with a KV cache (TRL is told `use_cache`: the model's config turns it off for
training, and TRL's generate would follow it), the loss of --loss (`LOSSES`: dapo; GSPO, liger `rl.loss:
gspo` and TRL `importance_sampling_level="sequence"` with its per-sequence loss, both at GSPO's clip range
3e-4 / 4e-4; CISPO, liger `rl.loss: cispo` and TRL `loss_type="cispo"`, each weight capped at 5: liger's
`epsilon_high` is the cap minus 1, TRL's the cap), beta 0 (no reference), scale_rewards group,
one update per batch of completions, fp32, no gradient checkpointing, AdamW with a constant learning rate, grad-norm clipping
at 1.0. A step is --prompts prompts x 8 completions (TRL's per_device_train_batch_size counts
completions: 8 x --prompts).

Each variant is a fresh process: TRL (run by --trl-python), liger with its kernels, liger with every
kernel off (both through `liger bench`'s worker). Measured after --warmup steps: the step time (from
the end of the step before to the end of its optimizer step), the part of it spent generating
(TRL: its `_generate`; liger: `time/sampling_s`, sampling and scoring), and the peak RSS growth over
the RSS right before training.

--vllm adds "liger, kernels on, vLLM engine": the kernels-on variant with `rl.engine: vllm` (liger's
default top-p 1 and no top-k, which that engine requires) and its own server, started by the run
(`.venv-vllm`; docs/rl.md "Sampling on vLLM"). Its peak memory is the training process's only: the
server runs in processes of its own (about 3 GiB more on a CPU, its 1 GiB KV cache included; 3.1 GiB
measured on this model). Its step time includes the weight push after every optimizer step (the LoRA
adapter saved, and loaded by the server under a new name); the server's start (once per run, 20-60 s
on 2 cores) comes before the first step, outside the measured steps. TRL's own vLLM path
(`use_vllm=True`) is not run here: vLLM's CPU build pins transformers below 5.20 in its own venv, and
TRL needs vLLM in its own process (colocate) or `trl vllm-serve` run in that venv; that comparison is
prepared for a lent GPU, not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
LORA = {"r": 16, "alpha": 32}
REWARD = "def length_reward(completions, **kwargs):\n    return [len(c) / 100 for c in completions]\n"
LOSSES = {  # --loss: (liger's rl keys, TRL's GRPOConfig keys) for the same loss
    "dapo": ({"loss": "dapo"}, {"loss_type": "dapo"}),
    "gspo": ({"loss": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4},
             {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
    "cispo": ({"loss": "cispo", "epsilon_high": 4.0}, {"loss_type": "cispo", "epsilon_high": 5.0}),
}  # fmt: skip


def setup(out: Path) -> tuple[Path, Path, Path]:
    """The model folder, the prompts file and the reward file, made once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = out / "model"
    if not (model_dir / "model.safetensors").is_file():
        config = AutoConfig.from_pretrained(REPO / "recipes/bench/llama-8x512.json")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
        AutoTokenizer.from_pretrained(REPO / "recipes/quickstart/model").save_pretrained(model_dir)
    prompts = out / "prompts.jsonl"
    rows = [
        json.loads(line)
        for line in (REPO / "recipes/quickstart/data/train.jsonl").read_text().splitlines()[:64]
    ]
    prompts.write_text("".join(json.dumps({"prompt": TEMPLATE.format(**r)}) + "\n" for r in rows))
    reward = out / "rewards.py"
    reward.write_text(REWARD)
    return model_dir, prompts, reward


def prompt_recipe(model_dir: Path, prompts: Path, objective: str, args) -> dict:
    """The recipe's sections every online bench on these prompts shares: the model, LoRA, the prompts
    (--new-tokens after 64 of prompt) and training at --prompts prompts a step."""
    return {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "adapter": {"type": "lora", **LORA, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"train": str(prompts), "format": "prompt", "max_seq_len": 64 + args.new_tokens},
        "training": {"objective": objective, "micro_batch_size": args.prompts, "grad_accum": 1, "lr": 1e-5,
                     "scheduler": "constant", "max_grad_norm": 1.0, "precision": "fp32", "seed": 0},
    }  # fmt: skip


def liger_variant(name: str, model_dir: Path, prompts: Path, reward: Path, out: Path, args, **rl) -> dict:
    """liger's variant NAME ("kernels_on", "kernels_off", or another name: kernels on), RL's keys over
    the shared rl section."""
    from trl_measure import run_liger_online  # bench/ is on sys.path (main)

    figures = run_liger_online({
        **prompt_recipe(model_dir, prompts, "grpo", args),
        "rl": {"num_generations": 8, "max_new_tokens": args.new_tokens, "temperature": 1.0, **LOSSES[args.loss][0],
               "beta": 0.0, "rewards": [{"function": f"{reward}:length_reward"}], **rl},
    }, name, out, args.steps, args.warmup)  # fmt: skip
    return {k: figures[k] for k in ("step_time_s", "peak_mem_mb", "generation_s")}


def trl_variant(model_dir: Path, prompts: Path, reward: Path, out: Path, args) -> dict:
    from trl_measure import run_trl  # bench/ is on sys.path (main)

    result = out / "trl.json"
    worker_argv = ["--trl-worker", str(model_dir), str(prompts), str(reward), str(result), "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
                   "--new-tokens", str(args.new_tokens), "--loss", args.loss]  # fmt: skip
    found = run_trl(args.trl_python, __file__, worker_argv, result, out)
    if "error" in found:
        raise SystemExit(f"TRL failed: see {found['log']}")
    return found


def trl_worker(model_dir: str, prompts: str, reward: str, result: str, args) -> int:
    """Under .venv-trl: TRL's GRPOTrainer, each step timed, its generation timed apart."""
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import start, step_clock, summary

    baseline = start()  # the imports done, nothing of the run exists yet
    import importlib.util

    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("rewards", reward)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generation: list[float] = []

    class Timed(GRPOTrainer):
        def _generate(self, *a, **k):
            began = time.perf_counter()
            out = super()._generate(*a, **k)
            generation.append(time.perf_counter() - began)
            return out

    torch.manual_seed(0)
    rows = [json.loads(line) for line in Path(prompts).read_text().splitlines()]
    config = GRPOConfig(
        output_dir=str(Path(result).parent / "trl-run"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=8 * args.prompts, num_generations=8, max_completion_length=args.new_tokens,
        temperature=1.0, **LOSSES[args.loss][1], beta=0.0, scale_rewards="group", learning_rate=1e-5,
        lr_scheduler_type="constant", max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        seed=0, dataloader_num_workers=0,
        generation_kwargs={"use_cache": True},  # the bench config says use_cache false (training's setting)
    )  # fmt: skip
    clock = step_clock()
    trainer = Timed(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=[module.length_reward], args=config, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[clock],
    )  # fmt: skip
    trainer.train()
    generated = generation[args.warmup :]
    Path(result).write_text(json.dumps({**summary(clock, args.warmup, baseline),
                                        "generation_s": sum(generated) / len(generated)}))  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-worker", nargs=4, metavar=("MODEL", "PROMPTS", "REWARD", "RESULT"))
    parser.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--loss", choices=list(LOSSES), default="dapo", help="the loss, the same on each side"
    )
    parser.add_argument("--vllm", action="store_true", help="also liger, kernels on, sampling on vLLM")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/grpo_vs_trl")
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(*args.trl_worker, args)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, prompts, reward = setup(args.out)
    found = {"TRL GRPOTrainer": trl_variant(model_dir, prompts, reward, args.out, args)}
    found["liger, kernels on"] = liger_variant("kernels_on", model_dir, prompts, reward, args.out, args)
    found["liger, kernels off"] = liger_variant("kernels_off", model_dir, prompts, reward, args.out, args)
    if args.vllm:
        found["liger, kernels on, vLLM engine"] = liger_variant(
            "vllm", model_dir, prompts, reward, args.out, args, engine="vllm"
        )
    (args.out / f"grpo_vs_trl-{args.loss}.json").write_text(json.dumps(found, indent=2))
    trl = found["TRL GRPOTrainer"]
    print(f"\nloss {args.loss}; {args.prompts} prompts x 8 completions x {args.new_tokens} new tokens; {args.warmup} warm-up + "
          f"{args.steps} measured steps; load average {os.getloadavg()[0]:.1f}\n")  # fmt: skip
    print("| | step time (s) | of which generation (s) | peak memory | time / TRL | memory / TRL |")
    print("|---|---|---|---|---|---|")
    for name, r in found.items():
        print(f"| {name} | {r['step_time_s']:.2f} | {r['generation_s']:.2f} | {r['peak_mem_mb']:.0f} MiB | "
              f"{r['step_time_s'] / trl['step_time_s']:.2f}x | {r['peak_mem_mb'] / trl['peak_mem_mb']:.2f}x |")  # fmt: skip
    if args.vllm:
        from trl_measure import VLLM_NOTE

        print(VLLM_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
