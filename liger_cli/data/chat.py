"""Chat rows -> token ids and labels: the assistant turns are learned, as the tokenizer's own chat
template renders them, whatever family it comes from.

Where an assistant turn is, tried in this order (one generic path, no per-family code):

1. The template marks it with `{% generation %}...{% endgeneration %}`: transformers'
   `return_assistant_tokens_mask` is used as it is.
2. The template is prefix-stable at the turn (ChatML, Llama-3, Gemma, Mistral): turn i is the text
   from the end of render(messages[:i], add_generation_prompt=True) to the end of
   render(messages[:i+1]), so it includes whatever closes a turn (`<|im_end|>`, `<|eot_id|>`,
   `<end_of_turn>`, `</s>`) and the model learns to stop.
3. It is not (Qwen3 drops the reasoning of turns before the last user message): the turn still
   starts where the generation prompt ends; its content ends where the whole conversation's
   rendering stops changing when only this turn's content is edited (one letter appended, compared
   from the end); and its closing text is what the template writes after the content when the turn
   ends the conversation. So the span is exactly what the full conversation renders for that turn.
   A template where even that fails is a ValueError naming the message (the caller adds file, row).

Then the recipe's options: learn every assistant turn or only the last, and learn the reasoning
blocks (`<think>...</think>`) or mask them. Character spans become token labels through the
tokenizer's offsets (a token with any character in a span is learned). Checks for the known masking
traps, and that the tokens before each learned turn are the generation prompt inference uses
(liger_cli.data.checks), produce warnings (codes in liger_cli.data) rather than errors: the data may
be what you meant.
"""

from __future__ import annotations

import re
import weakref

from liger_cli.data.checks import common_suffix, train_infer_mismatches
from liger_cli.data.encode import IGNORE_INDEX, Encoded

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
REASONING_BLOCK = re.compile(r"<think>(.*?)</think>\s*", re.S)


def encode_chat(row: dict, tokenizer, learn_turns: str = "all", learn_reasoning: bool = True) -> Encoded:
    """Chat row -> Encoded: ids, labels (assistant turns only), the learned turns and warnings.

    The reference: one rendering per turn (liger_cli.data.chat_batch renders once where it can, and
    must give exactly this)."""
    messages, tools = conversation(row)
    full = render(tokenizer, messages, tools)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    if GENERATION_BLOCK.search(tokenizer.chat_template or ""):
        turns = _marked_turns(tokenizer, messages, tools, ids, offsets)
    else:
        turns = [
            (i, *tokens_inside(offsets, start, end))
            for i, start, end in assistant_spans(tokenizer, messages, tools, full)
        ]
    return label_turns(tokenizer, messages, tools, full, ids, offsets, turns, learn_turns, learn_reasoning)


def label_turns(
    tokenizer, messages, tools, full, ids, offsets, turns, learn_turns, learn_reasoning, prompts=None
) -> Encoded:
    """The rendered, tokenized conversation and its assistant turns (message index, first token, end
    token) -> Encoded, with the recipe's options applied and the checks' warnings. `prompts`: the
    generation prompt's ids for each turn when the caller has them (else they are rendered here)."""
    turns = [t for t in turns if t[2] > t[1]]
    if learn_turns == "last":
        turns = turns[-1:]
    learned = [False] * len(ids)
    for _, first, end in turns:
        learned[first:end] = [True] * (end - first)

    warnings = []
    for block in REASONING_BLOCK.finditer(full):
        inside = [t for t, (a, b) in enumerate(offsets) if a < block.end() and b > block.start()]
        owner = next((i for i, first, end in turns if first <= inside[0] < end), None) if inside else None
        if not learn_reasoning:
            for t in inside:
                learned[t] = False
        elif inside and not block.group(1).strip() and any(learned[t] for t in inside):
            warnings.append(
                (
                    "EMPTY_REASONING_LEARNED",
                    _field(owner),
                    "an empty <think></think> block is learned, so the model learns to skip reasoning; "
                    "set data.learn_reasoning: false, or add the reasoning to the data",
                )
            )
    warnings += _learned_non_assistant(messages, full, offsets, learned, turns)
    labels = [i if keep else IGNORE_INDEX for i, keep in zip(ids, learned, strict=True)]
    turns = [(i, first, end) for i, first, end in turns if any(learned[first:end])]
    learned_turns = [(_field(i), first, end) for i, first, end in turns]
    warnings += _missing_turn_ends(tokenizer, ids, labels, learned_turns)
    warnings += train_infer_mismatches(tokenizer, messages, tools, ids, turns, prompts)
    return Encoded(ids, labels, learned_turns, warnings)


def conversation(row: dict) -> tuple[list[dict], list | None]:
    """The row's messages and tools as written: datasets reads JSON through Arrow, which gives every
    object every key seen anywhere in the file (null where missing); templates must not see those."""
    return _without_nulls(list(row["messages"])), _without_nulls(row.get("tools"))


