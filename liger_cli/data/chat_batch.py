"""Chat rows in batches: one rendering per row, and one batched call of the fast tokenizer, where the
template allows it; the reference (liger_cli.data.chat.encode_chat) everywhere else.

The reference finds assistant turn i by rendering the conversation before it twice (with and without
the generation prompt), and renders it once more for the train/infer check. A template that renders
each message inside one loop over `messages`, in order, with nothing after the loop (ChatML, Llama-3,
Gemma, Mistral as the tests ship them) renders messages[:k] as exactly the text it has written when
it takes message k. So each conversation is rendered once while the template is watched taking its
messages (character offsets of the turns); turn i starts after the generation prompt at message i's
offset and ends at message i+1's; the offsets become tokens through the tokenizer's offset mapping.
Every conversation of the batch is tokenized in one call, the train/infer check's prompts (the text
before each turn) in another.

Where it is used, else the reference decides the row (its errors included):
- per tokenizer: no {% generation %} markers; the loop does not look at what comes after the current
  message (`loop.last`, `loop.nextitem`, `loop.length`, `loop.revindex`, `messages | length`); and a
  probe conversation gives the reference's result;
- per row: the template took every message once, in order (a slice such as messages[1:] counts), and
  wrote nothing after its loop; no assistant message comes first; the generation prompt stands at
  each assistant message's offset;
- per batch: its first row gives the reference's result both ways; if not, that batch and the rest of
  the process use the reference, with a log line.
tests/test_chat_batch.py proves the two give identical ids, labels, turns and warnings on every
template the tests ship, over random conversations.
"""

from __future__ import annotations

import logging
import re
import weakref
from dataclasses import dataclass

from liger_cli.data.chat import (
    GENERATION_BLOCK,
    conversation,
    encode_chat,
    label_turns,
    render,
    tokens_inside,
)

log = logging.getLogger(__name__)

LOOKS_AHEAD = re.compile(r"loop\s*\.\s*(last|nextitem|length|revindex0?)\b|messages\s*\|\s*length\b")
PROBE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "One?"},
    {"role": "assistant", "content": "One."},
    {"role": "user", "content": "Two?"},
    {"role": "assistant", "content": "Two."},
]

_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (template, _Shape or None)


def encode_chats(rows: list[dict], tokenizer, learn_turns: str = "all", learn_reasoning: bool = True) -> list:
    """Each row's Encoded, or the ValueError the reference raises for it (the caller names the row)."""
    shape = _shape(tokenizer)
    if shape is None or not rows:
        return [_reference(row, tokenizer, learn_turns, learn_reasoning) for row in rows]
    drafts = [shape.draft(row, tokenizer) for row in rows]
    found = _encode_drafts(drafts, tokenizer, learn_turns, learn_reasoning)
    out = [
        enc if enc is not None else _reference(row, tokenizer, learn_turns, learn_reasoning)
        for row, enc in zip(rows, found, strict=True)
    ]
    first = _reference(rows[0], tokenizer, learn_turns, learn_reasoning)
    if found[0] is not None and not _same(found[0], first):
        log.warning(
            "data: the one-rendering path disagrees with the per-turn one on a row under this chat "
            "template; using the per-turn path for the rest of this run"
        )
        _SHAPES[tokenizer] = (_template(tokenizer), None)
        return [_reference(row, tokenizer, learn_turns, learn_reasoning) for row in rows]
    return out


def _reference(row, tokenizer, learn_turns, learn_reasoning):
    try:
        return encode_chat(row, tokenizer, learn_turns, learn_reasoning)
    except ValueError as err:
        return err


def _same(a, b) -> bool:
    if isinstance(a, ValueError) or isinstance(b, ValueError):
        return False
    return (a.input_ids, a.labels, a.turns, a.warnings) == (b.input_ids, b.labels, b.turns, b.warnings)


@dataclass
class _Draft:
    """One row rendered once: its text and each assistant turn's (message index, start, end) in it."""

    messages: list
    tools: list | None
    full: str
    spans: list[tuple[int, int, int]]


def _encode_drafts(drafts: list[_Draft | None], tokenizer, learn_turns, learn_reasoning) -> list:
    ready = [d for d in drafts if d is not None]
    texts = tokenizer([d.full for d in ready], return_offsets_mapping=True, **PLAIN)
    ids = [list(found) for found in texts["input_ids"]]
    offsets = [[tuple(o) for o in found] for found in texts["offset_mapping"]]
    prompts = _prompt_ids(tokenizer, ready, ids, offsets)
    encoded = []
    for d, row_ids, row_offsets, row_prompts in zip(ready, ids, offsets, prompts, strict=True):
        turns = [(i, *tokens_inside(row_offsets, start, end)) for i, start, end in d.spans]
        encoded.append(
            label_turns(
                tokenizer,
                *(d.messages, d.tools, d.full, row_ids, row_offsets, turns),
                *(learn_turns, learn_reasoning, row_prompts),
            )
        )
    found = iter(encoded)
    return [next(found) if d is not None else None for d in drafts]


PLAIN = {"add_special_tokens": False, "return_attention_mask": False, "return_token_type_ids": False}


