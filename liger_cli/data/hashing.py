"""Content hashes: of data files and folders (the data cache's key, the run fingerprint) and of a tokenizer.

Hashes are remembered per process by each file's (path, size, mtime), so a file `liger train` hashes
for the cache key is not read again for the run fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_KNOWN: dict[tuple, str] = {}

# The files of a tokenizer folder that change how text becomes ids (weights and configs do not).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


def sha256_of(path: Path) -> str:
    """The sha256 of a file's bytes, or of every file under a folder (names and bytes, in order)."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = (str(path.resolve()), *((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if stamp in _KNOWN:
        return _KNOWN[stamp]
    digest = hashlib.sha256()
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    _KNOWN[stamp] = digest.hexdigest()
    return _KNOWN[stamp]


def tokenizer_hash(tokenizer) -> str | None:
    """What the encoding depends on in the tokenizer: its files (when it was loaded from a folder, else
    its whole serialised pipeline), its chat template, its special token ids and its class; None for an
    object that is none of these (then nothing is cached)."""
    digest = hashlib.sha256()
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    files = [folder / name for name in TOKENIZER_FILES] if folder.is_dir() else []
    files = [f for f in files if f.is_file()]
    for file in files:
        digest.update(file.name.encode() + b"\0" + sha256_of(file).encode())
    if not files and getattr(tokenizer, "backend_tokenizer", None) is not None:
        digest.update(tokenizer.backend_tokenizer.to_str().encode())
    elif not files and callable(getattr(tokenizer, "get_vocab", None)):
        digest.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    elif not files:
        return None
    template = getattr(tokenizer, "chat_template", None)
    specials = {
        "class": type(tokenizer).__name__,
        "chat_template": template if isinstance(template, str) else json.dumps(template, sort_keys=True),
        "bos": getattr(tokenizer, "bos_token_id", None),
        "eos": getattr(tokenizer, "eos_token_id", None),
        "pad": getattr(tokenizer, "pad_token_id", None),
        "padding_side": getattr(tokenizer, "padding_side", None),
    }
    digest.update(json.dumps(specials, sort_keys=True, default=str).encode())
    return digest.hexdigest()
