"""Reading training data: local files -> `datasets.Dataset` rows, every row checked before any tokenizing.

A bad row 90% into a file fails in seconds, not hours into a run: `load_rows` validates every row
for the format and the first problem is a UserError naming the file, the row (and the line, for JSON
lines with blank lines) and the field.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from liger_cli.data.images import check_part, image_parts
from liger_cli.errors import UserError

# Loaders by file extension: the `datasets` packaged builder that reads each one.
LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

ROW_COLUMN = "__liger_row__"  # the row's index in its file, added by load_rows

FORMAT_FIELDS = {
    "text": "text needs a string field text",
    "instruction": "instruction format needs instruction, output and optional input",
    "chat": "chat format needs messages: a list of {role, content} objects",
    "preference": "preference format needs chosen and rejected, and prompt: all strings or all message lists",
    "prompt": "prompt format needs prompt: a string or a list of messages",
    "unpaired": "unpaired format needs label (true or false) and prompt with completion (both strings or "
    "both message lists), or messages ending with the assistant's completion",
}


def load_rows(path: Path, fmt: str):
    """Read one local file into a `datasets.Dataset` and validate every row for `fmt`."""
    import datasets

    path = Path(path)
    builder = LOADERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(
            f"data error: {path}: unknown file type {path.suffix or '(no extension)'!r}; "
            f"use one of {', '.join(LOADERS)}"
        )
    if not path.is_file():
        raise UserError(f"data error: {path}: file not found (check data.train / data.eval in the recipe)")
    if path.stat().st_size == 0:
        raise UserError(f"data error: {path}: the file is empty")

    kwargs: dict[str, Any] = {}
    if builder == "csv":
        # Keep CSV cells as the strings they are ("007" stays "007"); empty cells become "".
        kwargs = {"converters": dict.fromkeys(_string_fields(fmt), str), "na_filter": False}
    with quiet_datasets():
        try:
            rows = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
        except Exception as err:  # noqa: BLE001 - every loader failure becomes a message naming the file
            if builder == "json":
                _diagnose_json(path)  # raises a UserError naming the line when it finds the problem
            raise UserError(
                f"data error: {path}: could not read the file as {builder}: {_last_line(err)}"
            ) from err
    if len(rows) == 0:
        raise UserError(f"data error: {path}: the file has no rows")
    validate_rows(rows, path, fmt)
    # Remember each row's place in the file, so later messages name the right row after a split.
    return rows.add_column(ROW_COLUMN, list(range(len(rows))))


def validate_rows(rows, path: Path, fmt: str) -> None:
    """Check every row's fields and types for `fmt`; the first problem is a UserError with file and row."""
    check = row_check(fmt)
    for index, row in enumerate(rows):
        problem = check(row)
        if problem:
            raise UserError(f"data error: {path} {where(path, index)}: {problem} ({FORMAT_FIELDS[fmt]})")


def row_check(fmt: str):
    """The function row -> the row's first problem for `fmt` (a str), or None when it is valid."""
    return {
        "text": _check_text_row,
        "instruction": _check_instruction_row,
        "chat": _check_chat_row,
        "preference": _check_preference_row,
        "prompt": _check_prompt_row,
        "unpaired": _check_unpaired_row,
    }[fmt]


def split_eval_fraction(rows, fraction: float, seed: int, path: Path):
    """Hold out `fraction` of the rows for eval; the same seed gives the same split."""
    if not 0 < fraction < 1:
        raise UserError(f"data error: data.eval_fraction must be between 0 and 1 (exclusive), got {fraction}")
    n_eval = round(len(rows) * fraction)
    if n_eval < 1 or n_eval >= len(rows):
        raise UserError(
            f"data error: {path}: eval_fraction {fraction} of {len(rows)} rows leaves "
            f"{n_eval} eval rows; use a larger file, another fraction, or data.eval"
        )
    split = rows.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
    return split["train"], split["test"]


