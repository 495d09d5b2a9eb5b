"""`liger data RECIPE`: what training will see, before paying for it.

The data goes through `liger_cli.data.prepare_data`, the function `liger train` calls, so the
counts, the labels and the warnings are those of the run. This module only reads the result:
a report (counts, tokens, the share learned, packing efficiency, a length histogram, warnings),
`--show N` (examples with the learned tokens highlighted and special tokens as written) and
`--jsonl OUT` (the examples exactly as training receives them before packing). Each source says
whether the tokenized-data cache had it (`cache: hit (path)`), built it, or is off; a mixture of
several sources says each one's share of the examples and of the learned tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from liger_cli.data.build import WARNINGS, Split
from liger_cli.data.columns import (
    flat_values,
    histogram,
    learned_per_example,
    list_lengths,
    numbers,
    pack_starts,
)
from liger_cli.data.encode import IGNORE_INDEX
from liger_cli.data.images import IMAGE_FILES, IMAGE_STARTS, IMAGE_TOKENS
from liger_cli.data.preference import PAIR_COLUMNS
from liger_cli.data.tools import tool_schemas
from liger_cli.errors import UserError

# Without colour (piped, NO_COLOR), learned tokens are written between these markers.
LEARNED_OPEN, LEARNED_CLOSE = "[[", "]]"
HISTOGRAM_BINS = 8
BAR_WIDTH = 40


def data_command(recipe_path: Path, overrides: list[str], show: int = 0, jsonl: Path | None = None) -> int:
    """Load, validate and tokenize the recipe's data as `liger train` does; print the report."""
    from rich.console import Console

    from liger_cli.data.build import prepare_data
    from liger_cli.data.tokenizer import load_tokenizer
    from liger_cli.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    if recipe.data.streaming:
        raise UserError(
            "liger data reads and tokenizes the whole train data, which data.streaming exists to avoid: "
            "check a sample instead (head -n 1000 FILE > sample.jsonl, then --set data.train=sample.jsonl "
            "--set data.streaming=false)"
        )
    tokenizer = load_tokenizer(recipe)
    data_logger = logging.getLogger("liger_cli.data")
    level = data_logger.level
    data_logger.setLevel(logging.ERROR)  # the report below says everything the log lines would
    try:
        train, evald = prepare_data(
            recipe.data, tokenizer, recipe.training.seed, tools=tool_schemas(recipe.rl)
        )
    finally:
        data_logger.setLevel(level)

    console = Console(highlight=False, soft_wrap=True)
    d = recipe.data
    console.print(
        f"data: {recipe_path} (format {d.format}, max_seq_len {d.max_seq_len}, "
        f"packing {'on' if d.packing else 'off'}"
        + (
            f", learn_turns {d.learn_turns}, learn_reasoning {str(d.learn_reasoning).lower()}"
            if d.format == "chat"
            else f", learn_reasoning {str(d.learn_reasoning).lower()}"
            if d.format in ("preference", "unpaired")
            else ""
        )
        + ")"
    )
    for name, split in (("train", train), ("eval", evald)):
        if split is not None:
            console.print()
            console.print(report_text(name, split))
    console.print()
    console.print(warnings_text([train, evald]))
    if show > 0:
        show_examples(console, train, tokenizer, show)
    if jsonl is not None:
        n = write_jsonl(jsonl, [("train", train), ("eval", evald)])
        console.print(f"\nwrote {n} {'pairs' if is_pairs(train) else 'examples'} to {jsonl}")
    return 0