def _prompt_ids(tokenizer, ready: list[_Draft], ids, offsets) -> list[dict[int, list[int]]]:
    """For each row, each turn's generation prompt ids (those of the text before the turn), for the
    train/infer check. A tokenizer cuts its input at added tokens before anything else, so they are the
    row's ids up to the last added token before the turn, then the ids of the text from that token on:
    a few characters, the same in most rows, each tokenized once (and checked to start with that token)."""
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))
    asks, tails = [], {}
    for k, d in enumerate(ready):
        marks = [t for t, token in enumerate(ids[k]) if token in added]
        for i, start, _ in d.spans:
            j = next((t for t in reversed(marks) if offsets[k][t][1] <= start), None)
            tail = d.full[offsets[k][j][0] : start] if j is not None else d.full[:start]
            asks.append((k, i, j, tail))
            tails[tail] = None
    unique = list(tails)
    for tail, found in zip(unique, tokenizer(unique, **PLAIN)["input_ids"] if unique else [], strict=True):
        tails[tail] = list(found)
    prompts: list[dict[int, list[int]]] = [{} for _ in ready]
    redo = []
    for k, i, j, tail in asks:
        found = tails[tail]
        if j is None:
            prompts[k][i] = found
        elif found[:1] == [ids[k][j]]:
            prompts[k][i] = ids[k][:j] + found
        else:
            redo.append((k, i, ready[k].full[: next(s for m, s, _ in ready[k].spans if m == i)]))
    if redo:
        for (k, i, _), found in zip(
            redo, tokenizer([text for *_, text in redo], **PLAIN)["input_ids"], strict=True
        ):
            prompts[k][i] = list(found)
    return prompts


class _Watched(list):
    """The messages as the template sees them, noting how much text was written each time the template
    takes the next one (and when it has taken the last). A slice is watched too, with its offset."""

    def __init__(self, items, written: list[int], taken: list[tuple[int, int]], base: int = 0):
        super().__init__(items)
        self._written, self._taken, self._base = written, taken, base

    def __iter__(self):
        for k, item in enumerate(list.__iter__(self)):
            self._taken.append((self._base + k, self._written[0]))
            yield item
        self._taken.append((self._base + len(self), self._written[0]))

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                return _Watched(list.__getitem__(self, index), self._written, self._taken, self._base + start)
        return list.__getitem__(self, index)


class _Shape:
    """What one rendering needs of a tokenizer: its compiled templates, their arguments and the
    generation prompt."""

    def __init__(self, tokenizer, helpers):
        self.compile, self.plain, self.alias = helpers
        self.kwargs = self.plain(dict(tokenizer.special_tokens_map))
        without = render(tokenizer, PROBE[:2])
        with_prompt = render(tokenizer, PROBE[:2], generation_prompt=True)
        if not with_prompt.startswith(without):
            raise ValueError("the generation prompt is not appended to the conversation")
        self.prompt = with_prompt[len(without) :]

    def render(self, tokenizer, messages, tools) -> tuple[str, list[tuple[int, int]]] | None:
        """The conversation's text as apply_chat_template renders it, and the offsets it took each
        message at; None when it could not be rendered here."""
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            return None
        template = self.compile(tokenizer.get_chat_template(None, tools))
        written, taken = [0], []
        chat = _Watched(self.alias(self.plain(messages)), written, taken)
        pieces = []
        try:
            for piece in template.generate(
                messages=chat,
                tools=self.plain(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=False,
                **self.kwargs,
            ):
                pieces.append(piece)
                written[0] += len(piece)
        except Exception:  # noqa: BLE001 - the reference renders the row and says what is wrong
            return None
        return "".join(pieces), taken

    def draft(self, row: dict, tokenizer) -> _Draft | None:
        """The row rendered once with its assistant spans; None when the reference must decide it."""
        messages, tools = conversation(row)
        rendered = self.render(tokenizer, messages, tools) if messages else None
        if rendered is None:
            return None
        full, taken = rendered
        n = len(messages)
        indices = [k for k, _ in taken]
        if not taken or indices != list(range(indices[0], n + 1)) or taken[-1][1] != len(full):
            return None
        at = dict(taken)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if i == 0 or i not in at or not full.startswith(self.prompt, at[i]):
                return None
            spans.append((i, at[i] + len(self.prompt), at[i + 1]))
        return _Draft(messages, tools, full, spans)


def _template(tokenizer) -> tuple[str, int]:
    return str(tokenizer.chat_template), len(tokenizer)


def _shape(tokenizer) -> _Shape | None:
    """The tokenizer's _Shape when its template allows one rendering per row (see the module docstring);
    probed again when its template or vocabulary changed."""
    found = _SHAPES.get(tokenizer)
    if found is None or found[0] != _template(tokenizer):
        found = _SHAPES[tokenizer] = (_template(tokenizer), _probe(tokenizer))
    return found[1]


def _probe(tokenizer) -> _Shape | None:
    template = str(tokenizer.chat_template or "")
    if not template or GENERATION_BLOCK.search(template) or LOOKS_AHEAD.search(template):
        return None
    if not getattr(tokenizer, "is_fast", False):
        return None  # offsets come from the fast tokenizer
    try:
        from transformers.utils.chat_template_utils import (
            _alias_reasoning_fields,
            _compile_jinja_template,
            _plain_template_data,
        )
    except ImportError:
        return None
    try:
        shape = _Shape(tokenizer, (_compile_jinja_template, _plain_template_data, _alias_reasoning_fields))
        draft = shape.draft({"messages": PROBE}, tokenizer)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: the reference it is
        return None
    if draft is None:
        return None
    found = _encode_drafts([draft], tokenizer, "all", True)[0]
    return shape if _same(found, _reference({"messages": PROBE}, tokenizer, "all", True)) else None
