"""Training data, from the recipe's `data` section to what the training loop receives.

The flow: read and check every row (liger_cli.data.files) -> encode it into token ids and labels
(liger_cli.data.encode for text and instruction rows, liger_cli.data.chat for chat rows) -> truncate to
max_seq_len, drop examples with nothing left to learn -> optional packing. `liger train` and
`liger data` both call `prepare_data`, so what the report shows is what training gets.

Formats:
- text: `{"text": ...}`; the loss covers the whole text (+ eos).
- instruction: `{"instruction": ..., "input": ... (optional), "output": ...}`; the loss covers only
  the output (+ eos).
- chat: `{"messages": [...], "tools": [...] (optional)}`, rendered with the tokenizer's own chat
  template; the loss covers the assistant turns (all, or only the last), their end-of-turn token
  included, with or without their reasoning.

Problems that can be what the user meant are warnings with stable codes (WARNINGS), each naming
the file, the row and the field; problems that cannot be are UserErrors (exit 2).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from liger_cli.data.checks import double_bos, eos_masked_as_pad, eos_masked_message
from liger_cli.data.encode import (
    IGNORE_INDEX,
    collate,
    encode_instruction,
    encode_text,
    pack_examples,
    truncate,
)
from liger_cli.data.files import (
    FORMAT_FIELDS,
    ROW_COLUMN,
    load_rows,
    quiet_datasets,
    split_eval_fraction,
    where,
)
from liger_cli.data.split import DataWarning, Split
from liger_cli.errors import UserError

__all__ = ["IGNORE_INDEX", "WARNINGS", "build_datasets", "collate", "prepare_data"]

log = logging.getLogger(__name__)

WARNINGS = {
    "NOTHING_LEARNED": "an example with no learned token (dropped)",
    "EOT_NOT_LEARNED": "a learned turn that does not end with its end-of-turn or eos token",
    "NON_ASSISTANT_LEARNED": "a system, user or tool turn with learned tokens",
    "EMPTY_REASONING_LEARNED": "an empty <think></think> block that is learned",
    "TRUNCATED_EVERY_ANSWER": "truncation at max_seq_len cuts every answer of a kept example",
    "TRAIN_INFER_MISMATCH": "the tokens before a learned turn are not the generation prompt inference uses",
    "DOUBLE_BOS": "an example that starts with two bos tokens",
    "EOS_MASKED_AS_PAD": "a learned eos that is the pad token and that the collation masks as padding",
    "CHOSEN_EQUALS_REJECTED": "a preference pair whose chosen and rejected answers are the same tokens",
}

TRUNCATED_AWAY = "every learned token is past max_seq_len"


class DataConfig(Protocol):
    """The recipe's `data` section (liger_cli.recipe builds it; any object with these attributes works;
    learn_turns and learn_reasoning may be absent)."""

    train: Path
    eval: Path | None
    eval_fraction: float | None
    format: str
    max_seq_len: int
    packing: bool


def build_datasets(data_cfg: DataConfig, tokenizer, seed: int):
    """Load, validate, tokenize (and maybe pack) the train and eval data: (train, eval or None), each a
    `datasets.Dataset` of `{"input_ids", "labels", "position_ids"}`. See `prepare_data`."""
    train, evald = prepare_data(data_cfg, tokenizer, seed)
    return train.dataset, evald.dataset if evald is not None else None


def prepare_data(data_cfg: DataConfig, tokenizer, seed: int) -> tuple[Split, Split | None]:
    """Every user mistake (missing file, unknown extension, bad JSON, missing or mistyped field, chat
    template problems) is a UserError naming the file, the row and the field, raised before any
    tokenizing starts (template problems: when that row is tokenized)."""
    fmt = data_cfg.format
    if fmt not in FORMAT_FIELDS:
        raise UserError(f"data error: unknown data.format {fmt!r}; use one of: {', '.join(FORMAT_FIELDS)}")
    if data_cfg.eval is not None and data_cfg.eval_fraction is not None:
        raise UserError("data error: set data.eval or data.eval_fraction, not both")
    if fmt == "preference" and data_cfg.packing:
        raise UserError("data error: packing does not apply to preference pairs; set data.packing: false")
    _check_tokenizer(tokenizer, fmt)

    train_path = Path(data_cfg.train)
    train_rows = load_rows(train_path, fmt)
    eval_path = Path(data_cfg.eval) if data_cfg.eval is not None else None
    eval_rows = load_rows(eval_path, fmt) if eval_path is not None else None
    if data_cfg.eval_fraction is not None:
        train_rows, eval_rows = split_eval_fraction(train_rows, data_cfg.eval_fraction, seed, train_path)
        eval_path = train_path

    tokenize = _tokenize
    if fmt == "preference":
        from liger_cli.data.preference import tokenize_pairs as tokenize
    train = tokenize(train_rows, train_path, data_cfg, tokenizer)
    evald = tokenize(eval_rows, eval_path, data_cfg, tokenizer) if eval_rows is not None else None
    for split in (train, evald):
        if split is not None:
            _log_warnings(split.warnings)
    return train, evald


def encoder(data_cfg: DataConfig):
    """The function row -> Encoded for the recipe's format and chat options."""
    if data_cfg.format == "chat":
        from liger_cli.data.chat import encode_chat

        turns = getattr(data_cfg, "learn_turns", "all")
        reasoning = getattr(data_cfg, "learn_reasoning", True)
        return lambda row, tokenizer: encode_chat(row, tokenizer, turns, reasoning)
    return {"text": encode_text, "instruction": encode_instruction}[data_cfg.format]