def report_text(name: str, split: Split) -> str:
    """Counts, tokens, share learned, packing efficiency and a length histogram for one split (for a
    mixture: for each source, then each one's share of the mixture)."""
    if split.shares:
        parts = [report_text(f"{name} source {i + 1}", share.split) for i, share in enumerate(split.shares)]
        return "\n\n".join([*parts, mixture_text(name, split)])
    ex = split.examples
    if is_pairs(split):
        return pairs_text(name, split)
    if is_unpaired(split):
        return unpaired_text(name, split)
    lengths = list_lengths(ex, "input_ids")
    n_tokens = int(lengths.sum())
    n_learned = int(learned_per_example(ex, "labels").sum())
    dropped = sum(split.dropped.values())
    why = "".join(f"\n    dropped, {reason}: {n}" for reason, n in split.dropped.items())
    before = numbers(ex, "length")
    packed = (
        split.packing and split.dataset is not None
    )  # a mixture packs the mixed examples, not each source
    rows = len(split.dataset) if packed else len(pack_starts(lengths, split.max_seq_len))
    efficiency = n_tokens / (rows * split.max_seq_len)
    packing = (
        f"packing: {rows:,} rows of {split.max_seq_len} tokens, {efficiency:.1%} filled"
        if split.packing
        else f"packing: off (packing: true would fill {rows:,} rows of {split.max_seq_len} at {efficiency:.1%})"
    )
    lines = [
        f"{name}: {_shown(split.path)}",
        f"  examples: {split.rows:,} rows, {len(ex):,} kept, {split.truncated:,} truncated, {dropped:,} dropped{why}",
        f"  tokens: {n_tokens:,}, learned {n_learned:,} ({n_learned / max(n_tokens, 1):.1%})",
        f"  {packing}",
        _length_line("length (tokens before truncation)", before),
        *_histogram(before, split.max_seq_len),
        *_image_lines(ex, n_tokens),
        f"  cache: {split.cache}",
        _tokenized_line(split),
    ]
    return "\n".join(lines)


def _image_lines(ex, n_tokens: int) -> list[str]:
    """For image rows: how many images, how many tokens each became, and where they sit."""
    if IMAGE_TOKENS not in ex.column_names:
        return []
    counts, starts = flat_values(ex, IMAGE_TOKENS), flat_values(ex, IMAGE_STARTS)
    rows = int((list_lengths(ex, IMAGE_TOKENS) > 0).sum())
    if not len(counts):
        return ["  images: none kept"]
    image_tokens = int(counts.sum())
    return [
        f"  images: {len(counts):,} in {rows:,} of {len(ex):,} examples, {image_tokens:,} image tokens "
        f"({image_tokens / max(n_tokens, 1):.1%} of tokens, never learned)",
        _length_line("tokens per image", counts),
        _length_line("first token of each image", starts),
    ]


def mixture_text(name: str, split: Split) -> str:
    """Each source's share of the mixture: of its examples and of its learned tokens."""
    learned = [_learned_per_example(share.split) for share in split.shares]
    tokens = [int(per[share.taken].sum()) for per, share in zip(learned, split.shares, strict=True)]
    total_ex, total_tok = max(len(split.examples), 1), max(sum(tokens), 1)
    weights = sum(share.weight for share in split.shares)
    what = "pairs" if is_pairs(split) else "examples"
    lines = [f"{name} mixture: {len(split.examples):,} {what} per epoch from {len(split.shares)} sources"]
    for share, n_tokens in zip(split.shares, tokens, strict=True):
        kept = len(share.split.examples)
        lines.append(
            f"  {_shown(share.split.path)}: weight {share.weight:g} ({share.weight / weights:.1%}), "
            f"{len(share.taken):,} {what} ({len(share.taken) / total_ex:.1%}, {len(share.taken) / kept:.2f}x "
            f"its {kept:,}), learned tokens {n_tokens:,} ({n_tokens / total_tok:.1%})"
        )
    return "\n".join(lines)


def _learned_per_example(split: Split) -> np.ndarray:
    names = ["chosen_labels", "rejected_labels"] if is_pairs(split) else ["labels"]
    return sum(learned_per_example(split.examples, name) for name in names)


def source_path(split: Split, k: int) -> Path:
    """The file (or dataset) example k of the split came from."""
    return split.shares[split.source_of[k]].split.path if split.shares else split.path


def is_pairs(split: Split) -> bool:
    return "chosen_input_ids" in split.examples.column_names


def is_unpaired(split: Split) -> bool:
    return "label" in split.examples.column_names


