"""One rank of a run: train, then end deliberately, and leave a status the launcher can read.

On success a rank destroys the process group (gloo can deadlock in its destructor otherwise: see
docs/fsdp-facts.md#launching-on-a-cpu), then exits without C++ destructors: a gloo worker thread
still joinable at interpreter teardown aborts a finished rank ("terminate called without an active
exception", exit -6, seen in CI after all work was saved). On failure it writes what went wrong to
the launcher's status folder (so `liger train` can name the rank) and exits at once, without
destructors that could wait on the other ranks. The launcher (torchrun underneath) then stops the
others.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from liger_cli.errors import RunFailed, UserError

STATUS_ENV = "LIGER_STATUS_DIR"
"""Set by `liger train` for its ranks: a folder where each rank writes `rank-N` (its last status)."""


def inside_launcher() -> bool:
    """True in a process started by accelerate launch or torchrun (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def run_rank(train) -> NoReturn:
    """Call `train()` as one rank of a launched job, then end the process: 0 done, else 1 or 2."""
    report = _status_writer()
    report("running")
    signal.signal(signal.SIGTERM, _stopped_by_launcher(report))
    try:
        train()
    except (RunFailed, UserError) as err:
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
    exit_now(0)


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


def exit_now(code: int) -> NoReturn:
    """Flush what Python buffers, then leave without destructors or atexit hooks (callers close
    their own files first): teardown could wait forever on a dead peer, or abort a finished rank."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die(report, message: str, code: int) -> NoReturn:
    rank = os.environ.get("RANK", "0")
    print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    report(message)
    exit_now(code)
