"""Training data, from the recipe's `data` section to what the training loop receives.

The flow: read and check every row of each source (liger_cli.data.sources, .files) -> encode it into token ids and labels
(liger_cli.data.encode for text and instruction rows, liger_cli.data.chat for chat rows) -> truncate to
max_seq_len, drop examples with nothing left to learn (cached per source: liger_cli.data.cache) -> the
eval split and the weighted mixture (liger_cli.data.mix) -> optional packing. `liger train` and
`liger data` both call `prepare_data`, so what the report shows is what training gets.

Formats:
- text: `{"text": ...}`; the loss covers the whole text (+ eos).
- instruction: `{"instruction": ..., "input": ... (optional), "output": ...}`; the loss covers only
  the output (+ eos).
- chat: `{"messages": [...], "tools": [...] (optional)}`, rendered with the tokenizer's own chat
  template; the loss covers the assistant turns (all, or only the last), their end-of-turn token
  included, with or without their reasoning. Other turns may carry images as content parts, encoded
  by the model's processor (liger_cli.data.image_rows); their examples keep the image tensors.

Problems that can be what the user meant are warnings with stable codes (WARNINGS), each naming
the file, the row and the field; problems that cannot be are UserErrors (exit 2).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

from liger_cli.data.cache import keep, look_up
from liger_cli.data.checks import double_bos, eos_masked_as_pad, eos_masked_message
from liger_cli.data.columns import numbers, pack_table
from liger_cli.data.encode import (
    IGNORE_INDEX,
    collate,
    encode_instruction,
    encode_text,
    truncate,
)
from liger_cli.data.files import FORMAT_FIELDS, encoded_rows
from liger_cli.data.images import IMAGE_COLUMNS, IMAGE_FILES, IMAGE_STARTS, IMAGES_COLUMN
from liger_cli.data.mix import fraction_orders, mixture
from liger_cli.data.preference import FIELDS_COLUMN, PAIR_COLUMNS
from liger_cli.data.processes import encode_table, tokenizing_processes
from liger_cli.data.sources import Source, read_rows, sources_of
from liger_cli.data.split import DROP_COLUMN, WARNINGS_COLUMN, DataWarning, Split, split_of
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
CUT_IMAGE = "truncation at max_seq_len cuts an image's tokens"
PACK_CHUNK = 1000  # examples packed together: a packed row never joins examples of two chunks


class DataConfig(Protocol):
    """The recipe's `data` section (liger_cli.recipe builds it; any object with these attributes works;
    learn_turns, learn_reasoning, cache (default true), cache_dir and num_proc may be absent). train and
    eval: a path, a Hub name, an entry {path, weight, format, split, subset} or a list of them."""

    train: object
    eval: object | None
    eval_fraction: float | None
    format: str
    max_seq_len: int
    packing: bool


def build_datasets(data_cfg: DataConfig, tokenizer, seed: int, tools: list[dict] | None = None):
    """Load, validate, tokenize (and maybe pack) the train and eval data: (train, eval or None), each a
    `datasets.Dataset` of `{"input_ids", "labels", "position_ids"}`. See `prepare_data`."""
    train, evald = prepare_data(data_cfg, tokenizer, seed, tools=tools)
    return train.dataset, evald.dataset if evald is not None else None


def build_eval_dataset(data_cfg: DataConfig, tokenizer, seed: int):
    """The eval data alone (a streaming run reads its train data as a stream): a Dataset or None."""
    _, evald = prepare_data(data_cfg, tokenizer, seed, include_train=False)
    return evald.dataset if evald is not None else None


def prepare_data(
    data_cfg: DataConfig, tokenizer, seed: int, include_train: bool = True, tools: list[dict] | None = None
) -> tuple[Split | None, Split | None]:
    """Every user mistake (missing file, unknown extension, bad JSON, missing or mistyped field, chat
    template problems) is a UserError naming the file, the row and the field, raised before any
    tokenizing starts (template problems: when that row is tokenized). `tools`: the JSON schemas prompts
    (format prompt) are rendered with, for a run whose model may call tools (liger_cli.data.tools).

    Each source is tokenized once into an encoded table (every row, kept or not), read from the cache
    when it holds one (liger_cli.data.cache); the eval split, the mixture of several sources
    (liger_cli.data.mix) and packing are applied to those tables, after the cache."""
    fmt = data_cfg.format
    if fmt not in FORMAT_FIELDS:
        raise UserError(f"data error: unknown data.format {fmt!r}; use one of: {', '.join(FORMAT_FIELDS)}")
    if data_cfg.eval is not None and data_cfg.eval_fraction is not None:
        raise UserError("data error: set data.eval or data.eval_fraction, not both")
    if fmt in PAIRED_KINDS and data_cfg.packing:
        what = {"preference": "preference pairs", "prompt": "prompts (format prompt)"}.get(fmt)
        what = what or "unpaired completions (each example is read with its KL partner)"
        raise UserError(f"data error: packing does not apply to {what}; set data.packing: false")
    train_sources, eval_sources = sources_of(data_cfg.train, fmt), sources_of(data_cfg.eval, fmt)
    if not include_train:  # a stream reads the train data itself (liger_cli.data.stream)
        train_sources = []
    for source in train_sources + eval_sources:
        if _kind(source.format) != _kind(fmt):
            raise UserError(
                f"data error: {source}: format {source.format} cannot be mixed with data.format {fmt}; "
                "preference pairs, unpaired completions, prompts and single examples train different objectives"
            )
        _check_tokenizer(tokenizer, source.format)

    # Every miss is read and validated before any tokenizing starts.
    entries = [look_up(source, data_cfg, tokenizer, tools) for source in train_sources + eval_sources]
    rows = {id(e): read_rows(e.source) for e in entries if e.table is None}
    for entry in entries:
        if entry.table is None:
            source_rows = rows.pop(id(entry))
            entry.processes = tokenizing_processes(data_cfg, len(source_rows))
            keep(entry, _encode(source_rows, entry.source, data_cfg, tokenizer, tools))

    train_parts, eval_parts = [], []
    for entry in entries[: len(train_sources)]:
        path, order = _shown_path(entry.source), None
        if data_cfg.eval_fraction is not None:
            order, eval_order = fraction_orders(len(entry.table), data_cfg.eval_fraction, seed, path)
            eval_parts.append(_part(entry, data_cfg, eval_order))
        train_parts.append(_part(entry, data_cfg, order))
    eval_parts += [_part(entry, data_cfg, None) for entry in entries[len(train_sources) :]]

    weights = [source.weight for source in train_sources]
    train = mixture(train_parts, weights, seed) if len(train_parts) > 1 else (train_parts or [None])[0]
    evald = None
    if eval_parts:
        evald = mixture(eval_parts, None, seed) if len(eval_parts) > 1 else eval_parts[0]
    for split in (train, evald):
        if split is not None:
            _finish(split, data_cfg, seed, tokenizer.bos_token_id)
            _log_warnings(split.warnings)
    return train, evald


PAIRED_KINDS = ("preference", "prompt", "unpaired")


def _kind(fmt: str) -> str:
    """Formats that mix: single examples together; pairs, unpaired completions and prompts only with
    their own kind."""
    return fmt if fmt in PAIRED_KINDS else "example"


def encoder(fmt: str, data_cfg: DataConfig, images: Path | None = None):
    """The function (rows, tokenizer) -> each row's Encoded, or the ValueError a template problem of
    that row raised, for the format and the recipe's chat options. `images`: the folder image paths
    are relative to, for a chat source with image rows (liger_cli.data.image_rows)."""
    if fmt == "chat":
        from liger_cli.data.chat_batch import encode_chats

        turns = getattr(data_cfg, "learn_turns", "all")
        reasoning = getattr(data_cfg, "learn_reasoning", True)
        if images is not None:
            from liger_cli.data.image_rows import image_chat_encoder

            return image_chat_encoder(images, turns, reasoning)
        return lambda rows, tokenizer: without_images(encode_chats(rows, tokenizer, turns, reasoning), rows)
    encode = {"text": encode_text, "instruction": encode_instruction}[fmt]

    def each(rows, tokenizer):
        found = []
        for row in rows:
            try:
                found.append(encode(row, tokenizer))
            except ValueError as err:
                found.append(err)
                break  # the caller stops at the first problem
        return found

    return each


def without_images(found: list, rows: list[dict]) -> list:
    """A row with an image part on a path that does not read images (a stream) is an error, never
    text with image placeholders and no pixels."""
    from liger_cli.data.images import image_parts

    return [
        ValueError(f'field "{image_parts(row["messages"])[0][0]}": rows with images cannot be streamed; '
                   "set data.streaming: false") if image_parts(row["messages"]) else enc
        for row, enc in zip(rows, found, strict=True)
    ]  # fmt: skip


def _shown_path(source: Source) -> Path:
    return source.path if isinstance(source.path, Path) else Path(str(source))


def _encode(rows, source: Source, data_cfg: DataConfig, tokenizer, tools: list[dict] | None = None):
    """The source's encoded table: one row per source row (see split.split_of)."""
    path = _shown_path(source)
    if source.format == "preference":
        from liger_cli.data.preference import encode_pairs

        return encode_pairs(rows, path, data_cfg, tokenizer)
    if source.format == "unpaired":
        from liger_cli.data.unpaired import encode_unpaired

        return encode_unpaired(rows, path, data_cfg, tokenizer)
    if source.format == "prompt":
        from liger_cli.data.prompts import encode_prompts

        return encode_prompts(rows, path, data_cfg, tokenizer, tools)
    return _encode_rows(rows, path, source.format, data_cfg, tokenizer)


