"""`liger score`: a reward model's score for each row of a JSONL file, written as JSONL in input order.

Rows are `{"prompt": ..., "completion": ...}` (the prompt a string or a message list) or `{"messages":
[...]}` (a whole conversation, ending with the assistant's turn). Each output row is the input row with
`"score"` (a float) added. The reward model is a `training.objective: reward` run (its folder or its
final/), loaded and rendered as it trained (`liger_cli.model.reward_model`). Every row is read and
rendered before the model loads; the file is written whole or not at all (a temporary file renamed).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from liger_cli.errors import UserError
from liger_cli.model.reward_model import RewardModel, check_reward_run
from liger_cli.serve.generate import _check_out, _processes, _write

ROW_SHAPES = '{"prompt": ..., "completion": ...} or {"messages": [...]}'


def read_rows(path: Path) -> list[dict]:
    """The file's rows, each a JSON object of one of the two shapes (the first problem: a UserError)."""
    if not path.is_file():
        raise UserError(f"--prompts {path}: no such file; give a .jsonl file of {ROW_SHAPES} rows")
    rows = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"{path} line {line_number}: not JSON ({err.msg}); write one JSON object per line"
            ) from None
        whole = isinstance(row, dict) and "messages" in row and "prompt" not in row
        pair = isinstance(row, dict) and "prompt" in row and isinstance(row.get("completion"), str)
        if not (whole or pair):
            raise UserError(f"{path} line {line_number}: a row needs {ROW_SHAPES}; got {str(row)[:60]}")
        rows.append((line_number, row))
    if not rows:
        raise UserError(f"{path} holds no rows: write one JSON object per line, {ROW_SHAPES}")
    return rows


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
