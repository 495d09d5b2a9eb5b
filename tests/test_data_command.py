"""`liger data RECIPE`: the report, --show and --jsonl agree with what training receives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from liger_cli import cli
from liger_cli.data import build_datasets
from liger_cli.data.encode import IGNORE_INDEX
from liger_cli.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
EVAL = RECIPES / "quickstart" / "data" / "eval.jsonl"


def run(*args: str):
    return CliRunner().invoke(cli.app, ["data", *args])


def test_quickstart_report_show_and_jsonl_match_training(tmp_path):
    from liger_cli.data.tokenizer import load_tokenizer

    out = tmp_path / "examples.jsonl"
    sets = ["--set", f"data.train={EVAL}", "--set", "data.eval=null", "--set", "training.eval_samples=0"]
    result = run(str(RECIPES / "quickstart.yaml"), *sets, "--show", "2", "--jsonl", str(out))
    assert result.exit_code == 0, result.output

    recipe = load_recipe(
        RECIPES / "quickstart.yaml", [f"data.train={EVAL}", "data.eval=null", "training.eval_samples=0"]
    )
    train, _ = build_datasets(recipe.data, load_tokenizer(recipe), recipe.training.seed)
    tokens = sum(len(x) for x in train["input_ids"])
    learned = sum(sum(1 for label in x[1:] if label != IGNORE_INDEX) for x in train["labels"])
    assert "examples: 100 rows, 100 kept, 0 truncated, 0 dropped" in result.output
    assert f"tokens: {tokens:,}, learned {learned:,} ({learned / tokens:.1%})" in result.output
    assert "warnings: none" in result.output
    # Histogram bars count every example once.
    assert sum(int(m) for m in re.findall(r"\| #* +(\d+)$", result.output, re.M)) == 100

    first = json.loads(EVAL.read_text().splitlines()[0])
    assert "--- eval.jsonl row 1:" in result.output
    assert f"### Response:\n[[{first['output']}</s>]]" in result.output  # piped: no colour, markers

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["input_ids"] for x in lines] == train["input_ids"]
    assert [x["labels"] for x in lines] == train["labels"]
    assert [x["row"] for x in lines] == list(range(1, 101)) and {x["split"] for x in lines} == {"train"}


def test_chat_recipe_report_and_show():
    result = run(str(RECIPES / "chat.yaml"), "--show", "1")
    assert result.exit_code == 0, result.output
    assert "examples: 6 rows, 6 kept, 1 truncated, 0 dropped" in result.output
    assert "<|assistant|>\n[[twelve</s>\n]]<|user|>\n340\n<|assistant|>\n[[three hundred forty</s>\n]]" in (
        result.output
    )
    assert "<|system|>\nWrite numbers in words.\n<|user|>\n12\n" in result.output  # not learned: no markers


def test_warnings_name_code_file_row_and_field(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "one"}]},
        {
            "messages": [
                {"role": "user", "content": "2"},
                {"role": "assistant", "content": "two two two two two two two two two two"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "3 3 3 3 3 3 3 3 3 3"},
                {"role": "assistant", "content": "x"},
            ]
        },
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{path: {RECIPES / 'quickstart' / 'model'}}}\n"
        f"data: {{train: {data}, format: chat, max_seq_len: 12}}\n"
    )
    result = run(str(recipe))
    assert result.exit_code == 0, result.output
    assert "examples: 3 rows, 2 kept, 1 truncated, 1 dropped" in result.output
    assert "dropped, every learned token is past max_seq_len: 1" in result.output
    assert "TRUNCATED_EVERY_ANSWER: 1 example(s)" in result.output
    assert "chat.jsonl row 2, messages: truncation at max_seq_len=12 cuts every answer" in result.output


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.learn_turn=last", "did you mean `data.learn_turns`"),
        ("data.learn_turns=first", "data.learn_turns"),
        ("data.learn_reasoning=false", "applies to formats chat, preference and unpaired only"),
    ],
)
def test_bad_options_exit_2(tmp_path, override, message):
    out = tmp_path / "x.jsonl"
    result = run(str(RECIPES / "quickstart.yaml"), "--set", override, "--jsonl", str(out))
    assert result.exit_code == 2 and message in result.output, result.output
    assert not out.exists()


def test_bad_data_exits_2_and_writes_nothing(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "one"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "1", "tool_calls": []}]})
        + "\n"
    )
    out = tmp_path / "x.jsonl"
    result = run(str(RECIPES / "chat.yaml"), "--set", f"data.train={data}", "--jsonl", str(out))
    assert result.exit_code == 2
    assert (
        f'error: data error: {data} row 2: field "messages[0].tool_calls" must be a list, on an assistant'
        in (result.output)
    )
    assert not out.exists()


def test_show_on_a_terminal_highlights_instead_of_marking(tmp_path):
    from io import StringIO

    from rich.console import Console

    from liger_cli.data import prepare_data
    from liger_cli.data.report import show_examples
    from liger_cli.data.tokenizer import load_tokenizer

    recipe = load_recipe(RECIPES / "chat.yaml")
    tok = load_tokenizer(recipe)
    train, _ = prepare_data(recipe.data, tok, recipe.training.seed)
    outputs = {}
    for name, options in {"colour": {}, "no_color": {"no_color": True}}.items():
        buffer = StringIO()
        show_examples(
            Console(file=buffer, force_terminal=True, color_system="standard", **options), train, tok, 1
        )
        outputs[name] = buffer.getvalue()
    assert "[[" not in outputs["colour"] and "\x1b[" in outputs["colour"]
    assert re.search(r"\x1b\[[0-9;]*42m\s*twelve", outputs["colour"])  # learned: green background
    assert "[[twelve</s>\n]]" in outputs["no_color"] and "\x1b[4" not in outputs["no_color"]
