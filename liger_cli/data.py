"""Training data: local files -> validated rows -> token ids with the prompt masked out of the loss.

The flow, one function each: `load_rows` (through `datasets`, chosen by file extension) ->
`validate_rows` (every row checked before any tokenizing, so a bad row 90% into a file fails in
seconds, not hours into a run) -> `encode_*` (token ids and labels, prompt tokens labelled -100) ->
truncation and dropping of examples with nothing left to learn -> optional `pack_examples`.

Formats:
- text: `{"text": ...}`; the loss covers the whole text (+ eos).
- instruction: `{"instruction": ..., "input": ... (optional), "output": ...}`, rendered with
  `INSTRUCTION_TEMPLATE`; the loss covers only the output (+ eos).
- chat: `{"messages": [{"role": ..., "content": ...}, ...]}`, rendered with the tokenizer's own chat
  template; the loss covers only the assistant turns.

Labels are aligned with input_ids, not shifted: transformers' causal-LM loss shifts them itself.

Packing and attention: a packed row holds several examples whose `position_ids` restart at 0. The
collator then sends no attention mask, and transformers (>= 4.52 `masking_utils`, checked on 5.23:
`find_packed_sequence_indices`) turns restarting position_ids into a block-diagonal causal mask for
the `sdpa`, `eager` and `flex_attention` implementations; `flash_attention_2/3` use the same
position_ids as variable-length sequence boundaries. So attention does not leak across packed
examples for models built on `masking_utils.create_causal_mask` (Llama, Mistral, Qwen2/3, Gemma and
the other current families; tests/test_data.py checks the logits for Llama with sdpa and eager).
Two conditions: no attention_mask, and no KV cache (run with `use_cache=False`, as training does):
with a cache, transformers does not look for packed rows and each row gets one causal mask.
A model that builds its own mask without looking at position_ids (old or remote-code models) would
let each packed example attend to the ones before it in the row: no error, just a subtly different
model. Use `packing: false` there.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from liger_cli.errors import UserError

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the label value transformers' cross-entropy skips

# Loaders by file extension: the `datasets` packaged builder that reads each one.
LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

# The instruction prompt (Alpaca-style). The "### Input" block is left out when input is empty.
INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
INSTRUCTION_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

ROW_COLUMN = "__liger_row__"  # the row's index in its file, added by load_rows

FORMAT_FIELDS = {
    "text": "text needs a string field text",
    "instruction": "instruction format needs instruction, output and optional input",
    "chat": "chat format needs messages: a list of {role, content} objects",
}


class DataConfig(Protocol):
    """The recipe's `data` section (liger_cli.recipe builds it; any object with these attributes works)."""

    train: Path
    eval: Path | None
    eval_fraction: float | None
    format: str
    max_seq_len: int
    packing: bool


# ---------------------------------------------------------------------------------------------- public
def build_datasets(data_cfg: DataConfig, tokenizer, seed: int):
    """Load, validate, tokenize (and maybe pack) the train and eval data.

    Returns (train, eval or None), each a `datasets.Dataset` of examples
    `{"input_ids", "labels", "position_ids"}` (lists of ints). Every user mistake (missing file,
    unknown extension, bad JSON, missing or mistyped field, chat template problems) is a UserError
    naming the file, the row and the field, raised before any tokenizing starts.
    """
    fmt = data_cfg.format
    if fmt not in FORMAT_FIELDS:
        raise UserError(f"data error: unknown data.format {fmt!r}; use one of: {', '.join(FORMAT_FIELDS)}")
    if data_cfg.eval is not None and data_cfg.eval_fraction is not None:
        raise UserError("data error: set data.eval or data.eval_fraction, not both")
    _check_tokenizer(tokenizer, fmt)

    train_path = Path(data_cfg.train)
    train_rows = load_rows(train_path, fmt)
    eval_path = Path(data_cfg.eval) if data_cfg.eval is not None else None
    eval_rows = load_rows(eval_path, fmt) if eval_path is not None else None

    if data_cfg.eval_fraction is not None:
        train_rows, eval_rows = split_eval_fraction(train_rows, data_cfg.eval_fraction, seed, train_path)
        eval_path = train_path

    train = _tokenize(train_rows, train_path, fmt, tokenizer, data_cfg.max_seq_len, data_cfg.packing)
    evald = None
    if eval_rows is not None:
        evald = _tokenize(eval_rows, eval_path, fmt, tokenizer, data_cfg.max_seq_len, data_cfg.packing)
    return train, evald


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
    with _quiet_datasets():
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
    check = {"text": _check_text_row, "instruction": _check_instruction_row, "chat": _check_chat_row}[fmt]
    for index, row in enumerate(rows):
        problem = check(row)
        if problem:
            raise UserError(f"data error: {path} {_where(path, index)}: {problem} ({FORMAT_FIELDS[fmt]})")


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


