"""Preference pairs: `{"prompt", "chosen", "rejected"}` rows -> two sequences that share one prompt.

Two ways to write a pair, never mixed within a row:
- strings: the prompt (with the tokenizer's own prefix, as instruction rows get it) followed by the
  answer and eos; the answer and its eos are learned;
- message lists, rendered with the tokenizer's chat template through format chat's own code
  (`encode_chat`), where only the final assistant turn of chosen/rejected is learned. With no
  `prompt` key, chosen and rejected are whole conversations that share every message but the last:
  that shared part is the prompt (an "implicit prompt").

Truncation keeps both answers whole where it can: the prompt loses tokens from its left (a leading
BOS stays), the same number on both sides so both answers follow the same context; only an answer
longer than the room left (the prompt keeps at least half of max_seq_len) is cut at its end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from liger_cli.data.encode import IGNORE_INDEX, Encoded, _encode_with_prefix
from liger_cli.data.files import ROW_COLUMN, encoded_rows
from liger_cli.data.processes import encode_table, tokenizing_processes
from liger_cli.data.split import DROP_COLUMN, WARNINGS_COLUMN

SIDES = ("chosen", "rejected")
PAIR_COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
FIELDS_COLUMN = "fields"
"""A pair's other fields (a JSON object), e.g. a reward model's margin (`reward.margin_field`)."""


# --- encoding one pair ----------------------------------------------------------------------------------


@dataclass
class EncodedPair:
    chosen: Encoded
    rejected: Encoded


def encode_pair(row: dict, tokenizer, learn_reasoning: bool = True) -> EncodedPair:
    """One row -> the chosen and rejected sequences, each with only its answer learned."""
    found = encode_pairs_of([row], tokenizer, learn_reasoning)[0]
    if isinstance(found, ValueError):
        raise found
    return found


def encode_pairs_of(rows: list[dict], tokenizer, learn_reasoning: bool = True) -> list:
    """Each row's EncodedPair, or the ValueError a template problem of its chosen (else rejected) side
    raised. The chat sides of all rows are encoded together (liger_cli.data.chat_batch)."""
    from liger_cli.data.chat_batch import encode_chats

    chats = [chat for row in rows if not isinstance(row["chosen"], str) for chat, _ in _chat_sides(row)]
    encoded = iter(encode_chats(chats, tokenizer, "last", learn_reasoning))
    found = []
    for row in rows:
        if isinstance(row["chosen"], str):
            try:
                found.append(_text_pair(row, tokenizer))
            except ValueError as err:
                found.append(err)
            continue
        sides = []
        for side, (_, answer) in zip(SIDES, _chat_sides(row), strict=True):
            enc = next(encoded)
            if not isinstance(enc, ValueError):
                field_ = f"{side}[{len(answer) - 1}]"
                enc.turns = [(field_, first, end) for _, first, end in enc.turns]
                enc.warnings = [(code, f"{side}: {at}", message) for code, at, message in enc.warnings]
            sides.append(enc)
        errors = [enc for enc in sides if isinstance(enc, ValueError)]
        found.append(errors[0] if errors else EncodedPair(*sides))
    return found


def _text_pair(row: dict, tokenizer) -> EncodedPair:
    prompt_ids, _ = _encode_with_prefix(tokenizer, row["prompt"])
    sides = []
    for side in SIDES:
        answer = tokenizer(row[side], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, n = prompt_ids + answer, len(prompt_ids)
        sides.append(Encoded(ids, [IGNORE_INDEX] * n + answer, [(side, n, len(ids))]))
    return EncodedPair(*sides)


def _chat_sides(row: dict) -> list[tuple[dict, list]]:
    """The chosen and rejected conversations as chat rows, each with its answer's messages."""
    prompt = list(row["prompt"]) if row.get("prompt") is not None else list(row["chosen"][:-1])
    sides = []
    for side in SIDES:
        answer = list(row[side]) if row.get("prompt") is not None else [row[side][-1]]
        sides.append(({"messages": prompt + answer, "tools": row.get("tools")}, answer))
    return sides


def prompt_length(enc: Encoded) -> int:
    """Tokens before the first learned one."""
    return next((t for t, label in enumerate(enc.labels) if label != IGNORE_INDEX), len(enc.labels))


