"""An agentic GRPO step (multi-turn, with a tool): liger (kernels on, kernels off) against TRL's
`GRPOTrainer` with `tools=[...]`, on the shipped agent recipe (`recipes/agent.yaml`), on a CPU.

TRL lives in its own venv, never the project's (see bench/dpo_vs_trl.py for why):

    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && \\
        .venv-trl/bin/pip install -c constraints.txt -e . trl==1.16.0

    .venv/bin/python bench/agent_vs_trl.py           # 4 prompts x 8 trajectories, 1 warm-up + 2 measured steps
    .venv/bin/python bench/agent_vs_trl.py --vllm    # and liger sampling on vLLM (`rl.engine: vllm`)

The task is the recipe's: "What is the code for 417?" over a made-up table only the tool knows.
The same on every side:

- the weights: `recipes/agent/model` (the SFT warm start, 2 layers, hidden 128), with its tokenizer
  and Hermes-style tools chat template; fp32, no gradient checkpointing;
- the prompts: the rows of `recipes/agent/train.jsonl`, each one user message, rendered by the
  chat template with the tool's schema (`tools=`, from the function's type hints and docstring);
  every prompt's ids are checked equal on both sides (100 tokens each);
- the tool: `recipes/agent/tools.py:lookup`, called with the parsed arguments; the tool result is
  appended as the ids the template adds after the model turn's end-of-turn token (both sides
  append ids, neither re-tokenizes a sampled turn); those ids are checked equal on both sides for
  every tool result in liger's rollouts that is a code from the table (error texts differ, below);
- the reward: `recipes/agent/rewards.py:correct` on the last model turn's text (TRL hands reward
  functions each trajectory as messages: a wrapper passes it the last assistant message's content,
  which is what liger passes);
- LoRA r=16, alpha 32, dropout 0 on all linear layers (the recipe's); G = 8 trajectories per
  prompt at temperature 0.7 (top-p 1, no top-k) with a KV cache (TRL is told `use_cache`: the
  model's config turns it off for training); loss dapo, beta 0, scale_rewards group, one update per
  batch, AdamW at the recipe's constant learning rate, grad-norm clipping at 1.0; a step is
  --prompts prompts x 8 trajectories (TRL's per_device_train_batch_size counts trajectories);
- the limits: at most 3 model turns (liger `rl.max_turns: 3`; TRL `max_tool_calling_iterations=2`:
  the first turn plus 2 turns after tool results; on both sides the calls of the last allowed turn
  are not run), at most 80 new tokens a model turn (liger `rl.max_new_tokens`; TRL
  `generation_kwargs={"max_new_tokens": 80}`), and at most 256 - 100 = 156 ids after the prompt,
  sampled and tool ids together (liger `data.max_seq_len: 256` on the whole trajectory; TRL
  `max_completion_length=156`, after the prompt); a tool result that would pass it is not appended
  on either side; tool ids are masked out of the loss on both sides.

What differs, as each trainer does it:

- Parsing tool calls. liger parses `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
  Hermes convention, its default). TRL parses only chat templates it knows (Qwen, Llama 3.1, ...)
  and rejects this one ("Unrecognized chat template, failed to add response schema"), so the worker
  sets a `response_template` on the tokenizer by hand for the same convention (transformers'
  new-style parser: start anchor `<|assistant|>\\n`, `<tool_call>` JSON blocks, content up to
  `</s>`). A call that is not valid JSON: liger sends the error back to the model as the call's
  result and the trajectory goes on; TRL parses the turn as plain text (no call) and the trajectory
  ends there. A tool that raises: both send the error back (liger `error: ...`, TRL the text of
  `{"error": ...}`).
- Tools run on liger's `rl.tool_workers` threads (4), in TRL one after another in the trainer's
  thread.
- liger stops a turn at a budget min(80, room left); TRL samples up to 80 and cuts the excess.
- Prompt order: each side shuffles the 100 rows with its own seeded sampler, so a step's 4 prompts
  differ between sides (every prompt has the same form and length). Sampling is random on both
  sides, so the trajectories differ: the second table gives the work each side did (sampled tokens,
  tool calls and model turns per trajectory, reward).
- liger's step also runs one forward without gradient after sampling (the trainer's log-probs, for
  the sampler-agreement figures), which TRL skips with one update per batch.

Each variant is a fresh process: TRL (run by --trl-python), liger with its kernels, liger with every
kernel off (both through `liger bench`'s worker). Measured after --warmup steps: the step time (from
the end of the step before to the end of its optimizer step), the part of it spent generating
(liger: `time/sampling_s`, sampling, rendering the tool results and scoring; TRL: its `_generate`,
which includes rendering the tool results, less the time inside the tool), the time inside the tool
calls (liger: `time/tools_s`, the wall time of the threaded calls; TRL: the time inside `lookup`),
and the peak RSS growth over the RSS right before training.

--vllm adds the variant "vllm", "liger, kernels on, vLLM engine": the kernels-on variant with
`rl.engine: vllm` (the recipe's top-p 1 and no top-k, which that engine requires) and its own server,
started by the run (`.venv-vllm`; docs/rl.md "Sampling on vLLM"); every model turn is a request to
the server, the tool calls and the ids between turns stay liger's. Its peak memory is the training
process's only: the server runs in processes of its own (about 3 GiB more on a CPU, its 1 GiB KV
cache included). Its step time includes the weight push after every optimizer step (the LoRA adapter
saved, and loaded by the server under a new name); the server's start (once per run, 20-60 s on 2
cores) comes before the first step, outside the measured steps. TRL's own vLLM path (`use_vllm=True`)
is not run here: vLLM's CPU build pins transformers below 5.20 in its own venv, and TRL needs vLLM in
its own process (colocate) or `trl vllm-serve` run in that venv; that comparison is prepared for a
lent GPU, not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "recipes/agent"
RECIPE = REPO / "recipes/agent.yaml"
VARIANTS = ("trl", "kernels_on", "kernels_off")
"""The default --variants; "vllm" (--vllm) is liger, kernels on, sampling on vLLM."""
NAMES = {"trl": "TRL GRPOTrainer", "kernels_on": "liger, kernels on", "kernels_off": "liger, kernels off",
         "vllm": "liger, kernels on, vLLM engine"}  # fmt: skip
PROMPT_TOKENS = 100
"""Every train prompt renders to 100 ids with the tool's schema (checked); TRL's limit counts after it."""


# The agent template's convention, for TRL's parser (it only knows the templates it ships).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
    },
}  # fmt: skip


def recipe() -> dict:
    """recipes/agent.yaml, read as shipped: the limits and optimizer settings both sides use."""
    import yaml

    found = yaml.safe_load(RECIPE.read_text())
    rl, training = found["rl"], found["training"]
    if rl["tools"] != ["agent/tools.py:lookup"] or rl["rewards"] != [
        {"function": "agent/rewards.py:correct"}
    ]:
        raise SystemExit(f"{RECIPE}: its tools or rewards changed; update this bench")
    return {
        "lr": training["lr"], "seed": training["seed"], "max_seq_len": found["data"]["max_seq_len"],
        "max_turns": rl["max_turns"], "max_new_tokens": rl["max_new_tokens"], "G": rl["num_generations"],
        "temperature": rl["temperature"], "loss": rl["loss"], "r": found["adapter"]["r"],
        "alpha": found["adapter"]["alpha"],
    }  # fmt: skip


def liger_variant(name: str, shipped: dict, out: Path, args, **rl) -> dict:
    """liger's variant NAME ("kernels_on", "kernels_off", or another name: kernels on), RL's keys over
    the recipe's rl section."""
    import yaml
    from trl_measure import run_liger  # bench/ is on sys.path (main)

    path = out / "liger.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(AGENT / "model"), "dtype": "float32"},
        "adapter": {"type": "lora", "r": shipped["r"], "alpha": shipped["alpha"], "dropout": 0.0,
                    "target_modules": "all-linear"},
        "data": {"train": str(AGENT / "train.jsonl"), "format": "prompt", "max_seq_len": shipped["max_seq_len"]},
        "training": {"objective": "grpo", "micro_batch_size": args.prompts, "grad_accum": 1, "lr": shipped["lr"],
                     "scheduler": "constant", "max_grad_norm": 1.0, "precision": "fp32", "seed": shipped["seed"]},
        "rl": {"tools": [f"{AGENT / 'tools.py'}:lookup"], "max_turns": shipped["max_turns"],
               "max_new_tokens": shipped["max_new_tokens"], "num_generations": shipped["G"],
               "temperature": shipped["temperature"], "loss": shipped["loss"], "beta": 0.0,
               "rewards": [{"function": f"{AGENT / 'rewards.py'}:correct"}], **rl},
        "distributed": {"activation_checkpointing": "off"},
        "output": {"dir": str(out / "liger-run"), "overwrite": True},
        "logging": {"every": 1, "tensorboard": False},
    }, sort_keys=False))  # fmt: skip
    figures, measured = run_liger(path, name, out, args.steps, args.warmup)
    if "error" in figures:
        raise SystemExit(f"liger {name} failed: see {figures['log']}")

    def mean(key: str) -> float:
        return sum(m[key] for m in measured) / len(measured)

    return {"step_time_s": figures["step_time_s"], "step_times_s": figures["step_times_s"],
            "peak_mem_mb": figures["peak_mem_mb"], "generation_s": mean("time/sampling_s"),
            "tools_s": mean("time/tools_s"), "sampled_tokens": mean("completion_length"),
            "tool_calls": mean("tool/calls"), "turns": mean("turns"), "reward": mean("reward")}  # fmt: skip


