"""Images in chat rows: the parts that carry them, their bytes, and the model's processor that reads them.

A user (or system) turn's `content` may be a list of parts instead of a string:
`{"type": "text", "text": ...}`, `{"type": "image", "path": "img/1.png"}` (relative to the data file's
folder, or absolute), or `{"type": "image", "image": "data:image/png;base64,..."}` (an `image` that is
not a data: URI is read as a path). Images are read with PIL and processed by the processor saved
with the model (`AutoProcessor`), never fetched from a URL. liger_cli.data.image_rows encodes them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import weakref
from dataclasses import dataclass
from pathlib import Path

from liger_cli.data.hashing import sha256_of
from liger_cli.errors import UserError

# The processor's files that change what an image becomes (its sizes, means, patching, template).
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "image_processor_config.json",
    "chat_template.jinja",
    "chat_template.json",
)

_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (model folder, remote)
_PROCESSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> processor


@dataclass
class Picture:
    """One image part: where it is in the row, the file it came from ("" for a data: URI), its bytes."""

    field: str
    file: str
    data: bytes


def image_parts(messages) -> list[tuple[str, dict]]:
    """(field, part) of each image part, in the order the template writes them."""
    found = []
    for i, message in enumerate(messages or []):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image":
                    found.append((f"messages[{i}].content[{j}]", part))
    return found


def has_images(rows) -> bool:
    """Whether any row of a chat source has an image part. A `messages.content` column that `datasets`
    typed as strings has none, which is decided from the schema alone."""
    from datasets import Value

    feature = getattr(rows, "features", {}).get("messages")
    inner = getattr(feature, "feature", None)
    content = inner.get("content") if isinstance(inner, dict) else None
    if isinstance(content, Value) and content.dtype in ("string", "large_string"):
        return False
    return any(image_parts(messages) for messages in rows["messages"])


def check_part(part: dict) -> str | None:
    """The part's problem (a str for the row's message), or None."""
    kind = part.get("type")
    if kind == "text":
        return None if isinstance(part.get("text"), str) else 'a text part needs a string "text"'
    if kind == "image":
        if part.get("url") is not None:
            return 'image parts with "url" are not fetched; download the image and give its "path"'
        found = [k for k in ("path", "image") if isinstance(part.get(k), str)]
        return None if found else 'an image part needs "path" (a file) or "image" (a data: URI or a path)'
    return f'a part\'s "type" must be "text" or "image", found {kind!r}'


def read_picture(field: str, part: dict, base: Path | None) -> Picture:
    """The part's bytes, checked to be an image PIL reads; a ValueError naming the file otherwise."""
    value = part.get("path") or part.get("image")
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        try:
            data = base64.b64decode(payload, validate=True) if head.endswith(";base64") else payload.encode()
        except (binascii.Error, ValueError):
            raise ValueError(f'field "{field}": the data: URI is not valid base64') from None
        file, shown = "", "the data: URI"
    else:
        path = Path(value).expanduser()
        if not path.is_absolute():
            if base is None:
                raise ValueError(f'field "{field}": image {value}: a relative path needs a local data file')
            path = base / path
        file, shown = str(path.resolve()), f"image {value}"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ValueError(
                f'field "{field}": {shown}: file not found ({path}; paths are relative to the data file\'s folder)'
            ) from None
        except OSError as err:
            raise ValueError(f'field "{field}": {shown}: cannot read it ({err.strerror})') from None
    try:
        open_image(data).load()
    except Exception as err:  # noqa: BLE001 - any PIL failure is the user's file, named
        raise ValueError(f'field "{field}": {shown} is not an image PIL can read ({err})') from None
    return Picture(field, file, data)


def open_image(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))


def remember_model(tokenizer, model_path, trust_remote_code: bool) -> None:
    """Where the processor for this tokenizer's model lives (liger_cli.data.tokenizer calls it): the
    processor is only loaded when a row has an image."""
    _SOURCES[tokenizer] = (str(model_path), bool(trust_remote_code))


def processor_source(tokenizer) -> tuple[str, bool]:
    return _SOURCES.get(tokenizer) or (str(getattr(tokenizer, "name_or_path", "") or ""), False)


