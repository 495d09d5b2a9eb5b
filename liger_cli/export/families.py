"""What a Hugging Face family becomes in llama.cpp, for the families liger has verified; every other
model is refused by name before any work.

A family here is a llama.cpp architecture (its tensor-name map comes from the `gguf` package) plus the
few things the conversion must do to its weights. Llama's q/k projections are permuted: Hugging Face
rotates the two halves of each head (`rotate_half`), llama.cpp's LLAMA architecture rotates adjacent
pairs, so each head's rows are reordered from [x0..x(d/2-1), y0..] to [x0, y0, x1, y1, ...]. Qwen2 and
Qwen3 run llama.cpp's NEOX rotation, which is Hugging Face's: no permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from liger_cli.errors import UserError


@dataclass(frozen=True)
class Family:
    arch: str
    """The gguf package's MODEL_ARCH member name (a vision-language family's: its language model's)."""
    permute_qk: bool = False
    projector: str | None = None
    """A vision-language family's llama.cpp projector type: its vision tower goes in a second file."""
    norm_plus_one: bool = False
    """Gemma's RMSNorms scale by (1 + weight); llama.cpp's by the weight: written as weight + 1."""


FAMILIES = {
    "llama": Family("LLAMA", permute_qk=True),
    "mistral": Family("LLAMA", permute_qk=True),
    "qwen2": Family("QWEN2"),
    "qwen3": Family("QWEN3"),
    "gemma3_text": Family("GEMMA3", norm_plus_one=True),
}
VISION_FAMILIES = {  # the language model in one file, the tower and projector in llama.cpp's projector file
    "qwen2_vl": Family("QWEN2VL", projector="qwen2vl_merger"),
    "qwen2_5_vl": Family("QWEN2VL", projector="qwen2.5vl_merger"),
    "qwen3_vl": Family("QWEN3VL", projector="qwen3vl_merger"),  # interleaved M-RoPE, deepstack features
    "gemma3": Family("GEMMA3", projector="gemma3", norm_plus_one=True),  # SigLIP, pooled, RMSNorm, projection
    "mistral3": Family("LLAMA", permute_qk=True, projector="pixtral"),  # Pixtral tower, patch merger
    "idefics3": Family("LLAMA", permute_qk=True, projector="idefics3"),  # SigLIP tiles, pixel shuffle
    "smolvlm": Family("LLAMA", permute_qk=True, projector="idefics3"),  # SmolVLM2: Idefics 3's layout
}


def family_of(config) -> Family:
    """The model's Family, or a UserError naming why it cannot be exported (nothing is written)."""
    from liger_cli.model.vision import is_vision_language

    kind = config.model_type
    if is_vision_language(config) and kind not in VISION_FAMILIES:
        why = (
            "llama.cpp's own converter does not take a Hugging Face LLaVA with a CLIP tower either, and its "
            "llava graph misplaces the CLIP class token (llama.cpp issue 25814)"
            if kind == "llava" and getattr(config.vision_config, "model_type", "") == "clip_vision_model"
            else "liger does not write llama.cpp's projector file (mmproj) for it yet"
        )
        raise UserError(
            f"{kind} is a vision-language model: {why}, and a GGUF of its language model alone would not "
            f"answer image prompts; liger exports {', '.join(VISION_FAMILIES)} with its projector, and text "
            f"models ({', '.join(FAMILIES)})"
        )
    found = VISION_FAMILIES.get(kind) or FAMILIES.get(kind)
    config = config.get_text_config()
    if found is None:
        raise UserError(
            f"model_type {kind}: liger has not verified its llama.cpp conversion; it exports "
            f"{', '.join([*FAMILIES, *VISION_FAMILIES])} (convert it with llama.cpp's convert_hf_to_gguf.py and check it yourself)"
        )
    if found.arch == "GEMMA3":
        gemma3_settings(config)  # its own checks: two RoPEs, a window pattern, the query scale
        return found
    rope = rope_settings(config)
    if found.arch == "QWEN3VL":
        interleaved_sections(config)
    if rope.get("rope_type", "default") not in ("default", None, "llama3"):
        raise UserError(
            f"rope_type {rope['rope_type']} ({kind}): liger exports the default rotary embedding and Llama 3's "
            "scaled one only so far (other scalings are not verified against llama.cpp)"
        )
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", window is not None)
    if uses_window and window is not None and window < config.max_position_embeddings:
        raise UserError(
            f"sliding_window {window} ({kind}): llama.cpp's {found.arch.lower()} architecture attends "
            "to the whole context; export refused rather than answer differently past the window"
        )
    return found


def rope_settings(config) -> dict:
    """rope_theta and rope_type, wherever this transformers version keeps them."""
    found = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    found.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return found


