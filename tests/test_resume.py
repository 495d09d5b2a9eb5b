"""Resume continues exactly the run that wrote the checkpoint: a finished run can be made longer,
a finished run is not retrained, and a checkpoint from another recipe is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_output_safety import one_line_error, snapshot
from test_train import QUICK_DATA, adapter_weights, liger, recipe_text

STEPS = "micro_batch_size: 4, grad_accum: 2, lr: 5.0e-3, scheduler: constant, seed: 3"


def write_recipe(model_dir: Path, folder: Path, max_steps: int, data: Path) -> Path:
    """LoRA with dropout (the RNG state must be restored exactly), a constant schedule, no eval."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "out"
    recipe = folder / "r.yaml"
    recipe.write_text(
        recipe_text(
            model_dir,
            out,
            adapter="{type: lora, r: 4, alpha: 8, dropout: 0.1}",
            training=f"{{max_steps: {max_steps}, {STEPS}}}",
            output=f"{{dir: {out}}}",
            logging="{every: 1}",
            data=f"{{train: {data}, format: instruction, max_seq_len: 48}}",
        )
    )
    return recipe


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    """A 4-step run, and a 2-step run (both finished)."""
    root = tmp_path_factory.mktemp("resume")
    data = root / "train.jsonl"
    shutil.copy(QUICK_DATA / "train.jsonl", data)
    made = {}
    for steps in (4, 2):
        recipe = write_recipe(tiny_model_dir, root / f"run{steps}", steps, data)
        proc = liger("train", str(recipe))
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[steps] = recipe
    return made


def metric_steps(out: Path) -> list[int]:
    return [
        r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


def test_the_last_step_writes_a_complete_checkpoint(runs: dict[str, Path]) -> None:
    out = runs[2].parent / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    state = json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["step"] == 2


def test_resuming_a_finished_run_changes_nothing(runs: dict[str, Path]) -> None:
    out = runs[2].parent / "out"
    before = snapshot(out)
    proc = liger("train", str(runs[2]), "--set", "output.resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is complete (2 of 2 steps): nothing to do" in proc.stdout
    assert snapshot(out) == before  # no duplicate metric lines, no rewritten plan


def test_a_finished_run_continues_bit_identical_to_a_longer_run(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    copy = tmp_path / "run2"
    shutil.copytree(runs[2].parent, copy)
    recipe = copy / "r.yaml"
    recipe.write_text(runs[2].read_text().replace(str(runs[2].parent), str(copy)))
    proc = liger("train", str(recipe), "--set", "output.resume=auto", "--set", "training.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step-2" in proc.stdout
    assert metric_steps(copy / "out") == [1, 2, 3, 4]
    a, b = adapter_weights(runs[4].parent / "out"), adapter_weights(copy / "out")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("training.micro_batch_size=2", "training.micro_batch_size"),
        ("training.seed=4", "training.seed"),
        ("adapter.r=8", "adapter"),
        ("data.train=CHANGED", "data.train sha256"),
    ],
)
def test_a_resume_that_differs_names_the_field(
    runs: dict[str, Path], tmp_path: Path, change: str, field: str
) -> None:
    out = runs[4].parent / "out"
    before = snapshot(out)
    data = runs[4].parent.parent / "train.jsonl"
    original = data.read_bytes()
    if "CHANGED" in change:  # the same file, other content
        data.write_text(original.decode().replace("seven", "7"))
        change = "training.max_steps=6"
    try:
        line = one_line_error(liger("train", str(runs[4]), "--set", "output.resume=auto", "--set", change))
    finally:
        data.write_bytes(original)
    assert f"{field} differs" in line, line
    assert snapshot(out) == before
