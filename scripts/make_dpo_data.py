"""Build recipes/dpo/{train,eval}.jsonl: preference pairs over the quickstart's task (number -> words).

Each pair asks for a number in English words; the chosen answer is right, the rejected one is the
words of a near miss (one more or less, ten more or less, or two digits swapped), so the only way to
prefer the chosen answer is to read the number. The eval pairs use the quickstart's held-out numbers,
which no training pair contains. Deterministic:

    python scripts/make_dpo_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_quickstart_assets import INSTRUCTIONS, number_words

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "recipes" / "dpo"
PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{number}\n\n### Response:\n"


def near_miss(rng: random.Random, n: int) -> int:
    candidates = {n + 1, n - 1, n + 10, n - 10, int(str(n)[::-1]) if n >= 10 else n + 2}
    return rng.choice(sorted(m for m in candidates if 0 <= m <= 999 and m != n))


def pairs(rng: random.Random, numbers: list[int]) -> list[dict]:
    rows = []
    for n in numbers:
        prompt = PROMPT.format(instruction=rng.choice(INSTRUCTIONS["words"]), number=n)
        rows.append(
            {"prompt": prompt, "chosen": number_words(n), "rejected": number_words(near_miss(rng, n))}
        )
    rng.shuffle(rows)
    return rows


def main() -> None:
    rng = random.Random(0)
    numbers = list(range(1000))
    rng.shuffle(numbers)  # the same held-out 100 as the quickstart's eval set
    eval_numbers, train_numbers = sorted(numbers[:100]), sorted(numbers[100:])
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", pairs(rng, train_numbers)), ("eval.jsonl", pairs(rng, eval_numbers))):
        (OUT / name).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        print(f"wrote {OUT / name} ({len(rows)} pairs)")


if __name__ == "__main__":
    main()
