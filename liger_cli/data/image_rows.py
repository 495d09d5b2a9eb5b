"""Chat rows with images -> token ids, labels and the processor's image tensors, by one generic path.

1. The conversation is rendered and labelled as a text row is (liger_cli.data.chat_batch), under the
   processor's chat template, which writes each image part as the model's image placeholder.
2. The rendered text and the images (read with PIL, liger_cli.data.images) go through the model's own
   processor, which expands each placeholder into as many image tokens as the vision side gives
   (LLaVA: one per patch; Qwen2-VL: one per merged patch group; Gemma 3: a fixed block) and returns
   the image tensors (pixel_values, and image_grid_thw / image_sizes where the model takes them).
3. The processor's ids are aligned with the text's: labels carry over; the image tokens and whatever
   else the expansion added are -100, so images are never learned. Each image's first token and
   token count come from the alignment; a learned token the expansion changed is an error.

How images travel to the batch: the processor's image tensors for a row are kept in the row, one
safetensors blob (IMAGES_COLUMN), and the collate function concatenates them along dim 0
(liger_cli.data.images.batch_images). Why not keep the image bytes and process at collate time: the
cache then holds exactly what training receives, as it does for tokens (the ids above already depend on
the processed sizes); the collate function needs nothing but the rows, as every objective, the twin
and the final check call it without a processor; and each image is processed once, not once per
epoch. The price: processed pixels are larger than image files (a 336x336 LLaVA image is 1.35 MB of
float32), and the cache folder holds them.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from liger_cli.data.chat import conversation, render
from liger_cli.data.chat_batch import encode_chats
from liger_cli.data.encode import IGNORE_INDEX, Encoded
from liger_cli.data.images import (
    PER_TOKEN,
    TOKEN_TYPE_KEYS,
    Picture,
    chat_template,
    check_part,
    image_parts,
    open_image,
    processor_for,
    processor_source,
    read_picture,
)

TEXT_KEYS = {"input_ids", "attention_mask"}  # rebuilt by the collate function from the aligned ids

# tokenizer -> a copy of it under the processor's chat template (liger_cli.data.chat caches per tokenizer)
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class ImageEncoded(Encoded):
    """An Encoded row with images: the processor's image tensors (safetensors bytes), each image's file
    ("" for a data: URI), its first token and its token count."""

    images: bytes = b""
    files: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


def image_chat_encoder(base: Path | None, learn_turns: str, learn_reasoning: bool):
    """The function (rows, tokenizer) -> each row's Encoded (ImageEncoded for a row with images) or its
    ValueError: rows without images go through the text path unchanged."""

    def encode(rows, tokenizer):
        pictured = [bool(image_parts(row["messages"])) for row in rows]
        plain = [row for row, has in zip(rows, pictured, strict=True) if not has]
        texts = iter(encode_chats(plain, tokenizer, learn_turns, learn_reasoning))
        with_images = [row for row, has in zip(rows, pictured, strict=True) if has]
        images = iter(
            encode_image_chats(with_images, tokenizer, base, learn_turns, learn_reasoning)
            if with_images
            else []
        )
        return [next(images) if has else next(texts) for has in pictured]

    return encode


def encode_image_chats(rows, tokenizer, base: Path | None, learn_turns="all", learn_reasoning=True) -> list:
    """Each row's ImageEncoded, or the ValueError naming the field (and file) that is wrong."""
    processor = processor_for(tokenizer)
    view = template_view(tokenizer, processor)
    image_id = image_token_id(processor, processor_source(tokenizer)[0])
    pictures: list = []
    for row in rows:
        try:
            pictures.append([read_picture(f, part, base) for f, part in image_parts(row["messages"])])
        except ValueError as err:
            pictures.append(err)
    ready = [row for row, pics in zip(rows, pictures, strict=True) if not isinstance(pics, ValueError)]
    texts = iter(encode_chats(ready, view, learn_turns, learn_reasoning))
    out = []
    for row, pics in zip(rows, pictures, strict=True):
        enc = pics if isinstance(pics, ValueError) else next(texts)
        if not isinstance(enc, ValueError):
            try:
                enc = expand(row, enc, pics, view, processor, image_id)
            except ValueError as err:
                enc = err
        out.append(enc)
    return out


def template_view(tokenizer, processor):
    """The tokenizer under the processor's chat template (the one that knows image parts), when the
    two differ; the tokenizer itself otherwise."""
    template = chat_template(processor)
    if template == tokenizer.chat_template:
        return tokenizer
    found = _VIEWS.get(tokenizer)
    if found is None or found.chat_template != template:
        found = copy.copy(tokenizer)
        found.chat_template = template
        _VIEWS[tokenizer] = found
    return found


def image_token_id(processor, folder: str) -> int:
    """The token an image's features replace: the model config's `image_token_id` (or
    `image_token_index`), else the tokenizer's image token, else the processor's. Not the processor's
    first: Gemma 3's processor names its placeholder (`<start_of_image>`) so, not its image tokens."""
    config = Path(folder) / "config.json"
    if config.is_file():
        found = json.loads(config.read_text())
        for key in ("image_token_id", "image_token_index"):
            if isinstance(found.get(key), int):
                return found[key]
    for owner in (processor.tokenizer, processor):
        if isinstance(getattr(owner, "image_token_id", None), int):
            return owner.image_token_id
    return processor.tokenizer.convert_tokens_to_ids(processor.image_token)


