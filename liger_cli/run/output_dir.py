"""The output folder: decide what a run may do with it (read-only), then claim it when the run starts.

`check_output` only reads: it runs on every process before the tokenizer, the data and the model
are checked, and decides whether the run resumes, starts in an empty folder or replaces an old run.
`claim_output` acts on that decision once everything has been checked: only then does rank 0 delete
the old run (`overwrite`), and only a folder that carries liger's marker; the other processes wait
at a barrier before and after, so none of them looks at a folder half deleted.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from liger_cli.errors import UserError
from liger_cli.run.checkpoint import STATE_FILE, complete_checkpoints, remove_stale_temporaries

MARKER = ".liger-run"
"""Written into every run folder when the run starts: only folders that carry it are ever replaced
or resumed into."""


@dataclass(frozen=True)
class OutputDecision:
    out: Path
    resume_from: Path | None
    """The complete checkpoint the run continues from (None: from scratch)."""
    replace: bool
    """The folder holds an old run that `overwrite` replaces when the new run starts."""


def check_output(out: Path, resume: str, overwrite: bool, inputs: tuple[Path, ...] = ()) -> OutputDecision:
    """What the run may do with `out`; raises UserError and changes nothing when it may not.

    A non-empty folder is never replaced unless the recipe says so (a typo in output.dir must not
    cost a finished run), and never replaced or resumed into unless liger made it. `inputs` (model,
    tokenizer, data files) must not lie inside a folder that would be deleted.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"output.dir {out} is a file: choose a folder")
    if resume not in ("auto", "never"):
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise UserError(f"output.resume {path} is not a complete checkpoint (no {STATE_FILE} in it)")
        _require_run_folder(out, f"resume into {out}")
        return OutputDecision(out, path, replace=False)
    if resume == "auto" and complete_checkpoints(out):
        _require_run_folder(out, f"resume in {out}")
        return OutputDecision(out, complete_checkpoints(out)[-1], replace=False)
    if not _non_empty(out):
        return OutputDecision(out, None, replace=False)
    if not overwrite:
        why = "has no complete checkpoint to resume" if resume == "auto" else "is not empty"
        raise UserError(
            f"output folder {out} {why}: set output.overwrite=true to replace it, "
            "output.resume=auto to continue a run, or choose another output.dir"
        )
    _require_run_folder(out, f"delete {out}")
    for path in inputs:
        if path.resolve().is_relative_to(out.resolve()):
            raise UserError(
                f"refusing to replace {out}: the run reads {path} from inside it; move it or choose another output.dir"
            )
    return OutputDecision(out, None, replace=True)


def claim_output(decision: OutputDecision, is_main: bool, wait_for_everyone) -> None:
    """Start the run in its folder: rank 0 replaces the old run (if so decided) and writes the marker;
    every process waits for all the others before (all have decided) and after (the folder is ready)."""
    wait_for_everyone()
    out = decision.out
    if is_main:
        if decision.replace:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).touch()
        remove_stale_temporaries(out)
    wait_for_everyone()


def _non_empty(out: Path) -> bool:
    return out.is_dir() and any(out.iterdir())


def _require_run_folder(out: Path, action: str) -> None:
    """A folder liger did not make (no marker) is never written into by a resume or deleted."""
    if _non_empty(out) and not (out / MARKER).exists():
        raise UserError(
            f"refusing to {action}: it is not a liger run folder (no {MARKER}); "
            "choose another output.dir or remove it yourself"
        )
