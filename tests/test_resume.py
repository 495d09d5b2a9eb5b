"""Resume continues exactly the run that wrote the checkpoint: a finished run can be made longer,
a finished run is not retrained, and a checkpoint from another recipe is refused by name.

The two runs the tests compare, and the resume that makes the 2-step one longer, train in one process
(test_train.liger_in_one_process); the killed runs and the resume after them are real processes;
a finished run's no-op resume and the refusals run in this process (test_train.liger_here: the
command's exit code, stdout and one-line error)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import warm_python
from test_output_safety import one_line_error, snapshot
from test_train import QUICK_DATA, adapter_weights, liger, liger_here, liger_in_one_process, recipe_text

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


def copy_and_plant(run: str, copy: str, proof: str) -> None:
    """A copy of the finished 2-step run (folder RUN) at COPY, with pickles that accelerate would read if
    they were there planted in its checkpoint beside the ones liger writes in plain formats: unpickled,
    each creates PROOF."""
    import pickle

    shutil.copytree(run, copy)
    recipe = Path(copy) / "r.yaml"
    recipe.write_text(recipe.read_text().replace(run, copy))
    planted = pickle.dumps(_Planted(Path(proof)))
    for name in ("random_states_0.pkl", "scheduler.bin"):
        (Path(copy) / "out" / "checkpoints" / "step-2" / name).write_bytes(planted)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory) -> dict:
    """In one process: a 4-step run, a 2-step run (both finished), then a copy of the 2-step run with
    pickles planted in its checkpoint (copy_and_plant), made longer (4 steps) by `liger train`'s resume.
    Keys 4 and 2: their recipes; "continued": (the resume's result, the copy's recipe, the proof file)."""
    root = tmp_path_factory.mktemp("resume")
    data = root / "train.jsonl"
    shutil.copy(QUICK_DATA / "train.jsonl", data)
    made: dict = {steps: write_recipe(tiny_model_dir, root / f"run{steps}", steps, data) for steps in (4, 2)}
    copy, proof = root / "continued", root / "code-ran"
    procs = liger_in_one_process(
        *(["train", str(recipe)] for recipe in (made[4], made[2])),
        {"call": "test_resume.copy_and_plant", "args": [str(made[2].parent), str(copy), str(proof)]},
        ["train", str(copy / "r.yaml"), "--set", "output.resume=auto", "--set", "training.max_steps=4"],
    )
    for proc in procs[:2]:
        assert proc.returncode == 0, proc.stderr[-3000:]
    made["continued"] = (procs[2], copy / "r.yaml", proof)
    return made


def metric_steps(out: Path) -> list[int]:
    return [
        r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


def test_the_last_step_writes_a_complete_checkpoint(runs: dict) -> None:
    out = runs[2].parent / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    state = json.loads((out / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["step"] == 2


def test_resuming_a_finished_run_changes_nothing(runs: dict) -> None:
    out = runs[2].parent / "out"
    before = snapshot(out)
    proc = liger_here("train", str(runs[2]), "--set", "output.resume=auto")  # in this process: no training
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is complete (2 of 2 steps): nothing to do" in proc.stdout
    assert snapshot(out) == before  # no duplicate metric lines, no rewritten plan


def test_a_finished_run_continues_bit_identical_to_a_longer_run_and_no_checkpoint_runs_code(
    runs: dict,
) -> None:
    """The 2-step run, made longer (4 steps), equals the 4-step run bit for bit, although pickles that
    accelerate would read were planted in its checkpoint (liger writes plain formats and never reads
    them); then a planted optimizer state (accelerate's pickle format, read with weights_only) is
    refused with exit 2. No planted pickle ever runs code."""
    import pickle

    proc, recipe, proof = runs["continued"]  # planted and resumed in the fixture's process
    copy = recipe.parent
    planted = pickle.dumps(_Planted(proof))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not proof.exists()
    assert "resumed from" in proc.stdout and "step-2" in proc.stdout
    assert metric_steps(copy / "out") == [1, 2, 3, 4]
    a, b = adapter_weights(runs[4].parent / "out"), adapter_weights(copy / "out")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the optimizer state (accelerate's pickle format) is read with weights_only: refused, exit 2
    (copy / "out" / "checkpoints" / "step-4" / "optimizer.bin").write_bytes(planted)
    line = one_line_error(
        liger_here("train", str(recipe), "--set", "output.resume=auto", "--set", "training.max_steps=5")
    )
    assert "not plain tensor data" in line
    assert not proof.exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("training.micro_batch_size=2", "training.micro_batch_size"),
        ("data.train=CHANGED", "data.train sha256"),
    ],
)
def test_a_resume_that_differs_names_the_field(runs: dict, tmp_path: Path, change: str, field: str) -> None:
    out = runs[4].parent / "out"
    before = snapshot(out)
    data = runs[4].parent.parent / "train.jsonl"
    original = data.read_bytes()
    if "CHANGED" in change:  # the same file, other content
        data.write_text(original.decode().replace("seven", "7"))
        change = "training.max_steps=6"
    try:
        line = one_line_error(
            liger_here("train", str(runs[4]), "--set", "output.resume=auto", "--set", change)
        )
    finally:
        data.write_bytes(original)
    assert f"{field} differs" in line, line
    assert snapshot(out) == before


# A driver that trains in-process and dies by SIGKILL at a chosen point, in a fresh process.
KILL_DRIVER = """
import os, signal, sys
from liger_cli.run import checkpoint, train
from liger_cli.plan import build_plan
from liger_cli.recipe import load_recipe

recipe = load_recipe(sys.argv[1], sys.argv[4:])
where, at = sys.argv[2], int(sys.argv[3])
plan = build_plan(recipe)  # before the patches below: the plan's twin checks call the loss too

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if where == "mid-save":  # weights and optimizer written, RNG and trainer state not yet
    real_save_rng = checkpoint.save_rng
    def save_rng(folder, rank):
        if folder.name == f".tmp-step-{at}":
            die()
        real_save_rng(folder, rank)
    checkpoint.save_rng = save_rng
elif where == "mid-step":  # the `at`-th micro-batch of this process: between forward/backward passes
    from liger_cli.model.objectives.causal_lm import CausalLM
    real_loss, calls = CausalLM.loss, []
    def loss(*args):
        calls.append(1)
        if len(calls) == at:
            die()
        return real_loss(*args)
    CausalLM.loss = loss
elif where == "before-final":  # every step and checkpoint done, the final adapter not written
    train.save_final = lambda *args: die()
train.run(recipe, plan)
"""


def killed(recipe: Path, where: str, at: int, *overrides: str):
    """KILL_DRIVER in a fresh process (unbuffered, so its output up to the kill is all there)."""
    import os

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return warm_python.run(["-c", KILL_DRIVER, recipe, where, at, *overrides], timeout=600, env=env)


def test_sigkill_at_several_points_then_resume_is_bit_identical(runs: dict, tmp_path: Path) -> None:
    """Dropout on, a checkpoint every step: killed mid-save (the previous checkpoint is kept and the
    half-written save never looks complete), mid-step and right after the last complete checkpoint,
    before the final save; resumed each time from the last complete checkpoint; the final adapter equals
    the uninterrupted run's bit for bit, so every resume continued exactly."""
    recipe = tmp_path / "r.yaml"
    out = tmp_path / "out"
    recipe.write_text(
        runs[4]
        .read_text()
        .replace(str(runs[4].parent / "out"), str(out))
        .replace("{dir:", "{save_every: 1, dir:")
    )
    assert "save_every: 1" in recipe.read_text()
    auto = "output.resume=auto"
    assert killed(recipe, "mid-save", 2).returncode == -9
    assert (out / "checkpoints" / ".tmp-step-2").is_dir()  # the half-written save is there...
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-1"]  # ...never complete
    mid_step = killed(recipe, "mid-step", 4, auto)  # resumed at step 1; dies inside step 3 (grad_accum 2)
    assert mid_step.returncode == -9
    assert "resumed from" in mid_step.stdout and "step-1" in mid_step.stdout, mid_step.stdout[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-1", "step-2"]
    assert not (out / "checkpoints" / ".tmp-step-2").exists()  # the half-written save is gone
    before_final = killed(recipe, "before-final", 0, auto)
    assert before_final.returncode == -9
    assert "resumed from" in before_final.stdout and "step-2" in before_final.stdout
    assert not (out / "final").exists() and (out / "checkpoints" / "step-4").is_dir()
    proc = liger("train", str(recipe), "--set", auto)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step-4" in proc.stdout
    a, b = adapter_weights(runs[4].parent / "out"), adapter_weights(out)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


class _Planted:
    """Unpickling this creates a file: proof that a checkpoint file ran code."""

    def __init__(self, proof: Path):
        self.proof = proof

    def __reduce__(self):
        return (open, (str(self.proof), "w"))


def test_a_planted_distributed_checkpoint_index_is_refused(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from liger_cli.run.plain_state import check_distributed_checkpoint_index

    real = tmp_path / "real"
    dcp.save({"w": torch.randn(3, 2), "n": {"step": torch.tensor(2.0)}}, checkpoint_id=real, no_dist=True)
    check_distributed_checkpoint_index(real)  # torch's own index passes
    planted = tmp_path / "planted" / "pytorch_model_fsdp_0"
    planted.mkdir(parents=True)
    (planted / ".metadata").write_bytes(pickle.dumps(_Planted(tmp_path / "code-ran")))
    with pytest.raises(pickle.UnpicklingError, match="io.open is not part of"):
        check_distributed_checkpoint_index(tmp_path / "planted")
    assert not (tmp_path / "code-ran").exists()
