"""A vision-language model's second file: its vision tower and projector as llama.cpp's `mmproj` GGUF
(architecture `clip`), written with the `gguf` package's tensor-name map for it.

Qwen2-VL (projector `qwen2vl_merger`) and Qwen2.5-VL (`qwen2.5vl_merger`: RMSNorms, SiLU-gated MLPs,
window attention with a full-attention block every n): the patch embedding is a Conv3d over two frames,
which llama.cpp runs as two Conv2d kernels (`v.patch_embd.weight` and `.weight.1`, summed); each block's
fused qkv projection is split into q, k and v; the merger's norm is `v.post_ln` and its two linear layers
`mm.0` and `mm.2`. The image mean, std and patch size are the processor's; the MLP's activation is
llama.cpp's default for Qwen2-VL (quick GELU, as Qwen2-VL's) and SiLU for 2.5; the norms' epsilon is
their fixed 1e-6.

Qwen3-VL (`qwen3vl_merger`): Qwen2-VL's two-frame patch embedding (with a bias) plus a learned position
embedding over a square grid, which llama.cpp interpolates to each image's patch grid as Hugging Face does
(bilinear, corners aligned); the fused qkv kept (llama.cpp splits it in its graph); the merger as
`v.post_ln`, `mm.0` and `mm.2`; each deepstack merger (a LayerNorm after the 2x2 merge and two linear
layers) under the block whose output it reads. llama.cpp appends the deepstack features to each image
token's embedding and adds them to the first decoder layers' outputs (families.py writes how many).

Mistral 3 (`pixtral`): a Pixtral tower (RMSNorms, SiLU-gated MLPs, a 2D RoPE that llama.cpp rotates in
adjacent pairs, so each head's q/k rows are permuted as a Llama's are), the projector's RMSNorm, its
patch merger (2x2 patches unfolded into one) and two linear layers; the [IMG_BREAK] token's embedding is
copied from the language model's, as llama.cpp appends it to each row of image tokens itself.

Idefics 3 and SmolVLM (`idefics3`): a SigLIP tower on fixed-size tiles, its patches pixel-shuffled
(`scale_factor` per side into one token) and projected by one linear layer (`mm.model.fc`). llama.cpp cuts
a picture into the processor's tiles and a global view as Hugging Face does (the same Pillow-style Lanczos
resampling); the processor's longest edge is written for it.

Gemma 3 (`gemma3`): a SigLIP tower at a fixed image size, its patches average-pooled to
mm_tokens_per_image (llama.cpp's scale factor: patches per side over pooled tokens per side), an RMSNorm
(Gemma's, so its weight + 1) and a projection llama.cpp reads in Hugging Face's layout.

`check_tower` runs the writers' checks before any work: what llama.cpp's graph for the projector fixes
(Qwen3-VL's 2x2 merge, its tower's tanh GELU and RoPE base; Mistral 3's SiLU tower, GELU projector and
norm epsilon; Idefics 3's tanh GELU; Gemma 3's square pooling; Qwen2.5-VL's window pattern) is refused by
name where the model differs. Idefics 3's tiling is the processor's, checked as the file is written.
"""

from __future__ import annotations

from pathlib import Path

import torch

from liger_cli.errors import UserError
from liger_cli.export.families import permute_qk
from liger_cli.export.gguf_file import VISION_PREFIXES, model_tensors, plain_types

QWEN_VL_NORM_EPS = 1e-6  # the towers' LayerNorms (Qwen2-VL to Qwen3-VL) have this epsilon fixed
IMAGE_SIZE = 560  # llama.cpp's warm-up size for dynamic-size towers (its converter's default)


def vision_tensors(name: str, tensor: torch.Tensor):
    """(name, tensor) pairs llama.cpp's map knows, from one checkpoint tensor of Qwen2(.5)-VL's tower."""
    name = "visual." + name.removeprefix("model.").removeprefix("visual.")
    if ".qkv." in name:
        for part, piece in zip("qkv", tensor.chunk(3, dim=0), strict=True):
            yield name.replace(".qkv.", f".{part}."), piece
    else:
        yield from two_frames(name, tensor)


def two_frames(name: str, tensor: torch.Tensor):
    """The Conv3d patch embedding over two frames as llama.cpp's two Conv2d kernels; other tensors as they are."""
    if name.endswith("patch_embed.proj.weight"):
        if tensor.shape[2] != 2:
            raise UserError(f"{name}: a temporal patch of {tensor.shape[2]} frames; llama.cpp takes 2")
        yield "v.patch_embd.weight", tensor[:, :, 0]
        yield "v.patch_embd.weight.1", tensor[:, :, 1]
    else:
        yield name, tensor


