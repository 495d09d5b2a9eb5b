"""What is trained is what is served: TRAIN_INFER_MISMATCH, DOUBLE_BOS and EOS_MASKED_AS_PAD fire
where the example really differs from what the model sees at inference, and nowhere else."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_chat_templates import (
    CHATML,
    EXPECTED,
    LLAMA3,
    MARKED,
    QWEN3_CHAT,
    TOOL_CHAT,
    TWO_TURNS,
    encode_rows,
    family_tokenizer,
    runs_of,
)
from typer.testing import CliRunner

from liger_cli import cli
from liger_cli.data import prepare_data
from liger_cli.data.encode import IGNORE_INDEX, collate

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"
NEW_CODES = {"TRAIN_INFER_MISMATCH", "DOUBLE_BOS", "EOS_MASKED_AS_PAD"}


def found(train) -> list[tuple[str, int, str]]:
    return [(w.code, w.row, w.field) for w in train.warnings]


@pytest.mark.parametrize("family", [*EXPECTED, "qwen3"])
def test_no_family_template_warns_on_normal_data(tmp_path, family):
    tok = family_tokenizer(family)
    rows = [{"messages": TWO_TURNS}]
    rows += [{"messages": QWEN3_CHAT}] if family == "qwen3" else []
    rows += [{"messages": TOOL_CHAT}] if family == "chatml" else []
    for options in ({}, {"learn_turns": "last"}, {"learn_reasoning": False}):
        train = encode_rows(tmp_path, tok, rows, **options)
        assert not {w.code for w in train.warnings} & NEW_CODES, [str(w) for w in train.warnings]


def test_a_generation_prompt_unlike_the_history_header_is_a_mismatch(tmp_path):
    tok = family_tokenizer("marked")
    # History renders "<|im_start|>assistant\n" before an answer; inference gets "<|im_start|>assistant ".
    tok.chat_template = MARKED.replace(
        "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}", "{{- '<|im_start|>assistant ' -}}{%- endif -%}"
    )
    assert tok.chat_template != MARKED
    train = encode_rows(tmp_path, tok, [{"messages": TWO_TURNS[1:3]}, {"messages": TWO_TURNS}])
    assert runs_of(tok, train, 1) == EXPECTED["marked"]  # the labels themselves are right
    assert found(train) == [
        ("TRAIN_INFER_MISMATCH", 0, "messages[1]"),
        ("TRAIN_INFER_MISMATCH", 1, "messages[2]"),
        ("TRAIN_INFER_MISMATCH", 1, "messages[4]"),
    ]
    assert (
        "chat.jsonl row 2, messages[4]: the tokens before this turn end with [..., 's', 'is', 't', 'an', 't', '\\n'] in "
        "training, but the generation prompt for messages[:4] (add_generation_prompt=True) ends with "
        "[..., 's', 'is', 't', 'an', 't', ' '], so the model is trained on a context it is never served"
        in str(train.warnings[2])
    )


def test_a_prompt_that_tokenizes_apart_from_the_answer_is_a_mismatch(tmp_path):
    """The text is a prefix (the template is prefix-stable) but the tokens are not: the whole
    conversation merges the prompt's trailing space into the answer's first token (" seven")."""
    tok = family_tokenizer("chatml")
    tok.chat_template = (
        CHATML.replace("'<|im_start|>assistant' -}}", "'<|im_start|>assistant ' -}}")
        .replace("'\\n' + m.content", "m.content")
        .replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant '")
    )
    chat = [{"role": "user", "content": "7"}, {"role": "assistant", "content": "seven"}]
    train = encode_rows(tmp_path, tok, [{"messages": chat}])
    assert tok.decode(train.examples[0]["input_ids"]).endswith("<|im_start|>assistant seven<|im_end|>\n")
    assert runs_of(tok, train) == [" seven<|im_end|>\n"]
    assert found(train) == [("TRAIN_INFER_MISMATCH", 0, "messages[1]")]
    assert (
        "row 1, messages[1]: the tokens before this turn end with [..., 'as', 's', 'is', 't', 'an', 't'] in "
        "training, but the generation prompt for messages[:1] (add_generation_prompt=True) ends with "
        "[..., 's', 'is', 't', 'an', 't', ' ']: the same text, tokenized differently where the answer begins"
    ) in str(train.warnings[0])


def test_liger_data_reports_the_mismatch(tmp_path):
    tok = family_tokenizer("marked")
    tok.chat_template = MARKED.replace(
        "'<|im_start|>assistant\\n' -}}{%- endif", "'<|im_start|>assistant ' -}}{%- endif"
    )
    tok.save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": TWO_TURNS}) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{path: {QUICKSTART / 'model'}, tokenizer: {tmp_path / 'tokenizer'}}}\n"
        f"data: {{train: {data}, format: chat, max_seq_len: 128}}\n"
    )
    result = CliRunner().invoke(cli.app, ["data", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "TRAIN_INFER_MISMATCH: 1 example(s), the tokens before a learned turn are not the generation" in (
        result.output
    )
    assert "chat.jsonl row 1, messages[2]: the tokens before this turn end with" in result.output


def test_double_bos_in_text_and_chat(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QUICKSTART / "model")
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": "<s>one two"}) + "\n" + json.dumps({"text": "one two"}) + "\n")
    cfg = SimpleNamespace(
        train=path, eval=None, eval_fraction=None, format="text", max_seq_len=64, packing=False
    )
    train, _ = prepare_data(cfg, tok, seed=0)
    assert train.examples[0]["input_ids"][:2] == [tok.bos_token_id] * 2
    assert found(train) == [("DOUBLE_BOS", 0, "text")]
    assert "text.jsonl row 1, text: the example starts with two bos tokens ('<s>' twice)" in str(
        train.warnings[0]
    )

    llama = family_tokenizer("llama3")
    assert not encode_rows(tmp_path, llama, [{"messages": TWO_TURNS}]).warnings
    llama.chat_template = "{{- bos_token -}}" + LLAMA3  # the template writes bos, and so does the family's
    train = encode_rows(tmp_path, llama, [{"messages": TWO_TURNS}])
    assert found(train) == [("DOUBLE_BOS", 0, "messages")]


def masking_collate(features, pad_token_id):
    """A collator as many trainers write it: labels masked wherever input_ids is the pad token."""
    batch = collate(features, pad_token_id)
    batch["labels"][batch["input_ids"] == pad_token_id] = IGNORE_INDEX
    return batch


def test_our_collation_keeps_a_learned_eos_that_is_also_the_pad_token():
    eos = 2
    batch = collate(
        [
            {"input_ids": [5, eos], "labels": [-100, eos], "position_ids": [0, 1]},
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2]},
        ],
        pad_token_id=eos,
    )
    assert batch["labels"].tolist() == [[-100, eos, -100], [-100, 6, 7]]
    assert batch["input_ids"][0].tolist() == [5, eos, eos]


@pytest.mark.parametrize("fmt", ["instruction", "chat"])
def test_eos_masked_as_pad_fires_only_where_the_collation_masks_it(tmp_path, monkeypatch, fmt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QUICKSTART / "model")
    if fmt == "chat":
        rows = [{"messages": TWO_TURNS[1:3]}, {"messages": TWO_TURNS}]
        field = ["messages[1]", "messages[2]", "messages[4]"]
        rows_of = [0, 1, 1]
    else:
        rows = [
            {"instruction": "Say one.", "output": "one"},
            {"instruction": "Say two.", "output": "two two two"},
        ]
        field, rows_of = ["output", "output"], [0, 1]
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = SimpleNamespace(
        train=path,
        eval=None,
        eval_fraction=None,
        format=fmt,
        max_seq_len=128,
        packing=False,
        cache=False,  # the collation is swapped below: a cached table would hold the first one's warnings
    )

    def codes_with(pad: str, collation) -> list[tuple[str, int, str]]:
        tok.pad_token = pad
        monkeypatch.setattr("liger_cli.data.build.collate", collation)
        return [w for w in found(prepare_data(cfg, tok, seed=0)[0]) if w[0] == "EOS_MASKED_AS_PAD"]

    assert codes_with("</s>", collate) == []  # pad == eos, but our collation pads labels by length
    assert codes_with("<pad>", masking_collate) == []  # masks the pad, which is not the eos
    assert codes_with("</s>", masking_collate) == [
        ("EOS_MASKED_AS_PAD", row, f) for row, f in zip(rows_of, field, strict=True)
    ]
    train, _ = prepare_data(cfg, tok, seed=0)
    assert "is also the pad token, and the collation masks it with the padding (label -100)" in str(
        train.warnings[-1]
    )
    assert torch.tensor(train.examples[0]["labels"]).eq(tok.eos_token_id).any()  # learned before collation
