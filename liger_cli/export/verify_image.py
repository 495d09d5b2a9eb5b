"""A vision-language export's image check: a probe picture through the model and through llama.cpp's
multimodal library (mtmd) with the projector file, compared at the embeddings and at the next token.

Each family lays an image into the prompt its own way; `image_prompt` writes the model's inputs as its
processor would (its marker tokens around the image tokens), and llama.cpp's mtmd lays out the same
picture on its side: the two must give the same ids for the logits to be compared.
"""

from __future__ import annotations

import torch

from liger_cli.export.verify import BOUNDS, ExportMismatch, Report

IMAGE_BOUNDS = {**BOUNDS, "f32": 1e-2}
"""The image probe's: its embeddings' largest difference (relative to their largest value) and the next
token's |Δ log p|. f32's is looser than the text's: llama.cpp computes the projector's GELU through a
half-precision table (the tanh GELU where Qwen3-VL's and Mistral 3's mergers use the exact one), and its
qwen2vl language model ignores the RMSNorm epsilon (docs/export.md)."""


def probe_image(width: int, height: int):
    """A colour gradient, width x height RGB. A dynamic-size family's is 8 x 4 merged patches (Qwen2-VL's
    224 x 112, Qwen3-VL's 256 x 128, Mistral 3's 8 x 4 of patch x merge): a size both llama.cpp's
    preprocessing and the processor take as it is (32 image tokens; two of Qwen2.5-VL's 112-pixel attention
    windows); Gemma 3's is its fixed image size; Idefics 3's one row of tiles at the processor's longest
    edge (its global view resized by both sides with the same Lanczos filter)."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 2) % 256, (y * 4) % 256, ((x + y) * 3) % 256], axis=-1).astype(np.uint8)


def merge_of(config) -> int:
    """Patches merged per side into one image token (Mistral 3 keeps it on the model's config)."""
    return getattr(config, "spatial_merge_size", None) or config.vision_config.spatial_merge_size


def image_prompt(model, tokenizer, image_processor, before: str, after: str):
    """The probe image, the model's inputs for `before` + the image + `after`, and its image features as
    llama.cpp's mtmd returns them (Qwen3-VL's deepstack features appended to each token's; Mistral 3's
    [IMG_BREAK] embedding after each row but the last)."""
    from PIL import Image

    config, vision = model.config, model.config.vision_config
    kind = config.model_type
    tiled = kind in ("idefics3", "smolvlm")
    if kind == "gemma3":
        rgb = probe_image(vision.image_size, vision.image_size)
    elif tiled:  # one row of tiles at the processor's longest edge: no resize of the tiles on either side
        rgb = probe_image(image_processor.size["longest_edge"], vision.image_size)
    else:
        merged = vision.patch_size * merge_of(config)
        rgb = probe_image(8 * merged, 4 * merged)
    row_col = {"return_row_col_info": True} if tiled else {}
    pixels = image_processor(images=[Image.fromarray(rgb)], return_tensors="pt", **row_col)
    image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
    extra: dict = {}
    if tiled:  # each tile after its <row_r_col_c> mark, a newline after each row, then the global view
        per_tile = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
        fake, rows, cols = "<fake_token_around_image>", pixels["rows"][0][0], pixels["cols"][0][0]
        tiles = "".join(
            "".join(f"{fake}<row_{r + 1}_col_{c + 1}>" + image_token * per_tile for c in range(cols)) + "\n"
            for r in range(rows)
        )
        image, kinds_name = f"{tiles}\n{fake}<global-img>" + image_token * per_tile + fake, None
        extra = {"pixel_attention_mask": pixels["pixel_attention_mask"]}
    elif kind == "gemma3":  # <start_of_image>, the pooled image tokens, <end_of_image>; they attend both ways
        start, end = tokenizer.convert_ids_to_tokens([config.boi_token_index, config.eoi_token_index])
        image, kinds_name = start + image_token * config.mm_tokens_per_image + end, "token_type_ids"
    elif kind == "mistral3":  # rows of [IMG] closed by [IMG_BREAK], the last by [IMG_END]
        rows, cols = (
            int(side) // (vision.patch_size * merge_of(config)) for side in pixels["image_sizes"][0]
        )
        image = "[IMG_BREAK]".join([image_token * cols] * rows) + "[IMG_END]"
        extra, kinds_name = {"image_sizes": pixels["image_sizes"]}, None
    else:  # <|vision_start|>, the merged patches' tokens, <|vision_end|>; M-RoPE positions from the grid
        start, end = tokenizer.convert_ids_to_tokens(
            [config.vision_start_token_id, config.vision_end_token_id]
        )
        count = int(pixels["image_grid_thw"].prod()) // merge_of(config) ** 2
        image, kinds_name = start + image_token * count + end, "mm_token_type_ids"
        extra = {"image_grid_thw": pixels["image_grid_thw"]}
    ids = tokenizer(before + image + after, add_special_tokens=False, return_tensors="pt")["input_ids"]
    inputs = {"input_ids": ids, "pixel_values": pixels["pixel_values"], **extra}
    if kinds_name:
        inputs[kinds_name] = (ids == config.image_token_id).long()  # the processor's marks: 1 an image token
    features = image_features(model, pixels["pixel_values"], extra)
    if kind == "mistral3":  # llama.cpp's image chunk holds the [IMG_BREAK] rows itself
        brk = model.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("[IMG_BREAK]")].detach()
        parts = [features[r * cols : (r + 1) * cols] for r in range(rows)]
        features = torch.cat([piece for part in parts for piece in (part, brk[None])][:-1])
    return rgb, inputs, features


