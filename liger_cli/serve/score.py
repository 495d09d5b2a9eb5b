"""`liger score`: a reward model's score for each row of a JSONL file, written as JSONL in input order.

Rows are `{"prompt": ..., "completion": ...}` (the prompt a string or a message list) or `{"messages":
[...]}` (a whole conversation, ending with the assistant's turn). Each output row is the input row with
`"score"` (a float) added. The reward model is a `training.objective: reward` run (its folder or its
final/), loaded and rendered as it trained (`liger_cli.model.reward_model`). Every row is read and
rendered before the model loads; the file is written whole or not at all (a temporary file renamed).
"""

from __future__ import annotations

import time
from pathlib import Path

from liger_cli.errors import UserError
from liger_cli.generate.prompts import read_jsonl_rows
from liger_cli.model.reward_model import RewardModel, check_reward_run
from liger_cli.serve.generate import _check_out, _processes, _write

ROW_SHAPES = '{"prompt": ..., "completion": ...} or {"messages": [...]}'


def read_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of the file's rows, each a JSON object of one of the two shapes (the first
    problem: a UserError)."""

    def fits(row: dict) -> bool:
        whole = "messages" in row and "prompt" not in row
        return whole or ("prompt" in row and isinstance(row.get("completion"), str))

    return read_jsonl_rows(path, ROW_SHAPES, fits)


def score_command(run: Path, prompts: Path, out: Path, batch_size: int = 16, echo=print) -> int:
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    _check_out(out, prompts)
    final = check_reward_run(run, "RUN")
    rows = read_rows(prompts)
    _, _, device = _processes()
    model = RewardModel(final, device)
    ids = []
    for line, row in rows:
        try:
            ids.append(
                model.encode(row["messages"])
                if "messages" in row
                else model.encode(row["prompt"], row["completion"])
            )
        except ValueError as err:
            raise UserError(f"{prompts} line {line}: {err}") from None
    start = time.perf_counter()
    scores = model.scores(ids, batch_size)
    _write(out, [{**row, "score": score} for (_, row), score in zip(rows, scores, strict=True)])
    echo(f"wrote {len(rows)} scores to {out} ({time.perf_counter() - start:.1f}s; reward model {final})")
    return 0
