"""`data.streaming: true`: the train data read as a stream, never loaded whole, tokenized ahead of the loop.

What is read: one `.jsonl` or `.parquet` file, or a folder of such shards (one type, in name order), row by
row (JSON lines: a line at a time; parquet: a batch of rows of one row group at a time), so memory does
not grow with the file. Every row is checked and encoded by the functions the cached path uses
(`files.row_check`, `build.batch_encoder`): the same masking, truncation, dropping, warnings and error
messages naming the file and the row (for a folder: the shard and the row in it). There is no shuffle:
examples come in file order (shuffle the file beforehand if its order matters); when the last file ends
the stream starts again at the first (a second pass, in the same order).

Where the stream is: a plain dict (JSON in `trainer_state.json`) naming the pass, the file, the next row
in it and, for JSON lines, that row's byte offset and line, plus the kept examples consumed so far.
Resuming seeks there: JSON lines by byte offset (nothing is re-read), parquet by row offset (the row
group that holds it is re-read up to the row, at most one row group).

Ranks: every rank reads and encodes the whole stream (a row's drop decision needs its encoding) and
keeps its share: global micro-batch g holds the next micro_batch_size x world kept examples, rank r takes
the r-th slice, as `batches.StepBatches` slices a global micro-batch. So the step's examples are those a
one-process run with the same global batch size trains on. Encoding runs on a thread that keeps up to
`PREFETCH` global micro-batches ready in a bounded queue; an error there (a bad row) is raised in the
loop's thread when the loop reaches it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from liger_cli.data.files import FORMAT_FIELDS, ROW_COLUMN, row_check, where
from liger_cli.data.split import DROP_COLUMN, WARNINGS_COLUMN
from liger_cli.errors import UserError

log = logging.getLogger(__name__)

STREAM_SUFFIXES = (".jsonl", ".parquet")
START = {"pass": 0, "file": 0, "row": 0, "byte": 0, "line": 0, "examples": 0}
CHUNK = 64  # rows encoded together (the batch the cached path's map gives batch_encoder is 1000)
PARQUET_BATCH = 1024
PREFETCH = 8  # global micro-batches encoded ahead of the loop


def stream_files(path: Path) -> list[Path]:
    """The files a stream reads: the file, or the folder's `.jsonl` / `.parquet` shards in name order."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() not in STREAM_SUFFIXES:
            raise UserError(
                f"data error: {path}: data.streaming reads .jsonl and .parquet files, not "
                f"{path.suffix or '(no extension)'}; convert it, or set data.streaming: false"
            )
        return [path]
    if not path.is_dir():
        raise UserError(f"data error: {path}: no such file or folder (check data.train in the recipe)")
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        raise UserError(
            f"data error: {path}: data.streaming does not read datasets.save_to_disk folders; write the "
            "dataset as parquet shards (Dataset.to_parquet) or set data.streaming: false"
        )
    shards = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in STREAM_SUFFIXES)
    if not shards:
        raise UserError(f"data error: {path}: the folder holds no .jsonl or .parquet files to stream")
    if len({p.suffix.lower() for p in shards}) > 1:
        raise UserError(
            f"data error: {path}: the folder mixes .jsonl and .parquet shards; keep one type per folder"
        )
    return shards


def read_stream(files: list[Path], fmt: str, start: dict) -> Iterator[tuple[dict, dict]]:
    """(row, where the next row is) for every row from `start` on, each checked for `fmt`; endless: after
    the last file the next pass starts at the first. The row carries its index in its file (ROW_COLUMN)."""
    check, at = row_check(fmt), dict(start)
    while True:
        whole, n = at["file"] == 0 and at["row"] == 0, 0  # a pass read from its start, and its rows
        for i in range(at["file"], len(files)):
            if i != at["file"]:
                at = {**at, "file": i, "row": 0, "byte": 0, "line": 0}
            path = files[i]
            if path.stat().st_size == 0:
                raise UserError(f"data error: {path}: the file is empty")
            rows = _jsonl_rows(path, at) if path.suffix.lower() == ".jsonl" else _parquet_rows(path, at)
            for row, at in rows:
                problem = check(row)
                if problem:
                    index = row[ROW_COLUMN]
                    raise UserError(
                        f"data error: {path} {where(path, index)}: {problem} ({FORMAT_FIELDS[fmt]})"
                    )
                n += 1
                yield row, at
        if whole and n == 0:
            raise UserError(
                f"data error: {files[0].parent if len(files) > 1 else files[0]}: no rows to stream"
            )
        at = {**at, "pass": at["pass"] + 1, "file": 0, "row": 0, "byte": 0, "line": 0}


def _jsonl_rows(path: Path, at: dict) -> Iterator[tuple[dict, dict]]:
    row, byte, line = at["row"], at["byte"], at["line"]
    with open(path, "rb") as f:
        f.seek(byte)
        for raw in f:
            byte, line = byte + len(raw), line + 1
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except UnicodeDecodeError as err:
                raise UserError(f"data error: {path} line {line}: not UTF-8 text ({err.reason})") from None
            except json.JSONDecodeError as err:
                raise UserError(
                    f"data error: {path} line {line}: invalid JSON ({err.msg}, column {err.colno})"
                ) from None
            if not isinstance(record, dict):
                raise UserError(
                    f"data error: {path} row {row + 1}: expected a JSON object, found {type(record).__name__}"
                )
            record[ROW_COLUMN] = row
            row += 1
            yield record, {**at, "row": row, "byte": byte, "line": line}


