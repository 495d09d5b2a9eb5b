"""Where rows come from: a local file, a local dataset folder, or a Hub dataset; one or a weighted list.

`data.train` / `data.eval` is one source or a list of them. A source is
- a local file (`.jsonl`, `.json`, `.parquet`, `.csv`: liger_cli.data.files);
- a local folder: what `datasets.save_to_disk` writes (a Dataset, or a DatasetDict whose `split` is
  taken, `train` by default), or a folder of `.parquet` / `.jsonl` / `.json` / `.csv` shards of one
  type, read in name order;
- a Hub dataset name (`org/name`, not a local path), read through `datasets.load_dataset` with its
  `subset` and `split` (default `train`), so the user's Hub cache, token and `HF_HUB_OFFLINE` apply.
Every row is validated for the source's format, as a file's rows are.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from liger_cli.data.files import LOADERS, ROW_COLUMN, load_rows, quiet_datasets, validate_rows
from liger_cli.data.hashing import sha256_of
from liger_cli.errors import UserError


@dataclass(frozen=True)
class Source:
    path: Path | str  # a local Path, or a Hub dataset name (str)
    format: str
    weight: float = 1.0
    split: str | None = None
    subset: str | None = None

    @property
    def is_hub(self) -> bool:
        return not isinstance(self.path, Path)

    def __str__(self) -> str:
        if not self.is_hub:
            return str(self.path)
        return str(self.path) + (f" ({self.subset})" if self.subset else "") + f"[{self.split or 'train'}]"


def sources_of(value, default_format: str) -> list[Source]:
    """The recipe's data.train / data.eval (a path, a name, one entry or a list of entries) as Sources."""
    if value is None:
        return []
    entries = value if isinstance(value, list | tuple) else [value]
    found = []
    for entry in entries:
        if isinstance(entry, Path | str):
            entry = {"path": entry}
        elif not isinstance(entry, dict):
            entry = {k: getattr(entry, k, None) for k in ("path", "weight", "format", "split", "subset")}
        path = entry["path"]
        found.append(
            Source(
                path=_local_or_hub(path),
                format=entry.get("format") or default_format,
                weight=float(entry.get("weight") or 1.0),
                split=entry.get("split"),
                subset=entry.get("subset"),
            )
        )
    return found


def _local_or_hub(path: Path | str) -> Path | str:
    """A str that names a data file or starts like a path is local; else a Hub name (the recipe's schema
    has already turned every local path into a Path)."""
    if isinstance(path, Path):
        return path
    local = Path(path).expanduser()
    if local.suffix.lower() in LOADERS or path.startswith((".", "/", "~")):
        return local
    return path


def local_paths(value) -> list[Path]:
    """The local files and folders among the sources (for the output-folder checks)."""
    return [s.path for s in sources_of(value, "text") if not s.is_hub]


_HUB_ROWS: dict[tuple, object] = {}


def content_hash(source: Source) -> str:
    """The sha256 of the source's content: its file's bytes, its folder's files, or for a Hub dataset the
    version `datasets` resolved (its fingerprint), with the subset and split."""
    if not source.is_hub:
        if not Path(source.path).exists():
            read_rows(source)  # raises the UserError that says what is missing
        return sha256_of(Path(source.path))
    rows = _hub_rows(source)
    text = f"hub\0{source.path}\0{source.subset}\0{source.split}\0{rows._fingerprint}"
    return hashlib.sha256(text.encode()).hexdigest()


def read_rows(source: Source):
    """The source's rows as a `datasets.Dataset`, every row validated, with ROW_COLUMN added."""
    if source.is_hub:
        rows = _hub_rows(source)
    else:
        path = Path(source.path)
        if not path.is_dir():
            if path.suffix.lower() not in LOADERS and not path.exists():
                raise UserError(
                    f"data error: {path}: no such file or folder (check data.train / data.eval in the recipe)"
                )
            return load_rows(path, source.format)
        rows = _folder_rows(path, source)
    if len(rows) == 0:
        raise UserError(f"data error: {source}: the dataset has no rows")
    validate_rows(rows, source.path if not source.is_hub else Path(str(source)), source.format)
    return rows.add_column(ROW_COLUMN, list(range(len(rows))))


def _folder_rows(path: Path, source: Source):
    import datasets

    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        try:
            with quiet_datasets():
                found = datasets.load_from_disk(str(path), keep_in_memory=False)
        except Exception as err:  # noqa: BLE001 - a broken save is the user's to fix, named
            raise UserError(f"data error: {path}: could not read the saved dataset: {_last(err)}") from err
        if isinstance(found, datasets.DatasetDict):
            split = source.split or "train"
            if split not in found:
                raise UserError(
                    f"data error: {path}: the saved dataset has no split {split!r} (it has "
                    f"{', '.join(found)}); set split: in the data entry"
                )
            return found[split]
        return found
    shards = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOADERS)
    kinds = {LOADERS[p.suffix.lower()] for p in shards}
    if not shards:
        raise UserError(
            f"data error: {path}: the folder holds no dataset: neither what datasets.save_to_disk writes "
            f"nor {', '.join(LOADERS)} files"
        )
    if len(kinds) > 1:
        raise UserError(
            f"data error: {path}: the folder mixes file types ({', '.join(sorted(kinds))}); keep one type "
            "per folder, or list the files as separate data entries"
        )
    try:
        with quiet_datasets():
            return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in shards], split="train")
    except Exception as err:  # noqa: BLE001
        raise UserError(f"data error: {path}: could not read its shards: {_last(err)}") from err


def _hub_rows(source: Source):
    key = (source.path, source.subset, source.split)
    if key in _HUB_ROWS:
        return _HUB_ROWS[key]
    import datasets

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        with quiet_datasets():
            rows = datasets.load_dataset(source.path, source.subset, split=source.split or "train")
    except Exception as err:  # noqa: BLE001 - every Hub failure is one line naming the dataset
        if offline:
            raise UserError(
                f"data error: {source.path}: not a local file or folder, and as a Hub dataset it is not in "
                "your Hub cache while HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it once, or "
                "give a local path"
            ) from None
        raise UserError(
            f"data error: {source.path}: not a local file or folder, and could not load it as a Hub "
            f"dataset: {_last(err)}"
        ) from None
    if isinstance(rows, datasets.DatasetDict):  # pragma: no cover - split is always given
        rows = rows[source.split or "train"]
    _HUB_ROWS[key] = rows
    return rows


def _last(err: BaseException) -> str:
    from liger_cli.data.files import _last_line

    return _last_line(err)
