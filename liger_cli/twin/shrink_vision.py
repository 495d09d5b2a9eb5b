"""Shrink what `shrink_config` leaves large in a vision-language config: the vision tower's own size
names and the picture it sees, so that a twin with an image in its batch trains in a fraction of a second.

By attribute name, as `shrink_rules.py` does, applied after `shrink_config` (`tiny.py`):

* depth: `depth` (Qwen-VL towers) keeps 2 blocks, and a list of block indexes (full-attention blocks) keeps
  its kind: block 1 is in it when any later block was;
* widths: `embed_dim` is capped like `hidden_size`; `out_hidden_size` (what the tower hands the language
  model) is the shrunk text hidden size; a `window_size` in pixels is the original one (it is not a token
  window: the shrunk `patch_size` grid still divides it);
* the picture: `image_size` becomes 4 patches a side and `mm_tokens_per_image` 4 (2 a side), so that
  pooled towers (Gemma 3's) still divide the grid evenly. A config that cannot build so is built as
  `shrink_config` left it (`tiny.py` tries both).
"""

from __future__ import annotations

import math

from liger_cli.twin.shrink import stored, sub_configs
from liger_cli.twin.shrink_rules import HIDDEN

PATCHES_A_SIDE = 4
TOKENS_PER_IMAGE = 4


def shrink_vision(tiny, original) -> bool:
    """Shrink the vision settings of `tiny` (already `shrink_config(original)`) in place; whether
    anything changed."""
    vision, old_vision = getattr(tiny, "vision_config", None), getattr(original, "vision_config", None)
    if vision is None or old_vision is None:
        return False
    changed = False
    for cfg in sub_configs(vision):
        changed |= _depth(cfg) | _widths(cfg, tiny, old_vision)
    changed |= _picture(tiny, vision)
    return changed


def _depth(cfg) -> bool:
    depth = stored(cfg, "depth")
    if not isinstance(depth, int) or depth <= 2:
        return False
    for name, value in list(vars(cfg).items()):
        is_index_list = isinstance(value, (list, tuple)) and value and all(isinstance(i, int) for i in value)
        if is_index_list and "index" in name and max(value) < depth:
            cfg.__dict__[name] = ([0] if 0 in value else []) + ([1] if any(i > 0 for i in value) else [])
    cfg.depth = 2
    return True


def _widths(cfg, tiny, old_vision) -> bool:
    changed = False
    if isinstance(stored(cfg, "embed_dim"), int) and cfg.embed_dim > HIDDEN:
        cfg.embed_dim, changed = HIDDEN, True
    text = tiny.get_text_config(decoder=True)
    if isinstance(stored(cfg, "out_hidden_size"), int) and cfg.out_hidden_size != text.hidden_size:
        cfg.out_hidden_size, changed = text.hidden_size, True
    window = stored(old_vision, "window_size")
    if cfg is tiny.vision_config and isinstance(window, int) and stored(cfg, "window_size") != window:
        cfg.window_size, changed = window, True
    return changed


def _pair(value) -> tuple[int, int] | None:
    """(height, width) of an int or a 2-sequence of ints (InternVL's image and patch sizes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def _picture(tiny, vision) -> bool:
    size, patch = _pair(stored(vision, "image_size")), _pair(stored(vision, "patch_size"))
    if size is None or patch is None or size[0] <= PATCHES_A_SIDE * patch[0]:
        return False
    new = tuple(PATCHES_A_SIDE * p for p in patch)
    old = stored(vision, "image_size")
    vision.image_size = new[0] if isinstance(old, int) else type(old)(new)
    tokens = stored(tiny, "mm_tokens_per_image")
    if isinstance(tokens, int) and tokens > TOKENS_PER_IMAGE and math.isqrt(tokens) ** 2 == tokens:
        tiny.mm_tokens_per_image = TOKENS_PER_IMAGE
    return True
