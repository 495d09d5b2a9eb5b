"""The FSDP wrap plan: which module classes become FSDP units, and what that does to memory and correctness.

`resolve_wrap_classes` is the one place that decides the classes, for `liger train` and `liger inspect-wrap`
alike, so what inspect shows is what runs. `plan_units` replays accelerate 1.15's auto-wrap on a model
(a meta model is enough: it only reads shapes, dtypes and `requires_grad`) and names the known failures a
plan walks into (docs: field-failures.md, fsdp-facts.md).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from liger_cli.errors import UserError

ENV_KEY = "FSDP_TRANSFORMER_CLS_TO_WRAP"
ROOT = "(root)"  # how reports name the root unit
SOURCES = ("recipe", "env", "no_split_modules", "none")
_LAYER_LIKE = re.compile(r"(Layer|Block)$")


@dataclass(frozen=True)
class WrapWarning:
    """A plan that will fail, or cost more than it must; `code` is stable, `message` says the fix."""

    code: str
    message: str


@dataclass
class WrapResolution:
    """The classes to wrap and where the answer came from ("recipe" | "env" | "no_split_modules" | "none")."""

    classes: list[str]
    source: str
    warnings: list[WrapWarning] = field(default_factory=list)


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
    no_split = set(split_names(_no_split_modules(model)))

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
    the classes the model has. `_no_split_modules` entries the model lacks are dropped, since accelerate
    would fail on them and the user never wrote them. `recipe_origin` names where `recipe_value` came
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

    names = [name for name in split_names(_no_split_modules(model)) if name in present]
    if names:
        return WrapResolution(names, "no_split_modules")
    return WrapResolution([], "none", [_no_wrap_warning(model, _nbytes(_unique_params(model)))])


def accelerate_env(resolution: WrapResolution, env: MutableMapping[str, str] | None = None) -> None:
    """Make FSDP_TRANSFORMER_CLS_TO_WRAP agree with `resolution` before accelerate reads it.

    accelerate 1.15 splits the variable with a bare `split(",")`, so "" or "LlamaDecoderLayer," fail with
    "Could not find the transformer layer class  in the model." (and child processes inherit the value).
    We write the clean comma-joined list, or remove the variable when there is nothing to wrap.
    """
    env = os.environ if env is None else env
    if resolution.classes:
        env[ENV_KEY] = ",".join(resolution.classes)
    else:
        env.pop(ENV_KEY, None)


@dataclass
class Unit:
    """One FSDP unit: its parameters are gathered together and sharded together."""

    path: str  # module path; "a + b" for a group accelerate builds from several modules
    cls: str
    params: int
    trainable_params: int
    bytes: int
    bytes_per_rank: int
    reason: str  # "wrap_class" | "accelerate_embeddings" | "accelerate_output"


@dataclass
class WrapReport:
    """Everything `inspect-wrap` shows; `to_json()` is the machine-readable form."""

    model_type: str
    backend: str
    num_processes: int
    dtype: str
    wrap_classes: list[str]
    wrap_source: str
    units: list[Unit]
    root_params: int
    root_trainable_params: int
    root_bytes: int
    root_modules: list[str]
    total_params: int
    trainable_params: int
    total_bytes: int
    bytes_per_rank: int
    peak_bytes_per_rank: int
    lm_head_unit: str | None
    embed_unit: str | None
    final_norm_unit: str | None
    tied_embeddings: bool
    warnings: list[WrapWarning]

    def to_json(self) -> dict:
        data = asdict(self)
        for unit in data["units"]:
            unit["class"] = unit.pop("cls")
        return data

    def render(self) -> str:
        """A plain-text report: the units table, what the root keeps, where the embeddings land, warnings."""
        return _render(self)


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
) -> WrapReport:
    """Replay accelerate's FSDP auto-wrap on `model` and report the units, sizes and known failures.

    Every module (below the root) whose class is in `classes` becomes a unit, as in accelerate's transformer
    policy; under FSDP-2, accelerate 1.15 also makes the input embeddings a unit (when untied) and groups
    [final norm, lm_head] (plus embeddings when tied) into one unit that stays gathered after forward.
    Everything else stays in the root unit. Pass a `WrapResolution` to carry its source and warnings.
    `use_cache` defaults to `model.config.use_cache`. `check_ambient_config` looks for accelerate's default
    config file (at `accelerate_config`, default accelerate's own path); turn it off when the recipe names
    its own accelerate config.
    """
    if backend not in ("fsdp1", "fsdp2"):
        raise UserError(f"Unknown FSDP backend {backend!r}; use fsdp1 or fsdp2")
    if num_processes < 1:
        raise UserError(f"num_processes must be at least 1, got {num_processes}")
    if isinstance(classes, WrapResolution):
        names, source, warnings = list(classes.classes), classes.source, list(classes.warnings)
    else:
        names, source, warnings = split_names(classes), "given", []

    groups = _unit_groups(model, names, backend)
    module_unit, owners = _ownership(model, groups)
    params = _unique_params(model)
    paths = {id(m): name or ROOT for name, m in model.named_modules()}
    n = num_processes

    units = []
    for index, (modules, reason) in enumerate(groups):
        owned = [p for p in params if owners[id(p)][0] == index]
        units.append(
            Unit(
                path=" + ".join(paths[id(m)] for m in modules),
                cls=" + ".join(type(m).__name__ for m in modules),
                params=sum(p.numel() for p in owned),
                trainable_params=sum(p.numel() for p in owned if p.requires_grad),
                bytes=_nbytes(owned),
                bytes_per_rank=_ceil_div(_nbytes(owned), n),
                reason=reason,
            )
        )
    root = [p for p in params if owners[id(p)][0] is None]
    root_bytes = _nbytes(root)
    largest = max((u.bytes for u in units), default=0)
    bytes_per_rank = sum(u.bytes_per_rank for u in units) + _ceil_div(root_bytes, n)
    # The root stays gathered from forward into backward (FSDP-1 and FSDP-2 both skip the root's reshard
    # after forward); the other units are gathered one at a time on top of that.
    peak = bytes_per_rank + root_bytes - _ceil_div(root_bytes, n) + largest - _ceil_div(largest, n)

    input_embed, output_embed = _embeddings(model)

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
        total_bytes=_nbytes(params),
        bytes_per_rank=bytes_per_rank,
        peak_bytes_per_rank=peak,
        lm_head_unit=unit_of(output_embed),
        embed_unit=unit_of(input_embed),
        final_norm_unit=unit_of(_final_norm(_base_model(model))),
        tied_embeddings=_weight(input_embed) is not None and _weight(input_embed) is _weight(output_embed),
        warnings=[],
    )
    if use_cache is None:
        use_cache = bool(getattr(getattr(model, "config", None), "use_cache", False))
    report.warnings = _plan_warnings(
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


def ambient_accelerate_config(path: Path | str | None = None) -> Path | None:
    """accelerate's default config file if it exists (it lives under HF_HOME, read when accelerate imports)."""
    if path is None:
        from accelerate.commands.config import default_config_file

        path = default_config_file
    path = Path(path)
    return path if path.is_file() else None


# --- internals -------------------------------------------------------------------------------------------


def _no_split_modules(model: nn.Module) -> Iterable[str] | None:
    # A PeftModel forwards attribute reads to the base model, so this looks through peft too.
    try:
        return getattr(model, "_no_split_modules", None)
    except Exception:  # a custom __getattr__ may raise something other than AttributeError
        return None


def _class_list(model: nn.Module) -> str:
    return ", ".join(f"{name} (x{count})" if count > 1 else name for name, count in model_classes(model))


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())  # parameters() yields a tied Parameter once


