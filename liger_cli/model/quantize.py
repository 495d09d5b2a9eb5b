"""QLoRA: the base's linear layers in 4 bits (bitsandbytes NF4/FP4), an adapter trained on top.

bitsandbytes is imported only here and only for a quantized recipe (`liger --help` and plain runs
never load it). Two facts of bitsandbytes 0.50 on a CPU decide what this module does:

- A `Linear4bit` forward in eval mode under no_grad, on a CPU with AVX512-BF16, repacks its weight
  in place into an inference layout; later train-mode forwards then run `gemv_4bit`, which has no
  backward, and the adapter gradients before that layer come out None or wrong (only a UserWarning).
  `keep_exact_backward` switches that path off on every 4-bit layer, so an evaluation between steps
  changes nothing (tested: tests/test_qlora.py).
- Importing its CPU backend tries to fetch a kernel from the Hugging Face hub and logs "Failed to load
  CPU gemm_4bit_forward from kernels-community" when it cannot: harmless (the layers use their own
  CPU code), and filtered out by `process_state.silence_hub_kernel_notice` for every run.
"""

from __future__ import annotations

import torch
from torch import nn

from liger_cli import process_state
from liger_cli.errors import UserError

BLOCKSIZE = 64
"""bitsandbytes' 4-bit block size on a CPU: one scale (absmax) per 64 weights."""


def quantized(recipe) -> bool:
    return recipe.model.quantize != "none"


def shards_weights(recipe) -> bool:
    """The recipe's backend shards the frozen base's weights: FSDP-1, FSDP-2 and ZeRO-3.

    Their units flatten (FSDP-1) or split (FSDP-2, ZeRO-3) every weight as one floating dtype, so the
    4-bit weights are stored in the model's dtype (the same packed bytes, reinterpreted), and the norms
    are not upcast to fp32 as peft's k-bit preparation does (FSDP-1: "Must flatten tensors with uniform
    dtype"). Single process, DDP and ZeRO-2 keep uint8 storage and the usual preparation."""
    return recipe.distributed.shards_weights


def require_bitsandbytes(quantize: str, key: str = "model.quantize"):
    """The bitsandbytes module, or a UserError saying why `key: quantize` cannot run here."""
    process_state.silence_hub_kernel_notice()
    try:
        import bitsandbytes
    except Exception as err:  # ImportError, or a native library that does not load
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(
            f"{key} {quantize} needs bitsandbytes, which does not load here ({first}): "
            f"pip install bitsandbytes (Linux x86_64/aarch64, Windows, macOS arm64), or set {key}: none"
        ) from None
    return bitsandbytes


def describe(recipe, dtype: torch.dtype) -> str:
    """The Plan's line for the quantization (the compute dtype `dtype` is model.dtype's)."""
    m = recipe.model
    double = "double quantization" if m.quantize_double else "no double quantization"
    name = str(dtype).removeprefix("torch.")
    stored = f", packed in {name} storage so they shard" if shards_weights(recipe) else ""
    return (
        f"{m.quantize} 4-bit linear layers ({double}{stored}), compute in {name}; lm_head and embeddings "
        "unquantized"
    )


def quantization_config(
    quantize: str,
    double: bool,
    dtype: torch.dtype,
    storage: torch.dtype = torch.uint8,
    key: str = "model.quantize",
):
    """transformers' BitsAndBytesConfig: `quantize` (nf4/fp4) 4-bit weights packed in `storage` (uint8,
    or the model's dtype where the backend shards them: `shards_weights`), compute in `dtype`
    (model.dtype's); the run's, a distill teacher's (`key` distill.quantize) and `liger merge`'s (which reads
    a finished run's settings)."""
    from transformers import BitsAndBytesConfig

    require_bitsandbytes(quantize, key)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantize,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=storage,
    )


def after_loading(model: nn.Module) -> None:
    """What every 4-bit model loaded through `from_pretrained` needs before it is used: the run's base,
    the final check's reload and `liger merge`'s adapter on the 4-bit base."""
    keep_exact_backward(model)
    resume_checks_statistics(model)
    own_unquantized_tensors(model)  # else the checkpoint's map stays resident


def keep_exact_backward(model: nn.Module) -> None:
    """Switch off bitsandbytes' CPU inference repacking on every 4-bit layer (see the module's doc)."""
    for layer in four_bit_layers(model):
        layer.support_avx512bf16_for_cpu = False


def own_unquantized_tensors(model: nn.Module) -> int:
    """Copy every tensor the quantization left as it was (embeddings, lm_head, norms, biases) into memory
    of its own, one at a time; returns the bytes copied.

    `from_pretrained` memory-maps the checkpoint and keeps a tensor it does not convert as a view into
    that map. One such view (the tied embedding, typically) keeps the whole file mapped, and every page
    the quantizer read (each linear weight, in full precision) then stays in the process's resident
    memory, and a step's peak with it: on the Llama-3.2-1B shape with an fp32 checkpoint, 3.6 GiB of
    the 4.6 GiB file, which made QLoRA's step peak 1.07x LoRA's instead of 0.55x (bench/README.md).
    Once the last view is gone the map is closed (tested: tests/test_qlora.py)."""
    copies: dict[tuple, torch.Tensor] = {}  # one copy of the same data held by two tensors
    copied = 0
    for tensor in [*model.parameters(), *model.buffers()]:  # a tied weight once
        if is_4bit(tensor) or tensor.device.type != "cpu":
            continue
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if key not in copies:
            copies[key] = tensor.data.clone()
            copied += tensor.numel() * tensor.element_size()
        tensor.data = copies[key]
    return copied