def truncate_pair(pair: EncodedPair, max_seq_len: int, bos_id: int | None) -> tuple[EncodedPair, bool]:
    """Cut both sides to max_seq_len as the module docstring says; (the pair, whether anything was cut)."""
    sides, cut = truncate_sides([pair.chosen, pair.rejected], max_seq_len, bos_id)
    return EncodedPair(*sides), cut


def truncate_sides(sides: list[Encoded], max_seq_len: int, bos_id: int | None) -> tuple[list[Encoded], bool]:
    """Sequences that share one context cut to max_seq_len together: the prompt loses the same number of
    tokens from its left on every side (a leading BOS stays, the prompt keeps at least half of
    max_seq_len), then a side still too long is cut at its end; (the sides, whether anything was cut)."""
    longest = max(len(enc.input_ids) for enc in sides)
    if longest <= max_seq_len:
        return sides, False
    prompts = [prompt_length(enc) for enc in sides]
    keep_bos = bos_id is not None and all(enc.input_ids[:1] == [bos_id] for enc in sides)
    floor = min(min(prompts), max(max_seq_len // 2, int(keep_bos)))  # the prompt keeps at least this much
    cut = max(0, min(longest - max_seq_len, min(prompts) - floor))
    found = []
    for enc in sides:
        start = int(keep_bos)
        ids = enc.input_ids[:start] + enc.input_ids[start + cut :]
        labels = enc.labels[:start] + enc.labels[start + cut :]
        turns = [(f, max(start, first - cut), end - cut) for f, first, end in enc.turns]
        found.append(Encoded(ids[:max_seq_len], labels[:max_seq_len], turns, enc.warnings))
    return found, True


# --- a file of pairs ------------------------------------------------------------------------------------


def encode_pairs(rows, path: Path, data_cfg, tokenizer):
    """Encode and truncate every pair; a pair with a side that has nothing left to learn is marked
    dropped. One row per pair: the four PAIR_COLUMNS, row and lengths, and the DROP_COLUMN and
    WARNINGS_COLUMN that `split_of` reads."""
    max_len = data_cfg.max_seq_len
    path = Path(path)
    learn_reasoning = getattr(data_cfg, "learn_reasoning", True)

    def encode_batch(batch: dict[str, list]) -> dict[str, list]:
        names = (*PAIR_COLUMNS, "row", "prompt_length", "chosen_length", "rejected_length", "length",
                 FIELDS_COLUMN)  # fmt: skip
        out: dict[str, list] = {name: [] for name in (*names, DROP_COLUMN, WARNINGS_COLUMN)}
        for row, index, pair in encoded_rows(
            batch, lambda r: encode_pairs_of(r, tokenizer, learn_reasoning), path
        ):
            found = [list(w) for enc in (pair.chosen, pair.rejected) for w in enc.warnings]
            answers = [enc.input_ids[prompt_length(enc) :] for enc in (pair.chosen, pair.rejected)]
            if answers[0] == answers[1]:
                found.append(["CHOSEN_EQUALS_REJECTED", "chosen", "chosen and rejected are the same answer: "
                              "the pair teaches nothing; fix or remove the row"])  # fmt: skip
            whole, _ = truncate_pair(pair, max_len, tokenizer.bos_token_id)
            drop = any(
                all(label == IGNORE_INDEX for label in enc.labels[1:])
                for enc in (whole.chosen, whole.rejected)
            )
            for side, enc in zip(SIDES, (whole.chosen, whole.rejected), strict=True):
                out[f"{side}_input_ids"].append([] if drop else enc.input_ids)
                out[f"{side}_labels"].append([] if drop else enc.labels)
            out["row"].append(index)
            others = {k: v for k, v in row.items() if k not in (*SIDES, "prompt", ROW_COLUMN)}
            out[FIELDS_COLUMN].append(json.dumps(others, ensure_ascii=False, default=str))
            out["prompt_length"].append(prompt_length(pair.chosen))
            out["chosen_length"].append(len(answers[0]))
            out["rejected_length"].append(len(answers[1]))
            out["length"].append(max(len(pair.chosen.input_ids), len(pair.rejected.input_ids)))
            out[DROP_COLUMN].append("an answer is past max_seq_len" if drop else "")
            out[WARNINGS_COLUMN].append(json.dumps(found))
        return out

    return encode_table(
        rows,
        encode_batch,
        f"liger-preference-{max_len}-{len(rows)}",
        tokenizing_processes(data_cfg, len(rows)),
    )
