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


def trl_worker(model_dir: str, pairs: str, result: str, args) -> int:
    """Under .venv-trl: TRL's RewardTrainer, each step timed, its first loss kept."""
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import start, train_trl

    baseline = start()  # the imports done, nothing of the run exists yet
    import peft
    import torch
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    def check(trainer) -> None:  # LoRA, and the score head trained in full (modules_to_save)
        assert isinstance(trainer.model, peft.PeftModel)
        trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert any(".score.modules_to_save." in n for n in trained), "TRL's score head is not trained in full"

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    return train_trl(RewardTrainer, RewardConfig, model, pairs, result, args, baseline, LORA, "SEQ_CLS", check,
                     per_device_train_batch_size=args.pairs, center_rewards_coefficient=None)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-worker", nargs=3, metavar=("MODEL", "PAIRS", "RESULT"))
    parser.add_argument("--pairs", type=int, default=4, help="pairs per micro-batch (2x rows)")
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import arguments, compare, liger_side, parse, report, trl_side

    arguments(parser, "reward_vs_trl")
    args = parse(parser)
    if args.trl_worker:
        return trl_worker(*args.trl_worker, args)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, pairs, tokens = setup(args.out, args)
    data = {"train": str(pairs), "format": "preference", "max_seq_len": args.seq_len}
    found, load = compare(
        "TRL RewardTrainer",
        lambda: trl_side(__file__, args.out, args, [str(model_dir), str(pairs)],
                         {"--pairs": args.pairs, "--seq-len": args.seq_len}),
        lambda name: liger_side(name, args.out, args, model_dir, LORA, data,
                                training={"objective": "reward", "micro_batch_size": args.pairs}),
    )  # fmt: skip
    report(
        args.out / "reward_vs_trl.json", args, tokens, found, load, "TRL RewardTrainer", f"{args.pairs} pairs"
    )
    trl = found["TRL RewardTrainer"]
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
