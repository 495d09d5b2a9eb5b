"""Preference pairs (`data.format: preference`): what each side learns, implicit prompts, truncation
that keeps answers whole, bad rows as one-line errors, and `liger data` on pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from liger_cli import cli
from liger_cli.data import prepare_data
from liger_cli.data.encode import IGNORE_INDEX
from liger_cli.data.tokenizer import load_tokenizer
from liger_cli.errors import UserError
from liger_cli.recipe import load_recipe

MODEL = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "model"


def write(tmp_path: Path, rows: list[dict], **data) -> Path:
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"train": "pairs.jsonl", "format": "preference", "max_seq_len": 64, **data}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": {"path": str(MODEL)},
                "data": settings,
                "training": {"max_steps": 1, "objective": "dpo"},
                "output": {"dir": "out"},
            }
        )
    )
    return recipe


def pairs(recipe: Path):
    r = load_recipe(recipe, [])
    tokenizer = load_tokenizer(r)
    train, _ = prepare_data(r.data, tokenizer, 0)
    return train, tokenizer


def learned_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


def test_string_pairs_learn_only_the_answer_and_share_the_prompt(tmp_path):
    train, tok = pairs(write(tmp_path, [{"prompt": "12", "chosen": "twelve", "rejected": "twenty"}]))
    ex = train.examples[0]
    assert learned_text(tok, ex["chosen_input_ids"], ex["chosen_labels"]) == "twelve</s>"
    assert learned_text(tok, ex["rejected_input_ids"], ex["rejected_labels"]) == "twenty</s>"
    prompt = tok("12")["input_ids"]  # with the tokenizer's own BOS, as instruction rows
    assert ex["chosen_input_ids"][: len(prompt)] == prompt == ex["rejected_input_ids"][: len(prompt)]
    assert ex["chosen_labels"][: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    assert train.dataset.column_names == [
        "chosen_input_ids",
        "chosen_labels",
        "rejected_input_ids",
        "rejected_labels",
        "fields",  # the row's other fields as JSON (a reward model's margin_field)
    ]


def test_message_pairs_learn_only_the_final_assistant_turn_with_explicit_or_implicit_prompt(tmp_path):
    history = [
        {"role": "user", "content": "7"},
        {"role": "assistant", "content": "seven"},
        {"role": "user", "content": "8"},
    ]
    explicit = {
        "prompt": history,
        "chosen": [{"role": "assistant", "content": "eight"}],
        "rejected": [{"role": "assistant", "content": "nine"}],
    }
    implicit = {
        "chosen": [*history, {"role": "assistant", "content": "eight"}],
        "rejected": [*history, {"role": "assistant", "content": "nine"}],
    }
    train, tok = pairs(write(tmp_path, [explicit, implicit]))
    a, b = train.examples[0], train.examples[1]
    for side in ("chosen", "rejected"):
        assert a[f"{side}_input_ids"] == b[f"{side}_input_ids"]  # the implicit prompt is the shared prefix
        assert a[f"{side}_labels"] == b[f"{side}_labels"]
    # Only the last assistant turn is learned (the earlier "seven" is context), end of turn included.
    assert learned_text(tok, a["chosen_input_ids"], a["chosen_labels"]) == "eight</s>\n"
    assert learned_text(tok, a["rejected_input_ids"], a["rejected_labels"]) == "nine</s>\n"
    whole = tok.apply_chat_template([*history, {"role": "assistant", "content": "eight"}], tokenize=False)
    assert tok.decode(a["chosen_input_ids"]) == whole


def test_truncation_cuts_the_prompt_from_the_left_and_keeps_the_answers_whole(tmp_path):
    long_prompt = " ".join(str(n) for n in range(40))
    train, tok = pairs(
        write(
            tmp_path, [{"prompt": long_prompt, "chosen": "twelve", "rejected": "twenty one"}], max_seq_len=16
        )
    )
    assert train.truncated == 1 and len(train.examples) == 1
    ex = train.examples[0]
    chosen, rejected = ex["chosen_input_ids"], ex["rejected_input_ids"]
    assert max(len(chosen), len(rejected)) == 16
    assert chosen[0] == rejected[0] == tok.bos_token_id  # BOS stays
    assert learned_text(tok, chosen, ex["chosen_labels"]) == "twelve</s>"  # answers whole
    assert learned_text(tok, rejected, ex["rejected_labels"]) == "twenty one</s>"
    full = tok(long_prompt)["input_ids"]
    kept_c = chosen[
        1 : chosen.index(next(i for i, lab in zip(chosen, ex["chosen_labels"], strict=True) if lab != -100))
    ]
    kept_r = rejected[1 : len(kept_c) + 1]
    assert kept_c == kept_r == full[len(full) - len(kept_c) :]  # the same end of the prompt on both sides
    assert ex["prompt_length"] == len(full)  # counted before truncation


def test_an_answer_longer_than_the_room_is_cut_at_its_end_and_the_prompt_keeps_half(tmp_path):
    answer = " ".join(["seven"] * 30)
    train, tok = pairs(write(tmp_path, [{"prompt": "1 2 3 4 5 6 7 8 9 10", "chosen": answer, "rejected": "no"}],
                             max_seq_len=16))  # fmt: skip
    ex = train.examples[0]
    assert len(ex["chosen_input_ids"]) == 16
    prompt_kept = sum(1 for lab in ex["chosen_labels"] if lab == IGNORE_INDEX)
    assert prompt_kept >= 8
    assert ex["chosen_labels"][-1] != tok.eos_token_id  # the end of the long answer is cut
    assert learned_text(tok, ex["rejected_input_ids"], ex["rejected_labels"]) == "no</s>"


def test_equal_answers_are_a_warning_naming_the_row(tmp_path):
    rows = [
        {"prompt": "1", "chosen": "one", "rejected": "two"},
        {"prompt": "2", "chosen": "two", "rejected": "two"},
    ]
    train, _ = pairs(write(tmp_path, rows))
    assert [(w.code, w.row) for w in train.warnings] == [("CHOSEN_EQUALS_REJECTED", 1)]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "1", "chosen": "one"}, 'row 1: field "rejected" is missing'),
        (
            {"prompt": "1", "chosen": "one", "rejected": 2},
            'field "rejected" must be a string or a list of messages',
        ),
        (
            {"prompt": "1", "chosen": [{"role": "assistant", "content": "one"}], "rejected": "two"},
            "must be all strings or all message lists, not mixed",
        ),
        (
            {
                "chosen": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "one"}],
                "rejected": [{"role": "user", "content": "2"}, {"role": "assistant", "content": "two"}],
            },
            "share every message but the last",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "1"}],
                "chosen": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
                "rejected": [{"role": "assistant", "content": "two"}],
            },
            'field "chosen": its last message must be the assistant',
        ),  # fmt: skip
        ({"prompt": "1", "chosen": " ", "rejected": "two"}, 'field "chosen" is empty'),
    ],
)
def test_bad_rows_are_one_line_errors_naming_file_row_and_field(tmp_path, row, message):
    good = {"prompt": "1", "chosen": "one", "rejected": "two"}
    if isinstance(row.get("prompt"), list):  # one file keeps one kind of prompt (Arrow columns have one type)
        good = {k: [{"role": "user" if k == "prompt" else "assistant", "content": "1"}] for k in good}
    with pytest.raises(UserError) as err:
        pairs(write(tmp_path, [good, row]))
    assert "pairs.jsonl" in str(err.value) and "row 2" in str(err.value), err.value
    assert message.replace("row 1: ", "") in str(err.value), err.value
    assert "\n" not in str(err.value)


def test_packing_with_pairs_is_refused(tmp_path):
    with pytest.raises(UserError, match="packing does not apply to preference pairs"):
        pairs(write(tmp_path, [{"prompt": "1", "chosen": "one", "rejected": "two"}], packing=True))


def test_liger_data_reports_shows_and_writes_pairs(tmp_path):
    rows = [
        {"prompt": "12", "chosen": "twelve", "rejected": "twenty"},
        {"prompt": "3", "chosen": "three", "rejected": "three"},
    ]
    recipe = write(tmp_path, rows)
    out = tmp_path / "pairs-out.jsonl"
    result = CliRunner().invoke(cli.app, ["data", str(recipe), "--show", "1", "--jsonl", str(out)])
    assert result.exit_code == 0, result.output
    assert "pairs: 2 rows, 2 kept, 0 truncated, 0 dropped" in result.output
    assert "pairs whose chosen == rejected: 1" in result.output
    assert (
        "--- pairs.jsonl row 1, chosen:" in result.output
        and "--- pairs.jsonl row 1, rejected:" in result.output
    )
    assert "12[[twelve</s>]]" in result.output and "12[[twenty</s>]]" in result.output
    train, _ = pairs(recipe)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["row"] for x in lines] == [1, 2]
    for key in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
        assert [x[key] for x in lines] == train.examples[key]
