"""A distill run's teacher: checked before any weight loads (its tokenizer is the student's, its head
the student's vocabulary size, its forward hands lm_head's input to its loss), then loaded once, frozen,
in the run's precision or with its linear layers in 4 bits."""

from __future__ import annotations

import torch
from torch import nn

from liger_cli.errors import UserError


def teacher_dtype(recipe, device: torch.device) -> torch.dtype:
    """The run's precision: model.dtype when set, else bf16 or fp16 under that mixed precision (a frozen
    teacher needs no fp32 master weights), else float32."""
    from liger_cli.model.build import DTYPES

    if recipe.model.dtype != "auto":
        return DTYPES[recipe.model.dtype]
    precision = recipe.training.precision
    if precision == "auto" and device.type == "cuda":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def check_teacher(recipe) -> str:
    """The Plan's note on the teacher, or a UserError before any weight loads: its tokenizer must be the
    student's (every id, every special token), its head the student's vocabulary size, and its forward
    must hand lm_head's input straight to its loss (probed on the meta device)."""
    from transformers import AutoTokenizer

    from liger_cli.data.tokenizer import load_tokenizer
    from liger_cli.model.build import meta_model_from_config, read_config
    from liger_cli.model.vision import is_vision_language
    from liger_cli.recipe.rl_section import teacher_quantize

    path = recipe.distill.teacher
    try:
        theirs = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"distill.teacher {path}: no tokenizer loads from it ({first}); save the student's tokenizer there"
        ) from None
    ours = load_tokenizer(recipe)
    if why := tokenizer_difference(ours, theirs):
        raise UserError(
            f"distill.teacher {path}: its tokenizer is not the student's ({why}); distillation compares "
            "distributions over one vocabulary: use a teacher trained with the student's tokenizer"
        )
    config = read_config(path)
    student = read_config(recipe.model.path or recipe.model.config, recipe.model.trust_remote_code)
    sizes = [getattr(c.get_text_config(), "vocab_size", None) for c in (student, config)]
    if is_vision_language(config):
        raise UserError(f"distill.teacher {path}: a vision-language model; the teacher must be a causal LM")
    if sizes[0] != sizes[1]:
        raise UserError(
            f"distill.teacher {path}: its head has {sizes[1]} rows, the student's {sizes[0]}; distillation "
            "needs one vocabulary (the same tokenizer and vocab_size)"
        )
    meta = meta_model_from_config(path, dtype=torch.float32)
    if why := _deferral_refusal(meta):
        raise UserError(f"distill.teacher {path}: {why}; distill reads the teacher's lm_head input")
    count = sum(p.numel() for p in meta.parameters())
    four_bit = teacher_quantize(recipe)
    if four_bit != "none":
        from liger_cli.model.quantize import require_bitsandbytes

        require_bitsandbytes(four_bit, _quantize_key(recipe))
    how = "" if four_bit == "none" else f", {four_bit} 4-bit linear layers"
    if recipe.distributed.frozen_model_kept_whole() is None:
        how += ", its decoder layers sharded over the processes"
    return (
        f"distill: teacher {path} ({count:,} parameters{how}, frozen, no gradient), its tokenizer the student's "
        f"({len(ours)} ids); {recipe.distill.loss} at temperature {recipe.distill.temperature:g} on every "
        "sampled token"
    )


def tokenizer_difference(ours, theirs) -> str | None:
    """What differs between two tokenizers' ids and special tokens, or None."""
    if len(ours) != len(theirs):
        return f"{len(theirs)} ids, the student's {len(ours)}"
    mine, other = ours.get_vocab(), theirs.get_vocab()
    if mine != other:
        token = sorted(set(mine.items()) ^ set(other.items()))[0][0]
        return f"token {token!r} is {other.get(token)} there, {mine.get(token)} in the student's"
    for name in ("bos_token_id", "eos_token_id", "unk_token_id"):
        if getattr(ours, name) != getattr(theirs, name):
            return f"{name} {getattr(theirs, name)}, the student's {getattr(ours, name)}"
    if sorted(ours.all_special_ids) != sorted(theirs.all_special_ids):
        return (
            f"special tokens {sorted(theirs.all_special_ids)}, the student's {sorted(ours.all_special_ids)}"
        )
    return None


def _deferral_refusal(causal_lm: nn.Module) -> str | None:
    """Why our fused-loss interception cannot take this model's lm_head input, or None (patch_model's probe)."""
    from liger_kernels import patch_model

    report = patch_model(causal_lm, rms_norm=False, rope=False, swiglu=False, fused_linear_cross_entropy=True)
    return report.skipped.get("fused_linear_cross_entropy")


def _quantize_key(recipe) -> str:
    """The recipe key the teacher's 4-bit loading comes from (for the error that names it)."""
    return "model.quantize" if recipe.distill.quantize is None else "distill.quantize"


def load_teacher(recipe, device: torch.device) -> nn.Module:
    """The teacher, once, whole on every process (outside ZeRO-3's init): from_pretrained in the run's
    precision (`teacher_dtype`), its linear layers in 4 bits where distill.quantize (or model.quantize)
    says (packed in that precision where the backend will shard its layers, as a QLoRA base's are), no
    remote code, frozen, in eval mode, on `device`, with our fused-loss interception patched in (no
    kernel that changes a number)."""
    from liger_cli import process_state
    from liger_cli.model import quantize
    from liger_cli.model.build import model_class, read_config
    from liger_cli.recipe.rl_section import teacher_quantize

    path = recipe.distill.teacher
    kwargs = {"dtype": teacher_dtype(recipe, device)}
    if recipe.model.attn_implementation:
        kwargs["attn_implementation"] = recipe.model.attn_implementation
    four_bit = teacher_quantize(recipe)
    if four_bit != "none":  # packed in its compute dtype where its layers shard (as a QLoRA base), else uint8
        sharded = recipe.distributed.frozen_model_kept_whole() is None
        kwargs["quantization_config"] = quantize.quantization_config(
            four_bit,
            True,
            kwargs["dtype"],
            kwargs["dtype"] if sharded else torch.uint8,
            key=_quantize_key(recipe),
        )
    with process_state.loading_alone():
        teacher = model_class(read_config(path)).from_pretrained(path, **kwargs)
    if four_bit != "none":
        quantize.after_loading(teacher)
    teacher.config.use_cache = False
    teacher.requires_grad_(False).eval().to(device)
    if why := _deferral_refusal(teacher):
        raise UserError(f"distill.teacher {path}: {why}; distill reads the teacher's lm_head input")
    return teacher
