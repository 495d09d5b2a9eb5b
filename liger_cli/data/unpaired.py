"""Unpaired completions (KTO): `{"prompt", "completion", "label"}` rows -> one sequence each, plus the
mismatched sequence its KL term reads.

Two ways to write a row, as preference pairs have them:
- strings: the prompt (with the tokenizer's own prefix) followed by the completion and eos; the
  completion and its eos are learned;
- message lists, rendered with the tokenizer's chat template through format chat's own code, where only
  the final assistant turn is learned: `prompt` and `completion` lists, or one `messages` list whose
  last (assistant) turn is the completion.
`label` is true (a desirable completion) or false (an undesirable one). Truncation is the preference
format's (`truncate_sides`): the prompt loses tokens from its left, the completion stays whole where it can.

The KL term of KTO needs each prompt with a completion that does not answer it. Each example's partner
is fixed here, after the eval split and the mixture, by a seeded order of the split's examples (the
partner of an example is the next one in that order: never itself): the `kl_` columns hold the
example's prompt followed by its partner's completion (learned), truncated the same way. So what the
KL term reads depends on the data and the seed only, never on how a step is cut into micro-batches or
processes.
"""

from __future__ import annotations

import json
from pathlib import Path

from liger_cli.data.encode import IGNORE_INDEX, Encoded, _encode_with_prefix
from liger_cli.data.files import encoded_rows
from liger_cli.data.preference import prompt_length, truncate_sides
from liger_cli.data.processes import encode_table, tokenizing_processes
from liger_cli.data.split import DROP_COLUMN, WARNINGS_COLUMN
from liger_cli.errors import UserError

LABEL = "label"
UNPAIRED_COLUMNS = ("input_ids", "labels", LABEL, "kl_input_ids", "kl_labels")
"""What training receives per example (the `kl_` pair added by `with_partners`)."""


def encode_completions_of(rows: list[dict], tokenizer, learn_reasoning: bool = True) -> list:
    """Each row's Encoded (its completion learned), or the ValueError a template problem raised. The chat
    rows are encoded together (liger_cli.data.chat_batch)."""
    from liger_cli.data.chat_batch import encode_chats

    chats = [_chat_row(row) for row in rows if not isinstance(row.get("completion"), str)]
    encoded = iter(encode_chats(chats, tokenizer, "last", learn_reasoning))
    found = []
    for row in rows:
        if isinstance(row.get("completion"), str):
            prompt_ids, _ = _encode_with_prefix(tokenizer, row["prompt"])
            answer = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
            ids, n = prompt_ids + answer + [tokenizer.eos_token_id], len(prompt_ids)
            found.append(Encoded(ids, [IGNORE_INDEX] * n + ids[n:], [("completion", n, len(ids))]))
            continue
        enc = next(encoded)
        if not isinstance(enc, ValueError) and row.get("messages") is None:
            enc.warnings = [(code, f"completion: {at}", message) for code, at, message in enc.warnings]
        found.append(enc)
    return found


def _chat_row(row: dict) -> dict:
    messages = row["messages"] if row.get("messages") is not None else [*row["prompt"], *row["completion"]]
    return {"messages": list(messages), "tools": row.get("tools")}


def encode_unpaired(rows, path: Path, data_cfg, tokenizer):
    """Encode and truncate every row; a row with nothing left to learn is marked dropped. One row per
    source row: input_ids, labels, label, row, the prompt's and completion's lengths, length, and the
    DROP_COLUMN and WARNINGS_COLUMN that `split_of` reads."""
    max_len, path = data_cfg.max_seq_len, Path(path)
    learn_reasoning = getattr(data_cfg, "learn_reasoning", True)

    def encode_batch(batch: dict[str, list]) -> dict[str, list]:
        names = ("input_ids", "labels", LABEL, "row", "prompt_length", "completion_length", "length")
        out: dict[str, list] = {name: [] for name in (*names, DROP_COLUMN, WARNINGS_COLUMN)}
        encode = lambda r: encode_completions_of(r, tokenizer, learn_reasoning)  # noqa: E731
        for row, index, enc in encoded_rows(batch, encode, path):
            (kept,), _ = truncate_sides([enc], max_len, tokenizer.bos_token_id)
            drop = all(label == IGNORE_INDEX for label in kept.labels[1:])
            out["input_ids"].append([] if drop else kept.input_ids)
            out["labels"].append([] if drop else kept.labels)
            out[LABEL].append(bool(row[LABEL]))
            out["row"].append(index)
            out["prompt_length"].append(prompt_length(enc))
            out["completion_length"].append(len(enc.input_ids) - prompt_length(enc))
            out["length"].append(len(enc.input_ids))
            out[DROP_COLUMN].append("the completion is past max_seq_len" if drop else "")
            out[WARNINGS_COLUMN].append(json.dumps([list(w) for w in enc.warnings]))
        return out

    return encode_table(
        rows, encode_batch, f"liger-unpaired-{max_len}-{len(rows)}", tokenizing_processes(data_cfg, len(rows))
    )


def partners(n: int, seed: int) -> list[int]:
    """Each example's partner: the next one in a seeded order of the n examples (never itself)."""
    import numpy as np

    order = np.random.default_rng([seed, 41]).permutation(n).tolist()
    found = [0] * n
    for k, i in enumerate(order):
        found[i] = order[(k + 1) % n]
    return found


def with_partners(examples, seed: int, max_seq_len: int, bos_id: int | None, path) -> object:
    """The examples (a `datasets.Dataset`) with each one's KL sequence: its prompt, then its partner's
    completion (learned), truncated as the examples are (`kl_input_ids`, `kl_labels`)."""
    n = len(examples)
    if n < 2:
        raise UserError(
            f"data error: {path}: training.objective kto needs at least 2 examples in each split (its KL term "
            f"pairs each prompt with another example's completion), and this one has {n}; add rows"
        )
    found = kl_sequences(examples["input_ids"], examples["labels"], seed, max_seq_len, bos_id)
    examples = examples.add_column("kl_input_ids", [s.input_ids for s in found])
    return examples.add_column("kl_labels", [s.labels for s in found])


def kl_sequences(ids: list, labels: list, seed: int, max_seq_len: int, bos_id: int | None) -> list[Encoded]:
    """Each example's prompt followed by its partner's (`partners`) completion, the completion learned."""
    found = []
    for i, j in enumerate(partners(len(ids), seed)):
        p, q = (next(t for t, label in enumerate(labels[k]) if label != IGNORE_INDEX) for k in (i, j))
        mismatched = Encoded(list(ids[i][:p]) + list(ids[j][q:]), [IGNORE_INDEX] * p + list(labels[j][q:]))
        (kept,), _ = truncate_sides([mismatched], max_seq_len, bos_id)
        found.append(kept)
    return found


def label_note(examples, path) -> str | None:
    """A warning when every example has the same label: KTO then only pushes one way."""
    labels = examples[LABEL]
    if len(set(labels)) > 1:
        return None
    kind, other = ("true (desirable)", "false") if labels[0] else ("false (undesirable)", "true")
    return (
        f"data: {path}: every one of its {len(labels)} examples has label {kind}: KTO then only pushes "
        f"the model one way from its reference; add rows labelled {other}"
    )
