"""Chat templates as model families ship them: the learned tokens of every family, checked exactly.

Each template below is ours, written in its family's format (ChatML/Qwen2.5, Qwen3, Llama-3, Gemma,
Mistral, and {% generation %} markers), over an offline tokenizer built here from the quickstart
BPE with the family's special tokens added. Each test decodes every run of learned tokens and
compares it with the assistant's text plus the family's end-of-turn token.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from liger_cli.data import prepare_data
from liger_cli.data.encode import IGNORE_INDEX
from liger_cli.errors import UserError

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"

CHATML = r"""
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {{- '<|im_start|>assistant' -}}
    {%- if m.content -%}{{- '\n' + m.content -}}{%- endif -%}
    {%- for call in m.tool_calls or [] -%}
      {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

# Qwen3: reasoning is rendered only for assistant turns after the last user message, and the last
# turn always gets a <think> block (empty when there is no reasoning): not prefix-stable.
QWEN3 = r"""
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {%- set content = m.content or '' -%}
    {%- set reasoning = m.reasoning_content or '' -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content + '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

LLAMA3 = r"""
{{- bos_token -}}
{%- for m in messages -%}
  {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

# Gemma has no system role: the system prompt opens the first user turn.
GEMMA = r"""
{{- bos_token -}}
{%- set first = messages[0].content + '\n\n' if messages[0].role == 'system' else '' -%}
{%- for m in messages if m.role != 'system' -%}
  {%- set role = 'model' if m.role == 'assistant' else m.role -%}
  {{- '<start_of_turn>' + role + '\n' + (first if loop.first else '') + (m.content | trim) + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

# Mistral: no assistant header at all; the answer follows [/INST] and ends with eos.
MISTRAL = r"""
{{- bos_token -}}
{%- set sys = messages[0].content + '\n\n' if messages[0].role == 'system' else '' -%}
{%- for m in messages if m.role != 'system' -%}
  {%- if m.role == 'user' -%}{{- '[INST] ' + (sys if loop.first else '') + m.content + ' [/INST]' -}}
  {%- else -%}{{- ' ' + m.content + eos_token -}}{%- endif -%}
{%- endfor -%}
"""

MARKED = r"""
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' -}}{% generation %}{{- m.content + '<|im_end|>\n' -}}{% endgeneration %}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

FAMILIES = {
    "chatml": dict(template=CHATML, special=["<|im_start|>", "<|im_end|>"], eos="<|im_end|>"),
    "qwen3": dict(
        template=QWEN3,
        special=["<|im_start|>", "<|im_end|>"],
        plain=["<think>", "</think>"],
        eos="<|im_end|>",
    ),
    "llama3": dict(
        template=LLAMA3,
        special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "gemma": dict(
        template=GEMMA,
        special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
    ),
    "mistral": dict(template=MISTRAL, special=["[INST]", "[/INST]"], bos="<s>", eos="</s>"),
    "marked": dict(template=MARKED, special=["<|im_start|>", "<|im_end|>"], eos="<|im_end|>"),
}


def family_tokenizer(family: str):
    """The quickstart BPE with the family's special (and plain added) tokens and our template."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    backend = Tokenizer.from_file(str(QUICKSTART / "model" / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.get("plain", [])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=spec.get("bos", "<s>"), eos_token=spec["eos"], pad_token="<pad>"
    )
    tok.chat_template = spec["template"]
    return tok


def encode_rows(tmp_path, tok, rows, **options):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = SimpleNamespace(
        train=path, eval=None, eval_fraction=None, format="chat", max_seq_len=512, packing=False, **options
    )
    train, _ = prepare_data(cfg, tok, seed=0)
    return train


def learned_runs(tok, ids, labels) -> list[str]:
    """The decoded text of each run of consecutive learned tokens."""
    runs, current = [], []
    for token, label in [*zip(ids, labels, strict=True), (None, IGNORE_INDEX)]:
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


def runs_of(tok, train, k=0) -> list[str]:
    return learned_runs(tok, train.examples[k]["input_ids"], train.examples[k]["labels"])


def codes(train) -> list[str]:
    return [w.code for w in train.warnings]


SYSTEM = {"role": "system", "content": "Answer briefly."}
TWO_TURNS = [
    SYSTEM,
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Germany?"},
    {"role": "assistant", "content": "Berlin."},
]
EXPECTED = {
    "chatml": ["Paris.<|im_end|>\n", "Berlin.<|im_end|>\n"],
    "llama3": ["Paris.<|eot_id|>", "Berlin.<|eot_id|>"],
    "gemma": ["Paris.<end_of_turn>\n", "Berlin.<end_of_turn>\n"],
    "mistral": [" Paris.</s>", " Berlin.</s>"],
    "marked": ["Paris.<|im_end|>\n", "Berlin.<|im_end|>\n"],
}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_each_family_learns_exactly_the_assistant_turns(tmp_path, family):
    tok = family_tokenizer(family)
    train = encode_rows(tmp_path, tok, [{"messages": TWO_TURNS}])
    ex = train.examples[0]
    assert ex["input_ids"] == tok.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True)["input_ids"]
    assert runs_of(tok, train) == EXPECTED[family]
    assert codes(train) == []
    last = encode_rows(tmp_path, tok, [{"messages": TWO_TURNS}], learn_turns="last")
    assert runs_of(tok, last) == EXPECTED[family][-1:]


def test_gemma_system_prompt_is_in_the_first_user_turn_and_not_learned(tmp_path):
    tok = family_tokenizer("gemma")
    text = tok.decode(encode_rows(tmp_path, tok, [{"messages": TWO_TURNS}]).examples[0]["input_ids"])
    assert text.startswith("<bos><start_of_turn>user\nAnswer briefly.\n\nCapital of France?<end_of_turn>\n")


TOOL_CHAT = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "18 C, sunny"},
    {"role": "assistant", "content": "18 C and sunny."},
]


def test_tool_calls_are_learned_and_tool_results_are_not(tmp_path):
    tok = family_tokenizer("chatml")
    # A plain row beside it: Arrow gives its messages a null tool_calls, which must not reach the template.
    train = encode_rows(tmp_path, tok, [{"messages": TWO_TURNS}, {"messages": TOOL_CHAT}])
    assert runs_of(tok, train, 0) == EXPECTED["chatml"]
    assert runs_of(tok, train, 1) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "18 C and sunny.<|im_end|>\n",
    ]
    assert codes(train) == []


def test_llama3_tool_result_role_is_not_learned(tmp_path):
    tok = family_tokenizer("llama3")
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '{"name": "get_weather", "parameters": {"city": "Paris"}}'},
        {"role": "ipython", "content": "18 C, sunny"},
        {"role": "assistant", "content": "18 C and sunny."},
    ]
    train = encode_rows(tmp_path, tok, [{"messages": chat}])
    assert runs_of(tok, train) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "18 C and sunny.<|eot_id|>",
    ]


QWEN3_CHAT = [
    {"role": "system", "content": "Think, then answer."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "reasoning_content": "2 plus 2 is 4.", "content": "4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "<think>\n3 plus 3 is 6.\n</think>\n\n6"},
]


def test_qwen3_turns_are_exact_although_the_template_is_not_prefix_stable(tmp_path):
    tok = family_tokenizer("qwen3")
    train = encode_rows(tmp_path, tok, [{"messages": QWEN3_CHAT}])
    text = tok.decode(train.examples[0]["input_ids"])
    assert "2 plus 2" not in text  # the full conversation drops the earlier turn's reasoning ...
    # ... so the earlier turn is what the conversation renders for it, not what it renders alone.
    assert runs_of(tok, train) == ["4<|im_end|>\n", "<think>\n3 plus 3 is 6.\n</think>\n\n6<|im_end|>\n"]
    masked = encode_rows(tmp_path, tok, [{"messages": QWEN3_CHAT}], learn_reasoning=False)
    assert runs_of(tok, masked) == ["4<|im_end|>\n", "6<|im_end|>\n"]
    last = encode_rows(tmp_path, tok, [{"messages": QWEN3_CHAT}], learn_turns="last", learn_reasoning=False)
    assert runs_of(tok, last) == ["6<|im_end|>\n"]
    assert codes(train) == codes(masked) == codes(last) == []


def test_qwen3_empty_reasoning_block_is_a_warning_unless_masked(tmp_path):
    tok = family_tokenizer("qwen3")
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    train = encode_rows(tmp_path, tok, rows)
    assert runs_of(tok, train) == ["<think>\n\n</think>\n\nHello.<|im_end|>\n"]
    assert [(w.code, w.row, w.field) for w in train.warnings] == [
        ("EMPTY_REASONING_LEARNED", 0, "messages[1]")
    ]
    assert "chat.jsonl row 1, messages[1]: an empty <think></think> block is learned" in str(
        train.warnings[0]
    )
    masked = encode_rows(tmp_path, tok, rows, learn_reasoning=False)
    assert runs_of(tok, masked) == ["Hello.<|im_end|>\n"] and masked.warnings == []


def test_generation_markers_that_miss_the_end_or_cover_the_user_are_warnings(tmp_path):
    tok = family_tokenizer("marked")
    tok.chat_template = MARKED.replace(
        "{% generation %}{{- m.content + '<|im_end|>\\n' -}}{% endgeneration %}",
        "{% generation %}{{- m.content -}}{% endgeneration %}{{- '<|im_end|>\\n' -}}",
    )
    empty = [TWO_TURNS[1], {"role": "assistant", "content": ""}]
    train = encode_rows(tmp_path, tok, [{"messages": TWO_TURNS}, {"messages": empty}])
    assert runs_of(tok, train) == ["Paris.", "Berlin."]
    assert [(w.code, w.row, w.field) for w in train.warnings] == [
        ("EOT_NOT_LEARNED", 0, "messages[2]"),
        ("EOT_NOT_LEARNED", 0, "messages[4]"),
        ("NOTHING_LEARNED", 1, "messages"),
    ]
    assert len(train.examples) == 1 and train.dropped == {"nothing learned": 1}
    tok.chat_template = "{% generation %}" + MARKED + "{% endgeneration %}"
    train = encode_rows(tmp_path, tok, [{"messages": TWO_TURNS}])
    assert {(w.code, w.field) for w in train.warnings} >= {
        ("NON_ASSISTANT_LEARNED", "messages[0]"),
        ("NON_ASSISTANT_LEARNED", "messages[1]"),
    }


def test_a_template_that_cannot_be_located_names_the_row_and_message(tmp_path):
    tok = family_tokenizer("chatml")
    # The closing text of a turn changes with its position: no exact span exists.
    tok.chat_template = CHATML.replace(
        "{{- '<|im_end|>\\n' -}}", "{{- '<|im_end|>\\n' if loop.last else '\\n' -}}"
    )
    with pytest.raises(
        UserError, match=r"chat\.jsonl row 2: field \"messages\[2\]\": the chat template closes"
    ):
        encode_rows(tmp_path, tok, [{"messages": TWO_TURNS[:3]}, {"messages": TWO_TURNS}])