def interleaved_sections(config) -> list[int]:
    """Qwen3-VL's M-RoPE sections, checked to be what llama.cpp's interleaved M-RoPE takes (the rotary
    dimensions' pairs, in turn time, height, width; Hugging Face's layout always interleaves)."""
    sections = list(rope_settings(config).get("mrope_section") or [])
    if len(sections) != 3 or sum(sections) != head_dim(config) // 2:
        raise UserError(
            f"qwen3_vl mrope_section {sections}: llama.cpp takes three sections (time, height, width) "
            f"covering the {head_dim(config) // 2} rotary pairs"
        )
    return sections


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def gemma3_settings(config) -> dict:
    """Gemma 3's attention as llama.cpp's gemma3 architecture takes it, or a UserError naming what it
    would compute differently. Sliding-window layers rotate with their own base and no scaling; full-
    attention layers with the global base and, on the larger models, linear scaling; llama.cpp scales
    queries by 1/sqrt(head_dim) (1/sqrt(hidden/heads) on the 62-layer model), where Hugging Face uses
    query_pre_attn_scalar."""
    rope = getattr(config, "rope_parameters", None) or {}
    full = dict(rope.get("full_attention") or {"rope_theta": getattr(config, "rope_theta", 1e6),
                                               **(getattr(config, "rope_scaling", None) or {})})  # fmt: skip
    local = dict(
        rope.get("sliding_attention") or {"rope_theta": getattr(config, "rope_local_base_freq", 1e4)}
    )
    if (
        full.get("rope_type", "default") not in ("default", "linear")
        or local.get("rope_type", "default") != "default"
    ):
        raise UserError(
            f"gemma3 RoPE {full.get('rope_type')} (full attention) / {local.get('rope_type')} (sliding): liger "
            "exports Gemma 3's default and linear-scaled global RoPE and an unscaled local one"
        )
    scale = (
        config.hidden_size // config.num_attention_heads
        if config.num_hidden_layers == 62
        else head_dim(config)
    )
    if config.query_pre_attn_scalar != scale:
        raise UserError(
            f"gemma3 query_pre_attn_scalar {config.query_pre_attn_scalar}: llama.cpp scales queries by "
            f"1/sqrt({scale}) for this model; export refused rather than attend differently"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UserError(
            "gemma3 attn_logit_softcapping: llama.cpp's gemma3 architecture has no attention soft-capping"
        )
    sliding = [kind == "sliding_attention" for kind in config.layer_types]
    return {"full": full, "local": local, "sliding": sliding}


def write_hyperparameters(writer, config) -> None:
    """The architecture's metadata llama.cpp reads to build the graph (a VLM's: its language model's)."""
    deepstack = getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None)
    if deepstack:  # Qwen3-VL: the first len(deepstack) layers each add one more slice of an image's embedding
        writer.add_num_deepstack_layers(len(deepstack))
    config = config.get_text_config()
    dim = head_dim(config)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.model_type.startswith("gemma3"):
        write_gemma3_attention(writer, config)
        return
    writer.add_rope_freq_base(float(rope_settings(config)["rope_theta"]))
    sections = rope_settings(config).get("mrope_section")
    if sections:  # M-RoPE: the rotary dimensions given to time, height and width (llama.cpp takes four)
        writer.add_rope_dimension_sections([*sections, 0, 0, 0, 0][:4])


def write_gemma3_attention(writer, config) -> None:
    """Gemma 3's RoPEs, window pattern and soft-cap (gemma3_settings checked them)."""
    import gguf

    found = gemma3_settings(config)
    writer.add_rope_freq_base(float(found["full"]["rope_theta"]))
    if found["full"].get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(found["full"]["factor"]))
    if any(found["sliding"]):
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern(found["sliding"])  # per layer: llama.cpp's default is every 6th
        writer.add_rope_freq_base_swa(float(found["local"]["rope_theta"]))
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))


def permute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows from halves (Hugging Face's rotate_half) to interleaved pairs (llama.cpp's LLAMA)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def convert_tensor(name: str, tensor: torch.Tensor, family: Family, config) -> torch.Tensor:
    """A weight as llama.cpp's architecture expects it (q/k permuted where the rotation differs, Gemma's
    norms shifted by one)."""
    if family.norm_plus_one and name.endswith("norm.weight"):
        return tensor.float() + 1
    if family.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
        return permute_qk(tensor, config.num_attention_heads)
    if family.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
        return permute_qk(tensor, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return tensor


def rope_frequency_factors(config) -> torch.Tensor | None:
    """Llama 3's scaled RoPE as llama.cpp takes it: a `rope_freqs` tensor that divides each rotation
    frequency. Hugging Face scales inv_freq by 1/factor past the low-frequency wavelength, not at all
    under the high-frequency one, and by 1 / ((1 - s) / factor + s) between (s: where the wavelength
    lies, 0 to 1); llama.cpp divides by the inverse of that scale. None for an unscaled RoPE."""
    rope = rope_settings(config)
    if rope.get("rope_type") != "llama3":
        return None
    dim = head_dim(config)
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    smooth = ((old_context / wavelength - low) / (high - low)).clamp(0, 1)
    scale = torch.where(wavelength > old_context / low, 1 / factor, (1 - smooth) / factor + smooth)
    scale = torch.where(wavelength < old_context / high, torch.ones_like(scale), scale)
    return (1 / scale).to(torch.float32)
