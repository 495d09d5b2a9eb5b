"""A vision-language model's meta batch for the activation measurement: pictures as well as tokens.

Without pictures the meta forward of a VLM is a text model's: it misses what the picture path keeps for
backward (the projector's inputs when it trains, the tower's own activations when it trains, the
image features scattered into the sequence). So a model that takes `pixel_values` [pictures, channels,
height, width] (LLaVA and the families shaped like it) gets one picture per row at its vision
config's size, and each row starts with as many image tokens as its tower makes features (asked of
the meta model: `get_image_features`, never a config field, which may be stale), the rest text. The
recipe's data is not read: one picture per row is the assumption, said in the plan's note.

Families whose processor flattens patches (Qwen2-VL's pixel_values with image_grid_thw) get None: their
activations are measured as text, and the note says the pictures are not counted.
"""

from __future__ import annotations

import torch
from torch import nn

from liger_cli.model.vision import unwrapped, vision_tower


def meta_image_batch(model: nn.Module, batch: int, seq_len: int) -> tuple[dict, str] | None:
    """(the forward's meta inputs, a note for the plan), or None for a model without a vision tower."""
    base = unwrapped(model)
    if vision_tower(base) is None:
        return None
    config = base.config
    vision = getattr(config, "vision_config", None)
    size, channels = getattr(vision, "image_size", None), getattr(vision, "num_channels", None)
    image_token = getattr(config, "image_token_id", None)
    if not (isinstance(size, int) and isinstance(channels, int) and image_token is not None):
        return {}, "pictures not counted (this family's pixel inputs are not modelled)"
    dtype = next(p.dtype for p in base.parameters() if p.is_floating_point())
    pixels = torch.zeros(batch, channels, size, size, dtype=dtype, device="meta")
    with torch.no_grad():
        features = base.get_image_features(pixel_values=pixels)
    features = getattr(features, "pooler_output", features)
    per_picture = features[0].shape[0] if isinstance(features, (list, tuple)) else features.shape[1]
    if per_picture > seq_len:
        return {}, f"pictures not counted ({per_picture} image tokens > data.max_seq_len {seq_len})"
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    ids[:, :per_picture] = image_token
    note = f"one {size}x{size} picture a row, {per_picture} of its tokens"
    return {"input_ids": ids, "pixel_values": pixels}, note
