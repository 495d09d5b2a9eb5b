"""What one data file becomes: its examples, the dataset training receives, and what the report counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liger_cli.data.files import where


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
class Split:
    """One file's data after encoding: the examples before packing (with their file row and length
    before truncation) and the dataset training receives, plus counts for the report."""

    path: Path
    rows: int
    examples: Any  # datasets.Dataset: input_ids, labels, position_ids, row, length
    dataset: Any  # datasets.Dataset: input_ids, labels, position_ids (packed when packing is on)
    max_seq_len: int
    packing: bool
    truncated: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    warnings: list[DataWarning] = field(default_factory=list)
