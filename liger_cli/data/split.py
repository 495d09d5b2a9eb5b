"""What one data source becomes: its examples, the dataset training receives, and what the report counts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liger_cli.data.files import where

# Columns of an encoded table (one row per source row, cached) that `split_of` turns into counts.
DROP_COLUMN = "drop"  # why the row was dropped ("" when kept)
WARNINGS_COLUMN = "warnings"  # the row's warnings: a JSON list of [code, field, message]


@dataclass
class DataWarning:
    code: str
    path: Path
    row: int  # 0-based index in the file
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.path} {where(self.path, self.row)}, {self.field}: {self.message}"


@dataclass
class Share:
    """One source's part of a mixture: its own split, its weight, and which of its examples the mixture
    takes (indices into `split.examples`, repeated where the weight asks for more than it has)."""

    split: Split
    weight: float
    taken: list[int]


@dataclass
class Split:
    """One source's data after encoding (or a mixture of several): the examples before packing (with
    their file row and length before truncation) and the dataset training receives, plus counts for
    the report."""

    path: Path
    rows: int
    examples: Any  # datasets.Dataset: input_ids, labels, position_ids, row, length
    dataset: Any  # datasets.Dataset: input_ids, labels, position_ids (packed when packing is on)
    max_seq_len: int
    packing: bool
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    warnings: list[DataWarning] = field(default_factory=list)
    cache: str = "off"
    """What the tokenized-data cache did: "hit (path)", "built (path)" or "off"."""
    processes: int = 0
    """How many processes tokenized the source in this run (0: read from the cache)."""
    shares: list[Share] = field(default_factory=list)
    """A mixture's sources (empty for one source)."""
    source_of: list[int] = field(default_factory=list)
    """In a mixture: example i came from shares[source_of[i]]."""


def split_of(
    table, path: Path, max_seq_len: int, packing: bool, order: list[int] | None, cache: str
) -> Split:
    """The Split of the table's rows at `order` (all, in order, when None): kept examples in that order,
    dropped rows counted by reason, warnings, truncations. Column operations: only the rows that carry
    a warning or a drop reason are looked at one by one."""
    import numpy as np
    import pyarrow.compute as pc

    data = table.data
    order = np.arange(len(table)) if order is None else np.asarray(order, dtype=np.int64)
    dropped = pc.not_equal(data.column(DROP_COLUMN), "").to_numpy(zero_copy_only=False)[order]
    noted = pc.invert(pc.is_in(data.column(WARNINGS_COLUMN), value_set=_no_warnings()))
    noted = noted.to_numpy(zero_copy_only=False)[order]
    split = Split(path, len(order), None, None, max_seq_len, packing, cache=cache)
    if noted.any():
        at = order[noted]
        rows = data.column("row").take(at).to_pylist()
        for i, notes in zip(rows, data.column(WARNINGS_COLUMN).take(at).to_pylist(), strict=True):
            for code, field_, message in json.loads(notes):
                split.warnings.append(DataWarning(code, path, i, field_, message))
    for reason in data.column(DROP_COLUMN).take(order[dropped]).to_pylist():
        split.dropped[reason] = split.dropped.get(reason, 0) + 1
    kept = order[~dropped]
    lengths = data.column("length").to_numpy()
    split.truncated = int((lengths[kept] > max_seq_len).sum())
    split.examples = table.select(kept, keep_in_memory=True).remove_columns([DROP_COLUMN, WARNINGS_COLUMN])
    return split


def _no_warnings():
    import pyarrow as pa

    return pa.array(["", "[]"])