def trl_variant(shipped: dict, out: Path, args) -> dict:
    from trl_measure import run_trl  # bench/ is on sys.path (main)

    result = out / "trl.json"
    worker_argv = ["--trl-worker", str(result), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--prompts", str(args.prompts)]  # fmt: skip
    found = run_trl(args.trl_python, __file__, worker_argv, result, out)
    if "error" in found:
        raise SystemExit(f"TRL failed: see {found['log']}")
    return found


def _load(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trl_worker(result: str, args) -> int:
    """Under .venv-trl: TRL's GRPOTrainer with the tool, each step timed, its generation and the tool
    calls timed apart; the ids it renders for every prompt and every tool result, for the check."""
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import start, step_clock, summary

    baseline = start()  # the imports done, nothing of the run exists yet
    import functools

    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    shipped = recipe()
    tools, rewards = _load(AGENT / "tools.py"), _load(AGENT / "rewards.py")
    generation: list[float] = []
    in_tools = [0.0]
    work: list[dict] = []

    @functools.wraps(tools.lookup)  # the same name, signature, hints and docstring: the same schema
    def lookup(*a, **k):
        began = time.perf_counter()
        try:
            return tools.lookup(*a, **k)
        finally:
            in_tools[0] += time.perf_counter() - began

    def correct(completions, answer, **kwargs):
        """The recipe's reward on the last model turn's text, as liger passes it."""
        last = [
            next((m["content"] for m in reversed(c) if m["role"] == "assistant"), "") for c in completions
        ]
        work.append(
            {"turns": sum(sum(m["role"] == "assistant" for m in c) for c in completions) / len(completions)}
        )
        return rewards.correct(last, answer, **kwargs)

    class Timed(GRPOTrainer):
        def _generate(self, *a, **k):
            began, tools_before = time.perf_counter(), in_tools[0]
            out = super()._generate(*a, **k)
            generation.append((time.perf_counter() - began, in_tools[0] - tools_before))
            return out

    torch.manual_seed(0)
    rows = [json.loads(line) for line in (AGENT / "train.jsonl").read_text().splitlines()]
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    tokenizer = AutoTokenizer.from_pretrained(AGENT / "model")
    tokenizer.response_template = RESPONSE_TEMPLATE
    config = GRPOConfig(
        output_dir=str(Path(result).parent / "trl-run"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=shipped["G"] * args.prompts, num_generations=shipped["G"],
        max_completion_length=shipped["max_seq_len"] - PROMPT_TOKENS,
        max_tool_calling_iterations=shipped["max_turns"] - 1,
        temperature=shipped["temperature"], top_p=1.0, top_k=0, loss_type=shipped["loss"], beta=0.0,
        scale_rewards="group", learning_rate=shipped["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=shipped["seed"],
        dataloader_num_workers=0,
        # the model's config says use_cache false (training's setting); a turn at most max_new_tokens
        generation_kwargs={"use_cache": True, "max_new_tokens": shipped["max_new_tokens"]},
    )  # fmt: skip
    clock = step_clock()
    trainer = Timed(
        model=AutoModelForCausalLM.from_pretrained(AGENT / "model", dtype=torch.float32),
        reward_funcs=[correct], args=config, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer, tools=[lookup], callbacks=[clock],
        peft_config=LoraConfig(r=shipped["r"], lora_alpha=shipped["alpha"], lora_dropout=0.0,
                               target_modules="all-linear", task_type="CAUSAL_LM"),
    )  # fmt: skip
    # What TRL renders, for the parent's check against liger's rollouts.
    prompt_ids = trainer._tokenize_prompts([r["prompt"] for r in rows])[0]
    rendered = {
        "prompt_ids": {r["prompt"][0]["content"]: list(ids) for r, ids in zip(rows, prompt_ids, strict=True)},
        "tool_ids": {v: trainer._get_tool_suffix_ids([{"role": "tool", "name": "lookup", "content": v}])
                     for v in sorted(set(tools.TABLE.values()))},
    }  # fmt: skip
    trainer.train()
    logged = [e for e in trainer.state.log_history if e.get("step", 0) > args.warmup and "reward" in e]
    measured, turns = generation[args.warmup :], work[args.warmup :]
    Path(result).write_text(json.dumps({
        **summary(clock, args.warmup, baseline),
        "generation_s": sum(g - t for g, t in measured) / len(measured),
        "tools_s": sum(t for _, t in measured) / len(measured),
        "sampled_tokens": sum(e["completions/mean_length"] for e in logged) / len(logged),
        "tool_calls": sum(e["tools/call_frequency"] for e in logged) / len(logged),
        "turns": sum(w["turns"] for w in turns) / len(turns),
        "reward": sum(e["reward"] for e in logged) / len(logged),
        "rendered": rendered,
    }))  # fmt: skip
    return 0


def check_same_ids(rendered: dict, rollouts: Path) -> dict:
    """Each prompt's ids and each tool result's ids as liger trained on them (its rollouts.jsonl)
    against what TRL renders for the same prompt and the same result."""
    lengths = {len(ids) for ids in rendered["prompt_ids"].values()}
    if lengths != {PROMPT_TOKENS}:
        raise SystemExit(
            f"TRL renders prompts of {sorted(lengths)} ids, not {PROMPT_TOKENS}: update PROMPT_TOKENS"
        )
    prompts, trajectories, results = set(), 0, 0
    for row in map(json.loads, rollouts.read_text().splitlines()):
        if rendered["prompt_ids"][row["prompt"]] != row["prompt_ids"]:
            raise SystemExit(f"{row['prompt']!r}: liger and TRL render the prompt differently")
        prompts.add(row["prompt"])
        trajectories += 1
        ids, mask = row["completion_ids"], row["completion_mask"]
        runs, k = [], 0  # the tool ids: each maximal run of mask 0
        while k < len(ids):
            if mask[k]:
                k += 1
                continue
            end = k
            while end < len(ids) and not mask[end]:
                end += 1
            runs.append(ids[k:end])
            k = end
        tool_turns, turn = [], []  # each turn's tool results, in order
        for message in row["messages"]:
            if message["role"] == "tool":
                turn.append(message["content"])
            elif turn:
                tool_turns.append(turn)
                turn = []
        if turn:
            tool_turns.append(turn)
        for run, found in zip(runs, tool_turns, strict=True):
            if len(found) == 1 and found[0] in rendered["tool_ids"]:
                if rendered["tool_ids"][found[0]] != run:
                    raise SystemExit(f"tool result {found[0]!r}: liger and TRL append different ids")
                results += 1
    return {"trajectories": trajectories, "prompts": len(prompts), "tool_results": results}


def main() -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import chosen_variants

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-worker", metavar="RESULT")
    parser.add_argument("--trl-python", type=Path, default=REPO / ".venv-trl/bin/python")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(NAMES)}"
    )
    parser.add_argument("--vllm", action="store_true", help="also liger, kernels on, sampling on vLLM")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--prompts", type=int, default=4, help="prompts a step (the recipe's micro_batch_size)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/agent_vs_trl")
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker, args)
    variants = chosen_variants(parser, args, tuple(NAMES))
    if args.vllm and "vllm" not in variants:
        variants.append("vllm")
    args.out.mkdir(parents=True, exist_ok=True)
    shipped = recipe()
    found = {}
    for variant in variants:
        if variant == "trl":
            found[variant] = trl_variant(shipped, args.out, args)
        elif variant == "vllm":
            found[variant] = liger_variant(variant, shipped, args.out, args, engine="vllm")
        else:
            found[variant] = liger_variant(variant, shipped, args.out, args)
    checked = None
    liger = next((v for v in variants if v != "trl"), None)
    if "trl" in found and liger:
        checked = check_same_ids(found["trl"].pop("rendered"), args.out / liger / "rollouts.jsonl")
    (args.out / "agent_vs_trl.json").write_text(json.dumps({"checked": checked, **found}, indent=2))
    trl = found.get("trl")
    print(f"\n{args.prompts} prompts x {shipped['G']} trajectories, at most {shipped['max_turns']} model turns of "
          f"{shipped['max_new_tokens']} tokens, {shipped['max_seq_len']} ids a trajectory; {args.warmup} warm-up + "
          f"{args.steps} measured steps; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    if checked:
        print(
            f"ids checked equal on both sides: the prompts of {checked['trajectories']} trajectories "
            f"({checked['prompts']} prompts) and {checked['tool_results']} tool results"
        )
    print(
        "\n| | step time (s) | of which generation (s) | tool calls (s) | peak memory | time / TRL | memory / TRL |"
    )
    print("|---|---|---|---|---|---|---|")
    for variant, r in found.items():
        ratios = (f"{r['step_time_s'] / trl['step_time_s']:.2f}x | {r['peak_mem_mb'] / trl['peak_mem_mb']:.2f}x"
                  if trl else "- | -")  # fmt: skip
        print(f"| {NAMES[variant]} | {r['step_time_s']:.2f} | {r['generation_s']:.2f} | {r['tools_s']:.4f} | "
              f"{r['peak_mem_mb']:.0f} MiB | {ratios} |")  # fmt: skip
    print("\n| per trajectory, measured steps | sampled tokens | tool calls | model turns | reward |")
    print("|---|---|---|---|---|")
    for variant, r in found.items():
        print(f"| {NAMES[variant]} | {r['sampled_tokens']:.1f} | {r['tool_calls']:.2f} | {r['turns']:.2f} | "
              f"{r['reward']:.2f} |")  # fmt: skip
    if "vllm" in found:
        from trl_measure import VLLM_NOTE

        print(VLLM_NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