@contextlib.contextmanager
def quiet_datasets():
    """No progress bars from `datasets` for our small, fast steps (restored afterwards)."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def _string_fields(fmt: str) -> list[str]:
    fields = {
        "text": ["text"],
        "instruction": ["instruction", "input", "output"],
        "chat": [],
        "prompt": ["prompt"],
        "unpaired": ["prompt", "completion"],
    }
    return fields.get(fmt, ["prompt", "chosen", "rejected"])


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _required_string(row: dict, field: str) -> str | None:
    if field not in row or row[field] is None:
        return f'field "{field}" is missing'
    if not isinstance(row[field], str):
        return f'field "{field}" must be a string, found {_type_name(row[field])}'
    if not row[field].strip():
        return f'field "{field}" is empty'
    return None


def _check_text_row(row: dict) -> str | None:
    return _required_string(row, "text")


def _check_instruction_row(row: dict) -> str | None:
    problem = _required_string(row, "instruction") or _required_string(row, "output")
    if problem:
        return problem
    if row.get("input") is not None and not isinstance(row["input"], str):
        return f'field "input" must be a string, found {_type_name(row["input"])}'
    return None


def _check_chat_row(row: dict) -> str | None:
    """messages: [{role, content}], where an assistant turn may carry tool_calls instead of content,
    and reasoning_content (its reasoning, for templates that render it); a turn's content may be a list of
    text and (not for the assistant) image parts (liger_cli.data.images); tools: optional schemas."""
    messages = row.get("messages")
    if messages is None:
        return 'field "messages" is missing'
    if not isinstance(messages, list):
        return f'field "messages" must be a list, found {_type_name(messages)}'
    if not messages:
        return 'field "messages" is empty'
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        return f'field "tools" must be a list of tool schemas, found {_type_name(tools)}'
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return (
                f'field "messages[{i}]" must be an object with role and content, found {_type_name(message)}'
            )
        role = message.get("role")
        if not isinstance(role, str):
            return f'field "messages[{i}].role" ' + (
                "is missing" if role is None else f"must be a string, found {_type_name(role)}"
            )
        calls = message.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)):
            return f'field "messages[{i}].tool_calls" must be a list, on an assistant message'
        content = message.get("content")
        if content is None and not calls:
            return f'field "messages[{i}].content" is missing'
        if isinstance(content, list):
            for j, part in enumerate(content):
                problem = check_part(part) if isinstance(part, dict) else "a part must be an object"
                if not problem and role == "assistant" and part.get("type") != "text":
                    problem = "an assistant turn's parts must be text (images are for the other turns)"
                if problem:
                    return f'field "messages[{i}].content[{j}]": {problem}'
        elif content is not None and not isinstance(content, str):
            return f'field "messages[{i}].content" must be a string, found {_type_name(content)}'
        reasoning = message.get("reasoning_content")
        if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
            return f'field "messages[{i}].reasoning_content" must be a string, on an assistant message'
    if not any(m["role"] == "assistant" for m in messages):
        return 'field "messages" has no assistant turn, so there is nothing to learn'
    return None


def _check_prompt_row(row: dict) -> str | None:
    """The row's first problem, or None: a non-empty string, or a message list ending with a non-assistant turn."""
    prompt = row.get("prompt")
    if prompt is None:
        return 'field "prompt" is missing'
    if isinstance(prompt, str):
        return None if prompt.strip() else 'field "prompt" is empty'
    if not isinstance(prompt, list) or not prompt:
        return 'field "prompt" must be a string or a non-empty list of messages'
    for i, message in enumerate(prompt):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or message.get("content") is None
        ):
            return f'field "prompt[{i}]" must be an object with "role" and "content"'
    if prompt[-1]["role"] == "assistant":
        return 'field "prompt": the last message is the assistant\'s; end with the turn to answer'
    return _no_images(prompt, "prompt")


def _check_preference_row(row: dict) -> str | None:
    """prompt (optional with message lists), chosen, rejected: all strings or all message lists."""
    for side in ("chosen", "rejected"):
        if row.get(side) is None:
            return f'field "{side}" is missing'
    prompt = row.get("prompt")
    kinds = {side: type(row[side]) for side in ("chosen", "rejected")} | (
        {"prompt": type(prompt)} if prompt is not None else {}
    )
    if any(kind not in (str, list) for kind in kinds.values()):
        name = next(k for k, kind in kinds.items() if kind not in (str, list))
        return f'field "{name}" must be a string or a list of messages, found {_type_name(row[name])}'
    if len(set(kinds.values())) > 1:
        return 'fields "prompt", "chosen" and "rejected" must be all strings or all message lists, not mixed'
    if kinds["chosen"] is str:
        for name in kinds:
            if not row[name].strip():
                return f'field "{name}" is empty'
        return None
    for name in kinds:
        problem = _check_chat_row({"messages": row[name]}) if name != "prompt" else None
        if name == "prompt" and not row[name]:
            problem = 'field "messages" is empty'
        if problem:
            return problem.replace('"messages', f'"{name}', 1)
    for name in kinds:
        if problem := _no_images(row[name], name):
            return problem
    for side in ("chosen", "rejected"):
        if row[side][-1].get("role") != "assistant":
            return f'field "{side}": its last message must be the assistant\'s answer'
    if prompt is None:
        chosen, rejected = row["chosen"], row["rejected"]
        if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
            return (
                'without "prompt", chosen and rejected must be whole conversations that share every message '
                "but the last; add a prompt field, or make their earlier messages equal"
            )
    return None