def render_instruction_prompt(instruction: str, input: str | None = None) -> str:
    """The prompt for an instruction row; the model's answer follows it directly."""
    if input:
        return INSTRUCTION_TEMPLATE.format(instruction=instruction, input=input)
    return INSTRUCTION_TEMPLATE_NO_INPUT.format(instruction=instruction)


def encode_text(row: dict, tokenizer) -> tuple[list[int], list[int]]:
    """Text row -> (input_ids, labels): everything is learned except the tokenizer's own prefix (bos)."""
    ids, special = _encode_with_prefix(tokenizer, row["text"])
    labels = [IGNORE_INDEX if is_special else i for i, is_special in zip(ids, special, strict=True)]
    return ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]


def encode_instruction(row: dict, tokenizer) -> tuple[list[int], list[int]]:
    """Instruction row -> (input_ids, labels): only the output and the eos after it are learned.

    Prompt and output are tokenized separately and joined, so the boundary is exact for any tokenizer.
    """
    prompt_ids, _ = _encode_with_prefix(
        tokenizer, render_instruction_prompt(row["instruction"], row.get("input"))
    )
    answer_ids = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + answer_ids


def encode_chat(row: dict, tokenizer) -> tuple[list[int], list[int]]:
    """Chat row -> (input_ids, labels): only the assistant turns are learned.

    Works for any chat template that is prefix-stable (rendering the first k messages gives a prefix
    of rendering them all): for each assistant turn i, the text from the end of render(messages[:i],
    add_generation_prompt=True) to the end of render(messages[:i+1]) is the assistant's span, which
    includes whatever the template closes a turn with (eos, <|im_end|>), so the model learns to stop.
    Character spans are mapped onto tokens through the tokenizer's offsets, so BPE merges across a
    boundary cannot shift them. A template that is not prefix-stable raises ValueError (the caller
    names the row).
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]

    def render(msgs, generation_prompt):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start_text = render(messages[:i], True)
        end_text = render(messages[: i + 1], False)
        if not (full.startswith(end_text) and end_text.startswith(start_text)):
            raise ValueError(
                f"the tokenizer's chat template is not prefix-stable at message {i} (rendering the first "
                f"messages does not give a prefix of the whole conversation), so assistant turns cannot be "
                f"located; use a template that renders each turn independently, or the instruction format"
            )
        spans.append((len(start_text), len(end_text)))

    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    for t, (char_start, char_end) in enumerate(enc["offset_mapping"]):
        if char_end > char_start and any(s <= char_start and char_end <= e for s, e in spans):
            labels[t] = ids[t]
    return ids, labels


def truncate(ids: list[int], labels: list[int], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Keep the first max_seq_len tokens (the prompt is at the start and is needed for what follows)."""
    return ids[:max_seq_len], labels[:max_seq_len]


def pack_examples(examples: Sequence[dict], max_seq_len: int) -> list[dict]:
    """Greedily join consecutive examples into rows of at most max_seq_len tokens.

    Examples are never split. position_ids restart at 0 for each example (that is how attention
    learns the boundaries, see the module docstring), and the first label of each example is -100 so
    no loss is computed for predicting one example's first token from the end of the previous one.
    """
    packed: list[dict] = []
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ex in examples:
        n = len(ex["input_ids"])
        if row["input_ids"] and len(row["input_ids"]) + n > max_seq_len:
            packed.append(row)
            row = {"input_ids": [], "labels": [], "position_ids": []}
        row["input_ids"] += ex["input_ids"]
        row["labels"] += [IGNORE_INDEX] + list(ex["labels"][1:])
        row["position_ids"] += list(range(n))
    if row["input_ids"]:
        packed.append(row)
    return packed


class Collator:
    """Pads a batch of examples on the right into tensors for a causal LM.

    Unpacked batches get an attention_mask. Packed batches (some row's position_ids restart at 0)
    get none, so transformers derives the block-diagonal mask from position_ids; their padding gets
    position_ids 0, 1, ... of its own, so it forms a separate (ignored) sequence.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = any(0 in list(f["position_ids"])[1:] for f in features)
        batch: dict[str, list[list[int]]] = {
            "input_ids": [],
            "labels": [],
            "position_ids": [],
            "attention_mask": [],
        }
        for f in features:
            n, pad = len(f["input_ids"]), length - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * pad)
            tail = list(range(pad)) if packed else list(range(n, n + pad))
            batch["position_ids"].append(list(f["position_ids"]) + tail)
            batch["attention_mask"].append([1] * n + [0] * pad)
        if packed:
            del batch["attention_mask"]
        return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


def collate(features: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Functional form of `Collator`: pad right, -100 labels on padding, mask only when unpacked."""
    return Collator(pad_token_id)(features)