QWEN3_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
QWEN3_DEEPSTACK = {"norm": "V_DS_NORM", "linear_fc1": "V_DS_FC1", "linear_fc2": "V_DS_FC2"}


def qwen3vl_tensors(name: str, tensor: torch.Tensor, deepstack: list[int]):
    """Qwen3-VL's tower under llama.cpp's names: deepstack merger k under block deepstack[k]."""
    import gguf

    name = "visual." + name.removeprefix("model.").removeprefix("visual.")
    *_, part, suffix = name.split(".")
    if name.startswith("visual.deepstack_merger_list.") and part in QWEN3_DEEPSTACK:
        k = int(name.split(".")[2])
        tensor_name = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, QWEN3_DEEPSTACK[part])]
        yield f"{tensor_name.format(bid=deepstack[k])}.{suffix}", tensor
    elif name.startswith("visual.merger.") and part in QWEN3_MERGER:
        yield f"{QWEN3_MERGER[part]}.{suffix}", tensor
    else:
        yield from two_frames(name, tensor)


def window_pattern(full: list[int]) -> int:
    """Qwen2.5-VL's full-attention blocks as llama.cpp's pattern n (every n-th block attends fully)."""
    n = full[0] + 1
    if any(b - a != n for a, b in zip(full, full[1:], strict=False)):
        raise UserError(
            f"fullatt_block_indexes {full}: not every n-th block, which llama.cpp's qwen2.5vl takes"
        )
    return n


def gemma3_tensors(name: str, tensor: torch.Tensor):
    """Gemma 3's projector weights under the names llama.cpp's map knows (its soft-embedding norm + 1)."""
    name = name.removeprefix("model.").replace("mm_input_projection_weight", "mm_input_projection.weight")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")  # as transformers 5 saves it
    yield name, tensor.float() + 1 if name.endswith("mm_soft_emb_norm.weight") else tensor


def gemma3_pooling(config) -> int:
    """llama.cpp's scale factor for Gemma 3: patches per side pooled into one image token per side."""
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    pooled = round(config.mm_tokens_per_image**0.5)
    if pooled**2 != config.mm_tokens_per_image or side % pooled:
        raise UserError(
            f"gemma3 mm_tokens_per_image {config.mm_tokens_per_image} over {side}x{side} patches: llama.cpp pools "
            "a square of patches into each token"
        )
    return side // pooled


