"""A KTO step: liger (`training.objective: kto`, kernels on, kernels off) against TRL's `KTOTrainer`,
same model, rows, LoRA and batch, on a CPU.

TRL lives in its own venv, never the project's (see bench/dpo_vs_trl.py for its set-up):

    .venv/bin/python bench/kto_vs_trl.py                     # 8 rows x 512 tokens, 1 + 3 steps
    .venv/bin/python bench/kto_vs_trl.py --seq-len 256       # bench/README.md's table
    .venv/bin/python bench/kto_vs_trl.py --trl-python /path/to/.venv-trl/bin/python --rows 16

The same on every side: the weights (`recipes/bench/llama-8x512.json`, random init with seed 0, saved
once to a folder every run loads), the quickstart tokenizer, the rows (bench/dpo_vs_trl.py's
`make_pairs`, a prompt of about half the sequence and answers that fill the rest, split into thumbs
as scripts/make_kto_data.py splits the DPO recipe's pairs: the chosen answer labelled desirable, the
rejected one undesirable, shuffled; the token ids each side trains on are checked to be the same:
TRL's prompt + completion + eos string with BOS, liger's unpaired encoding), LoRA r=16 alpha 32
dropout 0 on all linear layers, KTO with beta 0.1 and both weights 1, the reference = the model with
its adapter disabled (TRL's default with a PEFT config, `precompute_ref_log_probs` off), fp32, a
micro-batch of --rows rows, no gradient accumulation, no gradient checkpointing, AdamW with a
constant learning rate, grad-norm clipping at 1.0. Each side runs four forwards a step (policy and
reference over the rows and over their mismatched rows) and one backward.

One difference, by definition: the KL estimate z0 pairs each prompt with another row's completion,
TRL with the row before it in the same micro-batch (completions rotated by one), liger with a seeded
partner drawn by its data stage (liger_cli.data.unpaired), so from step 2 on the two z0 differ. At
step 1 the policy is the reference (the adapter's B is zero): every reward and z0 are 0 and each
row's loss is half its weight, 0.5 on both sides; a run where the step-1 loss is not 0.5 exits 1.

Each variant a fresh process (trl_measure): TRL (run by --trl-python), liger with its kernels, liger
with every kernel off (both through `liger bench`'s worker). Measured after --warmup steps: the step
time (from the end of the step before to the end of its optimizer step) and the peak RSS growth over
the RSS right before training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
KTO = {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0}
START_LOSS, LOSS_RTOL = 0.5, 1e-4


def setup(out: Path, args) -> tuple[Path, Path, dict]:
    """The model folder and the rows file, made once; the token counts both sides train on."""
    from dpo_vs_trl import build_model, make_pairs  # bench/ is on sys.path (main)
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from make_kto_data import thumbs
    finally:
        sys.path.remove(str(REPO / "scripts"))

    model_dir = build_model(
        REPO / "recipes/bench/llama-8x512.json", REPO / "recipes/quickstart/model", out / "model"
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    steps = args.warmup + args.steps
    rows = thumbs(make_pairs(tokenizer, (args.rows * steps + 1) // 2, args.seq_len), seed=0)[
        : args.rows * steps
    ]
    rows_file = out / "rows.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, rows_file, check_same_ids(tokenizer, rows, args.seq_len)


def check_same_ids(tokenizer, rows: list[dict], seq_len: int) -> dict:
    """liger's unpaired encoding of each row against TRL's (prompt + completion + eos tokenized with BOS, the
    completion from where the prompt's own tokens end), ids and prompt length; the sequence lengths."""
    from liger_cli.data.unpaired import encode_completions_of

    lengths = []
    for i, (row, enc) in enumerate(zip(rows, encode_completions_of(rows, tokenizer), strict=True)):
        trl_ids = tokenizer(row["prompt"] + row["completion"] + tokenizer.eos_token)["input_ids"]
        prompt = len(tokenizer(row["prompt"])["input_ids"])
        if trl_ids != enc.input_ids or enc.labels[prompt - 1] != -100 or enc.labels[prompt] == -100:
            raise SystemExit(f"row {i}: liger and TRL would tokenize it differently")
        if len(trl_ids) > seq_len:
            raise SystemExit(f"row {i}: {len(trl_ids)} tokens > --seq-len {seq_len}")
        lengths.append(len(trl_ids))
    return {"sequence_tokens": [min(lengths), max(lengths)], "desirable": sum(r["label"] for r in rows)}


def trl_worker(model_dir: str, rows: str, result: str, args) -> int:
    """Under .venv-trl: TRL's KTOTrainer, each step timed, its first loss kept."""
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import start, train_trl

    baseline = start()  # the imports done, nothing of the run exists yet
    import peft
    import torch
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    def check(trainer) -> None:  # the reference: the adapter off
        assert trainer.ref_model is None and isinstance(trainer.model, peft.PeftModel)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return train_trl(KTOTrainer, KTOConfig, model, rows, result, args, baseline, LORA, "CAUSAL_LM", check,
                     per_device_train_batch_size=args.rows, loss_type="kto", **KTO, precompute_ref_log_probs=False)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-worker", nargs=3, metavar=("MODEL", "ROWS", "RESULT"))
    parser.add_argument("--rows", type=int, default=8, help="rows (completions) per micro-batch")
    sys.path.insert(0, str(Path(__file__).parent))
    from trl_measure import arguments, compare, liger_side, parse, report, trl_side

    arguments(parser, "kto_vs_trl")
    args = parse(parser)
    if args.trl_worker:
        return trl_worker(*args.trl_worker, args)
    if args.rows < 2:
        parser.error(
            "--rows must be at least 2: TRL's KL estimate pairs each row with another of its micro-batch"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, rows, tokens = setup(args.out, args)
    data = {"train": str(rows), "format": "unpaired", "max_seq_len": args.seq_len}
    found, load = compare(
        "TRL KTOTrainer",
        lambda: trl_side(__file__, args.out, args, [str(model_dir), str(rows)],
                         {"--rows": args.rows, "--seq-len": args.seq_len}),
        lambda name: liger_side(name, args.out, args, model_dir, LORA, data, kto=KTO,
                                training={"objective": "kto", "micro_batch_size": args.rows}),
    )  # fmt: skip
    report(args.out / "kto_vs_trl.json", args, tokens, found, load, "TRL KTOTrainer", f"{args.rows} rows")
    off = [n for n, r in found.items() if abs(r["first_step_loss"] - START_LOSS) > LOSS_RTOL * START_LOSS]
    for name in off:
        print(
            f"error: {name}'s step-1 loss is not {START_LOSS}: policy and reference differ at step 1",
            file=sys.stderr,
        )
    return 1 if off else 0


if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU bench: no worker sees a GPU
    sys.exit(main())
