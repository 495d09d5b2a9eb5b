"""Which module classes become FSDP units: recipe > FSDP_TRANSFORMER_CLS_TO_WRAP > `_no_split_modules` > [].

`resolve_wrap_classes` is the one place that decides the classes, for `liger train` (through the
Plan) and `liger inspect-wrap` alike, so what inspect shows is what runs. Names are cleaned the way
accelerate does not (see docs/field-failures.md#empty-wrap-class-names).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from liger_cli.errors import UserError
from liger_cli.plan.wrap.report import WrapWarning, format_size
from liger_cli.process_state import WRAP_ENV as ENV_KEY

SOURCES = ("recipe", "env", "no_split_modules", "none")
_LAYER_LIKE = re.compile(r"(Layer|Block)$")


@dataclass(frozen=True)
class WrapResolution:
    """The classes to wrap and where the answer came from ("recipe" | "env" | "no_split_modules" | "none")."""

    classes: list[str]
    source: str
    warnings: list[WrapWarning] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # `_no_split_modules` names the model lacks
    added: list[str] = field(default_factory=list)  # a VLM's block/tower classes `_no_split_modules` left out
    kept_whole: list[str] = field(default_factory=list)  # not wrapped: a unit would split a shared weight


def split_names(value: str | Iterable[str] | None) -> list[str]:
    """Comma-split, strip, drop empty names, de-duplicate in order: "" and " , " give [], never [""]."""
    if value is None:
        return []
    parts = [value] if isinstance(value, str) else list(value)
    names = [name.strip() for part in parts for name in str(part).split(",")]
    return list(dict.fromkeys(name for name in names if name))


def model_classes(model: nn.Module) -> list[tuple[str, int]]:
    """Module class names in the model with their counts, the likely wrap candidates first.

    Candidates: the model's `_no_split_modules` and names ending in Layer/Block, then classes of our own
    (not torch.nn builtins) that repeat, then the rest; each group in order of first appearance.
    """
    counts: Counter[str] = Counter()
    builtin: dict[str, bool] = {}
    for module in model.modules():
        name = type(module).__name__
        counts[name] += 1
        builtin.setdefault(name, type(module).__module__.startswith("torch."))
    no_split = set(split_names(no_split_modules(model)))

    def rank(name: str) -> int:
        if name in no_split or (_LAYER_LIKE.search(name) and not builtin[name]):
            return 0
        if counts[name] > 1 and not builtin[name]:
            return 1
        return 2

    order = {name: i for i, name in enumerate(counts)}
    return [(name, counts[name]) for name in sorted(counts, key=lambda n: (rank(n), order[n]))]


def resolve_wrap_classes(
    model: nn.Module,
    recipe_value: str | Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    recipe_origin: str = "the recipe's distributed.fsdp.wrap_classes",
) -> WrapResolution:
    """Decide the FSDP wrap classes: recipe > FSDP_TRANSFORMER_CLS_TO_WRAP > `_no_split_modules` > [].

    A level that names nothing after cleaning ("", " , ") counts as unset. Names the user gave must match a
    class in the model (a PeftModel is looked through: its modules are the base model's); the error lists
    the classes the model has. `_no_split_modules` entries the model lacks are dropped (and listed in
    `dropped`), since accelerate would fail on them and the user never wrote them; a VLM's vision block
    and tower classes are added where `_no_split_modules` leaves them out (listed in `added`). `recipe_origin` names where `recipe_value` came
    from in that error (a command-line option overriding the recipe, say).
    """
    env = os.environ if env is None else env
    present = {name for name, _ in model_classes(model)}
    origins = {"recipe": recipe_origin, "env": f"the environment variable {ENV_KEY}"}
    for source, value in (("recipe", recipe_value), ("env", env.get(ENV_KEY))):
        names = split_names(value)
        if not names:
            continue
        unknown = [name for name in names if name not in present]
        if unknown:
            raise UserError(
                f"FSDP wrap class {', '.join(repr(n) for n in unknown)} from {origins[source]} "
                f"matches no module in this model; use one of its classes: {_class_list(model)}"
            )
        return WrapResolution(names, source)

    named = split_names(no_split_modules(model))
    names = [name for name in named if name in present]
    dropped = [name for name in named if name not in present]
    added = [name for name in vision_classes(model) if name not in names]
    splitting = set(splitting_classes(model, names + added))  # a tied weight must stay in one unit
    names, added = [n for n in names if n not in splitting], [n for n in added if n not in splitting]
    kept = sorted(splitting)
    if names or added:
        return WrapResolution(
            names + added, "no_split_modules", dropped=dropped, added=added, kept_whole=kept
        )
    root_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return WrapResolution([], "none", [no_wrap_warning(model, root_bytes)], dropped=dropped, kept_whole=kept)


def splitting_classes(model: nn.Module, names: Sequence[str]) -> list[str]:
    """The classes among `names` whose units would split a shared parameter (tied embeddings, UDOP's
    relative bias): a module of the class holds a parameter that a module outside it holds too."""
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), set()).add(id(module))
    shared = {key for key, held in holders.items() if len(held) > 1}
    if not shared:
        return []
    found = []
    for module in model.modules():
        name = type(module).__name__
        if module is model or name not in names or name in found:
            continue
        inside = {id(m) for m in module.modules()}
        if any(key in shared and not holders[key] <= inside for key in map(id, module.parameters())):
            found.append(name)
    return found


def vision_classes(model: nn.Module) -> list[str]:
    """A VLM's units: its language model's and its vision tower's block classes (some `_no_split_modules`
    name only the attention, or nothing), then the tower class itself, so that the tower's other parameters
    (patch embedding, norms), frozen by default, do not share the root unit with the trainable projector
    and language model (FSDP-1 flattens a unit into one tensor); then a projector inside the tower (Qwen2-VL's
    merger), which trains while the tower is frozen (`model.train_projector`). [] for a text model."""
    from liger_cli.model.vision import (
        block_classes,
        is_vision_language,
        language_model,
        projectors,
        vision_tower,
    )

    tower = vision_tower(model)
    config = getattr(model, "config", None)
    if tower is None and (config is None or not is_vision_language(config)):
        return []
    blocks = [*block_classes(language_model(model)), *block_classes(tower)]
    inside = {id(m) for m in tower.modules()} if tower is not None else set()
    nested = [type(p).__name__ for p in projectors(model) if id(p) in inside and p is not tower]
    return list(dict.fromkeys([*blocks, *([type(tower).__name__] if tower is not None else []), *nested]))


def no_wrap_warning(model: nn.Module, root_bytes: int) -> WrapWarning:
    candidates = [name for name, count in model_classes(model)[:3] if count > 1] or ["<your block class>"]
    return WrapWarning(
        "NO_WRAP_CLASSES",
        f"No FSDP wrap classes: nothing in the recipe (distributed.fsdp.wrap_classes), {ENV_KEY} is unset or "
        f"empty, and the model has no _no_split_modules, so the blocks stay in the root unit and every rank "
        f"gathers them all at once ({format_size(root_bytes)} of parameters) instead of one block at a time. "
        f"Fix: set distributed.fsdp.wrap_classes to the repeated block class, e.g. {candidates[0]}.",
    )


def no_split_modules(model: nn.Module) -> Iterable[str] | None:
    # A PeftModel forwards attribute reads to the base model, so this looks through peft too.
    try:
        return getattr(model, "_no_split_modules", None)
    except Exception:  # a custom __getattr__ may raise something other than AttributeError
        return None


def _class_list(model: nn.Module) -> str:
    return ", ".join(f"{name} (x{count})" if count > 1 else name for name, count in model_classes(model))
