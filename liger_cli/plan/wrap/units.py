"""A replay of accelerate's FSDP auto-wrap policy: the units a model would get, and their sizes.

`plan_units` replays accelerate 1.15's auto-wrap on a model (a meta model is enough: it only reads
shapes, dtypes and `requires_grad`) and adds the warnings of `rules.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from liger_cli.errors import UserError
from liger_cli.plan.backends import FSDP_BACKENDS
from liger_cli.plan.wrap.report import ROOT, Part, Unit, WrapReport, ceil_div
from liger_cli.plan.wrap.resolve import WrapResolution, split_names
from liger_cli.plan.wrap.rules import ambient_accelerate_config, plan_warnings

Groups = list[tuple[list[nn.Module], str]]


def plan_units(
    model: nn.Module,
    classes: Sequence[str] | WrapResolution,
    backend: str = "fsdp2",
    num_processes: int = 1,
    fused_linear_cross_entropy: bool = False,
    activation_checkpointing: str = "off",
    use_orig_params: bool = True,
    use_cache: bool | None = None,
    check_ambient_config: bool = True,
    accelerate_config: Path | str | None = None,
    stored_bytes: Mapping[int, int] | None = None,
) -> WrapReport:
    """Replay accelerate's FSDP auto-wrap on `model` and report the units, sizes and known failures.

    Every module (below the root) whose class is in `classes` becomes a unit, as in accelerate's transformer
    policy; under FSDP-2, accelerate 1.15 also makes the input embeddings a unit (when untied) and groups
    [final norm, lm_head] (plus embeddings when tied) into one unit that stays gathered after forward.
    Everything else stays in the root unit. Pass a `WrapResolution` to carry its source and warnings.
    `use_cache` defaults to `model.config.use_cache`. `check_ambient_config` looks for accelerate's default
    config file (at `accelerate_config`, default accelerate's own path); turn it off when the recipe names
    its own accelerate config. `stored_bytes` (id(parameter) -> bytes) gives the size of parameters
    stored other than as their dtype says: QLoRA's 4-bit weights.
    """
    if backend not in FSDP_BACKENDS:
        raise UserError(f"Unknown FSDP backend {backend!r}; use {' or '.join(FSDP_BACKENDS)}")
    if num_processes < 1:
        raise UserError(f"num_processes must be at least 1, got {num_processes}")
    if isinstance(classes, WrapResolution):
        names, source, warnings = list(classes.classes), classes.source, list(classes.warnings)
        dropped, added, kept = list(classes.dropped), list(classes.added), list(classes.kept_whole)
    else:
        names, source, warnings, dropped, added, kept = split_names(classes), "given", [], [], [], []

    groups = _unit_groups(model, names, backend)
    module_unit, owners = _ownership(model, groups)
    params = list(model.parameters())  # parameters() yields a tied Parameter once
    paths = {id(m): name or ROOT for name, m in model.named_modules()}
    n = num_processes
    stored = stored_bytes or {}

    def nbytes(owned: Iterable[torch.Tensor]) -> int:
        return sum(stored.get(id(p), p.numel() * p.element_size()) for p in owned)

    units = []
    for index, (modules, reason) in enumerate(groups):
        owned = [p for p in params if owners[id(p)][0] == index]
        units.append(
            Unit(
                path=" + ".join(paths[id(m)] for m in modules),
                cls=" + ".join(type(m).__name__ for m in modules),
                params=sum(p.numel() for p in owned),
                trainable_params=sum(p.numel() for p in owned if p.requires_grad),
                bytes=nbytes(owned),
                bytes_per_rank=ceil_div(nbytes(owned), n),
                reason=reason,
            )
        )
    root = [p for p in params if owners[id(p)][0] is None]
    root_bytes = nbytes(root)
    largest = max((u.bytes for u in units), default=0)
    bytes_per_rank = sum(u.bytes_per_rank for u in units) + ceil_div(root_bytes, n)
    # The root stays gathered from forward into backward (FSDP-1 and FSDP-2 both skip the root's reshard
    # after forward); the other units are gathered one at a time on top of that.
    peak = bytes_per_rank + root_bytes - ceil_div(root_bytes, n) + largest - ceil_div(largest, n)

    input_embed, output_embed = embeddings(model)

    def unit_of(module: nn.Module | None) -> str | None:
        if module is None or id(module) not in module_unit:
            return None
        index = module_unit[id(module)]
        return ROOT if index is None else units[index].path

    report = WrapReport(
        model_type=str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__),
        backend=backend,
        num_processes=n,
        dtype=_dtype_name(params),
        wrap_classes=names,
        wrap_source=source,
        units=units,
        root_params=sum(p.numel() for p in root),
        root_trainable_params=sum(p.numel() for p in root if p.requires_grad),
        root_bytes=root_bytes,
        root_modules=_root_modules(model, owners),
        total_params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        total_bytes=nbytes(params),
        bytes_per_rank=bytes_per_rank,
        peak_bytes_per_rank=peak,
        lm_head_unit=unit_of(output_embed),
        embed_unit=unit_of(input_embed),
        final_norm_unit=unit_of(_final_norm(_base_model(model))),
        tied_embeddings=_weight(input_embed) is not None and _weight(input_embed) is _weight(output_embed),
        warnings=[],
        parts=vlm_parts(model, output_embed),
        dropped_no_split=dropped,
        added_vision=added,
        kept_whole=kept,
    )
    report.mixed_units = [u.path for u in units if 0 < u.trainable_params < u.params]
    if 0 < report.root_trainable_params < report.root_params:
        report.mixed_units.append(ROOT)
    if use_cache is None:
        use_cache = bool(getattr(getattr(model, "config", None), "use_cache", False))
    report.warnings = plan_warnings(
        model,
        report,
        warnings,
        owners,
        module_unit,
        groups,
        output_embed,
        fused_linear_cross_entropy=fused_linear_cross_entropy,
        activation_checkpointing=activation_checkpointing,
        use_orig_params=use_orig_params,
        use_cache=use_cache,
        ambient_config=ambient_accelerate_config(accelerate_config) if check_ambient_config else None,
    )
    return report


# --- the model as accelerate sees it ---------------------------------------------------------------------


def _dtype_name(params: Sequence[torch.Tensor]) -> str:
    """The dtype holding most parameters (LoRA adapters are fp32 on a bf16 base)."""
    weighted: Counter[str] = Counter()
    for p in params:
        weighted[str(p.dtype).removeprefix("torch.")] += p.numel()
    return weighted.most_common(1)[0][0] if weighted else "float32"


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embeddings, output embeddings = lm_head), each None where the model has none."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            module = None
        found.append(module if isinstance(module, nn.Module) else None)
    return found[0], found[1]


def _final_norm(model: nn.Module) -> nn.Module | None:
    """The final norm as accelerate finds it (None where accelerate's FSDP-2 path does not group it)."""
    try:
        from accelerate.utils.fsdp_utils import _find_final_norm
    except ImportError:
        return None
    return _find_final_norm(model)


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (where accelerate's final-norm search would look)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _accelerate_groups_output() -> bool:
    """accelerate >= 1.15's FSDP-2 path carves embeddings and [final norm, lm_head] into their own units."""
    try:
        from accelerate.utils.fsdp_utils import _find_final_norm  # noqa: F401
    except ImportError:
        return False
    return True


def vlm_parts(model: nn.Module, output_embed: nn.Module | None) -> list[Part]:
    """A VLM's parts, each with its parameter counts: the vision tower, the language model, lm_head and
    the rest (projector, ...); a parameter is counted in the first part that holds it. [] for a text model."""
    from liger_cli.model.vision import language_model, vision_tower

    tower = vision_tower(model)
    if tower is None:
        return []
    paths = {id(m): name for name, m in model.named_modules()}
    seen: set[int] = set()
    parts = []
    for name, module in (
        ("vision tower", tower),
        ("language model", language_model(model)),
        ("lm_head", output_embed),
        ("other (projector, ...)", model),
    ):
        if module is None:
            continue
        owned = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in owned)
        path = "(the rest)" if module is model else paths.get(id(module), "?")
        total, trainable = sum(p.numel() for p in owned), sum(p.numel() for p in owned if p.requires_grad)
        parts.append(Part(name, path, total, trainable))
    return parts


# --- the replay ------------------------------------------------------------------------------------------


def _unit_groups(model: nn.Module, names: Sequence[str], backend: str) -> Groups:
    """The units in model order: each a list of modules (one, or accelerate's output group) and a reason."""
    from accelerate.utils.dataclasses import get_module_class_from_name

    # As accelerate does: each name picks the first class of that name in the model, then isinstance.
    wanted = tuple(cls for name in names if (cls := get_module_class_from_name(model, name)) is not None)
    groups: Groups = [
        ([module], "wrap_class")
        for module in model.modules()
        if module is not model and isinstance(module, wanted)
    ]
    if backend == "fsdp2" and _accelerate_groups_output():
        wrapped = {id(modules[0]) for modules, _ in groups}
        input_embed, output_embed = embeddings(model)
        tied = _weight(input_embed) is not None and _weight(input_embed) is _weight(output_embed)
        if not tied and input_embed is not None and id(input_embed) not in wrapped:
            groups.append(([input_embed], "accelerate_embeddings"))
        tail = (_final_norm(model), input_embed, output_embed) if tied else (_final_norm(model), output_embed)
        tail = [m for m in tail if m is not None and m is not model and id(m) not in wrapped]
        if tail:
            groups.append((tail, "accelerate_output"))
        order = {id(m): i for i, m in enumerate(model.modules())}
        groups.sort(key=lambda group: order[id(group[0][0])])
    return groups


def _ownership(model: nn.Module, groups: Groups) -> tuple[dict[int, int | None], dict[int, list[int | None]]]:
    """Where each module sits, and which units hold each parameter (by id; None is the root).

    A module sits in its innermost enclosing unit. A parameter shared by modules in different units (tied
    weights) is held by several: the unit FSDP builds first manages it and is listed first (units are built
    children before parents, accelerate's embedding and output units after them, the root last).
    """
    post_order: dict[int, int] = {}

    def number(module: nn.Module) -> None:
        for child in module.children():
            number(child)
        post_order.setdefault(id(module), len(post_order))

    number(model)
    late = {"accelerate_embeddings": 1, "accelerate_output": 2}
    built = {
        index: len(post_order) + late[reason] if reason in late else post_order[id(modules[0])]
        for index, (modules, reason) in enumerate(groups)
    }
    unit_of_module = {id(m): index for index, (modules, _) in enumerate(groups) for m in modules}
    module_unit: dict[int, int | None] = {}
    holders: dict[int, list[int | None]] = {}

    def visit(module: nn.Module, unit: int | None) -> None:
        unit = unit_of_module.get(id(module), unit)
        module_unit[id(module)] = unit
        for param in module.parameters(recurse=False):
            held = holders.setdefault(id(param), [])
            if unit not in held:
                held.append(unit)
        for child in module.children():
            visit(child, unit)

    visit(model, None)
    for held in holders.values():
        held.sort(key=lambda unit: (unit is None, built.get(unit, 0)))
    return module_unit, holders


def _root_modules(model: nn.Module, owners: dict[int, list[int | None]]) -> list[str]:
    """The largest submodules whose parameters all stay in the root unit (what the root gathers)."""
    found: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        in_root = [owners[id(p)][0] is None for p in module.parameters()]
        if not any(in_root):
            return
        if module is not model and all(in_root):
            found.append(path)
            return
        for param_name, param in module.named_parameters(recurse=False):
            if owners[id(param)][0] is None:
                found.append(f"{path}.{param_name}" if path else param_name)
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return found