def unpaired_text(name: str, split: Split) -> str:
    """Examples kept, truncated, dropped; desirable and undesirable; prompt and completion tokens."""
    from liger_cli.data.unpaired import label_note

    ex = split.examples
    dropped = sum(split.dropped.values())
    why = "".join(f"\n    dropped, {reason}: {n}" for reason, n in split.dropped.items())
    desirable = int(np.asarray(ex["label"], dtype=bool).sum())
    tokens = {part: int(numbers(ex, f"{part}_length").sum()) for part in ("prompt", "completion")}
    note = label_note(ex, _shown(split.path))
    lines = [
        f"{name}: {_shown(split.path)}",
        f"  examples: {split.rows:,} rows, {len(ex):,} kept, {split.truncated:,} truncated, {dropped:,} dropped{why}",
        f"  labels: {desirable:,} desirable (true), {len(ex) - desirable:,} undesirable (false)",
        *([f"  warning: {note.removeprefix('data: ')}"] if note else []),
        "  tokens (before truncation): " + ", ".join(f"{part} {n:,}" for part, n in tokens.items()),
        _length_line("length (tokens before truncation)", numbers(ex, "length")),
        *_histogram(numbers(ex, "length"), split.max_seq_len),
        f"  cache: {split.cache}",
        _tokenized_line(split),
    ]
    return "\n".join(lines)


def pairs_text(name: str, split: Split) -> str:
    """Pairs kept, truncated, dropped; prompt/chosen/rejected tokens; pairs whose answers are equal."""
    ex = split.examples
    dropped = sum(split.dropped.values())
    why = "".join(f"\n    dropped, {reason}: {n}" for reason, n in split.dropped.items())
    same = sum(1 for w in split.warnings if w.code == "CHOSEN_EQUALS_REJECTED")
    tokens = {part: int(numbers(ex, f"{part}_length").sum()) for part in ("prompt", "chosen", "rejected")}
    longer = numbers(ex, "length")
    lines = [
        f"{name}: {_shown(split.path)}",
        f"  pairs: {split.rows:,} rows, {len(ex):,} kept, {split.truncated:,} truncated, {dropped:,} dropped{why}",
        "  tokens (before truncation): " + ", ".join(f"{part} {n:,}" for part, n in tokens.items()),
        f"  pairs whose chosen == rejected: {same:,}",
        _length_line("length of the longer side (tokens before truncation)", longer),
        *_histogram(longer, split.max_seq_len),
        f"  cache: {split.cache}",
        _tokenized_line(split),
    ]
    return "\n".join(lines)


def warnings_text(splits: list[Split | None]) -> str:
    found = [w for s in splits if s is not None for w in s.warnings]
    if not found:
        return "warnings: none"
    lines = ["warnings:"]
    for code in WARNINGS:
        hits = [w for w in found if w.code == code]
        if hits:
            examples = len({(w.path, w.row) for w in hits})
            lines.append(f"  {code}: {examples} example(s), {WARNINGS[code]}")
            lines += [f"    {w.path.name} {_row(w)}, {w.field}: {w.message}" for w in hits[:3]]
    return "\n".join(lines)


def show_examples(console, split: Split, tokenizer, n: int) -> None:
    """Each example's tokens, the learned ones highlighted (or between [[ ]] without colour)."""
    from rich.text import Text

    plain = console.color_system is None or console.no_color
    special = set(getattr(tokenizer, "all_special_ids", [])) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
    }
    if plain:
        legend = f"learned tokens are between {LEARNED_OPEN} and {LEARNED_CLOSE}; special tokens as written"
    else:
        legend = "learned tokens in green; special tokens in magenta"
    what = "pairs" if is_pairs(split) else "examples"
    console.print(f"\nfirst {min(n, len(split.examples))} train {what} ({legend}):")
    for k in range(min(n, len(split.examples))):
        ex = split.examples[k]
        for side in ("chosen", "rejected") if is_pairs(split) else ("",):
            ids, labels = (
                ex[f"{side}_input_ids" if side else "input_ids"],
                ex[f"{side}_labels" if side else "labels"],
            )
            learned = [label != IGNORE_INDEX for label in labels]
            cut = f", truncated from {ex['length']}" if not side and ex["length"] > len(ids) else ""
            head = f"row {ex['row'] + 1}" + (f", {side}" if side else "")
            if "label" in ex:
                head += f", label {str(ex['label']).lower()}"
            console.print(
                f"\n--- {source_path(split, k).name} {head}: {len(ids)} tokens{cut}, {sum(learned[1:])} learned ---"
            )
            text, cursor = Text(), 0
            for i, (file, start, count) in enumerate(_images_of(ex)):  # each image's run as one mark
                console.print(f"image {i + 1}: {file}, tokens {start}-{start + count - 1} ({count} tokens)")
                _marked(ids[cursor:start], learned[cursor:start], tokenizer, special, plain, text)
                text.append(f"<image {i + 1}: {count} tokens>", style=None if plain else "bold cyan")
                cursor = start + count
            console.print(_marked(ids[cursor:], learned[cursor:], tokenizer, special, plain, text))


