"""One rank of a run: train, then end deliberately, and leave a status the launcher can read.

On success a rank destroys the process group before exiting (gloo can deadlock in its destructor
otherwise: see docs/fsdp-facts.md#launching-on-a-cpu); on failure it writes what went wrong to the
launcher's status folder (so `liger train` can name the rank) and exits at once, without
destructors that could wait on the other ranks. The launcher (torchrun underneath) then stops the
others.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

from liger_cli.errors import UserError

STATUS_ENV = "LIGER_STATUS_DIR"
"""Set by `liger train` for its ranks: a folder where each rank writes `rank-N` (its last status)."""


def inside_launcher() -> bool:
    """True in a process started by accelerate launch or torchrun (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def run_rank(train) -> int:
    """Call `train()` as one rank of a launched job; returns 0, or never returns on failure."""
    from liger_cli.backends import DowngradeError
    from liger_cli.train import TrainingDiverged

    report = _status_writer()
    report("running")
    signal.signal(signal.SIGTERM, _stopped_by_launcher(report))
    try:
        train()
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