def _nbytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_name(params: Sequence[torch.Tensor]) -> str:
    """The dtype holding most parameters (LoRA adapters are fp32 on a bf16 base)."""
    weighted: Counter[str] = Counter()
    for p in params:
        weighted[str(p.dtype).removeprefix("torch.")] += p.numel()
    return weighted.most_common(1)[0][0] if weighted else "float32"


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
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


def _unit_groups(model: nn.Module, names: Sequence[str], backend: str) -> list[tuple[list[nn.Module], str]]:
    """The units in model order: each a list of modules (one, or accelerate's output group) and a reason."""
    from accelerate.utils.dataclasses import get_module_class_from_name

    # As accelerate does: each name picks the first class of that name in the model, then isinstance.
    wanted = tuple(cls for name in names if (cls := get_module_class_from_name(model, name)) is not None)
    groups: list[tuple[list[nn.Module], str]] = [
        ([module], "wrap_class")
        for module in model.modules()
        if module is not model and isinstance(module, wanted)
    ]
    if backend == "fsdp2" and _accelerate_groups_output():
        wrapped = {id(modules[0]) for modules, _ in groups}
        input_embed, output_embed = _embeddings(model)
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


def _ownership(
    model: nn.Module, groups: list[tuple[list[nn.Module], str]]
) -> tuple[dict[int, int | None], dict[int, list[int | None]]]:
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


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1 (readable at any model size)."""
    size, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"


def _no_wrap_warning(model: nn.Module, root_bytes: int) -> WrapWarning:
    candidates = [name for name, count in model_classes(model)[:3] if count > 1] or ["<your block class>"]
    return WrapWarning(
        "NO_WRAP_CLASSES",
        f"No FSDP wrap classes: nothing in the recipe (distributed.fsdp.wrap_classes), {ENV_KEY} is unset or "
        f"empty, and the model has no _no_split_modules, so the blocks stay in the root unit and every rank "
        f"gathers them all at once ({_size(root_bytes)} of parameters) instead of one block at a time. "
        f"Fix: set distributed.fsdp.wrap_classes to the repeated block class, e.g. {candidates[0]}.",
    )


def _plan_warnings(
    model: nn.Module,
    report: WrapReport,
    inherited: list[WrapWarning],
    owners: dict[int, list[int | None]],
    module_unit: dict[int, int | None],
    groups: list[tuple[list[nn.Module], str]],
    output_embed: nn.Module | None,
    *,
    fused_linear_cross_entropy: bool,
    activation_checkpointing: str,
    use_orig_params: bool,
    use_cache: bool,
    ambient_config: Path | None,
) -> list[WrapWarning]:
    warnings = [w for w in inherited if w.code != "NO_WRAP_CLASSES"]
    backend_name = "FSDP-1" if report.backend == "fsdp1" else "FSDP-2"
    if not report.wrap_classes:
        warnings.insert(0, _no_wrap_warning(model, report.root_bytes))

    split = [p for p in _unique_params(model) if len(owners[id(p)]) > 1]
    if split:
        consequence = (
            "FSDP-1 silently unties them (use_orig_params=False) or errors (use_orig_params=True)"
            if report.backend == "fsdp1"
            else "FSDP-2 refuses a parameter shared with another FSDP group"
        )
        tied = report.tied_embeddings and _weight(output_embed) in split
        what = "the tied input and output embeddings" if tied else f"{len(split)} shared parameter(s)"
        where = " and ".join(ROOT if u is None else report.units[u].path for u in owners[id(split[0])])
        warnings.append(
            WrapWarning(
                "TIED_SPLIT",
                f"{what} land in different units ({where}): "
                f"{consequence}. Fix: do not list the embedding or lm_head class in wrap_classes, so both "
                "stay in one unit.",
            )
        )

    lm_head_unit = module_unit.get(id(output_embed)) if output_embed is not None else None
    if fused_linear_cross_entropy and lm_head_unit is not None:
        modules, reason = groups[lm_head_unit]
        if reason == "wrap_class":
            warnings.append(
                WrapWarning(
                    "FLCE_LM_HEAD_OWN_UNIT",
                    f"lm_head is in its own {backend_name} unit ({report.lm_head_unit}) but fused linear "
                    "cross-entropy reads lm_head.weight in the causal-LM forward, outside lm_head's own "
                    "forward, where it is still a shard (FSDP-1: size mismatch; FSDP-2: mixed Tensor and "
                    f"DTensor). Fix: remove {type(output_embed).__name__} from wrap_classes so lm_head stays "
                    "in the root unit, or turn off kernels.fused_linear_cross_entropy.",
                )
            )
        elif reason == "accelerate_output" and modules == [output_embed]:
            warnings.append(
                WrapWarning(
                    "FLCE_LM_HEAD_NOT_GATHERED",
                    "accelerate's FSDP-2 output unit holds lm_head without a module that runs before the loss "
                    "(accelerate finds no final norm here, as happens for a peft-wrapped model), so nothing "
                    "gathers lm_head.weight before fused linear cross-entropy reads it. Fix: the fused loss "
                    "must unshard lm_head explicitly, or turn off kernels.fused_linear_cross_entropy.",
                )
            )
    if fused_linear_cross_entropy and output_embed is not None:
        extra = [
            n for n, p in output_embed.named_parameters() if p.requires_grad and p is not output_embed.weight
        ]
        if extra:
            warnings.append(
                WrapWarning(
                    "FLCE_LM_HEAD_ADAPTER",
                    f"lm_head carries adapter parameters ({', '.join(extra[:2])}) but fused linear cross-entropy "
                    "multiplies by lm_head.weight directly, which skips the adapter. Fix: leave lm_head out of "
                    "adapter.target_modules, or turn off kernels.fused_linear_cross_entropy.",
                )
            )

    if report.backend == "fsdp1" and not use_orig_params:
        mixed = [u.path for u in report.units if 0 < u.trainable_params < u.params]
        if 0 < report.root_trainable_params < report.root_params:
            mixed.append(ROOT)
        if mixed:
            warnings.append(
                WrapWarning(
                    "FSDP1_MIXED_REQUIRES_GRAD",
                    f"FSDP-1 without use_orig_params flattens each unit into one tensor, which cannot mix "
                    f"frozen and trainable parameters, and {len(mixed)} units do ({mixed[0]}, ...): "
                    "'Must flatten tensors with uniform requires_grad'. Fix: use_orig_params=True, or the "
                    "fsdp2 backend.",
                )
            )

    if activation_checkpointing != "off" and use_cache:
        warnings.append(
            WrapWarning(
                "AC_WITH_KV_CACHE",
                "Activation checkpointing is on while the model's KV cache is on (config.use_cache=True): "
                "the recomputed forward sees a cache that has grown and fails with CheckpointError "
                "(different metadata than during the forward pass). Fix: train with use_cache=False.",
            )
        )

    if ambient_config is not None:
        warnings.append(
            WrapWarning(
                "AMBIENT_ACCELERATE_CONFIG",
                f"accelerate's default config file {ambient_config} exists; `accelerate launch` would apply it, "
                "but liger launches with explicit flags and ignores it unless the recipe names it, so its "
                "settings (mixed precision, FSDP options, process count) do not apply to this run. Fix: put "
                "the settings you want in the recipe, or remove the file to avoid confusion.",
            )
        )
    return warnings


def _render(report: WrapReport) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    backend = "FSDP-1" if report.backend == "fsdp1" else "FSDP-2"
    source = {
        "recipe": "the recipe or --wrap-classes",
        "env": ENV_KEY,
        "no_split_modules": "the model's _no_split_modules",
        "none": "nothing named anywhere",
    }.get(report.wrap_source, report.wrap_source)
    lines = [
        f"Model {report.model_type} ({report.dtype}), {backend} over {report.num_processes} process(es); "
        f"wrap classes: {', '.join(report.wrap_classes) or '[]'} (from {source})",
    ]
    table = Table(title="FSDP units", title_justify="left", box=None, pad_edge=False)
    for header in ("unit", "class", "count", "params each", "trainable each", "size each", "per rank each"):
        table.add_column(header, justify="left" if header in ("unit", "class") else "right")
    root_row = Unit(
        ROOT,
        "(everything else)",
        report.root_params,
        report.root_trainable_params,
        report.root_bytes,
        _ceil_div(report.root_bytes, report.num_processes),
        "root",
    )
    for unit, count in [*_collapse(report.units), (root_row, 1)]:
        table.add_row(
            unit.path,
            unit.cls,
            str(count),
            f"{unit.params:,}",
            f"{unit.trainable_params:,}",
            _size(unit.bytes),
            _size(unit.bytes_per_rank),
        )
    buffer = io.StringIO()
    Console(file=buffer, width=140, no_color=True, highlight=False, force_terminal=False).print(table)
    lines.append(buffer.getvalue().rstrip())
    lines += [
        f"Root unit keeps: {', '.join(report.root_modules) or 'no parameters'}",
        f"lm_head: {report.lm_head_unit}; embed_tokens: {report.embed_unit}; "
        f"final norm: {report.final_norm_unit}; tied embeddings: {'yes' if report.tied_embeddings else 'no'}",
        f"Total: {report.total_params:,} parameters ({report.trainable_params:,} trainable), "
        f"{_size(report.total_bytes)}. Per rank: {_size(report.bytes_per_rank)} sharded, peak about "
        f"{_size(report.peak_bytes_per_rank)} with the root and the largest unit gathered (parameters only).",
    ]
    if report.warnings:
        lines.append(f"Warnings ({len(report.warnings)}):")
        lines += [f"  {w.code}: {w.message}" for w in report.warnings]
    else:
        lines.append("No warnings.")
    return "\n".join(lines) + "\n"


def _collapse(units: list[Unit]) -> list[tuple[Unit, int]]:
    """Fold identical units that differ only in one index (model.layers.0 .. 31) into one row."""
    rows: dict[tuple, list] = {}  # key -> [unit, indices, template]
    for unit in units:
        match = re.search(r"\.(\d+)(?=\.|$)", unit.path)
        template = unit.path[: match.start(1)] + "{}" + unit.path[match.end(1) :] if match else unit.path
        key = (template, unit.cls, unit.params, unit.trainable_params, unit.bytes, unit.reason)
        row = rows.setdefault(key, [unit, [], template])
        if match:
            row[1].append(int(match[1]))
    collapsed = []
    for unit, indices, template in rows.values():
        if len(indices) > 1:
            contiguous = indices == list(range(indices[0], indices[0] + len(indices)))
            span = (
                f"{{{indices[0]}..{indices[-1]}}}" if contiguous else "{" + ",".join(map(str, indices)) + "}"
            )
            unit = Unit(**{**asdict(unit), "path": template.format(span)})
        collapsed.append((unit, max(len(indices), 1)))
    return collapsed
