"""Real runs: how a step is split (micro-batch size, accumulation, processes) does not change the math.

tests/test_distributed.py proves 2 processes x micro-batch 2 x accumulation 2 against 1 x 2 x 4 (the
same micro-batch size). Here the micro-batch size changes too, so padding and each micro-batch's own
label count differ: micro-batch 4 x accumulation 1, micro-batch 1 x accumulation 4, and `liger train`
on 2 processes (DDP, gloo) x micro-batch 1 x accumulation 2 log the same losses and save the same
adapter, on instruction data whose examples have uneven lengths and label counts.
"""

from __future__ import annotations

import json

import pytest
from test_distributed import (  # noqa: F401 (assets is a fixture)
    assert_same_run,
    assets,
    free_port,
    liger_train,
    run_driver,
    write_recipe,
)

ACCUMULATION_AGREES = (
    "note: accumulation check: micro-batch 4 x accumulation 1 vs 1 x 4 on a tiny twin "
    "(padding, uneven label counts): loss and every gradient agree"
)


@pytest.mark.timeout(900)
def test_micro_batch_accumulation_and_processes_train_the_same_model(assets, tmp_path) -> None:  # noqa: F811
    rows = [json.loads(line) for line in assets["data"].read_text().splitlines()]
    assert len({len(r["output"]) for r in rows[:16]}) > 4  # uneven label counts: padding is needed

    def recipe(name: str, micro: int, accum: int, backend: str = "none"):
        over = {"training__micro_batch_size": micro, "training__grad_accum": accum}
        return write_recipe(assets, tmp_path / name, backend, **over)

    reference, accumulated = recipe("mb4-acc1", 4, 1), recipe("mb1-acc4", 1, 4)
    run_driver({"cases": [{"recipe": str(reference)}, {"recipe": str(accumulated)}]}, tmp_path, nproc=1)
    ddp = recipe("ddp-mb1-acc2", 1, 2, "ddp")
    proc = liger_train(ddp, "--set", f"distributed.main_process_port={free_port()}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "launching 2 processes" in proc.stderr

    for name in ("mb1-acc4", "ddp-mb1-acc2"):
        assert_same_run(tmp_path / name, tmp_path / "mb4-acc1")  # losses within 1e-5, adapters within 2e-5
    for name in ("mb4-acc1", "mb1-acc4", "ddp-mb1-acc2"):
        assert ACCUMULATION_AGREES in (tmp_path / name / "plan.txt").read_text()
