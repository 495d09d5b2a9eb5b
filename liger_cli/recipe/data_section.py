"""The recipe's `data` section: its sources (paths, Hub names, weighted lists) and encoding options."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, model_validator

from liger_cli.recipe.base import RelPath, _resolve, _Section

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def _data_path(value: Any, info: ValidationInfo) -> Any:
    """A data source: a local file or folder (a Path, anchored like every path), or a Hub dataset name
    (kept as the str it is): a name like `org/name` with no data-file suffix that is not a local path."""
    if (
        isinstance(value, str)
        and _HUB_NAME.fullmatch(value)
        and Path(value).suffix.lower() not in DATA_SUFFIXES
    ):
        base = (info.context or {}).get("base_dir")
        if not (Path(base) / value if base is not None else Path(value)).exists():
            return value
    if isinstance(value, str | Path):
        return _resolve(Path(value), info)
    return value


DataPath = Annotated[Path | str, BeforeValidator(_data_path)]


class DataSource(_Section):
    """One entry of a data.train / data.eval list."""

    path: DataPath
    """A local file, a local dataset folder, or a Hub dataset name."""
    weight: float = Field(1.0, gt=0)
    """train only: the source's share of the mixture's examples is weight / (sum of weights)."""
    format: Literal["text", "instruction", "chat", "preference", "unpaired", "prompt"] | None = None
    """The source's own format when it differs from data.format."""
    split: str | None = None
    """A Hub dataset's (or a saved DatasetDict's) split; default train."""
    subset: str | None = None
    """A Hub dataset's configuration (subset) name."""


def _entries(value: Any) -> Any:
    """A list's plain paths are entries with that path."""
    if isinstance(value, list):
        return [{"path": item} if isinstance(item, str | Path) else item for item in value]
    return value


Sources = Annotated[DataPath | DataSource | list[DataSource], BeforeValidator(_entries)]


class DataSection(_Section):
    """The data: train and eval sources, their format, and how they are encoded, cached and read."""

    train: Sources
    """A path or Hub name, one entry {path, weight, format, split, subset}, or a list of entries."""
    eval: Sources | None = None
    """Evaluation data, read whole, each source once (no weights)."""
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    """Hold out this share of data.train for evaluation, split by seed (instead of data.eval)."""
    format: Literal["text", "instruction", "chat", "preference", "unpaired", "prompt"] = "text"
    """How rows are read and what is learned: text, instruction, chat, preference (pairs), unpaired
    (completions labelled true or false: kto) or prompt (grpo)."""
    max_seq_len: int = Field(1024, ge=8)
    """Longer examples are truncated (the start is kept)."""
    packing: bool = False
    """Pack short examples into full rows whose position_ids restart at each example."""
    learn_turns: Literal["all", "last"] = "all"
    """chat: learn every assistant turn, or only the last one (earlier turns become context)."""
    learn_reasoning: bool = True
    """chat: learn the <think>...</think> blocks of assistant turns, or mask them out of the loss."""
    cache: bool = True
    """Keep the tokenized examples on disk, keyed by what they depend on, and read them back."""
    cache_dir: RelPath | None = None
    """Where the cache lives; default $LIGER_CACHE/data, else ~/.cache/liger/data (XDG_CACHE_HOME)."""
    num_proc: int | None = Field(None, ge=1)
    """Processes that tokenize in parallel (datasets' map num_proc); default: every usable core, at most one
    per 2000 rows (liger_cli.data.processes)."""
    streaming: bool = False
    """Read data.train as a stream (liger_cli.data.stream): never loaded whole, tokenized ahead of the loop."""

    def entries(self, which: str = "train") -> list[DataSource]:
        value = self.train if which == "train" else self.eval
        if value is None:
            return []
        return [v if isinstance(v, DataSource) else DataSource(path=v) for v in _as_list(value)]

    @model_validator(mode="after")
    def _one_eval(self) -> DataSection:
        if self.eval is not None and self.eval_fraction is not None:
            raise ValueError("set at most one of data.eval and data.eval_fraction")
        formats = {self.format} | {e.format for e in self.entries() + self.entries("eval") if e.format}
        if "chat" not in formats and self.learn_turns != "all":
            raise ValueError(
                "data.learn_turns applies to format: chat only; remove it or set data.format: chat"
            )
        if not formats & {"chat", "preference", "unpaired"} and not self.learn_reasoning:
            raise ValueError(
                "data.learn_reasoning applies to formats chat, preference and unpaired only; remove it or set "
                "data.format"
            )
        for which in ("train", "eval"):
            for i, entry in enumerate(self.entries(which)):
                kinds = {
                    f: f if f in ("preference", "unpaired", "prompt") else "example"
                    for f in (entry.format, self.format)
                }
                if entry.format is not None and kinds[entry.format] != kinds[self.format]:
                    raise ValueError(
                        f"data.{which}[{i}].format {entry.format} cannot be mixed with data.format "
                        f"{self.format}: preference pairs, unpaired completions, prompts and single examples "
                        "train different objectives"
                    )
                if which == "eval" and entry.weight != 1:
                    raise ValueError(
                        f"data.eval[{i}].weight: eval sources are each read whole, once; remove the weight"
                    )
        if self.streaming:
            self._check_streaming()
        return self

    def _check_streaming(self) -> None:
        """What a stream cannot do is refused up front (training.max_steps is checked by the Recipe)."""
        refused = {
            "eval_fraction": "a held-out split needs the whole file; give data.eval (read whole) instead",
            "packing": "packing is not supported while streaming; set data.packing: false",
        }
        for key, why in refused.items():
            if getattr(self, key) not in (None, False):
                raise ValueError(f"data.streaming does not support data.{key}: {why}")
        if self.format in ("preference", "unpaired"):
            raise ValueError(
                f"data.streaming does not support format {self.format} (reference log-probs need every "
                "example); set data.streaming: false"
            )
        sources = self.entries()
        if len(sources) != 1 or isinstance(self.train, list):
            raise ValueError(
                "data.streaming reads one train source (no weighted mixture): give data.train one .jsonl or "
                ".parquet file or one folder of such shards"
            )
        path = sources[0].path
        if not isinstance(path, Path):
            raise ValueError(
                f"data.streaming reads local files only, and {path} is a Hub dataset name: save it as "
                ".parquet or .jsonl shards in a folder and give that folder, or set data.streaming: false"
            )
        if path.suffix.lower() in (".json", ".csv"):
            raise ValueError(
                f"data.streaming reads .jsonl and .parquet files (and folders of them), not {path.suffix}: "
                "convert the file to .jsonl, or set data.streaming: false"
            )


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]
