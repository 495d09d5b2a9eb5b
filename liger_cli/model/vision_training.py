"""What of a vision-language model trains: `model.vision` and `model.train_projector`, applied where the
adapter is added (`build.add_adapter`), and read back off the built model for the Plan (`describe`).

The defaults are what LLaVA and TRL users expect: the vision tower frozen; the language model trains
through the adapter or in full; the projector trains in full under full fine-tuning, and beside an
adapter only when `model.train_projector` says so. The adapter's targets (`all-linear` or a list of
names) reach the language model only: never the projector, and the tower only with `vision: lora`
(peft's `all-linear` takes linear layers, never a Conv patch embedding, nor lm_head).

Beside an adapter, what trains in full (the projector, a `vision: full` tower) is peft's
`modules_to_save`: peft trains a copy, saves it in the adapter file, loads it back with the adapter and
puts it in place on `merge_and_unload`, so `final/` and `liger merge` hold it. Only switching
requires_grad on would train weights that the adapter file leaves out.
"""

from __future__ import annotations

import re

from torch import nn

from liger_cli.errors import UserError
from liger_cli.model.vision import language_model, projectors, unwrapped, vision_tower
from liger_cli.recipe import Recipe


def projector_trains(recipe: Recipe) -> bool:
    """`model.train_projector`, or its default: true under full fine-tuning, false with an adapter."""
    chosen = recipe.model.train_projector
    return recipe.adapter.type == "none" if chosen is None else chosen


def check_applies(model: nn.Module, recipe: Recipe) -> None:
    """The vision keys set on a model without a vision tower are an error, never ignored."""
    m = recipe.model
    if vision_tower(model) is None and (m.vision != "frozen" or m.train_projector is not None):
        name = type(unwrapped(model)).__name__
        raise UserError(
            f"model.vision and model.train_projector apply to a vision-language model, and {name} has no "
            "vision tower: remove them"
        )


def adapter_scope(model: nn.Module, recipe: Recipe) -> dict:
    """The peft config fields that keep a VLM's adapter in its language model: `exclude_modules` (the
    projector; the tower unless `vision: lora`) and `modules_to_save` (what trains in full beside the
    adapter). {} for a text model."""
    tower = vision_tower(model)
    if tower is None:
        return {}
    path = _paths(model)
    tower_path = path[id(tower)]
    projector_paths = [path[id(p)] for p in projectors(model)]
    mode = recipe.model.vision
    exclude = projector_paths + ([tower_path] if mode != "lora" else [])
    save = [tower_path] if mode == "full" else []
    if projector_trains(recipe):  # one inside a tower trained in full is in the tower's copy already
        save += [p for p in projector_paths if not (mode == "full" and p.startswith(tower_path + "."))]
    alternatives = "|".join(re.escape(p) for p in exclude)
    return {
        "exclude_modules": rf"({alternatives})(\..*)?" if exclude else None,
        "modules_to_save": save or None,
    }


def set_full_training(model: nn.Module, recipe: Recipe) -> None:
    """Full fine-tuning: the tower trains only with `vision: full`, the projector as `projector_trains`
    says (after the tower: a projector inside it, Qwen2-VL's merger, gets its own setting)."""
    tower = vision_tower(model)
    if tower is None:
        return
    tower.requires_grad_(recipe.model.vision == "full")
    for projector in projectors(model):
        projector.requires_grad_(projector_trains(recipe))


def describe(model: nn.Module) -> str | None:
    """The Plan's `trains` row, read off the built model (adapter included): each part of a VLM, its
    path and how it trains (frozen, lora, full, full as peft's modules_to_save). None for a text model.
    A parameter counts in the first part that holds it: the projector, the tower, the language model,
    then lm_head (left out when tied to the embeddings)."""
    base = unwrapped(model)
    tower = vision_tower(base)
    if tower is None:
        return None
    path = _paths(base)
    parts = {
        "projector": projectors(base),
        "vision tower": [tower],
        "language model": [m for m in [language_model(base)] if m is not None],
        "lm_head": [m for m in [base.get_output_embeddings()] if m is not None],
    }
    seen: set[int] = set()  # parameters and modules of the parts said before
    said = {}
    for name, modules in parts.items():
        own = [p for m in modules for p in m.parameters() if id(p) not in seen]
        inner = [m for module in modules for m in module.modules() if id(m) not in seen]
        seen.update([*map(id, own), *map(id, inner)])
        if own:
            where = ", ".join(path[id(m)] for m in modules)
            said[name] = f"{name}{f' ({where})' if where != name else ''}: {_mode(inner, own)}"
    order = ("vision tower", "projector", "language model", "lm_head")
    return "; ".join(said[name] for name in order if name in said)


def _mode(inner: list[nn.Module], params: list[nn.Parameter]) -> str:
    """How a part trains, from its modules (those of parts said before left out) and its parameters."""
    if any(hasattr(m, "modules_to_save") and hasattr(m, "original_module") for m in inner):
        return "full (peft modules_to_save)"
    if any(hasattr(m, "lora_A") for m in inner):
        return "lora"
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    if trainable == 0:
        return "frozen"
    return "full" if trainable == total else f"partly ({trainable:,} of {total:,} parameters)"


def _paths(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}
