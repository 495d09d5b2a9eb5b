"""A Hugging Face model folder written as one GGUF file with llama.cpp's own writer (the `gguf` package):
the architecture's metadata, every weight under llama.cpp's tensor name, the tokenizer.

Weights go in as f32, f16 or bf16 (`gguf.quants` packs bf16); 1-D tensors (norms, biases) stay f32, as
llama.cpp computes them. Quantized types are made from this file by llama.cpp's own quantizer
(`runtime.quantize`), never here. Tensors are read one at a time from the safetensors files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from liger_cli.errors import UserError
from liger_cli.export.families import Family, convert_tensor, rope_frequency_factors, write_hyperparameters

PLAIN_TYPES = ("f32", "f16", "bf16")


def model_tensors(folder: Path):
    """(name, tensor) for every weight in the folder's safetensors files, one at a time."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} has no .safetensors weights: save the model with safe_serialization")
    for file in files:
        with safe_open(file, framework="pt") as opened:
            for name in opened.keys():
                yield name, opened.get_tensor(name)


def write_gguf(folder: Path, path: Path, config, family: Family, tokenizer, out_type: str,
               turn_end: int | None, name: str) -> str:  # fmt: skip
    """Write `path`; returns the pre-tokenizer's name. A tensor llama.cpp's map has no name for stops
    the export (a model with weights llama.cpp would not load is not this family)."""
    import gguf

    from liger_cli.export.gguf_tokenizer import write_tokenizer

    text = config.get_text_config()
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    names = gguf.get_tensor_name_map(arch, text.num_hidden_layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(name)
    write_hyperparameters(writer, config)
    tensor_types, file_types = plain_types()
    writer.add_file_type(file_types[out_type])
    pre = write_tokenizer(writer, folder, tokenizer, text.vocab_size, turn_end)
    tied = getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)
    for hf_name, tensor in model_tensors(folder):
        hf_name = language_name(hf_name)
        if hf_name is None:
            continue  # the vision tower and projector: the projector file's (gguf_projector.py)
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the output projection from token_embd when output is absent
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from rope_freq_base
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UserError(
                f"tensor {hf_name} has no llama.cpp name in the {family.arch.lower()} architecture: this "
                f"{config.model_type} model has weights liger's export does not know; nothing written"
            )
        data = convert_tensor(hf_name, tensor, family, text).to(torch.float32).numpy()
        qtype = gguf.GGMLQuantizationType.F32 if data.ndim == 1 else tensor_types[out_type]
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    factors = rope_frequency_factors(text)
    if factors is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pre


VISION_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                   "model.multi_modal_projector.", "model.vision_model.", "model.connector.")  # fmt: skip


def language_name(name: str) -> str | None:
    """A checkpoint name as the language model's (a VLM's `model.language_model.` or `model.text_model.` or,
    in the layout Gemma 3 is saved in, `language_model.` prefix dropped), or None for the vision tower's and
    projector's weights."""
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix in ("model.language_model.", "model.text_model."):  # Idefics 3 and SmolVLM: text_model
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return name.removeprefix("language_model.")


def plain_types() -> tuple[dict, dict]:
    """Each plain type's tensor type and file type, in the gguf package's enums."""
    import gguf

    tensors = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
               "bf16": gguf.GGMLQuantizationType.BF16}  # fmt: skip
    files = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16}  # fmt: skip
    return tensors, files