def _part(entry, data_cfg: DataConfig, order: list[int] | None) -> Split:
    path = _shown_path(entry.source)
    if data_cfg.packing and IMAGES_COLUMN in entry.table.column_names:
        raise UserError(
            f"data error: {path}: packing does not apply to rows with images (a packed row would join "
            "several rows' image tensors); set data.packing: false"
        )
    split = split_of(entry.table, path, data_cfg.max_seq_len, data_cfg.packing, order, entry.status)
    split.processes = entry.processes
    pairs = entry.source.format == "preference"
    if len(split.examples) == 0:
        raise UserError(
            f"data error: {path}: no pair keeps a learned token on both sides after truncation at "
            f"max_seq_len={data_cfg.max_seq_len}; raise data.max_seq_len"
            if pairs
            else f"data error: {path}: no example has a trainable token left after truncation at "
            f"max_seq_len={data_cfg.max_seq_len}; raise data.max_seq_len"
        )
    if split.dropped.get(TRUNCATED_AWAY):
        log.warning(
            "data: %s: dropped %d of %d examples with no trainable tokens left after truncation at "
            "max_seq_len=%d (raise data.max_seq_len to keep them)",
            *(path, split.dropped[TRUNCATED_AWAY], split.rows, data_cfg.max_seq_len),
        )
    return split