def expand(row, enc: Encoded, pictures: list[Picture], view, processor, image_id: int) -> ImageEncoded:
    """The text row's Encoded -> the processor's ids, labels aligned, and the image tensors (step 2, 3)."""
    messages, tools = conversation(row)
    ids, images = processed(render(view, messages, tools), pictures, processor)
    labels, starts, counts, index = align(enc.input_ids, enc.labels, ids, image_id, len(pictures))
    turns = [(f, _mapped(index, first), _mapped(index, end - 1) + 1) for f, first, end in enc.turns]
    return ImageEncoded(ids, labels, turns, enc.warnings, images, [p.file for p in pictures], starts, counts)


def encode_image_prompt(messages: list[dict], tokenizer, base: Path | None) -> tuple[list[int], bytes]:
    """A prompt's conversation with images -> what training put before an answer: the processor's ids of
    the conversation under its chat template with the generation prompt, and the image tensors
    (IMAGES_COLUMN's blob, for `batch_images`). A ValueError names a bad part or image file."""
    for where, part in image_parts(messages):
        if (problem := check_part(part)) is not None:
            raise ValueError(f'field "{where}": {problem}')
    processor = processor_for(tokenizer)
    pictures = [read_picture(f, part, base) for f, part in image_parts(messages)]
    return processed(
        render(template_view(tokenizer, processor), messages, generation_prompt=True), pictures, processor
    )


def processed(text: str, pictures: list[Picture], processor) -> tuple[list[int], bytes]:
    """The processor's ids of a rendered text with its pictures (each placeholder expanded), and its
    image tensors as one safetensors blob (per-token ones under PER_TOKEN + name)."""
    import numpy as np
    from safetensors.numpy import save

    try:
        out = processor(
            text=[text],
            images=[open_image(p.data) for p in pictures],
            add_special_tokens=False,
            return_tensors="np",
        )
    except Exception as err:  # noqa: BLE001 - the processor's refusal, named for this row
        raise ValueError(
            f'field "messages": the processor refused the row: {str(err).splitlines()[0]}'
        ) from None
    tensors = {
        (PER_TOKEN + k if k in TOKEN_TYPE_KEYS else k): np.ascontiguousarray(
            v[0] if k in TOKEN_TYPE_KEYS else v
        )
        for k, v in out.items()
        if k not in TEXT_KEYS
    }
    return [int(t) for t in out["input_ids"][0]], save(tensors)


def align(plain: list[int], labels: list[int], expanded: list[int], image_id: int, n_images: int):
    """Labels for `expanded` (the processor's ids) from those of `plain` (the text's), each image's first
    token and token count, and where each plain token went (None: replaced by the expansion).

    Fast path: `expanded` is `plain` with each image token repeated (LLaVA, Qwen2-VL). Else a diff of
    the two, where each image is the run of image tokens (and what the expansion added around them)
    between two text tokens both sides share."""
    runs, collapsed, index = [], [], []
    t = 0
    while t < len(expanded):
        start = t
        if expanded[t] == image_id:
            while t < len(expanded) and expanded[t] == image_id:
                t += 1
            runs.append((start, t - start))
        else:
            t += 1
        collapsed.append(expanded[start])
        index.append(start)
    out = [IGNORE_INDEX] * len(expanded)
    if collapsed == plain and len(runs) == n_images:
        for k, e in enumerate(index):
            if plain[k] != image_id:
                out[e] = labels[k]
        return out, [s for s, _ in runs], [n for _, n in runs], index
    return _diff_align(plain, labels, expanded, image_id, n_images)


def _diff_align(plain, labels, expanded, image_id, n_images):
    from difflib import SequenceMatcher

    out, index = [IGNORE_INDEX] * len(expanded), [None] * len(plain)
    text = [False] * len(expanded)  # a text token both sides share
    for tag, i1, i2, j1, _ in SequenceMatcher(None, plain, expanded, autojunk=False).get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                index[i1 + k] = j1 + k
                out[j1 + k] = labels[i1 + k] if plain[i1 + k] != image_id else IGNORE_INDEX
                text[j1 + k] = plain[i1 + k] != image_id
        elif any(labels[k] != IGNORE_INDEX for k in range(i1, i2)):
            raise ValueError(
                'field "messages": the processor\'s image expansion changes learned tokens of this row (the '
                "tokens of the text alone and of the processor differ there); check the processor's chat template"
            )
    sites, current = [], None
    for j, token in enumerate(expanded):
        if text[j]:
            current = None
        elif token == image_id:
            if current is None:
                current = [j, 0]
                sites.append(current)
            current[1] += 1
    if len(sites) != n_images:
        raise ValueError(
            f'field "messages": the processor wrote {len(sites)} runs of image tokens for {n_images} images, '
            "so which tokens each image became cannot be told; write each image part apart in the text"
        )
    return out, [s for s, _ in sites], [n for _, n in sites], index


def _mapped(index: list, k: int) -> int:
    """The expanded position of plain token k, or of the nearest one before it that was kept (a turn's
    first and last tokens are learned, so kept: checked in `_diff_align`)."""
    while k > 0 and index[k] is None:
        k -= 1
    return index[k] or 0
