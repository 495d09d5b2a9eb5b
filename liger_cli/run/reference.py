"""Values an objective takes from the model before its first step (DPO's reference log-probs with full
fine-tuning): computed once under the run's own backend, stored with the run, read back on resume.

Computed after `prepare`, so through the model as the backend wrapped and sharded it: each rank takes
every world-th micro-batch of the train pairs, then of the eval pairs (`even_shares`: as many forwards
on every rank, since FSDP and ZeRO-3 forwards are collective), writes its rows into a zero table and
the ranks sum the tables (disjoint rows: exact), so every rank holds the whole of it. Rank 0 stores it
as `reference_logps.safetensors` in the output folder (a temporary name, then a rename), one float32
[pairs, 2] tensor per split, with what it depends on in its metadata. A resume reads it from the
folder of the run that wrote the checkpoint and never recomputes: the model is trained by then. A
missing file, or one computed for other data or another model, is refused.

The in-memory table is the train rows, then the eval rows; every example gets its row as the
objective's `PAIR_INDEX` column.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from liger_cli.data.batches import even_shares
from liger_cli.errors import UserError
from liger_cli.model.objectives import PAIR_INDEX
from liger_cli.run.fingerprint import short_json
from liger_cli.run.inputs import data_shares
from liger_cli.run.sequence_parallel import attending

if TYPE_CHECKING:
    from liger_cli.recipe import Recipe
    from liger_cli.run.backends import Backend
    from liger_cli.run.inputs import Data

REFERENCE_FILE = "reference_logps.safetensors"
DEPENDS_ON = ("model", "model.config sha256", "data", "data.train sha256", "data.eval sha256")
"""The run fingerprint's fields that the values depend on (with the pair counts)."""


def precompute_for(
    recipe: Recipe,
    backend: Backend,
    model: torch.nn.Module,
    data: Data,
    collate: Callable,
    fingerprint: dict,
    say: Callable[[str], object],
    resume_from: Path | None,
    unit: str = "pair",
    split=None,
):
    """The `precompute` an objective's `prepare` calls: computes (fresh run) or reads (resume) the
    table, gives every example its row, and returns the table on the run's device. `model` is the
    prepared one (as the backend wrapped it); `collate` the objective's; `unit` what its examples are;
    `split` the run's sequence parallelism (each group computes its share, split as it trains)."""

    def precompute(values) -> torch.Tensor:
        accelerator = backend.accelerator
        splits = {"train": data.train, "eval": data.eval}
        splits = {name: dataset for name, dataset in splits.items() if dataset is not None}
        depends = {field: fingerprint[field] for field in DEPENDS_ON}
        depends |= {f"pairs.{name}": len(dataset) for name, dataset in splits.items()}
        counts = f"{len(data.train)} train / {len(data.eval) if data.eval is not None else 0} eval {unit}s"
        out = recipe.output.dir / REFERENCE_FILE
        if resume_from is None:
            start = time.perf_counter()
            pad_id, micro = data.tokenizer.pad_token_id, recipe.training.micro_batch_size
            tables = {
                name: _compute(model, dataset, values, collate, pad_id, micro, accelerator, split)
                for name, dataset in splits.items()
            }
            if accelerator.is_main_process:
                _write(out, tables, depends)
            say(f"reference log-probs: computed for {counts} in {time.perf_counter() - start:.1f}s "
                f"under {backend.name}; stored in {out}")  # fmt: skip
        else:
            source = resume_from.parent.parent / REFERENCE_FILE  # <run>/checkpoints/step-N
            tables = _read(source, resume_from, depends)
            if accelerator.is_main_process and source.resolve() != out.resolve():
                shutil.copyfile(source, out.with_name(f".tmp-{REFERENCE_FILE}"))
                os.replace(out.with_name(f".tmp-{REFERENCE_FILE}"), out)  # the new run folder resumes too
            say(f"reference log-probs: read from {source} ({counts}), not recomputed")
        accelerator.wait_for_everyone()
        first = 0
        for name, dataset in splits.items():
            rows = list(range(first, first + len(dataset)))
            setattr(data, name, dataset.add_column(PAIR_INDEX, rows))
            first += len(dataset)
        return torch.cat(list(tables.values())).to(accelerator.device)

    return precompute


def _compute(
    model, dataset, values, collate, pad_id: int, micro: int, accelerator, split=None
) -> torch.Tensor:
    """[len(dataset), k] float32 on every rank: `values(model, batch)` of every example, in order (under
    sequence parallelism every process of a group finds its batch's values: its first one keeps them)."""
    table = None
    for rows, real in even_shares(
        len(dataset), micro, *data_shares(accelerator, split.degree if split else 1)
    ):
        batch = collate([dataset[k] for k in rows], pad_id)
        batch = split.shard(batch) if split else batch
        with attending(split, batch):
            found = values(model, {k: v.to(accelerator.device) for k, v in batch.items()}).float()
        if table is None:
            table = torch.zeros(len(dataset), found.shape[1], device=accelerator.device)
        if real and (split is None or split.index == 0):
            table[rows.start : rows.stop] = found
    return accelerator.reduce(table, "sum").cpu()


def _write(path: Path, tables: dict[str, torch.Tensor], depends: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".tmp-{path.name}")
    save_file(tables, str(tmp), metadata={field: json.dumps(value) for field, value in depends.items()})
    os.replace(tmp, path)


def _read(path: Path, checkpoint: Path, depends: dict) -> dict[str, torch.Tensor]:
    """The stored tables, if computed for this run's data and model; else a one-line UserError."""
    from safetensors import SafetensorError, safe_open

    fix = "resume with the data and model it was computed for, or start a new run in another output.dir"
    try:
        with safe_open(str(path), "pt") as f:
            stored, tables = f.metadata() or {}, {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as err:
        why = "is missing" if not path.exists() else f"is unreadable ({str(err).splitlines()[0]})"
        raise UserError(
            f"cannot resume {checkpoint}: {path} (the reference log-probs of the model before training) "
            f"{why}, and they cannot be recomputed from a trained model; start a new run in another output.dir"
        ) from None
    for field, value in depends.items():
        try:
            recorded = json.loads(stored[field]) if field in stored else None
        except ValueError:
            recorded = stored[field]
        if recorded != value:
            raise UserError(
                f"cannot resume {checkpoint}: {path} was computed for another {field} (file: "
                f"{short_json(recorded)}, run: {short_json(value)}); {fix}"
            )
    for name, table in tables.items():
        if table.dim() != 2 or table.shape[0] != depends.get(f"pairs.{name}"):
            raise UserError(f"cannot resume {checkpoint}: {path} holds a {name} table of shape "
                            f"{tuple(table.shape)}, not one row per pair; {fix}")  # fmt: skip
    return {name: tables[name] for name in ("train", "eval") if name in tables}
