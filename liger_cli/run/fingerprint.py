"""What a run's numbers depend on, recorded in every checkpoint and compared on resume.

A checkpoint continues only the run that wrote it: the same model (path and config), adapter,
data (files and their content), seed, batch sizes, process count and backend. `training.max_steps`
(or `epochs`) is deliberately not part of it: a finished run may be continued for longer.
"""

from __future__ import annotations

import json
from pathlib import Path

from liger_cli.data.hashing import sha256_of
from liger_cli.data.sources import content_hash, sources_of
from liger_cli.errors import UserError
from liger_cli.recipe import Recipe

FINGERPRINT_FILE = "run.json"


def fingerprint(recipe: Recipe, num_processes: int, backend: str) -> dict:
    """Field name -> JSON value, for every setting the run's math depends on."""
    m, d, t = recipe.model, recipe.data, recipe.training
    source = Path(m.path or m.config)
    config = source / "config.json" if source.is_dir() else source
    data = d.model_dump(mode="json", exclude={"cache", "cache_dir", "num_proc"})  # how, not what
    found = {
        "model": str(source.resolve()),
        "model.config sha256": sha256_of(config) if config.is_file() else None,
        "adapter": recipe.adapter.model_dump(mode="json"),
        "data": data,
        "data.train sha256": _data_hashes(d.train, d.format),
        "data.eval sha256": _data_hashes(d.eval, d.format),
        "training.seed": t.seed,
        "training.micro_batch_size": t.micro_batch_size,
        "training.grad_accum": t.grad_accum,
        "processes": num_processes,
        "distributed.backend": backend,
    }
    if recipe.distributed.sequence_parallel > 1:  # the data is sharded over the groups, not the processes
        found["distributed.sequence_parallel"] = recipe.distributed.sequence_parallel
    if recipe.rl is not None and recipe.rl.max_staleness:  # which weights sample each batch
        found["rl.max_staleness"] = recipe.rl.max_staleness
    return json.loads(json.dumps(found))  # exactly what a JSON round trip gives back


def _data_hashes(value, fmt: str):
    """One source: its content hash (as before lists existed); a list: [source, weight, hash] each."""
    sources = sources_of(value, fmt)
    if not sources:
        return None
    if not isinstance(value, list) and sources[0].weight == 1:
        return content_hash(sources[0])
    return [[str(s), s.weight, content_hash(s)] for s in sources]


def write_fingerprint(folder: Path, found: dict) -> None:
    (folder / FINGERPRINT_FILE).write_text(json.dumps(found, indent=2, sort_keys=True))


def check_same_run(checkpoint: Path, found: dict) -> None:
    """A resume that would not continue the same run is a user error naming the first field that differs."""
    path = checkpoint / FINGERPRINT_FILE
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        raise UserError(
            f"cannot resume {checkpoint}: it has no readable {FINGERPRINT_FILE} (what the run depends on); "
            "start a new run in another output.dir"
        ) from None
    only_recorded = [f for f in recorded if f not in found]  # a field only the checkpoint has differs too
    for field in [*found, *only_recorded]:
        value = found.get(field)
        if recorded.get(field) != value:
            raise UserError(
                f"cannot resume {checkpoint}: {field} differs (checkpoint: {short_json(recorded.get(field))}, "
                f"recipe: {short_json(value)}); resume with the recipe that wrote it, or start a new run in "
                "another output.dir"
            )


def short_json(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."