def qwen3vl_grid(vision) -> int:
    """Qwen3-VL's position-embedding grid side, after checking the tower is what llama.cpp's graph builds."""
    side = round(vision.num_position_embeddings**0.5)
    theta = (getattr(vision, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    problems = [
        f"spatial_merge_size {vision.spatial_merge_size} (llama.cpp merges 2x2 patches)"
        if vision.spatial_merge_size != 2 else None,
        f"hidden_act {vision.hidden_act} (llama.cpp's tower uses the tanh GELU)"
        if vision.hidden_act != "gelu_pytorch_tanh" else None,
        f"the tower's RoPE base {theta:g} (llama.cpp's is 10000)" if float(theta) != 10000.0 else None,
        f"num_position_embeddings {vision.num_position_embeddings} (not a square grid)"
        if side**2 != vision.num_position_embeddings else None,
    ]  # fmt: skip
    found = [p for p in problems if p]
    if found:
        raise UserError(
            f"qwen3_vl vision tower: {'; '.join(found)}: export refused rather than see differently"
        )
    return side


PIXTRAL_NORM_EPS = 1e-5  # the Pixtral tower's RMSNorms; llama.cpp gives the projector's norm the same


def pixtral_checks(config) -> None:
    """Mistral 3 as llama.cpp's pixtral graph builds it, or a UserError naming what differs."""
    vision, text = config.vision_config, config.get_text_config()
    theta = (getattr(vision, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    problems = [
        f"its language model is {text.model_type} (liger exports Mistral 3's mistral and llama ones)"
        if text.model_type not in ("mistral", "llama") else None,
        f"vision_feature_layer {config.vision_feature_layer} (llama.cpp reads the last layer's output)"
        if config.vision_feature_layer != -1 else None,
        f"the tower's hidden_act {vision.hidden_act} (llama.cpp's tower gates with SiLU)"
        if vision.hidden_act != "silu" else None,
        f"projector_hidden_act {config.projector_hidden_act} (llama.cpp's projector uses a GELU)"
        if config.projector_hidden_act != "gelu" else None,
        f"the tower's RoPE base {theta:g} (llama.cpp's is 10000)" if float(theta) != 10000.0 else None,
        f"the projector norm's epsilon {text.rms_norm_eps:g} (llama.cpp uses the tower's, {PIXTRAL_NORM_EPS:g})"
        if text.rms_norm_eps != PIXTRAL_NORM_EPS else None,
    ]  # fmt: skip
    found = [p for p in problems if p]
    if found:
        raise UserError(f"mistral3: {'; '.join(found)}: export refused rather than see differently")


def pixtral_tensors(name: str, tensor: torch.Tensor, heads: int):
    """Mistral 3's tower and projector under the map's names (each head's q/k rows from halves to pairs)."""
    name = name.removeprefix("model.")
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        tensor = permute_qk(tensor, heads)
    yield name, tensor


def image_break_id(folder: Path) -> int:
    from liger_cli.export.gguf_tokenizer import read_tokenizer_json

    found = [
        t["id"] for t in read_tokenizer_json(folder).get("added_tokens", []) if t["content"] == "[IMG_BREAK]"
    ]
    if not found:
        raise UserError(
            "mistral3: the tokenizer has no [IMG_BREAK] token, which llama.cpp puts after each row"
        )
    return found[0]


def write_tower_shape(writer, image_size: int, width: int, ffn: int, blocks: int, heads: int, eps: float):
    """The sizes every projector type's tower is built from."""
    writer.add_vision_image_size(image_size)
    writer.add_vision_embedding_length(width)
    writer.add_vision_feed_forward_length(ffn)
    writer.add_vision_block_count(blocks)
    writer.add_vision_head_count(heads)
    writer.add_vision_attention_layernorm_eps(eps)


def write_siglip_shape(writer, vision, eps: float) -> None:
    """A SigLIP-style config's sizes (Gemma 3, Idefics 3, Pixtral name them alike)."""
    write_tower_shape(writer, vision.image_size, vision.hidden_size, vision.intermediate_size,
                      vision.num_hidden_layers, vision.num_attention_heads, eps)  # fmt: skip


def write_pixtral_settings(writer, config) -> None:
    write_siglip_shape(writer, config.vision_config, PIXTRAL_NORM_EPS)
    writer.add_vision_use_silu(True)
    writer.add_vision_spatial_merge_size(config.spatial_merge_size)


def idefics3_checks(config) -> None:
    vision, text = config.vision_config, config.get_text_config()
    problems = [
        f"its language model is {text.model_type} (liger exports Idefics 3's and SmolVLM's llama one)"
        if text.model_type != "llama" else None,
        f"the tower's hidden_act {vision.hidden_act} (llama.cpp's uses the tanh GELU)"
        if vision.hidden_act != "gelu_pytorch_tanh" else None,
    ]  # fmt: skip
    found = [p for p in problems if p]
    if found:
        raise UserError(
            f"{config.model_type}: {'; '.join(found)}: export refused rather than see differently"
        )


def idefics3_tiling(config, image_processor) -> int:
    """The processor's longest edge, after checking that llama.cpp tiles pictures as it does: llama.cpp
    always cuts a picture into tiles of the tower's size plus a global view."""
    tile = config.vision_config.image_size
    longest, largest = image_processor.size["longest_edge"], image_processor.max_image_size["longest_edge"]
    splitting = image_processor.do_image_splitting
    if not splitting or largest != tile or longest <= tile:
        raise UserError(
            f"{config.model_type}: the processor's tiling (do_image_splitting {splitting}, tiles of {largest}, "
            f"longest edge {longest}) is not llama.cpp's, which always cuts a picture into {tile}-pixel tiles "
            "plus a global view"
        )
    return longest


def write_idefics3_settings(writer, config, image_processor) -> None:
    write_siglip_shape(writer, config.vision_config, config.vision_config.layer_norm_eps)
    writer.add_vision_preproc_image_size(idefics3_tiling(config, image_processor))
    writer.add_vision_use_gelu(True)
    writer.add_vision_projector_scale_factor(config.scale_factor)


def check_tower(config, family) -> None:
    """Every check the projector's writer makes, before any work (see the module's docstring)."""
    if family.projector == "pixtral":
        pixtral_checks(config)
    elif family.projector == "idefics3":
        idefics3_checks(config)
    elif family.projector == "gemma3":
        gemma3_pooling(config)
    elif family.projector == "qwen3vl_merger":
        qwen3vl_grid(config.vision_config)
        layers = config.get_text_config().num_hidden_layers
        if len(config.vision_config.deepstack_visual_indexes) >= layers:
            raise UserError(
                f"qwen3_vl: {len(config.vision_config.deepstack_visual_indexes)} deepstack features into "
                f"{layers} decoder layers: llama.cpp's graph cannot add one to the last layer (it aborts)"
            )
    elif family.projector == "qwen2.5vl_merger":
        window_pattern(config.vision_config.fullatt_block_indexes)


def write_gemma3_settings(writer, config) -> None:
    write_siglip_shape(writer, config.vision_config, config.vision_config.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    writer.add_vision_projector_scale_factor(gemma3_pooling(config))


def write_qwen3vl_settings(writer, config) -> None:
    vision = config.vision_config
    size = qwen3vl_grid(vision) * vision.patch_size  # the picture size its position grid was trained at
    write_tower_shape(writer, size, vision.hidden_size, vision.intermediate_size, vision.depth, vision.num_heads,
                      QWEN_VL_NORM_EPS)  # fmt: skip
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision.spatial_merge_size)
    deepstack = set(vision.deepstack_visual_indexes)
    writer.add_vision_is_deepstack_layers([block in deepstack for block in range(vision.depth)])


def write_projector(folder: Path, path: Path, config, family, image_processor, out_type: str) -> None:
    import gguf

    vision, text = config.vision_config, config.get_text_config()
    kind = family.projector
    depth = getattr(vision, "depth", None) or vision.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(depth, 3))  # Qwen's merger's mlp.2 too
    tensor_types, file_types = plain_types()
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_file_type(file_types[out_type])
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(kind)
    writer.add_vision_projection_dim(text.hidden_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_image_mean([float(v) for v in image_processor.image_mean])
    writer.add_vision_image_std([float(v) for v in image_processor.image_std])
    if kind == "idefics3":
        write_idefics3_settings(writer, config, image_processor)
    else:
        settings = {"gemma3": write_gemma3_settings, "qwen3vl_merger": write_qwen3vl_settings,
                    "pixtral": write_pixtral_settings}  # fmt: skip
        settings.get(kind, lambda writer, config: write_qwen_settings(writer, config, family))(writer, config)
    for name, piece in tower_tensors(folder, config, kind):
        gguf_name = (
            name
            if name.startswith(("v.", "mm."))
            else names.get_name(name, try_suffixes=(".weight", ".bias"))
        )
        if gguf_name is None:
            raise UserError(f"tensor {name} has no name in llama.cpp's {kind} projector")
        data = piece.to(torch.float32).numpy()
        plain = data.ndim == 1 or ".embeddings." in name  # llama.cpp's converter keeps SigLIP's in f32
        qtype = gguf.GGMLQuantizationType.F32 if plain else tensor_types[out_type]
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tower_tensors(folder: Path, config, kind: str):
    """(name, tensor) of the projector file, from the checkpoint's vision tower and projector weights."""
    vision = config.vision_config
    brk = image_break_id(folder) if kind == "pixtral" else None
    for hf_name, tensor in model_tensors(folder):
        if brk is not None and hf_name.endswith("embed_tokens.weight"):
            yield "v.token_embd.img_break", tensor[brk]  # llama.cpp's row end, the language model's embedding
        if not hf_name.startswith(VISION_PREFIXES):
            continue
        if kind == "qwen3vl_merger":
            yield from qwen3vl_tensors(hf_name, tensor, vision.deepstack_visual_indexes)
        elif kind == "pixtral":
            yield from pixtral_tensors(hf_name, tensor, vision.num_attention_heads)
        elif kind == "gemma3":
            yield from gemma3_tensors(hf_name, tensor)
        elif kind == "idefics3":
            yield hf_name, tensor  # llama.cpp's map knows Idefics 3's names as saved
        else:
            yield from vision_tensors(hf_name, tensor)


def write_qwen_settings(writer, config, family) -> None:
    vision = config.vision_config
    width = (
        getattr(vision, "embed_dim", None) or vision.hidden_size
    )  # Qwen2-VL names it embed_dim, 2.5 hidden_size
    ffn = int(width * vision.mlp_ratio) if getattr(vision, "mlp_ratio", None) else vision.intermediate_size
    write_tower_shape(writer, IMAGE_SIZE, width, ffn, vision.depth, vision.num_heads, QWEN_VL_NORM_EPS)
    if family.projector == "qwen2.5vl_merger":  # window attention, full every n-th block; SiLU-gated MLPs
        writer.add_vision_use_silu(True)
        writer.add_vision_n_wa_pattern(window_pattern(vision.fullatt_block_indexes))
    writer.add_vision_spatial_merge_size(vision.spatial_merge_size)
