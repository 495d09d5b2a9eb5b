"""Build recipes/kto/{train,eval}.jsonl: the DPO recipe's pairs (recipes/dpo/) split into thumbs.

Each pair {"prompt", "chosen", "rejected"} gives two unpaired rows: the prompt with the chosen answer,
labelled true (desirable), and the prompt with the rejected one, labelled false (undesirable). The rows
are shuffled (seeded), so a micro-batch holds both kinds and rarely both halves of one pair; the eval
rows come from the DPO eval pairs (the quickstart's held-out numbers). Deterministic:

    python scripts/make_kto_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def thumbs(pairs: list[dict], seed: int) -> list[dict]:
    rows = [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair in pairs
        for side in ("chosen", "rejected")
    ]
    random.Random(seed).shuffle(rows)
    return rows


def main() -> None:
    out = REPO / "recipes" / "kto"
    out.mkdir(exist_ok=True)
    for seed, split in enumerate(("train", "eval")):
        text = (REPO / "recipes" / "dpo" / f"{split}.jsonl").read_text()
        pairs = [json.loads(line) for line in text.splitlines() if line.strip()]
        rows = thumbs(pairs, seed)
        (out / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{out / f'{split}.jsonl'}: {len(rows)} rows from {len(pairs)} pairs")


if __name__ == "__main__":
    main()