def _check_unpaired_row(row: dict) -> str | None:
    """label: a boolean; prompt and completion (strings, or message lists), or messages whose last turn
    is the assistant's completion."""
    label = row.get("label")
    if not isinstance(label, bool):
        found = "it is missing" if label is None else f"found {_type_name(label)} {label!r}"
        return f'field "label" must be true (a desirable completion) or false (an undesirable one): {found}'
    if row.get("messages") is not None:
        if row.get("prompt") is not None or row.get("completion") is not None:
            return 'give either "messages" or "prompt" with "completion", not both'
        problem = _check_chat_row(row) or _no_images(row["messages"], "messages")
        if problem is None and row["messages"][-1].get("role") != "assistant":
            problem = 'field "messages": its last message must be the assistant\'s completion'
        return problem
    for name in ("prompt", "completion"):
        if row.get(name) is None:
            return f'field "{name}" is missing (or give "messages")'
        if not isinstance(row[name], str | list):
            return f'field "{name}" must be a string or a list of messages, found {_type_name(row[name])}'
    if type(row["prompt"]) is not type(row["completion"]):
        return 'fields "prompt" and "completion" must be both strings or both message lists, not mixed'
    if isinstance(row["prompt"], str):
        return next((f'field "{n}" is empty' for n in ("prompt", "completion") if not row[n].strip()), None)
    if not row["prompt"]:
        return 'field "prompt" is empty'
    for name in ("prompt", "completion"):
        problem = _check_chat_row({"messages": row[name]}) if name == "completion" else None
        if problem := problem or _no_images(row[name], name):
            return problem.replace('"messages', f'"{name}', 1)
    if row["completion"][-1].get("role") != "assistant":
        return 'field "completion": its last message must be the assistant\'s'
    return None


def _no_images(messages: list, name: str) -> str | None:
    """Images are read for chat rows only; elsewhere a placeholder without pixels would be trained on."""
    found = image_parts(messages)
    if found:
        return f'field "{found[0][0].replace("messages", name, 1)}": images are read in format chat only'
    return None


def encoded_rows(batch: dict[str, list], encode, path: Path):
    """A datasets batch (column -> values) as (row, its index in its file, its encoding) per row, `encode`
    taking the rows; an encoding that is a ValueError (a template problem found while rendering that row)
    is a UserError naming the row."""
    from liger_cli.errors import UserError

    rows = [{k: v[j] for k, v in batch.items()} for j in range(len(batch[ROW_COLUMN]))]
    for row, enc in zip(rows, encode(rows), strict=True):
        if isinstance(enc, ValueError):
            raise UserError(f"data error: {path} {where(path, row[ROW_COLUMN])}: {enc}") from None
        yield row, row[ROW_COLUMN], enc


def where(path: Path, index: int) -> str:
    """'row N' (1-based); for JSON lines also the line, which differs when the file has blank lines."""
    if path.suffix.lower() == ".jsonl":
        line = _line_of_row(path, index)
        if line is not None and line != index + 1:
            return f"row {index + 1} (line {line})"
    return f"row {index + 1}"


def _line_of_row(path: Path, index: int) -> int | None:
    seen = -1
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                seen += 1
                if seen == index:
                    return lineno
    return None


def _diagnose_json(path: Path) -> None:
    """Find why a JSON / JSON-lines file did not load, and raise a UserError naming the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"data error: {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text.strip():
        raise UserError(f"data error: {path}: the file has no rows")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as whole_err:
        document = None
        if text.lstrip().startswith("["):  # one JSON array: its parse error has the line
            raise UserError(
                f"data error: {path} line {whole_err.lineno}: invalid JSON ({whole_err.msg}, "
                f"column {whole_err.colno})"
            ) from None
    if document is not None:
        if not isinstance(document, list):
            raise UserError(
                f"data error: {path}: expected JSON lines (one object per line) or a JSON list of "
                f"objects, found a single {_type_name(document)}"
            )
        records = enumerate(document, 1)
    else:
        records = _json_lines(path, text)
    for row_number, record in records:
        if not isinstance(record, dict):
            raise UserError(
                f"data error: {path} row {row_number}: expected a JSON object, found {_type_name(record)}"
            )


def _json_lines(path: Path, text: str):
    row = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row += 1
        try:
            yield row, json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"data error: {path} line {lineno}: invalid JSON ({err.msg}, column {err.colno})"
            ) from None


def _last_line(err: BaseException) -> str:
    """The most specific message in an exception chain (datasets wraps the real cause)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__
