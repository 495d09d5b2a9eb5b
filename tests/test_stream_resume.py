"""A streaming run resumed from a step-2 checkpoint continues exactly the run that went through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from test_data_stream import instruction_rows, write_jsonl
from test_train import adapter_weights, liger_in_one_process, recipe_text


def streaming_recipe(model_dir: Path, folder: Path, data: Path, max_steps: int) -> Path:
    """LoRA with dropout, a constant schedule, 8 examples a step from a 30-row file that drops some
    rows: step 3 starts the second pass, so the position is neither 2 x 8 rows nor the file's start."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "r.yaml"
    recipe.write_text(
        recipe_text(
            model_dir,
            folder / "out",
            adapter="{type: lora, r: 4, alpha: 8, dropout: 0.1}",
            training=f"{{max_steps: {max_steps}, micro_batch_size: 4, grad_accum: 2, lr: 5.0e-3, "
            "scheduler: constant, seed: 3}",
            output=f"{{dir: {folder / 'out'}, save_every: 2}}",
            logging="{every: 1}",
            data=f"{{train: {data}, format: instruction, max_seq_len: 48, streaming: true}}",
        )
    )
    return recipe


def losses(out: Path) -> dict[int, float]:
    lines = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def keep_only_step_2(through: str, stopped: str) -> None:
    """The run that stopped at step 2: its step-2 checkpoint, as the run that went on wrote it."""
    through_out, stopped_out = Path(through) / "out", Path(stopped) / "out"
    (stopped_out / "checkpoints").mkdir(parents=True)
    shutil.copytree(through_out / "checkpoints" / "step-2", stopped_out / "checkpoints" / "step-2")
    shutil.copy(through_out / ".liger-run", stopped_out / ".liger-run")


def test_resume_at_step_2_gives_the_same_losses_and_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", instruction_rows(30))
    through = streaming_recipe(tiny_model_dir, tmp_path / "through", data, 4)
    stopped = tmp_path / "stopped"
    recipe = streaming_recipe(tiny_model_dir, stopped, data, 4)
    # the run through, the step-2 copy and the resume, in one process (one process's imports)
    went_through, proc = liger_in_one_process(
        ["train", str(through)],
        {"call": "test_stream_resume.keep_only_step_2", "args": [str(tmp_path / "through"), str(stopped)]},
        ["train", str(recipe), "--set", "output.resume=auto"],
    )
    assert went_through.returncode == 0, went_through.stderr[-3000:]
    state = json.loads((stopped / "out" / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["stream"]["examples"] == 16 and state["stream"]["row"] != 16  # rows were dropped
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step-2" in proc.stdout

    want, got = losses(tmp_path / "through" / "out"), losses(stopped / "out")
    assert sorted(got) == [3, 4]
    assert [got[3], got[4]] == [want[3], want[4]]
    a, b = adapter_weights(tmp_path / "through" / "out"), adapter_weights(stopped / "out")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    end = json.loads((stopped / "out" / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert end["stream"]["pass"] == 1 and end["stream"]["examples"] == 32