def _marked(ids, learned, tokenizer, special, plain: bool, text):
    """The tokens as text, learned runs between markers (plain) or highlighted."""
    keys = [(is_learned, not plain and i in special) for i, is_learned in zip(ids, learned, strict=True)]
    for start, end in _runs(keys):
        piece = tokenizer.decode(ids[start:end], skip_special_tokens=False)
        is_learned, is_special = learned[start], ids[start] in special
        if plain:
            text.append(f"{LEARNED_OPEN}{piece}{LEARNED_CLOSE}" if is_learned else piece)
        else:
            style = ("bold magenta" if is_special else "") + (" on dark_green" if is_learned else "")
            text.append(piece, style=style.strip() or None)
    return text


def _images_of(ex: dict) -> list[tuple[str, int, int]]:
    """(file as shown, first token, tokens) of each image of one example."""
    files = [str(_shown(Path(f))) if f else "data: URI" for f in ex.get(IMAGE_FILES) or []]
    return list(zip(files, ex.get(IMAGE_STARTS) or [], ex.get(IMAGE_TOKENS) or [], strict=True))


def write_jsonl(path: Path, splits) -> int:
    """One line per example before packing: split, row (1-based, in its file), input_ids, labels; for
    preference pairs chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels; for unpaired
    completions also label, kl_input_ids and kl_labels (the prompt with its KL partner's completion)."""
    n = 0
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = path.open("w", encoding="utf-8")
    except OSError as err:
        raise UserError(f"--jsonl {path}: cannot write it ({err.strerror}); give a file path") from None
    with f:
        for name, split in splits:
            if split is None:
                continue
            columns = [c for c in PAIR_COLUMNS if is_pairs(split)] or ["input_ids", "labels"]
            for k, ex in enumerate(split.examples):
                record = {"split": name, "row": ex["row"] + 1} | {c: ex[c] for c in columns}
                if is_unpaired(split):
                    kl = split.dataset[k]
                    record |= {"label": ex["label"], "kl_input_ids": kl["kl_input_ids"],
                               "kl_labels": kl["kl_labels"]}  # fmt: skip
                if split.shares:
                    record["source"] = str(source_path(split, k))
                f.write(json.dumps(record) + "\n")
                n += 1
    return n


def _shown(path: Path) -> Path:
    """The path relative to the working directory when it is below it (shorter, as the user typed it)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def _row(w) -> str:
    from liger_cli.data.files import where

    return where(w.path, w.row)


def _runs(keys: list) -> list[tuple[int, int]]:
    """(start, end) of each run of equal consecutive keys."""
    runs, start = [], 0
    for t in range(1, len(keys) + 1):
        if t == len(keys) or keys[t] != keys[start]:
            runs.append((start, t))
            start = t
    return runs


def _tokenized_line(split: Split) -> str:
    if not split.processes:
        return "  tokenized: read from the cache"
    return f"  tokenized: by {split.processes} process{'es' if split.processes > 1 else ''}"


def _length_line(what: str, lengths: np.ndarray) -> str:
    """min, median (the upper one of an even count, as sorted(...)[n // 2]) and max."""
    median = np.sort(lengths)[len(lengths) // 2]
    return f"  {what}: min {lengths.min()}, median {median}, max {lengths.max()}"


def _histogram(lengths: np.ndarray, max_seq_len: int) -> list[str]:
    """Text bars: HISTOGRAM_BINS equal bins up to max_seq_len, then one for the truncated."""
    width = -(-max_seq_len // HISTOGRAM_BINS)
    counts = histogram(lengths, max_seq_len, HISTOGRAM_BINS).tolist()
    top = max(counts) or 1
    labels = [f"{b * width + 1}-{min((b + 1) * width, max_seq_len)}" for b in range(HISTOGRAM_BINS)]
    labels.append(f"> {max_seq_len}")
    pad = max(len(label) for label in labels)
    return [
        f"    {label:>{pad}} | {'#' * round(BAR_WIDTH * c / top):<{BAR_WIDTH}} {c:,}"
        for b, (label, c) in enumerate(zip(labels, counts, strict=True))
        if c or (b < HISTOGRAM_BINS and b * width < max_seq_len)  # no empty bin past max_seq_len
    ]