# ---------------------------------------------------------------------------------------------- helpers
ENCODERS: dict[str, Callable[[dict, Any], tuple[list[int], list[int]]]] = {
    "text": encode_text,
    "instruction": encode_instruction,
    "chat": encode_chat,
}


def _tokenize(rows, path: Path, fmt: str, tokenizer, max_seq_len: int, packing: bool):
    """Encode, truncate, drop examples with nothing to learn, and maybe pack (all in one batched map)."""
    encode = ENCODERS[fmt]
    seen = {"dropped": 0}

    def encode_batch(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
        n_rows = len(next(iter(batch.values())))
        for j in range(n_rows):
            row = {k: v[j] for k, v in batch.items()}
            try:
                ids, labels = encode(row, tokenizer)
            except ValueError as err:  # a template problem found while rendering this row
                raise UserError(f"data error: {path} {_where(path, row[ROW_COLUMN])}: {err}") from None
            ids, labels = truncate(ids, labels, max_seq_len)
            if all(label == IGNORE_INDEX for label in labels[1:]):
                seen["dropped"] += 1
                continue  # nothing left to learn (label 0 is never a prediction target)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["position_ids"].append(list(range(len(ids))))
        if packing:
            examples = [dict(zip(out, values, strict=True)) for values in zip(*out.values(), strict=True)]
            packed = pack_examples(examples, max_seq_len)
            out = {k: [p[k] for p in packed] for k in out}
        return out

    with _quiet_datasets():
        examples = rows.map(
            encode_batch,
            batched=True,
            batch_size=1000,
            remove_columns=rows.column_names,
            load_from_cache_file=False,
            keep_in_memory=True,
            new_fingerprint=f"liger-{fmt}-{max_seq_len}-{packing}-{len(rows)}",
        )
    if seen["dropped"]:
        log.warning(
            "data: %s: dropped %d of %d examples with no trainable tokens left after truncation at "
            "max_seq_len=%d (raise data.max_seq_len to keep them)",
            *(path, seen["dropped"], len(rows), max_seq_len),
        )
    n_tokens = sum(len(x) for x in examples["input_ids"]) if len(examples) else 0
    packed_into = f", packed into {len(examples)} sequences" if packing else ""
    log.info("data: %s: %d examples%s, %d tokens", path, len(rows) - seen["dropped"], packed_into, n_tokens)
    if len(examples) == 0:
        raise UserError(
            f"data error: {path}: no example has a trainable token left after truncation at "
            f"max_seq_len={max_seq_len}; raise data.max_seq_len"
        )
    return examples


def _encode_with_prefix(tokenizer, text: str) -> tuple[list[int], list[bool]]:
    """Tokenize with the tokenizer's own leading special tokens (bos, if it adds one), none at the end.

    Returns the ids and which of them are added special tokens. Trailing added tokens (a tokenizer
    set to append eos) are dropped here because we append eos ourselves after the part to learn.
    """
    enc = tokenizer(text, add_special_tokens=True, return_special_tokens_mask=True)
    ids, special = list(enc["input_ids"]), [bool(s) for s in enc["special_tokens_mask"]]
    last_text_token = max((i for i, is_special in enumerate(special) if not is_special), default=len(ids) - 1)
    return ids[: last_text_token + 1], special[: last_text_token + 1]


def _check_tokenizer(tokenizer, fmt: str) -> None:
    if tokenizer.eos_token_id is None and fmt != "chat":
        raise UserError(
            "data error: the tokenizer has no eos token, so the model cannot learn to stop; set eos_token "
            "in the model's tokenizer_config.json"
        )
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "data error: format chat needs a tokenizer with a chat template, and this one has none; add a "
            "chat_template (chat_template.jinja or tokenizer_config.json) to the model folder, or use "
            "format: instruction"
        )


@contextlib.contextmanager
def _quiet_datasets():
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
    return {"text": ["text"], "instruction": ["instruction", "input", "output"], "chat": []}[fmt]


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
    messages = row.get("messages")
    if messages is None:
        return 'field "messages" is missing'
    if not isinstance(messages, list):
        return f'field "messages" must be a list, found {_type_name(messages)}'
    if not messages:
        return 'field "messages" is empty'
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return (
                f'field "messages[{i}]" must be an object with role and content, found {_type_name(message)}'
            )
        for key in ("role", "content"):
            value = message.get(key)
            if value is None:
                return f'field "messages[{i}].{key}" is missing'
            if not isinstance(value, str):
                return f'field "messages[{i}].{key}" must be a string, found {_type_name(value)}'
    if not any(m["role"] == "assistant" for m in messages):
        return 'field "messages" has no assistant turn, so there is nothing to learn'
    return None


def _where(path: Path, index: int) -> str:
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
