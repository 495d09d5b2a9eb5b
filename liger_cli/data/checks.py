"""What is trained is what is served: checks that an example's tokens are those the model sees when it
answers, and that its learned end survives collation. Each finds a warning (codes in liger_cli.data).

- TRAIN_INFER_MISMATCH (chat): at inference the prompt is
  `apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)` and the model writes
  turn i after it. So in the training example, the tokens before learned turn i must end with exactly
  those ids. They do not when the generation prompt differs from the assistant header the template
  renders in history, or when the text is the same but tokenizes differently at the boundary (a
  prompt ending in a space the whole conversation merges into the answer's first token: trained on
  " seven" after "Answer:", served "Answer: " and asked for "seven"). "The conversation so far" is
  messages[:i] as the row holds them; the template decides how it renders earlier turns (Qwen3
  drops the reasoning of turns before the last user message, in both renderings alike).
- DOUBLE_BOS (every format): the example starts with two bos tokens (a text that already starts
  with bos under a tokenizer that adds one; a chat template that writes bos_token twice).
- EOS_MASKED_AS_PAD (every format): the pad token is the eos token and the collation the run uses
  (`liger_cli.data.collate`) turns a learned eos into -100, as a collator that masks labels where
  `input_ids == pad_token_id` does. Ours pads labels with -100 by length, so a learned eos keeps its
  label even when pad == eos; the check runs the real collation on the examples, padded, and so
  fires only where the masking really happens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from liger_cli.data.encode import IGNORE_INDEX

SHOWN_TOKENS = 6  # tokens shown on each side of a TRAIN_INFER_MISMATCH
COLLATE_CHUNK = 64  # examples per probe batch of EOS_MASKED_AS_PAD


def train_infer_mismatches(
    tokenizer, messages, tools, ids, turns, prompts=None
) -> list[tuple[str, str, str]]:
    """(code, field, message) for each learned turn (message index, first token, end) whose preceding
    ids do not end with the ids of the generation prompt for the conversation before it. `prompts`:
    those ids by message index when the caller has them (None: not comparable); else rendered here."""
    warnings = []
    for i, first, _ in turns:
        if i is None:
            continue
        if prompts is not None:
            prompt = prompts.get(i)
        else:
            try:
                prompt = tokenizer.apply_chat_template(
                    messages[:i], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            except Exception:  # noqa: BLE001 - a template that cannot render the prefix: nothing to compare
                prompt = None
        if prompt is None:
            continue
        before, prompt = list(ids[:first]), list(prompt)
        if len(prompt) <= len(before) and before[len(before) - len(prompt) :] == prompt:
            continue
        same = common_suffix(before, prompt)
        said = (
            f"the tokens before this turn end with {_tail(tokenizer, before, same)} in training, but the "
            f"generation prompt for messages[:{i}] (add_generation_prompt=True) ends with "
            f"{_tail(tokenizer, prompt, same)}"
        )
        if tokenizer.decode(ids[: first + 1]).startswith(tokenizer.decode(prompt)):
            fix = (
                ": the same text, tokenized differently where the answer begins (its first token takes in "
                "the end of the prompt), so the model is trained on a context it is never served; end the "
                "template's assistant header and generation prompt with text that does not merge into the "
                "answer, such as a newline"
            )
        else:
            fix = (
                ", so the model is trained on a context it is never served; make the template's generation "
                "prompt exactly the assistant header it renders before earlier answers (spaces and newlines "
                "included)"
            )
        warnings.append(("TRAIN_INFER_MISMATCH", f"messages[{i}]", said + fix))
    return warnings


def double_bos(tokenizer, ids: Sequence[int]) -> str | None:
    """The DOUBLE_BOS message when the example starts with two bos tokens, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or list(ids[:2]) != [bos, bos]:
        return None
    return (
        f"the example starts with two bos tokens ({tokenizer.bos_token!r} twice), the model is served "
        "with one; remove bos_token from the data (the tokenizer adds it) or write it once in the chat "
        "template"
    )


def eos_masked_as_pad(
    tokenizer, examples: list[tuple[list[int], list[int], list]], collate: Callable
) -> list[tuple[int, str]]:
    """(example index, field) of each learned turn whose learned eos the collation masks as padding.

    `examples`: (input_ids, labels, turns as (field, first, end)) as training receives them. Each is
    collated beside a longer one, so it is padded as in a real batch.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None or pad != eos:
        return []
    found = []
    for start in range(0, len(examples), COLLATE_CHUNK):
        chunk = examples[start : start + COLLATE_CHUNK]
        longest = max(len(ids) for ids, _, _ in chunk) + 1
        features = [
            {"input_ids": ids, "labels": labels, "position_ids": list(range(len(ids)))}
            for ids, labels, _ in chunk
        ]
        features.append(
            {
                "input_ids": [pad] * longest,
                "labels": [IGNORE_INDEX] * longest,
                "position_ids": list(range(longest)),
            }
        )
        collated = collate(features, pad)["labels"].tolist()
        for k, (ids, labels, turns) in enumerate(chunk):
            for field, first, end in turns:
                learned_eos = [t for t in range(first, min(end, len(ids))) if labels[t] == eos]
                if any(collated[k][t] == IGNORE_INDEX for t in learned_eos):
                    found.append((start + k, field))
    return found


def eos_masked_message(tokenizer) -> str:
    return (
        f"the learned eos token {tokenizer.eos_token!r} is also the pad token, and the collation masks it "
        "with the padding (label -100), so the model never learns to stop; give the tokenizer a pad token "
        "of its own (pad_token in tokenizer_config.json, or model.tokenizer), or pad labels by length"
    )


def _tail(tokenizer, ids: list[int], same: int) -> str:
    """The last tokens of `ids` up to the first difference from the end, as a list of token texts."""
    shown = ids[max(0, len(ids) - same - SHOWN_TOKENS) :]
    pieces = [tokenizer.decode([t]) for t in shown[: SHOWN_TOKENS + min(same, 1)]]
    more = ", ..." if len(shown) > len(pieces) else ""
    opening = "[..., " if len(shown) < len(ids) else "["
    return f"{opening}{', '.join(repr(p) for p in pieces)}{more}]" if shown else "[] (nothing)"


def common_suffix(a: Sequence, b: Sequence) -> int:
    """How many items the two sequences (token ids, or the characters of two strings) end with alike."""
    n = 0
    for x, y in zip(reversed(a), reversed(b), strict=False):
        if x != y:
            break
        n += 1
    return n