def _finish(split: Split, data_cfg: DataConfig, seed: int = 0, bos_id: int | None = None) -> None:
    """The dataset training receives: the model's columns, packed when packing is on; unpaired
    completions with each one's KL sequence (liger_cli.data.unpaired)."""
    names = split.examples.column_names
    if "label" in names:
        from liger_cli.data.unpaired import UNPAIRED_COLUMNS, label_note, with_partners

        if (note := label_note(split.examples, split.path)) is not None:
            log.warning(note)
        examples = with_partners(split.examples, seed, data_cfg.max_seq_len, bos_id, split.path)
        split.dataset = examples.select_columns(list(UNPAIRED_COLUMNS))
        log.info("data: %s: %d unpaired examples", split.path, len(split.examples))
        return
    # (each image's first token goes along: eval samples cut prompts and keep the images they hold)
    kept = [c for c in ("input_ids", "labels", "position_ids", IMAGES_COLUMN, IMAGE_STARTS) if c in names]
    if "prompt_ids" in names:  # prompts (online RL), with the file row for the sampling keys
        kept = ["prompt_ids", "prompt", "fields", "row"]
    split.dataset = split.examples.select_columns(kept or [*PAIR_COLUMNS, FIELDS_COLUMN])
    max_len = data_cfg.max_seq_len
    if data_cfg.packing:
        split.dataset = pack_table(split.dataset, max_len, chunk=PACK_CHUNK)
    examples = split.examples
    n_tokens = int(numbers(examples, "length").sum()) if "input_ids" in examples.column_names else 0
    packed_into = f", packed into {len(split.dataset)} sequences" if data_cfg.packing else ""
    log.info("data: %s: %d examples%s, %d tokens", split.path, len(split.examples), packed_into, n_tokens)


