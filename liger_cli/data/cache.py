"""The tokenized-data cache: each source is tokenized once, then read back (Arrow, memory-mapped).

An entry holds one source's encoded rows exactly as tokenizing gave them (every row, kept or dropped,
with its warnings), so the eval split, the mixture and the report are computed from it as from a
fresh tokenization. Its key is the sha256 of everything the encoding depends on:
- the source's content hash (file bytes, folder files, or the Hub version `datasets` resolved);
- the tokenizer: its files, chat template, special token ids (liger_cli.data.hashing.tokenizer_hash);
- the data section's encoding options: format, max_seq_len, learn_turns, learn_reasoning;
- CACHE_VERSION and the transformers / tokenizers versions.
An entry of image rows (liger_cli.data.images) also records an image key: the sha256 of every image
file its rows read (data: URIs are in the data file) and of the processor's files. A hit needs the
image key computed now to match, so changing an image's bytes or the processor's sizes rebuilds the
entry (the images are found from the entry's own rows, so a source without images never pays for it).
Not in the key, because they are applied after reading the entry: weights (the mixture),
eval_fraction, packing and the seed. So changing a weight or packing re-uses every entry.

An entry is written under a temporary name (`<key>.tmp-<host>-<pid>`) and renamed into place, so a
reader never sees half of one; an entry that fails to load (corrupt, or not liger's) is removed and
rebuilt, with a log line. `datasets`' own fingerprint cache is never relied on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from liger_cli.data.files import quiet_datasets
from liger_cli.data.hashing import tokenizer_hash
from liger_cli.data.images import IMAGE_FILES, image_key
from liger_cli.data.sources import Source, content_hash

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 3: a prompt row's messages with tool calls are kept as JSON text (data/prompts.py)
"""Raise when the encoded columns or their meaning change: every old entry is then a miss."""
ENTRY_FILE = "liger_entry.json"


def cache_root(data_cfg) -> Path | None:
    """Where entries live: data.cache_dir, else $LIGER_CACHE/data, else <user cache>/liger/data; None when
    data.cache is false."""
    if not getattr(data_cfg, "cache", True):
        return None
    if getattr(data_cfg, "cache_dir", None) is not None:
        return Path(data_cfg.cache_dir)
    if os.environ.get("LIGER_CACHE"):
        return Path(os.environ["LIGER_CACHE"]).expanduser() / "data"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "liger" / "data"


def entry_key(source: Source, data_cfg, tokenizer, tools: list[dict] | None = None) -> str | None:
    """The entry's name; None when the tokenizer cannot be hashed (then nothing is cached)."""
    import tokenizers
    import transformers

    tokenizer_part = tokenizer_hash(tokenizer)
    if tokenizer_part is None:
        return None
    parts = {
        "version": CACHE_VERSION,
        "content": content_hash(source),
        "subset": source.subset,
        "split": source.split,
        "format": source.format,
        "max_seq_len": data_cfg.max_seq_len,
        "learn_turns": getattr(data_cfg, "learn_turns", "all"),
        "learn_reasoning": getattr(data_cfg, "learn_reasoning", True),
        "tokenizer": tokenizer_part,
        "libraries": [transformers.__version__, tokenizers.__version__],
    }
    if tools is not None:  # prompts rendered with the run's tool schemas (rl.tools)
        parts["tools"] = tools
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load_entry(root: Path, key: str, tokenizer=None):
    """The entry's table, or None when there is none; a broken entry, or one whose images or processor
    changed since it was written (its image key), is removed (and logged)."""
    import datasets

    folder = root / key
    if not folder.exists():
        return None
    try:
        meta = json.loads((folder / ENTRY_FILE).read_text())
        with quiet_datasets():
            table = datasets.load_from_disk(str(folder))
        if meta.get("key") != key or len(table) != meta.get("rows"):
            raise ValueError("its record does not match its rows")
        table.data.validate()
        if meta.get("images") is not None and meta["images"] != _image_key(table, tokenizer):
            log.info(
                "data cache: %s: an image or the processor changed since it was built; rebuilding", folder
            )
            shutil.rmtree(folder, ignore_errors=True)
            return None
    except Exception as err:  # noqa: BLE001 - any unreadable entry is rebuilt, never used
        log.warning("data cache: %s is unreadable (%s); removing and rebuilding it", folder, err)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return table


def _image_key(table, tokenizer) -> str | None:
    """The image key of a table of image rows (None for other tables), from its image files column."""
    if IMAGE_FILES not in table.column_names:
        return None
    import pyarrow.compute as pc

    files = pc.unique(pc.list_flatten(table.data.column(IMAGE_FILES))).to_pylist()
    return image_key(files, tokenizer)


def save_entry(root: Path, key: str, table, source: Source, tokenizer=None) -> Path:
    """Write under a temporary name, then rename into place (another process may have won: keep theirs)."""
    folder = root / key
    tmp = root / f"{key}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    with quiet_datasets():
        table.save_to_disk(str(tmp))
    record = {"key": key, "rows": len(table), "source": str(source), "format": source.format}
    if (images := _image_key(table, tokenizer)) is not None:
        record["images"] = images
    (tmp / ENTRY_FILE).write_text(json.dumps(record, indent=2))
    try:
        os.replace(tmp, folder)
    except OSError:
        if not folder.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # written meanwhile by another process: theirs is as good
    return folder


@dataclass
class Entry:
    """One source's place in the cache: its table once read or built, and what the cache did."""

    source: Source
    root: Path | None = None
    key: str | None = None
    table: object | None = None
    status: str = "off"
    processes: int = 0
    """How many processes tokenized it in this run (0: read from the cache)."""
    tokenizer: object | None = None
    """The tokenizer it is encoded with (an entry of image rows checks its processor's files)."""


def look_up(source: Source, data_cfg, tokenizer, tools: list[dict] | None = None) -> Entry:
    """The source's entry, with its table on a hit (status "hit (path)"); no table on a miss or when off."""
    root = cache_root(data_cfg)
    key = entry_key(source, data_cfg, tokenizer, tools) if root is not None else None
    if key is None:
        return Entry(source)
    table = load_entry(root, key, tokenizer)
    if table is None:
        return Entry(source, root, key, tokenizer=tokenizer)
    log.info("data cache: hit for %s (%s)", source, root / key)
    return Entry(source, root, key, table, f"hit ({root / key})", tokenizer=tokenizer)


def keep(entry: Entry, fresh) -> None:
    """Store a freshly tokenized table (status "built (path)"), then read it back memory-mapped."""
    entry.table = fresh
    if entry.root is None:
        return
    try:
        folder = save_entry(entry.root, entry.key, fresh, entry.source, entry.tokenizer)
    except OSError as err:
        log.warning("data cache: cannot write under %s (%s); going on without the cache", entry.root, err)
        entry.status = f"off (cannot write {entry.root})"
        return
    log.info("data cache: built %s for %s", folder, entry.source)
    table = load_entry(entry.root, entry.key, entry.tokenizer)
    entry.table = fresh if table is None else table
    entry.status = f"built ({folder})"
