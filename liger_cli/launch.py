"""Run a recipe: in this process, or in N processes through `accelerate launch`.

One process trains in-process. Several are started by exec'ing `accelerate launch` with explicit
arguments (an argv list, never a shell string) on `python -m liger_cli train RECIPE`, so
`accelerate launch -m liger_cli train RECIPE` and `torchrun -m liger_cli train RECIPE` are the
same path: inside a launcher, each process simply trains as one rank.

Each rank ends deliberately: on success it destroys the process group before exiting (gloo can
deadlock in its destructor otherwise); on failure it writes what went wrong to the launcher's
status folder (so `liger train` can name the rank) and exits at once, without destructors that
could wait on the other ranks. The launcher (torchrun underneath) then stops the others.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

from liger_cli.errors import UserError
from liger_cli.plan import Plan, build_plan
from liger_cli.recipe import Recipe

STATUS_ENV = "LIGER_STATUS_DIR"
"""Set by `liger train` for its ranks: a folder where each rank writes `rank-N` (its last status)."""


def inside_launcher() -> bool:
    """True in a process started by accelerate launch or torchrun (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def dry_run_plan(recipe: Recipe) -> Plan:
    """The Plan of a recipe, with the model built on the meta device (no weights read)."""
    from liger_kernels import patch_model

    from liger_cli.model import build_meta_model_for

    _quiet_libraries()
    model = build_meta_model_for(recipe)
    plan = build_plan(recipe, model)
    report = patch_model(model, **recipe.kernels.model_dump())
    plan.kernel_report = report.lines()
    return plan


def launch(recipe: Recipe, recipe_path: Path, overrides: list[str]) -> int:
    """Train; returns the exit code (0 done, 1 runtime failure)."""
    plan = build_plan(recipe)
    if plan.device == "cpu":  # tells DeepSpeed (when accelerate imports it) what it would guess, aloud
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _return_freed_memory_to_the_os()
    if plan.num_processes > 1 and not inside_launcher():
        from liger_cli.multiprocess import run_accelerate_launch

        return run_accelerate_launch(recipe, plan, recipe_path, overrides)

    from liger_cli.distributed import DowngradeError
    from liger_cli.train import TrainingDiverged, run

    _quiet_libraries()
    if not inside_launcher():
        try:
            run(recipe, plan)
        except (TrainingDiverged, DowngradeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0

    report = _status_writer()
    report("running")
    signal.signal(signal.SIGTERM, _stopped_by_launcher(report))
    try:
        run(recipe, plan)
    except (TrainingDiverged, DowngradeError, UserError) as err:
        _die(
            report,
            f"{'user error' if isinstance(err, UserError) else 'error'}: {err}",
            2 if isinstance(err, UserError) else 1,
        )
    except BaseException as err:  # noqa: BLE001 - any failure of a rank ends the rank, loudly
        traceback.print_exc()
        _die(report, f"error: {type(err).__name__}: {err}", 1)
    end_process_group()
    report("ok")
    return 0


def _return_freed_memory_to_the_os() -> None:
    """On a CPU, serve tensors of 1 MiB and more with mmap, so freeing them gives the memory back.

    glibc's default threshold grows up to 32 MiB, after which activations and logits come from the
    heap and stay in the process after they are freed: measured on recipes/bench-cpu.yaml, RSS
    stayed 2.2-2.8 GiB above the live tensors. A training process's memory should be what it uses.
    """
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3  # from glibc's malloc.h
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).mallopt(m_mmap_threshold, 1 << 20)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc (musl, macOS): keep the allocator's own policy


def _quiet_libraries() -> None:
    """Our own progress and metrics lines are the run's log: silence libraries' bars and notices."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # peft still calls transformers' deprecated `is_gradient_checkpointing`: not the user's concern.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def end_process_group() -> None:
    """Destroy the process group explicitly (measured: 2 in 30 gloo runs hung in its destructor)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _status_writer():
    folder = os.environ.get(STATUS_ENV)
    rank = os.environ.get("RANK", "0")

    def report(status: str) -> None:
        if folder:
            path = Path(folder) / f"rank-{rank}"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(status.strip().splitlines()[0][:500] + "\n")
            os.replace(tmp, path)

    return report


def _stopped_by_launcher(report):
    def handler(signum, frame):  # noqa: ARG001
        report("stopped by the launcher (another rank failed first)")
        os._exit(128 + signum)

    return handler


def _die(report, message: str, code: int) -> None:
    rank = os.environ.get("RANK", "0")
    print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    report(message)
    sys.stdout.flush()
    os._exit(code)  # no destructors: a process-group teardown could wait forever on a dead peer
