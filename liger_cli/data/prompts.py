"""Prompt rows for online RL (`data.format: prompt`): `{"prompt": "text" or [messages], ...fields}`.

A prompt is rendered as `liger generate` renders it (`liger_cli.generate.prompts` does the same with
this module's rules): a string after the tokenizer's prefix (bos), a message list through the chat
template with its generation prompt. Every other field of the row (an `answer`, a `task`) is kept as
JSON beside the prompt's ids, and reaches the reward functions as a keyword argument. Nothing is
learned from the prompt itself: the learned tokens are the completions sampled during training.
"""

from __future__ import annotations

import json
from pathlib import Path

from liger_cli.data.encode import _encode_with_prefix
from liger_cli.data.files import ROW_COLUMN, where
from liger_cli.data.processes import encode_table, tokenizing_processes
from liger_cli.data.split import DROP_COLUMN, WARNINGS_COLUMN
from liger_cli.errors import UserError

PROMPT_COLUMNS = ("prompt_ids", "prompt", "fields")
"""What the run reads of a prompt example: its ids, the prompt as written (JSON) and the row's other
fields (a JSON object)."""
INPUT = "liger_input:"
"""The prefix of a row's own column renamed for the encoding map (one named as an output column)."""


def prompt_messages(prompt, tools: list[dict] | None) -> list[dict] | None:
    """The conversation a prompt stands for: its messages; with tools a string is one user message (the
    tools are described through the chat template); None for a string rendered as plain text."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if tools is not None else None
    from liger_cli.data.chat import _without_nulls

    return _without_nulls(list(prompt))


def prompt_ids(prompt, tokenizer, tools: list[dict] | None = None) -> list[int]:
    """The tokens a completion continues: a string after the tokenizer's prefix, or messages through
    the chat template with its generation prompt (and the tools' schemas, given tools)."""
    messages = prompt_messages(prompt, tools)
    if messages is None:
        return _encode_with_prefix(tokenizer, prompt)[0]
    from liger_cli.data.chat import render

    text = render(tokenizer, messages, tools, generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompts(rows, path: Path, data_cfg, tokenizer, tools: list[dict] | None = None):
    """One encoded row per prompt row: PROMPT_COLUMNS, the row, its length, and the DROP_COLUMN and
    WARNINGS_COLUMN that `split_of` reads (a prompt is never dropped here: one too long for
    rl.max_new_tokens is refused by the run, which knows that number)."""
    path = Path(path)
    if tools is not None:
        from liger_cli.data.tools import check_template_takes_tools

        check_template_takes_tools(tokenizer, tools)

    outputs = (*PROMPT_COLUMNS, "row", "length", DROP_COLUMN, WARNINGS_COLUMN)
    # An output column named as an input column keeps the input's type in `datasets`' map: a prompt whose
    # messages hold tool calls is typed List(Json), and its JSON text came back a list of characters.
    renamed = {name: INPUT + name for name in rows.column_names if name in outputs}
    rows = rows.rename_columns(renamed) if renamed else rows

    def encode_batch(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {name: [] for name in outputs}
        for j in range(len(batch[ROW_COLUMN])):
            row = {k.removeprefix(INPUT): v[j] for k, v in batch.items()}
            index = row.pop(ROW_COLUMN)
            try:
                ids = prompt_ids(row["prompt"], tokenizer, tools)
            except ValueError as err:  # a template problem found while rendering this row
                raise UserError(f"data error: {path} {where(path, index)}: {err}") from None
            out["prompt_ids"].append(ids)
            out["prompt"].append(json.dumps(row.pop("prompt"), ensure_ascii=False))
            out["fields"].append(json.dumps(row, ensure_ascii=False, default=str))
            out["row"].append(index)
            out["length"].append(len(ids))
            out[DROP_COLUMN].append("")
            out[WARNINGS_COLUMN].append("[]")
        return out

    return encode_table(
        rows, encode_batch, f"liger-prompt-{len(rows)}", tokenizing_processes(data_cfg, len(rows))
    )