def batch_encoder(path: Path, fmt: str, data_cfg: DataConfig, tokenizer, images: Path | None = None):
    """The function {column: values} -> encoded columns, one row each: encode and truncate every row; a
    row with nothing left to learn is marked dropped (DROP_COLUMN), every warning goes into its row's
    WARNINGS_COLUMN. The cached path maps it over a source's rows; the stream calls it on each chunk.
    `images` (see `encoder`) adds the image columns (liger_cli.data.images); a row whose truncation
    cuts an image is dropped, as the model needs every token of each image it is given."""
    encode, max_len = encoder(fmt, data_cfg, images), data_cfg.max_seq_len
    answer_field = {"text": "text", "instruction": "output", "chat": "messages"}[fmt]
    start_field = {"text": "text", "instruction": "instruction", "chat": "messages"}[fmt]

    def encode_batch(batch: dict[str, list]) -> dict[str, list]:
        names = ("input_ids", "labels", "position_ids", "row", "length", DROP_COLUMN, WARNINGS_COLUMN)
        out: dict[str, list] = {name: [] for name in names + (IMAGE_COLUMNS if images is not None else ())}
        notes, kept = [], []  # per row: its warnings; per kept row: (position, ids, labels, turns)
        for j, (_, index, enc) in enumerate(encoded_rows(batch, lambda r: encode(r, tokenizer), path)):
            found = [list(w) for w in enc.warnings]
            if (bos_message := double_bos(tokenizer, enc.input_ids)) is not None:
                found.append(["DOUBLE_BOS", start_field, bos_message])
            ids, labels = truncate(enc.input_ids, enc.labels, max_len)
            drop = ""
            if all(label == IGNORE_INDEX for label in labels[1:]):  # label 0 is never a prediction target
                if any(label != IGNORE_INDEX for label in enc.labels[1:]):
                    drop = TRUNCATED_AWAY
                else:
                    drop = "nothing learned"
                    found.append(["NOTHING_LEARNED", answer_field, "no token of this example is learned"])
                ids, labels = [], []
            elif len(enc.input_ids) > max_len and all(end > max_len for _, _, end in enc.turns):
                found.append([
                    "TRUNCATED_EVERY_ANSWER",
                    answer_field,
                    f"truncation at max_seq_len={max_len} cuts every answer ({len(enc.input_ids)} tokens), "
                    "so the model never sees one end; raise data.max_seq_len",
                ])  # fmt: skip
            if (
                not drop
                and images is not None
                and any(
                    s + n > max_len
                    for s, n in zip(getattr(enc, "starts", []), getattr(enc, "counts", []), strict=True)
                )
            ):
                drop, ids, labels = CUT_IMAGE, [], []
            if images is not None:  # a dropped row keeps its files: the cache's image key covers them
                for name, value in zip(IMAGE_COLUMNS, _image_values(enc), strict=True):
                    out[name].append(value if not drop or name == IMAGE_FILES else type(value)())
            if not drop:
                kept.append((j, ids, labels, enc.turns))
            notes.append(found)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["position_ids"].append(list(range(len(ids))))
            out["row"].append(index)
            out["length"].append(len(enc.input_ids) if not drop else 0)
            out[DROP_COLUMN].append(drop)
        examples = [(ids, labels, turns) for _, ids, labels, turns in kept]
        for k, field_ in eos_masked_as_pad(tokenizer, examples, collate):
            notes[kept[k][0]].append(["EOS_MASKED_AS_PAD", field_, eos_masked_message(tokenizer)])
        out[WARNINGS_COLUMN] = [json.dumps(found) for found in notes]
        return out

    return encode_batch


def _image_values(enc) -> tuple:
    """The image columns' values for an encoded row (empty for a row without images)."""
    return (
        getattr(enc, "images", b""),
        getattr(enc, "files", []),
        getattr(enc, "starts", []),
        getattr(enc, "counts", []),
    )


def _encode_rows(rows, path: Path, fmt: str, data_cfg: DataConfig, tokenizer):
    """Encode and truncate every row (`batch_encoder`), batches of 1000 rows through `datasets`' map."""
    from liger_cli.data.images import has_images

    images = (path.parent if path.is_file() else path) if fmt == "chat" and has_images(rows) else None
    encode_batch, max_len = batch_encoder(path, fmt, data_cfg, tokenizer, images), data_cfg.max_seq_len
    fingerprint = f"liger-{fmt}-{max_len}-{len(rows)}"
    return encode_table(rows, encode_batch, fingerprint, tokenizing_processes(data_cfg, len(rows)))


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
