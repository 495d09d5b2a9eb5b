"""Vision-language models: telling one from its config, and finding its parts (tower, projector, blocks,
language model).

Detection goes by transformers' own auto mappings, never by a list of model names: a config class that
`AutoModelForImageTextToText` maps is a VLM when it is not a causal LM, or when it carries a
`vision_config` (Gemma 3 is in both mappings). The parts are found the way transformers finds them
(`get_encoder(modality="image")`, `get_decoder()`), with the module built from `config.vision_config`
as the fallback; the projector by elimination (`projectors`). Which parts a run trains is
`vision_training.py`'s; `freeze_vision` is `inspect-wrap --vision`'s.
"""

from __future__ import annotations

from torch import nn

VISION_MODES = ("frozen", "lora", "full")


def is_vision_language(config) -> bool:
    """Whether `AutoModelForImageTextToText` is the class to build for this config."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return False
    return (
        type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or getattr(config, "vision_config", None) is not None
    )


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (the model itself without one)."""
    get_base = getattr(model, "get_base_model", None)  # through a peft wrapper
    return get_base() if callable(get_base) else model


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The image encoder, None for a model without one (a text model, a tower-less VLM such as Fuyu).

    In order: transformers' `get_encoder(modality="image")`; the submodule built from `config.vision_config`;
    the outermost submodule of transformers' whose main input is `pixel_values` (a tower nested in a
    sub-model, as in PI0 or T5Gemma 2, or named `encoder`, as in VisionEncoderDecoder). A candidate that
    also holds the text embeddings (T5Gemma 2's encoder) is not the vision tower.
    """
    base = unwrapped(model)
    try:
        embed = base.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embed = None

    def tower_like(module) -> bool:
        return (
            isinstance(module, nn.Module)
            and module is not base
            and not any(m is embed for m in module.modules())
            and any(True for _ in module.parameters())
        )

    try:
        tower = base.get_encoder(modality="image")
    except (AttributeError, TypeError, ValueError):
        tower = None
    if tower_like(tower):
        return tower
    vision_config = getattr(getattr(base, "config", None), "vision_config", None)
    for module in base.modules():
        if (
            vision_config is not None
            and getattr(module, "config", None) is vision_config
            and tower_like(module)
        ):
            return module
    for module in base.modules():
        if getattr(module, "main_input_name", None) == "pixel_values" and tower_like(module):
            return module
    return None


def language_model(model: nn.Module) -> nn.Module | None:
    """The text decoder (`get_decoder()`), None when transformers names none."""
    base = unwrapped(model)
    try:
        decoder = base.get_decoder()
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        return None
    return decoder if isinstance(decoder, nn.Module) and decoder is not base else None


def block_lists(module: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The outermost ModuleLists of blocks inside `module`: items of classes of our own (not torch builtins;
    one class, or several as in Mllama's self- and cross-attention layers) holding parameters. Lists
    nested inside a found list (MoE experts) are not listed again."""
    found: list[tuple[str, nn.ModuleList]] = []
    inside: set[int] = set()
    for name, child in module.named_modules():
        if id(child) in inside or not isinstance(child, nn.ModuleList) or len(child) == 0:
            continue
        if any(type(item).__module__.startswith("torch.") for item in child):
            continue
        if not any(True for _ in child.parameters()):
            continue
        found.append((name, child))
        inside.update(id(m) for m in child.modules())
    return found


def block_classes(module: nn.Module | None) -> list[str]:
    """Class names of the blocks in `module` (see `block_lists`), in model order."""
    if module is None:
        return []
    return list(dict.fromkeys(type(item).__name__ for _, lst in block_lists(module) for item in lst))


def projectors(model: nn.Module) -> list[nn.Module]:
    """The multimodal projector, as the outermost modules that hold it; [] without a vision tower.

    Found by elimination, never by name: the modules holding parameters that belong to none of the vision
    tower, the language model, the embeddings and the other encoders (sub-models whose main input is not
    token ids: an audio tower, a video tower). That is LLaVA's and Gemma 3's `multi_modal_projector`,
    Idefics 3's `connector`, BLIP-2's Q-Former with its `language_projection`. A model with nothing
    there keeps its projector inside the tower: the tower's modules registered after its (longest list
    of) blocks, e.g. Qwen2-VL's `visual.merger` (Qwen3-VL's deepstack mergers too).
    """
    base = unwrapped(model)
    tower = vision_tower(base)
    if tower is None:
        return []
    encoders = [m for m in base.modules() if getattr(m, "main_input_name", "input_ids") != "input_ids"]
    parts = [tower, language_model(base), _embeddings(base, "input"), _embeddings(base, "output"), *encoders]
    owned = {id(p) for part in parts if part is not None and part is not base for p in part.parameters()}
    outside = _outermost(base, lambda m: m is not base and _all_params_in(m, exclude=owned))
    copies = getattr(tower, "modules_to_save", None)  # peft's wrapper of a tower trained in full beside
    if isinstance(copies, nn.ModuleDict) and len(copies):  # an adapter: the projector in its trained copy
        tower = next(iter(copies.values()))
    if outside or not (lists := block_lists(tower)):
        return outside
    blocks = max((lst for _, lst in lists), key=len)
    order = {id(m): i for i, m in enumerate(tower.modules())}
    end = max(order[id(m)] for m in blocks.modules())
    holds_blocks = {id(m) for m in tower.modules() if any(x is blocks for x in m.modules())}
    return _outermost(
        tower, lambda m: order[id(m)] > end and id(m) not in holds_blocks and _all_params_in(m, set())
    )


def _embeddings(base: nn.Module, which: str) -> nn.Module | None:
    try:
        found = getattr(base, f"get_{which}_embeddings")()
    except (AttributeError, NotImplementedError):
        return None
    return found if isinstance(found, nn.Module) else None


def _all_params_in(module: nn.Module, exclude: set[int]) -> bool:
    """`module` holds parameters, none of them in `exclude`."""
    params = list(module.parameters())
    return bool(params) and not any(id(p) in exclude for p in params)


def _outermost(root: nn.Module, wanted) -> list[nn.Module]:
    """The modules under `root` for which `wanted` holds, none inside another found one, in model order."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in root.modules():
        if id(module) in inside or not wanted(module):
            continue
        found.append(module)
        inside.update(id(m) for m in module.modules())
    return found


def freeze_vision(model: nn.Module, mode: str = "frozen") -> None:
    """`frozen` (the default): the vision tower's parameters stop requiring grad; `full` and `lora`
    leave them as they are (`lora` adds its adapters through peft, not here)."""
    if mode not in VISION_MODES:
        raise ValueError(f"vision mode {mode!r}: use one of {', '.join(VISION_MODES)}")
    tower = vision_tower(model)
    if mode == "frozen" and tower is not None:
        for param in tower.parameters():
            param.requires_grad_(False)


def tower_path(model: nn.Module) -> str | None:
    """The vision tower's module path in `model` (peft prefixes included), None without a tower."""
    tower = vision_tower(model)
    return (
        next((name for name, m in model.named_modules() if m is tower), None) if tower is not None else None
    )