def _parquet_rows(path: Path, at: dict) -> Iterator[tuple[dict, dict]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - a broken file is the user's to fix, named
        raise UserError(f"data error: {path}: could not read the file as parquet: {err}") from None
    first_row, groups = 0, []  # the row groups from the one holding at["row"] on, and that group's first row
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if groups or first_row + n > at["row"]:
            groups.append(g)
        else:
            first_row += n
    if not groups:
        return
    row = first_row
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=groups):
        for record in batch.to_pylist():
            if row >= at["row"]:
                record[ROW_COLUMN] = row
                yield record, {**at, "row": row + 1}
            row += 1


def encoded_stream(
    path: Path, fmt: str, data_cfg, tokenizer, start: dict = START
) -> Iterator[tuple[dict, dict]]:
    """(example, where the stream is after it) for every kept example from `start` on: each chunk of rows
    encoded by the cached path's `batch_encoder`; dropped rows are skipped, each warning code and drop
    reason logged the first time it is seen."""
    from liger_cli.data.build import _check_tokenizer, batch_encoder

    if fmt not in ("text", "instruction", "chat"):
        raise UserError(f"data error: data.streaming does not read format {fmt}; set data.streaming: false")
    _check_tokenizer(tokenizer, fmt)
    files = stream_files(path)
    encoders = {i: batch_encoder(f, fmt, data_cfg, tokenizer) for i, f in enumerate(files)}
    seen: set[str] = set()
    whole = start["file"] == 0 and start["row"] == 0  # the current pass is read from its start
    kept, chunk, current = 0, [], start["pass"]
    for row, at in read_stream(files, fmt, start):
        if chunk and (
            len(chunk) == CHUNK or (at["pass"], at["file"]) != (chunk[0][1]["pass"], chunk[0][1]["file"])
        ):
            for item in _encode_chunk(chunk, encoders[chunk[0][1]["file"]], seen, files):
                kept += 1
                yield item
            chunk = []
        if at["pass"] != current:  # a pass read whole must have kept an example, or none ever will
            if whole and kept == 0:
                raise UserError(
                    f"data error: {path}: no example has a trainable token left after truncation at "
                    f"max_seq_len={data_cfg.max_seq_len}; raise data.max_seq_len"
                )
            whole, kept, current = True, 0, at["pass"]
        chunk.append((row, at))


def _encode_chunk(chunk: list[tuple[dict, dict]], encode_batch, seen: set[str], files: list[Path]):
    """The kept examples of rows of one file, each with where the stream is after it."""
    rows = [row for row, _ in chunk]
    names = list(dict.fromkeys(k for row in rows for k in row))
    batch = {name: [row.get(name) for row in rows] for name in names}  # a missing key is null, as in Arrow
    file = chunk[0][1]["file"]
    out = encode_batch(batch)
    for j, (_, at) in enumerate(chunk):
        for code, field, message in json.loads(out[WARNINGS_COLUMN][j]):
            if code not in seen:
                seen.add(code)
                log.warning("data warning %s: %s %s, %s: %s (first of its kind in the stream)",
                            code, files[file], where(files[file], out["row"][j]), field, message)  # fmt: skip
        if out[DROP_COLUMN][j]:
            if out[DROP_COLUMN][j] not in seen:
                seen.add(out[DROP_COLUMN][j])
                log.warning("data: %s: dropping rows: %s (first at row %d)", files[file], out[DROP_COLUMN][j],
                            out["row"][j] + 1)  # fmt: skip
            continue
        example = {k: out[k][j] for k in ("input_ids", "labels", "position_ids")}
        yield example, at


class StreamBatches:
    """This rank's micro-batches, in order, from an encoded stream read on a background thread.

    `open_stream(position)` gives (example, position after it) from `position` on. Global micro-batch g
    is the next micro_batch_size x world kept examples; this rank takes slice `rank` of it."""

    START = START

    def __init__(self, open_stream: Callable, micro_batch_size: int, world: int, rank: int):
        self.open_stream, self.micro_batch_size, self.world, self.rank = (
            open_stream,
            micro_batch_size,
            world,
            rank,
        )
        self.start, self.next_g = dict(START), 0
        self.at = dict(START)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def seek(self, position: dict, next_g: int) -> None:
        """Continue from a checkpoint's position (before the first micro-batch is asked for)."""
        if self._thread is not None:
            raise RuntimeError("seek after the stream started")
        self.start, self.at, self.next_g = {**START, **position}, {**START, **position}, next_g

    def examples(self, g: int) -> list[dict]:
        """The examples of global micro-batch g for this rank (asked for in order)."""
        if g != self.next_g:
            raise RuntimeError(f"the stream gives micro-batch {self.next_g} next, not {g}")
        if self._thread is None:
            self._queue = queue.Queue(maxsize=PREFETCH)
            self._thread = threading.Thread(target=self._produce, name="liger-stream", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        share, self.at = item
        self.next_g += 1
        return share

    def position(self) -> dict:
        """Where the stream is after the micro-batches given so far (saved with each checkpoint)."""
        return dict(self.at)

    def probe(self, n: int) -> list[dict]:
        """The stream's first n examples (the final check's probe batch); stops the reading thread first,
        since a tokenizer is not to be used from two threads at once."""
        self.close()
        found = []
        for example, _ in self.open_stream(dict(START)):
            found.append(example)
            if len(found) == n:
                break
        return found

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:  # unblock a producer waiting on a full queue
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread = None

    def _produce(self) -> None:
        size = self.micro_batch_size * self.world
        mine = slice(self.rank * self.micro_batch_size, (self.rank + 1) * self.micro_batch_size)
        consumed = self.start["examples"]
        try:
            group = []
            for example, at in self.open_stream(dict(self.start)):
                group.append(example)
                if len(group) == size:
                    consumed += size
                    if not self._put((group[mine], {**at, "examples": consumed})):
                        return
                    group = []
        except BaseException as err:  # noqa: BLE001 - raised in the loop's thread by `examples`
            self._put(err)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False
