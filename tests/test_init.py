"""`liger init`: a commented starter recipe per objective that `liger train --dry-run` accepts as written,
never over an existing file; and every command's --help ends with the docs page that explains it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from liger_cli import cli
from liger_cli.recipe import describe
from liger_cli.recipe.schema import Recipe

REPO = Path(__file__).resolve().parents[1]

ROWS = {
    "sft": {"instruction": "Write the number in words.", "input": "12", "output": "twelve"},
    "dpo": {"prompt": "12 in words:", "chosen": " twelve", "rejected": " eleven"},
    "grpo": {"prompt": "12 in words:", "answer": "twelve"},
}


def _invoke(*args: str):
    """In this process, with what the command changes process-wide put back (a dry run hides
    bitsandbytes from the rest of its process when its recipe does not quantize)."""
    from test_train import restored_process_state

    with restored_process_state():
        return CliRunner().invoke(cli.app, list(args))


def _data(tmp_path: Path, objective: str) -> Path:
    path = tmp_path / f"{objective}.jsonl"
    path.write_text("".join(json.dumps(ROWS[objective]) + "\n" for _ in range(8)))
    return path


@pytest.mark.parametrize(
    ("objective", "quantize", "backend", "data_format"),
    [
        ("sft", "none", "none", "instruction"),
        ("dpo", "none", "none", "preference"),
        ("grpo", "none", "none", "prompt"),
        ("sft", "nf4", "fsdp2", "instruction"),
    ],
)
def test_init_writes_a_commented_recipe_that_dry_run_accepts(
    tiny_model_dir: Path, tmp_path: Path, objective: str, quantize: str, backend: str, data_format: str
) -> None:
    recipe = tmp_path / "recipes" / "starter.yaml"
    recipe.parent.mkdir()
    data = _data(recipe.parent, objective)
    result = _invoke(
        "init", str(recipe), "--model", str(tiny_model_dir), "--data", str(data), "--objective", objective,
        "--quantize", quantize, "--backend", backend,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = recipe.read_text()
    written = yaml.safe_load(text)
    assert written["training"]["objective"] == objective
    assert written["data"]["train"] == data.name  # relative to the recipe's folder
    assert written["data"]["format"] == data_format
    assert written["model"]["quantize"] == quantize
    assert written["distributed"]["backend"] == backend
    assert ("quantize_double" in written["model"]) == (quantize != "none")  # else refused, so commented out
    assert ("rl" in written) == (objective == "grpo")
    assert ("preference" in written) == (objective == "dpo")
    if objective == "grpo":
        assert written["rl"]["rewards"] == [{"function": "liger_cli.rewards:exact_match"}]
    if objective == "dpo":  # refused at its default by dpo: shown commented out, not set
        assert "gamma" not in written["preference"] and "# gamma: 0.5" in text
    # every key of the sections written is there at its default, under its schema description
    for key in describe.keys(Recipe.model_fields["training"].annotation):
        if key.name != "objective":
            assert written["training"][key.name] == key.default
        assert f"  # {key.description[:30]}" in text

    dry = _invoke("train", str(recipe), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "# plan" in dry.output
    assert not (recipe.parent / "runs").exists(), "--dry-run wrote the run's folder"


def test_init_refuses_to_overwrite_and_bad_options(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = _data(tmp_path, "sft")
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: {path: mine}\n")
    args = ["--model", str(tiny_model_dir), "--data", str(data), "--objective", "sft"]
    result = _invoke("init", str(recipe), *args)
    assert result.exit_code == 2
    assert (
        result.output.strip()
        == f"error: {recipe} exists; liger init never overwrites: give another FILE, or move it away"
    )
    assert recipe.read_text() == "model: {path: mine}\n"

    fresh = tmp_path / "fresh.yaml"
    for option, value, said in (
        (
            "--objective",
            "ppo",
            "error: --objective ppo: choose one of sft, dpo, simpo, orpo, kto, reward, grpo, distill",
        ),
        ("--quantize", "int8", "error: --quantize int8: choose one of none, nf4, fp4"),
        ("--data", str(tmp_path / "none.jsonl"), f"error: --data {tmp_path / 'none.jsonl'}: no such file"),
    ):
        changed = [*args]
        if option in changed:
            changed[changed.index(option) + 1] = value
        else:
            changed += [option, value]
        result = _invoke("init", str(fresh), *changed)
        assert result.exit_code == 2, result.output
        assert result.output.startswith(said) and result.output.count("\n") == 1, result.output
        assert not fresh.exists()

    result = _invoke("init", str(fresh), *args[:2], "--data", str(data), "--objective", "sft")
    assert result.exit_code == 0, result.output
    assert fresh.is_file()


def test_every_command_help_ends_with_its_docs_page() -> None:
    names = [c.name or c.callback.__name__ for c in cli.app.registered_commands]
    assert "init" in names and len(names) >= 8
    for name in names:
        result = _invoke(name, "--help")
        assert result.exit_code == 0, result.output
        last = result.output.strip().splitlines()[-1].strip()
        assert last.startswith("Docs: docs/"), f"liger {name} --help ends with {last!r}"
        assert (REPO / last.removeprefix("Docs: ")).is_file(), last