def processor_for(tokenizer):
    """The model's processor (AutoProcessor, loaded once per tokenizer); a UserError when the model has
    none that handles images, or it has no chat template."""
    found = _PROCESSORS.get(tokenizer)
    if found is not None:
        return found
    source, remote = processor_source(tokenizer)
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=remote)
    except (OSError, ValueError, ImportError) as err:
        raise UserError(
            f"data error: rows with images need the model's processor, and {source} has none that loads: "
            f"{str(err).splitlines()[0]}; save the processor beside the model (processor.save_pretrained)"
        ) from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "image_token", None) is None:
        raise UserError(
            f"data error: rows with images need the model's processor, and {source} has none with an image "
            "processor and an image token (processor_config.json); use a vision-language model or text rows"
        )
    if not chat_template(processor):
        raise UserError(
            f"data error: the processor at {source} has no chat template, so image rows cannot be rendered; "
            "add chat_template.jinja to the model folder"
        )
    _PROCESSORS[tokenizer] = processor
    return processor


def chat_template(processor):
    """The processor's chat template, else its tokenizer's (as its apply_chat_template takes them)."""
    return processor.chat_template or getattr(processor.tokenizer, "chat_template", None)


def processor_hash(tokenizer) -> str:
    """The processor's files (sizes, means, patching, template) by content, for the cache's image key."""
    source, _ = processor_source(tokenizer)
    folder = Path(source)
    digest = hashlib.sha256()
    for name in PROCESSOR_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + sha256_of(folder / name).encode())
    return digest.hexdigest()


def image_key(files, tokenizer) -> str:
    """What an entry of image rows depends on beyond its data file: every image file's bytes (data:
    URIs are in the data file already) and the processor's files."""
    digest = hashlib.sha256(processor_hash(tokenizer).encode())
    for file in sorted(set(files) - {""}):
        path = Path(file)
        digest.update(file.encode() + b"\0" + (sha256_of(path).encode() if path.is_file() else b"missing"))
    return digest.hexdigest()


# Columns of an encoded table of image rows (only sources with an image row have them).
IMAGES_COLUMN = "images"  # the processor's image tensors of the row, as safetensors bytes (b"" for none)
IMAGE_FILES = "image_files"  # each image's file ("" for a data: URI)
IMAGE_STARTS = "image_starts"  # each image's first token
IMAGE_TOKENS = "image_tokens"  # how many tokens each image became
IMAGE_COLUMNS = (IMAGES_COLUMN, IMAGE_FILES, IMAGE_STARTS, IMAGE_TOKENS)


# Per-token outputs of a processor (which tokens are image tokens: Gemma 3's token_type_ids for its
# bidirectional image attention, Qwen-VL's mm_token_type_ids for M-RoPE positions), kept per row under
# PER_TOKEN + name and padded by `batch_images` like input_ids.
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")
PER_TOKEN = "per_token."


def batch_images(blobs, lengths: list[int], length: int, left: bool = False) -> dict:
    """The rows' image tensors as the model's forward takes them: each key's tensors concatenated along
    dim 0 in row order (LLaVA's pixel_values [images, 3, H, W], Qwen2-VL's flattened patches and
    image_grid_thw [images, 3], image_sizes [images, 2]); rows without images add nothing. Every key
    the processor returned besides the text's becomes a keyword of the model's forward. Per-token keys
    (TOKEN_TYPE_KEYS) are cut to each row's `lengths` (truncation only cuts the end, never an image)
    and padded with 0 to `length`, on the right as training pads, or on the `left` as prompts are
    padded for generation; a row without images is all 0 (text)."""
    import torch
    from safetensors.numpy import load

    found: dict[str, list] = {}
    loaded = [load(blob) if blob else {} for blob in blobs]
    per_token = {name for row in loaded for name in row if name.startswith(PER_TOKEN)}
    for name in sorted(per_token):
        rows = []
        for row, n in zip(loaded, lengths, strict=True):
            values = torch.zeros(length, dtype=torch.long)
            if name in row:
                values[length - n if left else 0 : length if left else n] = torch.from_numpy(
                    row[name][:n].astype("int64")
                )
            rows.append(values)
        found[name.removeprefix(PER_TOKEN)] = [torch.stack(rows)]
    for row in loaded:
        for name, value in row.items():
            if not name.startswith(PER_TOKEN):
                found.setdefault(name, []).append(torch.from_numpy(value.copy()))
    try:
        return {name: torch.cat(values) for name, values in found.items()}
    except RuntimeError as err:
        raise ValueError(
            f"the processor's image tensors of these rows do not join along their first dimension ({err}); "
            "use micro_batch_size 1 for this model"
        ) from None
