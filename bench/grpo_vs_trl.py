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
(`use_vllm=True`, --trl-vllm) cannot run on a CPU: vLLM's CPU build pins transformers below 5.20 in its
own venv, and TRL's colocated vLLM is written for CUDA; --trl-vllm stops at once without a GPU.

On a GPU (`bash bench/gpu.sh` runs this as its step "GRPO step: vLLM engine vs TRL use_vllm"):

    .venv/bin/python bench/grpo_vs_trl.py --vllm --trl-vllm --trl-python .venv-vllm/bin/python \\
        --model-config recipes/bench/llama-3.2-1b.json --skip-kernels-off --new-tokens 256

Where CUDA is available every side trains on the GPU in bf16 (the model saved and loaded as bfloat16,
liger `training.precision: bf16`, TRL `bf16=True`); on a CPU everything is as above (fp32, TRL with
`use_cpu=True`). --model-config picks the model's shape (default `recipes/bench/llama-8x512.json`;
`recipes/bench/llama-3.2-1b.json` is Llama-3.2-1B's, random weights, with the same quickstart
tokenizer). --trl-vllm makes TRL sample on vLLM too: `use_vllm=True, vllm_mode="colocate"` (vLLM in
TRL's own process), `vllm_gpu_memory_utilization=0.3` (liger's `rl.vllm.gpu_memory_utilization`
default) and `vllm_max_model_length` = liger's `data.max_seq_len`; TRL's default importance-sampling
correction stays on. --trl-python must then hold CUDA vllm, TRL and peft: the project's `.venv-vllm`
once TRL is installed in it (bench/gpu_report.py does that). Versions: TRL 1.16.0 (the newest) supports
vLLM 0.22-0.31 (its `vllm` extra; at run time it only warns above 0.31), but `scripts/setup-vllm.sh`
installs the newest vllm that fits constraints-vllm.txt's transformers 5.19.0, which is 0.33.0 (as of
2026-12); vllm 0.31.0 would need transformers < 5.18. So TRL runs on a vLLM it does not list, and a
failure there is TRL's side of that gap. liger's vLLM server runs with `--enforce-eager` (no CUDA
graphs: liger's choice, docs/rl.md), TRL's colocated vLLM with vLLM's defaults. TRL's step time
includes its weight push (the LoRA merged and loaded into vLLM before sampling), liger's too (the
adapter pushed after the step).

