"""Recipes: valid ones load with paths resolved; every malformed one exits 2 with a one-line error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from liger_cli.cli import app
from liger_cli.errors import UserError
from liger_cli.recipe import load_recipe

GOOD = """\
model:
  path: model
data:
  train: data/train.jsonl
  format: text
training:
  max_steps: 3
output:
  dir: out
"""


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "hello"}\n')
    return tmp_path


def write(workdir: Path, text: str) -> Path:
    path = workdir / "recipe.yaml"
    path.write_text(text)
    return path


def test_good_recipe_resolves_paths_against_its_folder(workdir: Path, monkeypatch) -> None:
    monkeypatch.chdir("/")
    recipe = load_recipe(write(workdir, GOOD))
    assert recipe.model.path == workdir / "model"
    assert recipe.data.train == workdir / "data" / "train.jsonl"
    assert recipe.output.dir == workdir / "out"
    assert recipe.training.max_steps == 3
    assert recipe.model.trust_remote_code is False
    assert recipe.output.overwrite is False


def test_overrides_are_parsed_as_yaml_and_validated(workdir: Path) -> None:
    recipe = load_recipe(
        write(workdir, GOOD),
        ["training.lr=1e-4", "kernels.rope=false", "adapter.target_modules=[q_proj, v_proj]"],
    )
    assert recipe.training.lr == pytest.approx(1e-4)
    assert recipe.kernels.rope is False
    assert recipe.adapter.target_modules == ["q_proj", "v_proj"]


def test_unquoted_off_means_off_for_activation_checkpointing(workdir: Path) -> None:
    """YAML 1.1 reads an unquoted `off` as false, in a recipe and in a --set alike."""
    on = load_recipe(write(workdir, GOOD), ["distributed.activation_checkpointing=auto"])
    assert on.distributed.activation_checkpointing == "auto"
    off = load_recipe(write(workdir, GOOD), ["distributed.activation_checkpointing=off"])
    assert off.distributed.activation_checkpointing == "off"


def test_wrap_classes_are_split_trimmed_and_deduplicated(workdir: Path) -> None:
    recipe = load_recipe(write(workdir, GOOD), ["distributed.fsdp.wrap_classes= A , A,B,"])
    assert recipe.distributed.fsdp.wrap_classes == ["A", "B"]
    recipe = load_recipe(write(workdir, GOOD), ["distributed.fsdp.wrap_classes=' , '"])
    assert recipe.distributed.fsdp.wrap_classes is None


# (recipe text, overrides, substrings the one-line error must contain)
BAD = [
    (GOOD + "training2: {}\n", [], ["unknown key `training2`", "did you mean `training`"]),
    (
        GOOD.replace("max_steps: 3", "lerning_rate: 3"),
        [],
        ["unknown key `training.lerning_rate`", "did you mean `training.lr`"],
    ),
    (GOOD.replace("max_steps: 3", "learning_rate: 3"), [], ["did you mean `training.lr`"]),
    (GOOD.replace("max_steps: 3", "batch_size: 3"), [], ["did you mean `training.micro_batch_size`"]),
    (
        GOOD.replace("format: text", "formatt: text"),
        [],
        ["unknown key `data.formatt`", "did you mean `data.format`"],
    ),
    (
        GOOD.replace("max_steps: 3", "lr: fast"),
        [],
        ["training.lr", "'fast'", "valid number", "recipe.yaml:7"],
    ),
    (GOOD.replace("max_steps: 3", "lr: -1"), [], ["training.lr", "greater than 0"]),
    (GOOD.replace("max_steps: 3", "max_steps: 0"), [], ["training.max_steps", "greater than or equal to 1"]),
    (
        GOOD.replace("max_steps: 3", "max_steps: 3\n  epochs: 1"),
        [],
        ["only one of training.max_steps and training.epochs"],
    ),
    (GOOD.replace("max_steps: 3", "scheduler: wavy"), [], ["training.scheduler", "'wavy'", "cosine"]),
    (GOOD + "kernels:\n  cross_entropy: true\n", [], ["mutually exclusive"]),
    (GOOD + "adapter:\n  type: qlora\n", [], ["adapter.type", "'lora', 'dora' or 'none'"]),
    (GOOD + "adapter:\n  r: 0\n", [], ["adapter.r", "greater than or equal to 1"]),
    (GOOD + "adapter:\n  dropout: 1.5\n", [], ["adapter.dropout", "less than 1"]),
    (GOOD + "adapter:\n  target_modules: 5\n", [], ["adapter.target_modules", "all-linear"]),
    (
        GOOD.replace("format: text", "format: csv"),
        [],
        ["data.format", "'text', 'instruction', 'chat', 'preference', 'unpaired' or 'prompt'"],
    ),
    (
        GOOD.replace("format: text", "format: text\n  eval_fraction: 1.5"),
        [],
        ["data.eval_fraction", "less than 1"],
    ),
    (
        GOOD.replace("format: text", "format: text\n  eval_fraction: 0.1\n  eval: data/train.jsonl"),
        [],
        ["at most one of data.eval and data.eval_fraction"],
    ),
    (GOOD + "distributed:\n  num_processes: 2\n", [], ["backend is none", "ddp, fsdp1, fsdp2 or deepspeed"]),
    (GOOD + "distributed:\n  backend: ddp\n  num_machines: 2\n", [], ["main_process_ip"]),
    (GOOD + "distributed:\n  backend: horovod\n", [], ["distributed.backend", "'horovod'"]),
    (
        GOOD + "distributed:\n  activation_checkpointing: yes-please\n",
        [],
        ["distributed.activation_checkpointing"],
    ),
    (
        GOOD + "distributed:\n  main_process_port: 70000\n",
        [],
        ["distributed.main_process_port", "less than or equal to 65535"],
    ),
    (GOOD + "output:\n  dir: a\n", [], ["duplicate key `output`", "line 10", "first at line 8"]),
    (GOOD.replace("  max_steps: 3", "  max_steps: 3\n  max_steps: 4"), [], ["duplicate key `max_steps`"]),
    ("model: [unclosed\n", [], ["invalid YAML", "line 2"]),
    ("model:\n  path: model\n   bad: indent\n", [], ["invalid YAML", "line 3"]),
    ("", [], ["recipe is empty"]),
    ("# only a comment\n", [], ["recipe is empty"]),
    ("- a\n- b\n", [], ["top level must be a mapping", "list"]),
    ("just a string\n", [], ["top level must be a mapping", "str"]),
    (GOOD.replace("path: model", "path: missing-model"), [], ["model.path", "missing-model", "not a folder"]),
    (GOOD.replace("path: model", "path: data"), [], ["has no config.json"]),
    (
        GOOD.replace("train: data/train.jsonl", "train: data/nope.jsonl"),
        [],
        ["data.train file not found", "nope.jsonl"],
    ),
    (
        GOOD.replace("model:\n  path: model\n", "model:\n  dtype: float32\n"),
        [],
        ["exactly one of model.path", "model.config"],
    ),
    (GOOD.replace("  path: model\n", "  config: model/config.json\n"), [], ["set model.tokenizer"]),
    (
        GOOD.replace("data:\n  train: data/train.jsonl\n  format: text\n", ""),
        [],
        ["missing required key `data`"],
    ),
    (GOOD + "training: 5\n", [], ["duplicate key `training`"]),
    (GOOD.replace("training:\n  max_steps: 3\n", "training: 5\n"), [], ["`training` must be a section"]),
    (
        GOOD,
        ["training.lerning_rate=1e-4"],
        ["--set", "unknown key `training.lerning_rate`", "did you mean `training.lr`"],
    ),
    (GOOD, ["trainin.lr=1e-4"], ["--set", "unknown key `trainin`", "did you mean `training`"]),
    (GOOD, ["training.lr=abc"], ["--set training.lr=abc", "training.lr", "valid number"]),
    (GOOD, ["training.lr"], ["expected KEY=VALUE"]),
    (GOOD, ["kernels.cross_entropy=true"], ["mutually exclusive"]),
    (
        GOOD,
        ["distributed.backend=fsdp1", "distributed.num_processes=2", "distributed.fsdp.sharding=no_shard"],
        ["no_shard with an adapter fails at FSDP-1's final save", "distributed.backend ddp"],
    ),
    (GOOD, ["training.max_steps.x=1"], ["`training.max_steps` is not a section"]),
    (GOOD, ["output.resume=does/not/exist"], ["output.resume checkpoint folder not found"]),
    # Control characters, and values PyYAML cannot build: the line, no traceback.
    (GOOD.replace("path: model", "path: mo\x00del"), [], ["line 2, column 11", "U+0000", "delete it"]),
    (GOOD.replace("format: text", "format: te\x1bxt"), [], ["line 5, column 13", "U+001B (\\x1b)"]),
    (GOOD + "\x7f", [], ["line 10, column 1", "U+007F"]),
    (GOOD, ["output.dir=o\x00ut"], ["--set output.dir=o\\x00ut", "U+0000 at position 13", "delete it"]),
    (GOOD, ["output.dir=a\nb"], ["--set output.dir=a\\nb", "U+000A"]),
    (GOOD, ["train\x07ing.lr=1e-4"], ["U+0007 at position 6"]),
    (GOOD + "logging: {run_name: 2024-13-45}\n", [], ["invalid YAML at line 10", "month must be in 1..12"]),
    (
        GOOD.replace("max_steps: 3", "max_steps: !!int three"),
        [],
        ["invalid YAML at line 7, column 14", "invalid literal"],
    ),
    (GOOD + "? [a, b]\n: c\n", [], ["invalid YAML at line 10", "unhashable key"]),
]


@pytest.mark.parametrize(("text", "overrides", "expected"), BAD, ids=[f"bad{i:02d}" for i in range(len(BAD))])
def test_malformed_recipe_exits_2_with_one_line(
    workdir: Path, text: str, overrides: list[str], expected: list[str]
) -> None:
    recipe = write(workdir, text)
    args = ["train", str(recipe)]
    for item in overrides:
        args += ["--set", item]
    result = CliRunner().invoke(app, [*args, "--dry-run"])
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert message.startswith("error: ")
    assert "\n" not in message, message
    assert "Traceback" not in result.output
    for part in expected:
        assert part in message, (part, message)
    assert not (workdir / "out").exists()


def test_at_least_25_malformed_cases() -> None:
    assert len(BAD) >= 25


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_real_process_exit_code_and_no_traceback(workdir: Path) -> None:
    """The installed entry point, not just the in-process runner, maps user errors to exit 2."""
    recipe = write(workdir, GOOD.replace("max_steps: 3", "lr: fast"))
    proc = subprocess.run(
        [sys.executable, "-m", "liger_cli", "train", str(recipe)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "training.lr" in proc.stderr
    assert not (workdir / "out").exists()


# Shipped recipes that name a run another recipe writes first (they load only after it): their round trip
# is asserted where that run exists.
NEEDS_A_RUN = {
    "grpo-rm.yaml": "tests/test_reward_model.py, on the reward run its fixture trains",
    "smollm2-grpo.yaml": "tests/test_real_model_recipes.py, on the short SFT run it trains first",
}


@pytest.mark.parametrize(
    "shipped",
    [
        p
        for p in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
        if p.name not in NEEDS_A_RUN
    ],
)
def test_a_runs_resolved_recipe_loads_back_as_the_same_recipe(shipped: Path, tmp_path: Path) -> None:
    """The `recipe.yaml` a run writes (every default resolved) is a recipe that loads again, unchanged."""
    recipe = load_recipe(shipped, [])
    again = tmp_path / "recipe.yaml"
    again.write_text(recipe.to_yaml())
    assert load_recipe(again, []).model_dump() == recipe.model_dump()


@pytest.mark.parametrize(
    "overrides",
    [["training.objective=simpo"], ["training.objective=orpo"], ["preference.loss_type=hinge"],
     ["preference.loss_type=ipo", "preference.sft_weight=0.5"]],
)  # fmt: skip
def test_every_preference_objectives_resolved_recipe_loads_back(overrides: list[str], tmp_path: Path) -> None:
    shipped = Path(__file__).resolve().parents[1] / "recipes" / "dpo.yaml"
    source = tmp_path / "dpo.yaml"  # the shipped DPO recipe without its loss_type (not simpo's or orpo's)
    text = shipped.read_text().replace(", loss_type: sigmoid}", "}")
    for relative in ("quickstart/model", "dpo/train.jsonl", "dpo/eval.jsonl"):
        text = text.replace(f" {relative}", f" {shipped.parent / relative}")
    source.write_text(text)
    recipe = load_recipe(source, overrides)
    again = tmp_path / "recipe.yaml"
    again.write_text(recipe.to_yaml())
    assert load_recipe(again, []).model_dump() == recipe.model_dump()
