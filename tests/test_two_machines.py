"""Two "machines" on this one: the commands `liger launch --nodes 2 --procs 1 --main-ip 127.0.0.1`
prints, run at once as two `liger train` processes (each its own `accelerate launch --num_machines 2
--machine_rank R`, one rank each, gloo), train what 1 process trains (the same global batch: 2 x 2 x 2 =
1 x 2 x 4), under FSDP-2 and ZeRO-3; the output is written once, by global rank 0, and a checkpoint
written by two machines resumes through `torchrun -m liger_cli` and `accelerate launch -m liger_cli`.
Not part of the shared 2-process launch (tests/conftest.py): this file runs on the other worker."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from safetensors.torch import load_file
from test_distributed import (
    assert_same_run,
    child_env,
    free_port,
    losses,
    make_assets,
    run_here,
    write_recipe,
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("two-machines"))


@pytest.fixture(scope="module")
def reference(assets) -> Path:
    """The 1-process run of the LoRA recipe (in this worker)."""
    out = assets["root"] / "ref-lora"
    run_here({"cases": [{"recipe": str(write_recipe(assets, out))}]})
    return out


def two_machines(recipe: Path, port: int, *overrides: str) -> list[subprocess.CompletedProcess]:
    """`liger launch --nodes 2 --procs 1 --main-ip 127.0.0.1`'s two commands, run at once as two `liger
    train` processes: each is one machine, its own `accelerate launch --num_machines 2 --machine_rank R`.
    Machine 0 is forked warm (warm_python, from one other thread), machine 1 a plain process writing to a
    file (a full pipe would stop it, and machine 0 would wait on it)."""
    import threading

    from liger_cli.launch.nodes import Job

    job = Job(2, 1, "127.0.0.1", port)
    argv = [["-m", "liger_cli", *job.command(recipe, list(overrides), rank)[1:]] for rank in (0, 1)]
    first: list = []
    thread = threading.Thread(
        target=lambda: first.append(warm_python.run(argv[0], env=child_env(), timeout=500))
    )
    log = recipe.with_name(f"{recipe.stem}-{port}.machine1")
    with open(log, "w") as sink:
        second = subprocess.Popen(
            [sys.executable, *argv[1]], env=child_env(), stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        thread.start()
        code = second.wait(timeout=500)
        thread.join(timeout=500)
    finally:
        second.kill()
    assert first, "machine 0 did not finish"
    done = first[0]
    return [subprocess.CompletedProcess(done.args, done.returncode, done.stdout + done.stderr, ""),
            subprocess.CompletedProcess(second.args, code, log.read_text(), "")]  # fmt: skip


@pytest.mark.timeout(1200)
def test_two_machines_train_what_one_process_trains_and_their_checkpoint_resumes(
    reference, assets, tmp_path: Path
) -> None:
    """FSDP-2, one process on each machine: the same losses and adapter as 1 process (and so as the
    shared launch's one 2-process FSDP-2 run, tests/test_distributed.py), metrics and checkpoints written
    once, into the folder both machines see. Their step-2 checkpoint then resumed on one machine through
    `torchrun -m liger_cli` and through `accelerate launch -m liger_cli`: the same steps 3-4 and adapter."""
    out = tmp_path / "two-machines"
    recipe = write_recipe(assets, out, "fsdp2", output__save_every=2)
    for machine in two_machines(recipe, free_port()):
        assert machine.returncode == 0, machine.stdout[-3000:]
    assert_same_run(out, reference)
    assert "2 on 2 machine(s)" in (out / "plan.txt").read_text()
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == len((reference / "metrics.jsonl").read_text().splitlines())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]

    checkpoint = out / "checkpoints" / "step-2"
    launchers = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"],
    }  # fmt: skip
    for name, launcher in launchers.items():
        resumed = tmp_path / name
        port = ["--master_port" if name == "torchrun" else "--main_process_port", str(free_port())]
        argv = [*launcher, *port, "-m", "liger_cli", "train", str(recipe),
                "--set", f"output.dir={resumed}", "--set", f"output.resume={checkpoint}"]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=child_env())
        assert proc.returncode == 0, name + proc.stderr[-5000:]
        assert f"resumed from {checkpoint} at step 2" in proc.stdout
        assert losses(resumed) == pytest.approx(losses(out)[2:], abs=1e-5, rel=0), name
        got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (resumed, out))
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.timeout(1200)
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (scripts/setup.sh installs it)",
)
def test_zero3_on_two_machines_trains_what_one_process_trains(reference, assets, tmp_path: Path) -> None:
    """ZeRO-3, one process on each machine, from the start: the same losses and adapter as 1 process."""
    out = tmp_path / "zero3"
    for machine in two_machines(
        write_recipe(assets, out, "deepspeed", distributed__zero_stage=3), free_port()
    ):
        assert machine.returncode == 0, machine.stdout[-3000:]
    assert_same_run(out, reference)
    assert (
        "2 on 2 machine(s)" in (out / "plan.txt").read_text()
        and "(deepspeed)" in (out / "plan.txt").read_text()
    )