def prepare_for_training(model: nn.Module) -> nn.Module:
    """peft's usual k-bit preparation (every base weight frozen, every fp16/bf16 parameter left
    unquantized, embeddings and lm_head included, upcast to fp32: the memory plan counts them so);
    activation checkpointing stays with the Plan (`enable_activation_checkpointing`)."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def quantize_linears(model: nn.Module, quantize: str, double: bool, skip: tuple[str, ...] = ("lm_head",)):
    """Replace every nn.Linear (but `skip`) with a bitsandbytes 4-bit layer holding its weights
    quantized, as `from_pretrained` with a BitsAndBytesConfig does: for a twin built from a config."""
    import bitsandbytes as bnb

    dtype = next(model.parameters()).dtype
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name.rsplit(".", 1)[-1] not in skip
    ]
    for name, linear in targets:
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=dtype,
            compress_statistics=double,
            quant_type=quantize,
            device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            linear.weight.data.detach().clone(),
            requires_grad=False,
            compress_statistics=double,
            quant_type=quantize,
            module=layer,
        ).to("cpu")
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data.detach().clone(), requires_grad=False)
        layer.support_avx512bf16_for_cpu = False
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, name.rsplit(".", 1)[-1], layer)
    return model


def dequantized_weight(layer) -> torch.Tensor:
    """The full-precision weight a 4-bit layer computes with."""
    import bitsandbytes as bnb

    return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


def is_4bit(tensor: torch.Tensor) -> bool:
    """A 4-bit packed weight (bitsandbytes' Params4bit)."""
    return type(tensor).__name__ == "Params4bit"


def four_bit_layers(model: nn.Module) -> list[nn.Module]:
    """Every bitsandbytes 4-bit linear layer of `model` (none without bitsandbytes loaded)."""
    import sys

    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def packed_bytes(layer: nn.Module) -> int:
    """The bytes of a 4-bit layer's packed weight, unsharded: two weights a byte, whatever the storage
    dtype (its quantization statistics are kept apart, whole on every rank)."""
    return -(-layer.quant_state.shape.numel() // 2)


def resume_checks_statistics(model: nn.Module) -> None:
    """Let a checkpoint of the model load back (strictly, as FSDP-1's resume does): bitsandbytes writes
    each 4-bit layer's quantization statistics into the state dict (`weight.absmax`, ...) but does not
    read them back. They are frozen with the base, so each is checked bit for bit against the loaded
    base's, and taken out of the state dict; one that differs is a load error naming it."""
    for layer in four_bit_layers(model):
        layer.register_load_state_dict_pre_hook(_check_statistics)


def _check_statistics(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    own = getattr(module.weight, "quant_state", None) or module.quant_state
    expected = {f"{prefix}weight.{k}": v for k, v in own.as_dict(packed=True).items()}
    for key in [k for k in state_dict if k.startswith(f"{prefix}weight.")]:
        saved, mine = state_dict.pop(key), expected.get(key)
        same = mine is not None and saved.shape == mine.shape and saved.dtype == mine.dtype
        if not (same and same_bits(saved, mine)):
            errors.append(f"{key}: the checkpoint's 4-bit statistics are not the loaded base's")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: 4-bit weights packed in a float dtype (under FSDP and ZeRO-3) hold bytes
    that read as NaN, which `torch.equal` never finds equal."""
    return torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    )


def four_bit_bytes(recipe, model: nn.Module) -> dict[int, tuple[int, int]]:
    """QLoRA: what each base linear weight takes in 4 bits (id -> (packed bytes, statistics bytes)), as
    bitsandbytes stores it: two weights a byte (in any storage dtype), one absmax per 64-weight block (a
    uint8 with double quantization, plus one float32 per 256 blocks and its 256-value code; float32
    without), and the 16-value code. lm_head and the adapter's own layers are not quantized (tested
    against a loaded model's state dict). The packed bytes shard; the statistics stay whole."""
    if recipe.model.quantize == "none":
        return {}
    return four_bit_sizes(model, recipe.model.quantize_double)


def four_bit_sizes(model: nn.Module, double: bool) -> dict[int, tuple[int, int]]:
    """`four_bit_bytes` of any model whose linear layers load in 4 bits (a distill teacher's too)."""
    found = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or "lora_" in name or name.rsplit(".", 1)[-1] == "lm_head":
            continue
        n = module.weight.numel()
        blocks = -(-n // BLOCKSIZE)
        scales = blocks + 4 * -(-blocks // 256) + 256 * 4 if double else 4 * blocks  # + the nested code
        found[id(module.weight)] = (n // 2, scales + 16 * 4)  # + the 16-value code (quant_map)
    return found
