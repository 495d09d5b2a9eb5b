"""One rendering per row (liger_cli.data.chat_batch) against the per-turn reference (encode_chat):
identical ids, labels, learned turns, warnings and errors on every template the tests ship, over random
conversations with system prompts, tool calls, tool results, reasoning and empty reasoning."""

from __future__ import annotations

import json
import random

import pytest
from test_chat_templates import FAMILIES, QUICKSTART, family_tokenizer

from liger_cli.data import chat_batch
from liger_cli.data.chat import encode_chat

ONE_RENDERING = {"chatml", "llama3", "gemma", "mistral", "quickstart"}
WORDS = "alpha beta gamma delta seven 12 Paris <think> </think> \n  ? ! tool_call".split(" ")


def tokenizer_of(family: str):
    if family == "quickstart":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(QUICKSTART / "model")
    return family_tokenizer(family)


def text(rng: random.Random, low: int = 0) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, 6)))


def assistant(rng: random.Random, family: str) -> dict:
    message = {"role": "assistant", "content": text(rng, 1)}
    kind = rng.random()
    if kind < 0.2:
        message["content"] = f"<think>{text(rng)}</think>\n\n{message['content']}"
    elif kind < 0.3:
        message["content"] = f"<think></think>{message['content']}"
    elif kind < 0.4:
        message["reasoning_content"] = text(rng, 1)
    elif kind < 0.5 and family == "chatml":
        call = {"name": "lookup", "arguments": {"q": text(rng, 1)}}
        message["tool_calls"] = [{"type": "function", "function": call}]
    return message


def conversation_of(rng: random.Random, family: str) -> dict:
    messages = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": text(rng, 1)})
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": text(rng, 1)})
        messages.append(assistant(rng, family))
        if family in ("chatml", "llama3") and "tool_calls" in messages[-1]:
            messages.append({"role": "tool", "content": json.dumps({"found": text(rng, 1)})})
            messages.append(assistant(rng, "plain"))
    if rng.random() < 0.1:
        messages = messages[1:] if messages[0]["role"] == "system" else messages
        messages = messages[1:]  # starts with an assistant turn: an error, both ways
    return {"messages": messages}


def same(a, b) -> bool:
    if isinstance(a, ValueError) or isinstance(b, ValueError):
        return type(a) is type(b) and str(a) == str(b)
    return (a.input_ids, a.labels, a.turns, a.warnings) == (b.input_ids, b.labels, b.turns, b.warnings)


def reference(row, tok, **options):
    try:
        return encode_chat(row, tok, **options)
    except ValueError as err:
        return err


@pytest.mark.parametrize("family", [*FAMILIES, "quickstart"])
def test_one_rendering_gives_the_per_turn_masks_on_random_conversations(family):
    tok = tokenizer_of(family)
    assert (chat_batch._shape(tok) is not None) == (family in ONE_RENDERING)
    rng = random.Random(f"chat-batch-{family}")
    rows = [conversation_of(rng, family) for _ in range(120)]
    assert sum(len(r["messages"]) > 0 and r["messages"][0]["role"] == "assistant" for r in rows) > 3
    for options in ({}, {"learn_turns": "last"}, {"learn_reasoning": False}):
        found = chat_batch.encode_chats(rows, tok, **options)
        expected = [reference(row, tok, **options) for row in rows]
        for k, (a, b) in enumerate(zip(found, expected, strict=True)):
            assert same(a, b), (family, options, k, rows[k])
    if family in ONE_RENDERING:  # the fast path did the work: rows the reference accepts rendered once
        shape = chat_batch._shape(tok)
        drafts = [shape.draft(row, tok) for row in rows]
        accepted = [d for d, e in zip(drafts, expected, strict=True) if not isinstance(e, ValueError)]
        assert accepted and all(d is not None for d in accepted)


def test_the_learned_tokens_of_one_rendering_are_the_assistant_turns():
    tok = family_tokenizer("chatml")
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And Germany?"},
            {"role": "assistant", "content": "Berlin."},
        ]
    }
    (enc,) = chat_batch.encode_chats([row], tok)
    learned = [t for t, label in zip(enc.input_ids, enc.labels, strict=True) if label != -100]
    assert tok.decode(learned) == "Paris.<|im_end|>\nBerlin.<|im_end|>\n"
    assert (
        enc.input_ids
        == tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
    )


# The last message renders without its newline: a turn's text depends on whether a message follows it,
# which one rendering cannot see (render(messages[:i+1]) is not the text up to message i+1).
LAST_DIFFERS = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' }}"
    "{%- if loop.index0 + 1 < (messages | count) -%}{{ '\\n' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\n<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_a_template_whose_turns_depend_on_later_messages_gets_the_per_turn_path():
    tok = family_tokenizer("chatml")
    tok.chat_template = LAST_DIFFERS
    assert chat_batch._shape(tok) is None  # the probe conversation tells the two apart
    rng = random.Random(3)
    rows = [conversation_of(rng, "plain") for _ in range(20)]
    found = chat_batch.encode_chats(rows, tok)
    assert all(same(a, reference(row, tok)) for a, row in zip(found, rows, strict=True))


@pytest.mark.parametrize("family", ["chatml", "qwen3", "gemma"])
def test_preference_pairs_encoded_together_equal_each_side_through_the_reference(family):
    from liger_cli.data.preference import encode_pairs_of

    tok = tokenizer_of(family)
    rng = random.Random(f"pairs-{family}")
    rows = []
    for k in range(60):
        messages = conversation_of(rng, family)["messages"]
        prompt = [m for m in messages if m["role"] != "assistant"][:3] or [{"role": "user", "content": "hi"}]
        chosen, rejected = assistant(rng, family), assistant(rng, family)
        if k % 2:  # an explicit prompt
            rows.append({"prompt": prompt, "chosen": [chosen], "rejected": [rejected]})
        else:  # an implicit prompt: whole conversations sharing all but the last message
            rows.append({"chosen": [*prompt, chosen], "rejected": [*prompt, rejected]})
    for learn_reasoning in (True, False):
        found = encode_pairs_of(rows, tok, learn_reasoning)
        for row, pair in zip(rows, found, strict=True):
            prompt = row.get("prompt") or row["chosen"][:-1]
            chats = [{"messages": [*prompt, row[side][-1]]} for side in ("chosen", "rejected")]
            expected = [reference(c, tok, learn_turns="last", learn_reasoning=learn_reasoning) for c in chats]
            errors = [e for e in expected if isinstance(e, ValueError)]
            if errors:
                assert isinstance(pair, ValueError) and str(pair) == str(errors[0])
                continue
            for got, want in zip((pair.chosen, pair.rejected), expected, strict=True):
                assert got.input_ids == want.input_ids and got.labels == want.labels
                assert [w[0] for w in got.warnings] == [w[0] for w in want.warnings]
                assert [t[1:] for t in got.turns] == [t[1:] for t in want.turns]