def render(tokenizer, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
    """The template's text for `messages`; a template that refuses the conversation is a ValueError."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - jinja's raise_exception and template bugs alike
        raise ValueError(f'field "messages": the chat template failed on this conversation: {err}') from None


def assistant_spans(tokenizer, messages: list[dict], tools, full: str) -> list[tuple[int, int, int]]:
    """(message index, start, end) in `full` of each assistant turn, end-of-turn text included."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], tools, generation_prompt=True)
        if not full.startswith(prompt):
            raise ValueError(
                f'field "messages[{i}]": the chat template is not prefix-stable at message {i} (the '
                "messages before it, with the generation prompt, do not render as a prefix of the whole "
                "conversation), so the turn cannot be located; use a template that renders earlier turns "
                "the same way, or mark assistant turns with {% generation %}"
            )
        alone = render(tokenizer, messages[: i + 1], tools)
        end = len(alone) if full.startswith(alone) else _turn_end(tokenizer, messages, tools, i, full, alone)
        spans.append((i, len(prompt), end))
    return spans


def _turn_end(tokenizer, messages, tools, i: int, full: str, alone: str) -> int:
    """Where turn i ends in `full` when the template renders it differently there (see step 3)."""
    edited = [dict(m) for m in messages]
    content = edited[i].get("content") or ""
    if isinstance(content, list):  # text parts: the last one is edited
        parts = [dict(p) for p in content]
        last = next(p for p in reversed(parts) if p.get("type") == "text")
        last["text"] += "Q" if last["text"].endswith("Z") else "Z"
        edited[i]["content"] = parts
    else:
        edited[i]["content"] = content + ("Q" if content.endswith("Z") else "Z")
    content_end = len(full) - common_suffix(full, render(tokenizer, edited, tools))
    alone_edited = render(tokenizer, edited[: i + 1], tools)
    closer = alone[len(alone) - common_suffix(alone, alone_edited) :]
    if not full.startswith(closer, content_end):
        raise ValueError(
            f'field "messages[{i}]": the chat template closes this assistant turn differently inside the '
            f"conversation than at its end ({closer!r}), so the turn's end cannot be located; mark "
            "assistant turns with {% generation %} in the template"
        )
    return content_end + len(closer)


def _marked_turns(tokenizer, messages, tools, ids, offsets) -> list[tuple[int | None, int, int]]:
    """Token runs inside {% generation %} blocks, from transformers, paired with assistant messages."""
    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    if list(out["input_ids"]) != ids:
        raise ValueError(
            'field "messages": the template renders differently with return_assistant_tokens_mask'
        )
    runs, start = [], None
    for t, flag in enumerate([*out["assistant_masks"], 0]):
        if flag and start is None:
            start = t
        elif not flag and start is not None:
            runs.append((start, t))
            start = None
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(runs) != len(assistants):
        assistants = [None] * len(runs)
    return [(i, a, b) for i, (a, b) in zip(assistants, runs, strict=True)]


def tokens_inside(offsets, start: int, end: int) -> tuple[int, int]:
    """(first, end) token indices of the tokens with a character in [start, end). A token that
    straddles a boundary (" odd" after a prompt ending in "assistant:") is learned, as transformers'
    assistant mask does."""
    first = next((t for t, (a, b) in enumerate(offsets) if b > a and a < end and b > start), None)
    if first is None:
        return 0, 0
    last = next(t for t in range(len(offsets) - 1, first - 1, -1) if _overlaps(offsets[t], start, end))
    return first, last + 1


def _overlaps(offset: tuple[int, int], start: int, end: int) -> bool:
    a, b = offset
    return b > a and a < end and b > start


def _learned_non_assistant(messages, full, offsets, learned, turns) -> list[tuple[str, str, str]]:
    """System, user and tool contents that carry a learned token (a misplaced generation block)."""
    turn_ends = {i: offsets[end - 1][1] for i, _, end in turns if i is not None}
    learned_tokens = [t for t, keep in enumerate(learned) if keep]
    warnings, cursor = [], 0
    for k, message in enumerate(messages):
        if k in turn_ends:
            cursor = max(cursor, turn_ends[k])
        content = message.get("content")
        if message["role"] == "assistant" or not isinstance(content, str) or not content.strip():
            continue
        pos = full.find(content, cursor)
        if pos < 0:
            continue
        cursor = pos + len(content)
        if any(offsets[t][0] < cursor and offsets[t][1] > pos for t in learned_tokens):
            warnings.append(
                (
                    "NON_ASSISTANT_LEARNED",
                    f"messages[{k}]",
                    f"the {message['role']} turn is learned; the model would learn to write its own "
                    "prompts: fix the template's {% generation %} blocks",
                )
            )
    return warnings


def _missing_turn_ends(tokenizer, ids, labels, turns) -> list[tuple[str, str, str]]:
    """Learned turns whose last learned token (whitespace aside) is not eos or a special token."""
    enders, blank = _token_facts(tokenizer)
    warnings = []
    for field, first, end in turns:
        kept = [t for t in range(first, end) if labels[t] != IGNORE_INDEX]
        while kept and blank(ids[kept[-1]]):
            kept.pop()
        if kept and ids[kept[-1]] not in enders:
            warnings.append(
                (
                    "EOT_NOT_LEARNED",
                    field,
                    "the learned turn does not end with an end-of-turn or eos token, so the model never "
                    "learns to stop; include it in the template's {% generation %} block",
                )
            )
    return warnings


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_facts(tokenizer):
    """The ids that end a turn (eos and the special added tokens), and whether a token decodes to
    whitespace only; kept per tokenizer (and its vocabulary size), as every row asks the same."""
    size = len(tokenizer)
    found = _FACTS.get(tokenizer)
    if found is None or found[0] != size:
        enders = {tokenizer.eos_token_id} | {
            i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special
        }
        blanks: dict[int, bool] = {}

        def blank(token: int) -> bool:
            if token not in blanks:
                blanks[token] = not tokenizer.decode([token]).strip()
            return blanks[token]

        found = _FACTS[tokenizer] = (size, enders, blank)
    return found[1], found[2]


def _field(message_index: int | None) -> str:
    return "messages" if message_index is None else f"messages[{message_index}]"


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
