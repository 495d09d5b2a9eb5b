"""The tiny twin's batch for a vision-language model: text rows that each carry one image.

The pixels are random and made from the twin's own config: first the plain form
`[images, channels, size, size]` at the vision config's image size; else what the family's own image
processor (its PIL backend, transformers' image-processor mapping) makes of a random picture, with
every tensor it returns (a Qwen-VL `image_grid_thw`, a pixel mask, image sizes). A form is taken when
the twin's own `get_image_features` accepts it; the image token is then repeated as many times as
the features it returned are long, so the count is the model's, never a formula of ours.

Image tokens are never learned (labels -100), and no random text id is a special token of the model.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from liger_cli.twin.shrink import sub_configs
from liger_cli.twin.shrink_rules import TOKEN_SUFFIXES

IMAGE_TOKEN_NAMES = ("image_token_id", "image_token_index")
# image-processor settings that must be the vision config's (processor attribute: config attribute)
PROCESSOR_SETTINGS = {
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "spatial_merge_size",
}
PROCESSOR_PICTURE = 56  # a random picture's side when the config names no image size


class ImageBatchError(ValueError):
    """No image batch could be made for this twin; the message is one line saying why."""


def image_token_id(config) -> int | None:
    """The id the model replaces with image features, from the config (outer config first)."""
    for cfg in sub_configs(config):
        for name in IMAGE_TOKEN_NAMES:
            value = vars(cfg).get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _special_ids(config) -> set[int]:
    """Every token id the configs name: random text must not draw one (an image token, a boi/eoi)."""
    ids: set[int] = set()
    for cfg in sub_configs(config):
        for name, value in vars(cfg).items():
            if not name.endswith(TOKEN_SUFFIXES):
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            ids |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
    return ids


def _image_size(config) -> tuple[int, int, int] | None:
    """(channels, height, width) the vision config asks for, None when it names no image size."""
    vision = getattr(config, "vision_config", None)
    size = getattr(vision, "image_size", None)
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) for s in size):
        height, width = size
    elif isinstance(size, int) and not isinstance(size, bool):
        height = width = size
    else:
        return None
    return getattr(vision, "num_channels", 3) or 3, height, width


def _plain_pixels(config, images: int, g: torch.Generator) -> dict | None:
    shape = _image_size(config)
    return None if shape is None else {"pixel_values": torch.randn(images, *shape, generator=g)}


def _processor_pixels(config, images: int, g: torch.Generator) -> dict | None:
    """The family's own image processor (PIL backend: no torchvision needed) on random pictures."""
    import numpy as np
    from PIL import Image
    from transformers.models.auto import image_processing_auto as auto

    names = auto.IMAGE_PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", None)) or {}
    name = names.get("pil") if isinstance(names, dict) else None
    if name is None:
        return None
    processor = auto.get_image_processor_class_from_name(name)()
    vision = getattr(config, "vision_config", None)
    for attribute, source in PROCESSOR_SETTINGS.items():  # the twin's patch grid, not the default one
        if isinstance(getattr(vision, source, None), int) and hasattr(processor, attribute):
            setattr(processor, attribute, getattr(vision, source))
    _, height, width = _image_size(config) or (3, PROCESSOR_PICTURE, PROCESSOR_PICTURE)
    pixels = torch.randint(0, 256, (images, height, width, 3), generator=g, dtype=torch.uint8).numpy()
    pictures = [Image.fromarray(np.ascontiguousarray(p)) for p in pixels]
    out = processor(images=pictures, return_tensors="pt")
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def _feature_count(output) -> int:
    """How many positions of image features `get_image_features` returned (any of its output forms)."""
    features = getattr(output, "pooler_output", None)
    features = output if features is None else features
    if isinstance(features, torch.Tensor):
        return features.shape[:-1].numel()
    if isinstance(features, (list, tuple)) and all(isinstance(f, torch.Tensor) for f in features):
        return sum(f.shape[:-1].numel() for f in features)
    raise ImageBatchError(f"get_image_features returned {type(features).__name__}, not features")


def image_inputs(model: nn.Module, images: int, seed: int = 0) -> tuple[dict, int]:
    """(pixel keywords for `images` images, image-feature positions per image) the twin accepts."""
    get_features = getattr(model, "get_image_features", None)
    if get_features is None:
        raise ImageBatchError(f"{type(model).__name__} has no get_image_features")
    errors = []
    for make in (_plain_pixels, _processor_pixels):
        try:
            pixels = make(model.config, images, torch.Generator().manual_seed(seed))
            if pixels is None:
                continue
            with torch.no_grad():
                count = _feature_count(get_features(**pixels))
        except Exception as err:  # noqa: BLE001 - a form the model refuses: try the next, say why at the end
            errors.append(f"{make.__name__.strip('_')}: {type(err).__name__}: {str(err).strip()[:100]}")
            continue
        if count % images == 0 and count > 0:
            return pixels, count // images
        errors.append(f"{make.__name__.strip('_')}: {count} feature positions for {images} images")
    raise ImageBatchError("no pixel input the model accepts (" + "; ".join(errors or ["no image size"]) + ")")


def tiny_image_batch(model: nn.Module, seed: int = 0, batch: int = 2, text: int = 12) -> dict:
    """A batch of `batch` rows, each `3 prompt ids + the image's tokens + text ids` (row 1 right-padded),
    with the pixel inputs; labels -100 on the prompt, the image and padding. `ImageBatchError` if none."""
    from liger_cli.twin.tiny import twin_vocab

    config = model.config
    image_id = image_token_id(config)
    if image_id is None:
        raise ImageBatchError(f"{type(config).__name__} names no image token id")
    pixels, per_image = image_inputs(model, batch, seed)
    vocab, pad = twin_vocab(model)
    allowed = torch.tensor([i for i in range(3, vocab) if i not in _special_ids(config)])
    g = torch.Generator().manual_seed(seed)
    prompt, length = 3, 3 + per_image + text
    input_ids = allowed[torch.randint(0, len(allowed), (batch, length), generator=g)]
    input_ids[:, prompt : prompt + per_image] = image_id
    is_image = input_ids == image_id
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        attention_mask[1, length - text // 2 :] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, pad)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : prompt + per_image] = -100
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **pixels}
    accepted = inspect.signature(type(model).forward).parameters
    for name in ("mm_token_type_ids", "token_type_ids"):  # image positions marked 1, as the processors do
        if name in accepted:
            out[name] = is_image.long()
    return out
