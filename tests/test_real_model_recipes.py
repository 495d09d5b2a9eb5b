"""The real-model quickstart's recipes as shipped (recipes/smollm2-sft.yaml, then smollm2-grpo.yaml from its
adapter) on SmolLM2-135M-Instruct (the `real_model` fixture): each is valid and planned on this machine
(`--dry-run` finds the model), and each trains for 2 steps with a 2-row eval, its adapter reloaded and
verified. Every command shares ONE fresh process (test_train.liger_in_one_process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_train import liger_in_one_process

pytestmark = pytest.mark.timeout(1800)
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SFT, GRPO = RECIPES / "smollm2-sft.yaml", RECIPES / "smollm2-grpo.yaml"
SHORT = ["--set", "training.max_steps=2", "--set", "training.eval_every=2", "--set", "logging.every=1"]


def model_path(recipe: Path) -> Path:
    return (recipe.parent / yaml.safe_load(recipe.read_text())["model"]["path"]).resolve()


def first_rows(source: Path, path: Path, n: int = 2) -> Path:
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:n]))
    return path


@pytest.fixture(scope="module")
def runs(real_model: Path, tmp_path_factory) -> dict:
    """Both dry-runs and both short runs, in order: the GRPO recipe starts from the SFT run's adapter, so its
    `adapter.init` is pointed at the short SFT run's (the shipped one names ../runs/smollm2-sft/final)."""
    root = tmp_path_factory.mktemp("smollm2")
    # The recipes name the model where scripts/real_model.py builds it; LIGER_REAL_MODEL may put it elsewhere.
    where = [] if model_path(SFT) == real_model.resolve() else ["--set", f"model.path={real_model}"]
    sft_eval = first_rows(RECIPES / "smollm2" / "eval.jsonl", root / "sft-eval.jsonl")
    grpo_eval = first_rows(RECIPES / "smollm2" / "grpo-eval.jsonl", root / "grpo-eval.jsonl")
    init = ["--set", f"adapter.init={root / 'sft' / 'final'}"]
    sft = ["train", str(SFT), *where, "--set", f"output.dir={root / 'sft'}", "--set", f"data.eval={sft_eval}",
           "--set", "training.eval_samples=2", *SHORT]  # fmt: skip
    grpo = ["train", str(GRPO), *where, *init, "--set", f"output.dir={root / 'grpo'}",
            "--set", f"data.eval={grpo_eval}", "--set", "training.micro_batch_size=2",
            "--set", "rl.num_generations=4", *SHORT]  # fmt: skip
    procs = liger_in_one_process(
        ["train", str(SFT), *where, "--dry-run"], sft, ["train", str(GRPO), *where, *init, "--dry-run"], grpo
    )
    return {"root": root, "procs": dict(zip(["sft-dry", "sft", "grpo-dry", "grpo"], procs, strict=True))}


def test_shipped_recipes_name_the_real_model() -> None:
    assert (
        model_path(SFT) == model_path(GRPO) == RECIPES.parent / ".venv" / "models" / "SmolLM2-135M-Instruct"
    )


@pytest.mark.parametrize("name", ["sft-dry", "grpo-dry"])
def test_each_recipe_plans_on_this_machine(runs: dict, name: str) -> None:
    proc = runs["procs"][name]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SmolLM2-135M-Instruct (from_pretrained)" in proc.stdout


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_each_recipe_trains_and_its_adapter_is_verified(runs: dict, name: str) -> None:
    proc = runs["procs"][name]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "final model verified" in proc.stdout
    out = runs["root"] / name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2
    evals = [r for r in rows if ("eval_loss" if name == "sft" else "eval_reward") in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_the_grpo_recipes_resolved_recipe_loads_back_as_the_same_recipe(runs: dict) -> None:
    """test_recipe.py's round trip for the shipped recipe that needs the SFT run first (its NEEDS_A_RUN)."""
    from liger_cli.recipe import load_recipe

    written = runs["root"] / "grpo" / "recipe.yaml"
    recipe = load_recipe(written, [])
    again = runs["root"] / "grpo-again.yaml"
    again.write_text(recipe.to_yaml())
    assert load_recipe(again, []).model_dump() == recipe.model_dump()


def test_chat_with_the_grpo_run_talks_through_its_template(runs: dict, monkeypatch) -> None:
    """The GRPO recipe's prompts are message lists: `liger chat` on its run, without --format, renders what
    is typed through SmolLM2's chat template (before: as plain text, an empty reply)."""
    import io

    from liger_cli.generate.engine import Sampling
    from liger_cli.serve.chat import chat_command

    monkeypatch.setattr("sys.stdin", io.StringIO("What is 431 + 254?\n"))
    said = io.StringIO()
    assert chat_command(runs["root"] / "grpo", None, Sampling(10, 0.0), False, None, None, out=said) == 0
    text = said.getvalue()
    assert "(format chat)" in text, text
    reply = next(line for line in text.splitlines() if line.startswith("model> "))
    assert reply[len("model> ") :].strip(), text