def image_features(model, pixel_values, extra: dict) -> torch.Tensor:
    """The model's tower and projector on the pixels: one row per image token (Qwen3-VL's deepstack
    features appended to each, as llama.cpp lays them out)."""
    config = model.config
    layer = {"vision_feature_layer": config.vision_feature_layer} if config.model_type == "mistral3" else {}
    with torch.no_grad():
        found = model.model.get_image_features(pixel_values, **extra, **layer)
    deepstack = [features[0] for features in getattr(found, "deepstack_features", None) or []]
    return torch.cat([found.pooler_output[0], *deepstack], dim=-1)


def check_image(runtime, projector, model, tokenizer, image_processor, out_type: str, report: Report) -> None:
    """A probe image through both: its embeddings (the model's tower and projector on its image processor's
    pixels, against llama.cpp's mtmd on the projector file with its own preprocessing), then the next token
    after a prompt holding it (the language model file, M-RoPE positions included)."""
    from liger_cli.export.runtime import MEDIA

    before, after = "Look at this picture: ", " What colour is it?"
    rgb, inputs, embedded = image_prompt(model, tokenizer, image_processor, before, after)
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    want = torch.log_softmax(logits.double(), dim=-1)
    embeddings, got = runtime.image_log_probs(projector, before + MEDIA + after, rgb, embedded.shape[-1])
    got = got[: want.shape[-1]]
    bound = IMAGE_BOUNDS.get(out_type)
    tower_bound = IMAGE_BOUNDS.get(out_type, IMAGE_BOUNDS["f16"])  # a quantized model's projector file is f16
    if embeddings.shape != embedded.shape:
        raise ExportMismatch(
            f"llama.cpp makes {tuple(embeddings.shape)} embeddings of the probe image, the model {tuple(embedded.shape)}"
        )
    report.image_embedding_diff = float((embeddings - embedded).abs().max() / embedded.abs().max())
    report.image_logprob_diff = float((want - got).abs().max())
    if not report.image_embedding_diff <= tower_bound:  # NaN fails too
        raise ExportMismatch(
            f"llama.cpp encodes the probe image differently: its embeddings differ from the model's by up to "
            f"{report.image_embedding_diff:.3g} of their largest value (bound: {tower_bound:g})"
        )
    if bound is not None and not report.image_logprob_diff <= bound:
        raise ExportMismatch(
            f"after an image prompt llama.cpp's next-token log-probs differ from the model's by up to "
            f"{report.image_logprob_diff:.3g} (bound for {out_type}: {bound:g})"
        )
    top, token = int(got.argmax()), int(want.argmax())
    if bound is not None and top != token and float(want[token] - want[top]) > 2 * bound:
        raise ExportMismatch(
            f"after an image prompt the greedy tokens differ: the model {token} {runtime.piece(token)!r}, "
            f"llama.cpp {top} {runtime.piece(top)!r}"
        )