The table adds tokens/s (completion tokens a step over the step time: liger's `completion_length`,
TRL's `completions/mean_length`, times the 8 x --prompts completions) and the sampler's mean |log-prob
difference| from the trainer's (liger's `sampler/abs_logp_diff` from its metrics.jsonl, every engine;
TRL's `sampling/sampling_logp_difference/mean`, logged with vLLM only). On a GPU, peak memory is each
training process's `torch.cuda.max_memory_allocated`: TRL's colocated vLLM (its weights and KV cache)
is inside TRL's process, liger's server is outside liger's; so a column adds the most memory
nvidia-smi saw in use on the GPU during each run, every process counted (liger's server too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL_CONFIG = REPO / "recipes/bench/llama-8x512.json"
TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
LORA = {"r": 16, "alpha": 32}
REWARD = "def length_reward(completions, **kwargs):\n    return [len(c) / 100 for c in completions]\n"
LOSSES = {  # --loss: (liger's rl keys, TRL's GRPOConfig keys) for the same loss
    "dapo": ({"loss": "dapo"}, {"loss_type": "dapo"}),
    "gspo": ({"loss": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4},
             {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}),
    "cispo": ({"loss": "cispo", "epsilon_high": 4.0}, {"loss_type": "cispo", "epsilon_high": 5.0}),
}  # fmt: skip


def setup(out: Path, config: Path = MODEL_CONFIG, dtype: str = "float32") -> tuple[Path, Path, Path]:
    """The model folder (CONFIG's shape, random init, saved in DTYPE; another shape or dtype than the
    default gets a folder of its own), the prompts file and the reward file, made once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    default = Path(config).resolve() == MODEL_CONFIG and dtype == "float32"
    model_dir = out / ("model" if default else f"model-{Path(config).stem}-{dtype}")
    if not (model_dir / "model.safetensors").is_file():
        shape = AutoConfig.from_pretrained(config)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(shape, dtype=getattr(torch, dtype)).save_pretrained(model_dir)
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


def prompt_recipe(model_dir: Path, prompts: Path, objective: str, args, dtype: str = "float32") -> dict:
    """The recipe's sections every online bench on these prompts shares: the model (in DTYPE: float32
    trains in fp32, bfloat16 in bf16), LoRA, the prompts (--new-tokens after 64 of prompt) and training
    at --prompts prompts a step."""
    precision = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    return {
        "model": {"path": str(model_dir), "dtype": dtype},
        "adapter": {"type": "lora", **LORA, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"train": str(prompts), "format": "prompt", "max_seq_len": 64 + args.new_tokens},
        "training": {"objective": objective, "micro_batch_size": args.prompts, "grad_accum": 1, "lr": 1e-5,
                     "scheduler": "constant", "max_grad_norm": 1.0, "precision": precision, "seed": 0},
    }  # fmt: skip


def liger_variant(name: str, model_dir: Path, prompts: Path, reward: Path, out: Path, args, **rl) -> dict:
    """liger's variant NAME ("kernels_on", "kernels_off", or another name: kernels on), RL's keys over
    the shared rl section."""
    from trl_measure import run_liger_online  # bench/ is on sys.path (main)

    with gpu_memory_peak() as seen:
        figures = run_liger_online({
            **prompt_recipe(model_dir, prompts, "grpo", args, args.dtype),
            "rl": {"num_generations": 8, "max_new_tokens": args.new_tokens, "temperature": 1.0,
                   **LOSSES[args.loss][0], "beta": 0.0, "rewards": [{"function": f"{reward}:length_reward"}], **rl},
        }, name, out, args.steps, args.warmup)  # fmt: skip
    measured = figures["measured"]
    mean = {key: sum(m[key] for m in measured) / len(measured) for key in ("completion_length", *MISMATCH)}
    return {**{k: figures[k] for k in ("step_time_s", "peak_mem_mb", "generation_s")}, **seen, **mean,
            "completion_tokens": mean["completion_length"] * 8 * args.prompts}  # fmt: skip


MISMATCH = ("sampler/abs_logp_diff", "sampler/abs_logp_diff_max", "sampler/kl")
"""liger's mismatch figures (its sampler's log-probs against the trainer's, on either engine), each
the measured steps' mean in a variant's figures."""


@contextlib.contextmanager
def gpu_memory_peak():
    """On a GPU, {"gpu_used_mb": the most memory nvidia-smi saw in use on GPU 0 while the block ran, every
    process counted (a vLLM server too)}, polled every 0.5 s; on a CPU, {}."""
    import torch

    seen: dict = {}
    if not torch.cuda.is_available():
        yield seen
        return
    done = threading.Event()
    query = ["nvidia-smi", "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]

    def poll() -> None:
        while not done.wait(0.5):
            used = subprocess.run(query, capture_output=True, text=True).stdout.strip()
            if used.isdigit():
                seen["gpu_used_mb"] = max(seen.get("gpu_used_mb", 0.0), float(used))

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()


def trl_variant(model_dir: Path, prompts: Path, reward: Path, out: Path, args) -> dict:
    from trl_measure import run_trl  # bench/ is on sys.path (main)

    result = out / "trl.json"
    worker_argv = ["--trl-worker", str(model_dir), str(prompts), str(reward), str(result), "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
                   "--new-tokens", str(args.new_tokens), "--loss", args.loss]  # fmt: skip
    if args.trl_vllm:
        worker_argv.append("--trl-vllm")
    with gpu_memory_peak() as seen:
        found = run_trl(args.trl_python, __file__, worker_argv, result, out, gpu=args.dtype != "float32")
    if "error" in found:
        raise SystemExit(f"TRL failed: see {found['log']}")
    return {**found, **seen}


def trl_worker(model_dir: str, prompts: str, reward: str, result: str, args) -> int:
    """Under .venv-trl (--trl-vllm: .venv-vllm): TRL's GRPOTrainer, each step timed, its generation timed
    apart; on the GPU, in bf16, where CUDA is available."""
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.append(str(REPO))  # liger_cli for trl_measure.start, where this venv has no liger installed
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

    gpu = torch.cuda.is_available()
    if args.trl_vllm:  # vLLM in TRL's process, with the share of the GPU liger's own server gets
        sampling = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
                    "vllm_max_model_length": 64 + args.new_tokens}  # fmt: skip
    else:  # the bench config says use_cache false (training's setting), and TRL's generate would follow it
        sampling = {"generation_kwargs": {"use_cache": True}}
    torch.manual_seed(0)
    rows = [json.loads(line) for line in Path(prompts).read_text().splitlines()]
    config = GRPOConfig(
        output_dir=str(Path(result).parent / "trl-run"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=8 * args.prompts, num_generations=8, max_completion_length=args.new_tokens,
        temperature=1.0, **LOSSES[args.loss][1], beta=0.0, scale_rewards="group", learning_rate=1e-5,
        lr_scheduler_type="constant", max_grad_norm=1.0, use_cpu=not gpu, bf16=gpu, fp16=False,
        gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        seed=0, dataloader_num_workers=0, **sampling,
    )  # fmt: skip
    clock = step_clock()
    trainer = Timed(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if gpu else torch.float32),
        reward_funcs=[module.length_reward], args=config, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules="all-linear", task_type="CAUSAL_LM"),
        callbacks=[clock],
    )  # fmt: skip
    trainer.train()
    generated = generation[args.warmup :]
    logged = [
        h
        for h in trainer.state.log_history
        if h.get("step", 0) > args.warmup and "completions/mean_length" in h
    ]
    diffs = [h[TRL_DIFF] for h in logged if TRL_DIFF in h]  # logged with vLLM only
    Path(result).write_text(json.dumps({
        **summary(clock, args.warmup, 0.0 if gpu else baseline),  # a GPU's peak: the CUDA allocator's
        "generation_s": sum(generated) / len(generated),
        "completion_tokens": sum(h["completions/mean_length"] for h in logged) / len(logged) * 8 * args.prompts,
        **({"sampler/abs_logp_diff": sum(diffs) / len(diffs)} if diffs else {}),
    }))  # fmt: skip
    return 0


TRL_DIFF = "sampling/sampling_logp_difference/mean"
"""TRL's mean |log-prob difference| between vLLM's sampled tokens and the trainer's, liger's
`sampler/abs_logp_diff`."""


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
    parser.add_argument(
        "--trl-vllm",
        action="store_true",
        help="TRL samples on vLLM (use_vllm=True, colocate): a CUDA GPU only",
    )
    parser.add_argument(
        "--model-config", type=Path, default=MODEL_CONFIG, help="the model's shape (config.json)"
    )
    parser.add_argument("--skip-kernels-off", action="store_true", help="leave out liger, kernels off")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/grpo_vs_trl")
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(*args.trl_worker, args)
    import torch

    args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if args.trl_vllm and args.dtype == "float32":
        parser.error(
            "--trl-vllm needs a CUDA GPU (TRL's vLLM runs in its process, on CUDA); leave it out here"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, prompts, reward = setup(args.out, args.model_config, args.dtype)
    trl_name = "TRL GRPOTrainer, use_vllm" if args.trl_vllm else "TRL GRPOTrainer"
    found: dict[str, dict] = {}

    def measure(name: str, variant, *more, **rl) -> None:
        """found[NAME]: VARIANT's figures, or its error (one failing, on a GPU run's one chance, leaves the
        others to run); the results JSON rewritten after each."""
        try:
            found[name] = variant(*more, model_dir, prompts, reward, args.out, args, **rl)
        except SystemExit as err:
            found[name] = {"error": str(err)}
        (args.out / f"grpo_vs_trl-{args.loss}.json").write_text(json.dumps(found, indent=2))

    measure(trl_name, trl_variant)
    measure("liger, kernels on", liger_variant, "kernels_on")
    if not args.skip_kernels_off:
        measure("liger, kernels off", liger_variant, "kernels_off")
    if args.vllm:
        measure("liger, kernels on, vLLM engine", liger_variant, "vllm", engine="vllm")
    where = "on the GPU" if args.dtype == "bfloat16" else "on the CPU"
    print(f"\nloss {args.loss}; {args.model_config.name}, {args.dtype} {where}; {args.prompts} prompts x 8 completions x "
          f"{args.new_tokens} new tokens; {args.warmup} warm-up + {args.steps} measured steps; load average "
          f"{os.getloadavg()[0]:.1f}\n\n{table(found, trl_name)}")  # fmt: skip
    ours = found.get("liger, kernels on, vLLM engine", {"error": ""})
    if "error" not in ours:
        from trl_measure import VLLM_NOTE

        means = ", ".join(f"{key} {ours[key]:.3g}" for key in MISMATCH)
        print(f"{VLLM_NOTE}\nliger on vLLM, the measured steps' means: {means}")
    return 1 if any("error" in r for r in found.values()) else 0


def table(found: dict[str, dict], trl_name: str) -> str:
    """The markdown table: step time, generation, tokens/s, peak memory (on a GPU also the GPU's memory in
    use, every process), the ratios to TRL's row, and the sampler's mean |log-prob difference|; a
    variant that failed, its error."""
    trl = found[trl_name]
    gpu = any("gpu_used_mb" in r for r in found.values())
    head = ["step time (s)", "of which generation (s)", "tokens/s", "peak memory", *(["GPU in use"] if gpu else []),
            "time / TRL", "memory / TRL", "sampler abs logp diff"]  # fmt: skip
    lines = ["| | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for name, r in found.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} |" + " |" * (len(head) - 1))
            continue
        cells = [f"{r['step_time_s']:.2f}", f"{r['generation_s']:.2f}", f"{r['completion_tokens'] / r['step_time_s']:.0f}",
                 f"{r['peak_mem_mb']:.0f} MiB", *([f"{r['gpu_used_mb']:.0f} MiB" if "gpu_used_mb" in r else "-"] if gpu else []),
                 *([f"{r['step_time_s'] / trl['step_time_s']:.2f}x", f"{r['peak_mem_mb'] / trl['peak_mem_mb']:.2f}x"]
                   if "error" not in trl else ["-", "-"]),
                 f"{r['sampler/abs_logp_diff']:.2g}" if "sampler/abs_logp_diff" in r else "-"]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
