"""Model, tokenizer, adapters and kernels, built as the recipe and the Plan say.

The order matters and is the same everywhere: load (or build) the model, switch off the KV cache,
add the adapter through peft, enable activation checkpointing, patch our kernels into the
instance. Loading passes every argument of `model.load_kwargs` to `from_pretrained` untouched
(a wrapper that drops a loading argument breaks engines such as ZeRO-3:
see docs/field-failures.md#zero-3-loading-drops-an-argument).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn

import liger_cli.model.quantize as quantize
from liger_cli.errors import UserError
from liger_cli.recipe import Recipe


class Decisions(Protocol):
    """What building the model needs of the Plan (decided later in the flow, from the meta model)."""

    kernels: dict[str, bool]
    activation_checkpointing: str


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(recipe: Recipe) -> torch.dtype:
    """Weights stay fp32 under mixed precision; an explicit model.dtype wins."""
    if recipe.model.dtype != "auto":
        return DTYPES[recipe.model.dtype]
    return torch.float32


def read_config(source: Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"cannot read a model config from {source}: {first}") from None


def model_class(config):
    """The auto class a config builds: `AutoModelForSequenceClassification` for a reward model (a config
    that names a sequence-classification class: `reward_config`, or a saved reward model's),
    `AutoModelForImageTextToText` for a vision-language model (told from the config by transformers' own
    mappings: `vision.is_vision_language`), `AutoModelForCausalLM` otherwise. Every place that builds or
    loads the recipe's model asks here."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    from liger_cli.model.vision import is_vision_language

    if is_reward_config(config):
        return AutoModelForSequenceClassification
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def is_reward_config(config) -> bool:
    """Whether the config names a sequence-classification class (a reward model's: one score)."""
    return any(
        str(name).endswith("ForSequenceClassification")
        for name in getattr(config, "architectures", None) or ()
    )


def reward_config(config, pad_token_id: int | None = None):
    """The config of the recipe's model as a reward model (`training.objective: reward`): the family's own
    sequence-classification class (transformers' mapping) with one label, and `pad_token_id` set to the
    collator's, which that class reads to score each row's last non-pad token. A UserError when the family
    has no such class. Returns a changed copy."""
    import copy

    from transformers import AutoModelForSequenceClassification

    from liger_cli.model.vision import is_vision_language

    config = copy.deepcopy(config)
    mapping = AutoModelForSequenceClassification._model_mapping
    if is_vision_language(config) or type(config) not in mapping:
        raise UserError(
            f"training.objective reward: transformers has no sequence-classification class for "
            f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')}): choose a text model "
            "whose family has one (Llama, Qwen2, Mistral, Gemma, ...)"
        )
    config.architectures = [mapping[type(config)].__name__]
    config.num_labels = 1
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    return config


def recipe_config(recipe: Recipe, pad_token_id: int | None = None):
    """The config the recipe's model is built from: the model's own, or as a reward model (`reward_config`;
    `pad_token_id` None: the tokenizer's, as the data stage pads)."""
    m = recipe.model
    config = read_config(m.path or m.config, m.trust_remote_code)
    if recipe.training.objective != "reward":
        return config
    if pad_token_id is None:
        from liger_cli.data.tokenizer import load_tokenizer

        pad_token_id = load_tokenizer(recipe).pad_token_id
    return reward_config(config, pad_token_id)


def meta_model_from_config(
    source: Path,
    trust_remote_code: bool = False,
    dtype: torch.dtype | None = None,
    attn_implementation=None,
) -> nn.Module:
    """The model of a config (`model_class`; `source` a folder, or the config itself) on the meta device:
    structure only, no weights read or allocated. `dtype` None keeps the config's own dtype (what the
    checkpoint holds)."""
    import warnings

    config = read_config(source, trust_remote_code) if not hasattr(source, "to_dict") else source
    if dtype is None:
        dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.float32
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = model_class(config).from_config(config, **kwargs)
    except ValueError as err:
        raise UserError(
            f"{source}: not a causal language model or vision-language model transformers can build: {err}"
        ) from None
    model.config.use_cache = False
    return model


def load_base_model(recipe: Recipe) -> nn.Module:
    """`from_pretrained` for a model folder, `from_config` (seeded random init) for model.config; a
    vision-language config builds its image-text-to-text class (`model_class`)."""
    m = recipe.model
    kwargs = {"dtype": model_dtype(recipe), "trust_remote_code": m.trust_remote_code}
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    if m.quantize != "none":  # QLoRA (quantize.py); the schema allows it with model.path only
        storage = kwargs["dtype"] if quantize.shards_weights(recipe) else torch.uint8
        kwargs["quantization_config"] = quantize.quantization_config(
            m.quantize, m.quantize_double, kwargs["dtype"], storage
        )
    config = recipe_config(recipe)
    if m.path is not None:
        if is_reward_config(
            config
        ):  # the score head is new: initialised from the seed, the same on every rank
            torch.manual_seed(recipe.training.seed)
            kwargs["config"] = config
        model = model_class(config).from_pretrained(m.path, **kwargs, **m.load_kwargs)
        if m.quantize != "none":
            quantize.after_loading(model)
    else:
        torch.manual_seed(recipe.training.seed)
        model = model_class(config).from_config(config, **kwargs)
    # A cache during recompute grows and breaks checkpointing
    # (see docs/field-failures.md#checkpointing-recomputes-different-shapes).
    model.config.use_cache = False
    return model


def _peft_config(recipe: Recipe, model: nn.Module):
    """peft's config for the recipe's adapter on `model`; on a VLM kept to its language model
    (`vision_training.adapter_scope`)."""
    from peft import LoraConfig, PeftConfig

    from liger_cli.model.vision_training import adapter_scope

    a = recipe.adapter
    if a.init is not None:  # the starting adapter's own configuration
        config = PeftConfig.from_pretrained(a.init)
        config.use_dora = a.type == "dora" or getattr(config, "use_dora", False)
        config.inference_mode = False
        return config
    return LoraConfig(
        r=a.r,
        lora_alpha=a.alpha,
        lora_dropout=a.dropout,
        target_modules=a.target_modules,
        use_dora=a.type == "dora",
        # a reward model: peft's SEQ_CLS trains its score head in full beside the adapter (modules_to_save)
        task_type="SEQ_CLS" if recipe.training.objective == "reward" else "CAUSAL_LM",
        **adapter_scope(model, recipe),
    )


def adapter_in_model_dtype(recipe: Recipe) -> bool:
    """FSDP-1 flattens each unit into one tensor of one dtype ("Must flatten tensors with uniform
    dtype"), and peft keeps adapter weights in float32 under a half-precision base: under FSDP-1 the
    adapter takes the model's dtype instead (the Plan says so)."""
    half = model_dtype(recipe) in (torch.bfloat16, torch.float16)
    return recipe.distributed.flattens_units and half and recipe.adapter.type != "none"


def add_adapter(model: nn.Module, recipe: Recipe, low_cpu_mem_usage: bool = False) -> nn.Module:
    """peft's own LoRA/DoRA; `low_cpu_mem_usage` builds the adapter on the meta device too. What of a
    vision-language model trains is set here too (`vision_training.py`), adapter or not."""
    from liger_cli.model.vision_training import check_applies, set_full_training

    check_applies(model, recipe)
    if recipe.adapter.type == "none":
        set_full_training(model, recipe)
        return model
    from peft import get_peft_model

    if quantize.quantized(recipe) and not quantize.shards_weights(recipe) and not low_cpu_mem_usage:
        model = quantize.prepare_for_training(model)
    try:
        if recipe.adapter.init is not None and not low_cpu_mem_usage:  # its trained weights, trainable
            from peft import PeftModel

            return PeftModel.from_pretrained(
                model, recipe.adapter.init, is_trainable=True,
                autocast_adapter_dtype=not adapter_in_model_dtype(recipe),
            )  # fmt: skip
        return get_peft_model(
            model,
            _peft_config(recipe, model),
            low_cpu_mem_usage=low_cpu_mem_usage,
            autocast_adapter_dtype=not adapter_in_model_dtype(recipe),
        )
    except ValueError as err:
        raise UserError(f"adapter: {err}; check adapter.target_modules") from None


def enable_activation_checkpointing(model: nn.Module, plan: Decisions) -> None:
    """Checkpoint every decoder layer with the implementation the Plan chose
    (see docs/field-failures.md#checkpointing-recomputes-different-shapes).

    Through transformers' `activation_checkpointing_enable` (`gradient_checkpointing_enable` is
    deprecated); it also makes the embeddings' output require grad, without which reentrant
    checkpointing over a frozen base (LoRA) passes no gradient ("element 0 of tensors does not
    require grad"). The KV cache stays off: one that grows during recompute breaks the shapes.
    """
    if plan.activation_checkpointing == "off":
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.activation_checkpointing_enable({"use_reentrant": plan.activation_checkpointing == "reentrant"})
    base.config.use_cache = False


def build_model(recipe: Recipe, plan: Decisions) -> tuple[nn.Module, tuple[str, ...]]:
    """The model a run trains: base + adapter + checkpointing + our kernels; and the kernels' report."""
    model = load_base_model(recipe)
    model = add_adapter(model, recipe)
    enable_activation_checkpointing(model, plan)
    return model, patch_kernels(model, plan)


def patch_kernels(model: nn.Module, plan: Decisions) -> tuple[str, ...]:
    """Patch the Plan's kernels into this model instance; returns the patch report, one line each."""
    from liger_kernels import patch_model

    if not any(plan.kernels.values()):
        return ("none (all kernels off in the recipe)",)
    try:
        report = patch_model(model, **plan.kernels)
    except ValueError as err:
        raise UserError(f"kernels: {err}") from None
    return tuple(report.lines())


def twin_adapter(recipe: Recipe):
    """For the kernel check's tiny twin: the recipe's adapter with random (not zero) LoRA B, so the
    adapter's path changes the outputs and its gradients are compared too; None without an adapter.
    With model.quantize the twin's linear layers are quantized first, so our kernels are compared on
    the model as it will run."""
    if recipe.adapter.type == "none":
        return None
    from peft import get_peft_model

    m = recipe.model

    def add(model: nn.Module) -> nn.Module:
        if m.quantize != "none":  # the twin's linear layers in 4 bits, as the run's base is loaded
            quantize.require_bitsandbytes(recipe.model.quantize)
            quantize.quantize_linears(model, m.quantize, m.quantize_double)
        config = _peft_config(recipe, model)
        config.init_lora_weights = False
        return get_peft_model(model, config)

    return add


def build_meta_model_for(recipe: Recipe) -> nn.Module:
    """The recipe's model and adapter on the meta device: structure only, no weights read."""
    m = recipe.model
    source = recipe_config(recipe) if recipe.training.objective == "reward" else m.path or m.config
    model = meta_model_from_config(source, m.trust_remote_code, model_dtype(recipe), m.attn_implementation)
    return add_adapter(model, recipe, low_cpu_mem_usage=True)


def meta_twin(peft_model: nn.Module) -> nn.Module:
    """The same peft model on the meta device: module paths free of wrapper names, no memory.

    peft names the adapter's weights after module paths; under FSDP-1 those contain
    `_fsdp_wrapped_module` in the middle (peft strips only a leading one), so `save_pretrained`
    silently writes an empty adapter. The twin's paths match the clean state dict FSDP gives.
    """
    import copy

    from peft import get_peft_model

    base = peft_model.get_base_model()
    with torch.device("meta"):
        twin_base = model_class(base.config).from_config(base.config)
    twin_base.name_or_path = base.name_or_path
    name = peft_model.active_adapter
    return get_peft_model(twin_base, copy.deepcopy(peft_model.peft_config[name]), adapter_name=name)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total), counting a tied weight once."""
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    size = {key: _numel(p) for key, p in seen.items()}
    total = sum(size.values())
    trainable = sum(size[key] for key, p in seen.items() if p.requires_grad)
    return trainable, total


def _numel(p: nn.Parameter) -> int:
    """The parameter's element count: ZeRO-3's full size; a 4-bit weight's unpacked size (two a byte)."""
    if quantize.is_4bit(p) and getattr(p, "quant_state", None) is not None:
        return p.quant_state.shape.numel()
    return getattr(p, "ds_numel", p.numel())
