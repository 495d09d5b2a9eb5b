"""Rebuild recipes/smollm2/: the data of the real-model quickstart (recipes/smollm2-sft.yaml, smollm2-grpo.yaml).

SFT: two-digit additions ("What is 47 + 38?") as chat rows, answered in a fixed format SmolLM2-135M-Instruct
does not use on its own: "ANSWER: 85". GRPO: harder ones, three digits each ("What is 737 + 361?"), as
prompts (a message list, rendered through the chat template) with the answer `liger_cli.rewards:exact_match`
checks. Each eval split (64 questions) is held out: no pair (a, b) of it, in either order, is trained on.
eval-prompts.jsonl holds the SFT eval's questions as prompts with their answers, for `liger generate`.

    python scripts/make_smollm2_assets.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "recipes" / "smollm2"
SEED = 0
N_EVAL, N_SFT, N_GRPO = 64, 1000, 400
GRPO_SEED = 7


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def answer(a: int, b: int) -> str:
    return f"ANSWER: {a + b}"


def chat_row(a: int, b: int) -> dict:
    user, assistant = (
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": answer(a, b)},
    )
    return {"messages": [user, assistant]}


def prompt_row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": question(a, b)}], "answer": answer(a, b)}


def write(name: str, rows: list[dict]) -> None:
    (OUT / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    rng = random.Random(SEED)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a <= b]
    rng.shuffle(pairs)
    swap = [(b, a) if rng.random() < 0.5 else (a, b) for a, b in pairs]  # either order in the questions
    held_out, train = swap[:N_EVAL], swap[N_EVAL:]
    OUT.mkdir(parents=True, exist_ok=True)
    write("sft-train.jsonl", [chat_row(a, b) for a, b in train[:N_SFT]])
    write("eval.jsonl", [chat_row(a, b) for a, b in held_out])
    write("eval-prompts.jsonl", [prompt_row(a, b) for a, b in held_out])
    rng, seen, prompts = random.Random(GRPO_SEED), set(), []
    while len(prompts) < N_EVAL + N_GRPO:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (min(a, b), max(a, b)) not in seen:
            seen.add((min(a, b), max(a, b)))
            prompts.append(prompt_row(a, b))
    write("grpo-eval.jsonl", prompts[:N_EVAL])
    write("grpo-train.jsonl", prompts[N_EVAL:])


if __name__ == "__main__":
    main()