def _tokenize(rows, path: Path, data_cfg: DataConfig, tokenizer) -> Split:
    """Encode, truncate, drop examples with nothing to learn, note warnings, and maybe pack."""
    encode, max_len = encoder(data_cfg), data_cfg.max_seq_len
    split = Split(path, len(rows), None, None, max_len, data_cfg.packing)
    answer_field = {"text": "text", "instruction": "output", "chat": "messages"}[data_cfg.format]
    start_field = {"text": "text", "instruction": "instruction", "chat": "messages"}[data_cfg.format]

    def warn(code: str, row: int, field_: str, message: str) -> None:
        split.warnings.append(DataWarning(code, path, row, field_, message))

    def encode_batch(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "row": [], "length": []}
        kept_turns = []
        for j in range(len(batch[ROW_COLUMN])):
            row = {k: v[j] for k, v in batch.items()}
            index = row[ROW_COLUMN]
            try:
                enc = encode(row, tokenizer)
            except ValueError as err:  # a template problem found while rendering this row
                raise UserError(f"data error: {path} {where(path, index)}: {err}") from None
            for code, field_, message in enc.warnings:
                warn(code, index, field_, message)
            if (bos_message := double_bos(tokenizer, enc.input_ids)) is not None:
                warn("DOUBLE_BOS", index, start_field, bos_message)
            ids, labels = truncate(enc.input_ids, enc.labels, max_len)
            if all(label == IGNORE_INDEX for label in labels[1:]):  # label 0 is never a prediction target
                if any(label != IGNORE_INDEX for label in enc.labels[1:]):
                    _count(split.dropped, TRUNCATED_AWAY)
                else:
                    _count(split.dropped, "nothing learned")
                    warn("NOTHING_LEARNED", index, answer_field, "no token of this example is learned")
                continue
            if len(enc.input_ids) > max_len:
                split.truncated += 1
                if all(end > max_len for _, _, end in enc.turns):
                    warn(
                        "TRUNCATED_EVERY_ANSWER",
                        index,
                        answer_field,
                        f"truncation at max_seq_len={max_len} cuts every answer ({len(enc.input_ids)} tokens), "
                        "so the model never sees one end; raise data.max_seq_len",
                    )
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["position_ids"].append(list(range(len(ids))))
            out["row"].append(index)
            out["length"].append(len(enc.input_ids))
            kept_turns.append(enc.turns)
        examples = list(zip(out["input_ids"], out["labels"], kept_turns, strict=True))
        for k, field_ in eos_masked_as_pad(tokenizer, examples, collate):
            warn("EOS_MASKED_AS_PAD", out["row"][k], field_, eos_masked_message(tokenizer))
        return out

    with quiet_datasets():
        split.examples = rows.map(
            encode_batch,
            batched=True,
            batch_size=1000,
            remove_columns=rows.column_names,
            load_from_cache_file=False,
            keep_in_memory=True,
            new_fingerprint=f"liger-{data_cfg.format}-{max_len}-{len(rows)}",
        )
    n_dropped = split.rows - len(split.examples)
    if split.dropped.get(TRUNCATED_AWAY):
        log.warning(
            "data: %s: dropped %d of %d examples with no trainable tokens left after truncation at "
            "max_seq_len=%d (raise data.max_seq_len to keep them)",
            *(path, split.dropped[TRUNCATED_AWAY], split.rows, max_len),
        )
    if len(split.examples) == 0:
        raise UserError(
            f"data error: {path}: no example has a trainable token left after truncation at "
            f"max_seq_len={max_len}; raise data.max_seq_len"
        )
    split.dataset = split.examples.select_columns(["input_ids", "labels", "position_ids"])
    if data_cfg.packing:
        with quiet_datasets():
            split.dataset = split.dataset.map(
                _pack_batch(max_len),
                batched=True,
                remove_columns=split.dataset.column_names,
                batch_size=1000,
                load_from_cache_file=False,
                keep_in_memory=True,
                new_fingerprint=f"liger-packed-{data_cfg.format}-{max_len}-{len(rows)}",
            )
    n_tokens = sum(split.examples["length"]) if len(split.examples) else 0
    packed_into = f", packed into {len(split.dataset)} sequences" if data_cfg.packing else ""
    log.info("data: %s: %d examples%s, %d tokens", path, split.rows - n_dropped, packed_into, n_tokens)
    return split


def _pack_batch(max_seq_len: int):
    def pack(batch: dict[str, list]) -> dict[str, list]:
        examples = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        packed = pack_examples(examples, max_seq_len)
        return {k: [p[k] for p in packed] for k in batch}

    return pack


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _log_warnings(warnings: list[DataWarning]) -> None:
    """One line per code: how many examples, and the first one in full."""
    by_code: dict[str, list[DataWarning]] = {}
    for w in warnings:
        by_code.setdefault(w.code, []).append(w)
    for found in by_code.values():
        more = f" (and {len(found) - 1} more examples)" if len(found) > 1 else ""
        log.warning("data warning %s%s", found[0], more)


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
