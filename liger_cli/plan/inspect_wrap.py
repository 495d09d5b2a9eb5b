"""`liger inspect-wrap`: how FSDP will shard a model, shown before anything runs.

The model is built on the meta device, so no weights are read and parameters take no memory: a 70B
config inspects in seconds. With `--recipe`, the wrap classes are the recipe's Plan's (the object
`liger train` prints and runs), and the Plan is printed first.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from liger_cli.errors import UserError
from liger_cli.plan.backends import FSDP_BACKENDS
from liger_cli.plan.wrap import WrapResolution, plan_units, render_report, resolve_wrap_classes

if TYPE_CHECKING:
    from liger_cli.plan.decide import Plan
    from liger_cli.recipe import Recipe

_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_SPEC_HELP = "give a Hugging Face model folder, a config.json file, or package.module:factory"


def build_meta_model(
    spec: str, trust_remote_code: bool = False, dtype: torch.dtype | None = None
) -> nn.Module:
    """The model named by `spec` on the meta device (shapes and dtypes only, nothing allocated).

    `spec` is a model folder with config.json, a config.json file, or `package.module:factory` (a callable
    returning an nn.Module, called under the meta device). `dtype` defaults to the config's own dtype, so
    sizes are those of the checkpoint.
    """
    path = Path(spec).expanduser()
    if path.exists():
        return _from_config(path, trust_remote_code, dtype)
    if _FACTORY.fullmatch(spec):
        return _from_factory(spec)
    raise UserError(f"model {spec!r} not found: {_SPEC_HELP}")


def apply_default_lora(model: nn.Module, exclude: str | None = None) -> nn.Module:
    """peft's LoRA (r=8, all linear layers) on a meta model, so frozen and trainable parameters mix.

    `exclude` is a module path kept free of adapters (a VLM's vision tower: `all-linear` would otherwise
    put LoRA into it). low_cpu_mem_usage keeps the adapter weights on meta too (without it peft allocates
    them on the CPU first: measured here +440 MB and 7 s for Llama-3-70B at r=16).
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, target_modules="all-linear")
    if exclude:
        config.exclude_modules = rf"{re.escape(exclude)}(\..*)?"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecations inside peft
            return get_peft_model(model, config, low_cpu_mem_usage=True)
    except ValueError as err:
        raise UserError(f"--lora: peft cannot apply LoRA to this model: {err}") from None


def check_arguments(model, recipe, backend, num_processes, device_memory, vision) -> None:
    """`liger inspect-wrap`'s options that cannot go together or hold a wrong value: a one-line UserError."""
    from liger_cli.model.vision import VISION_MODES

    if model is None and recipe is None:
        raise UserError("give a MODEL (folder, config.json or package.module:factory) or --recipe RECIPE")
    if backend is not None and backend not in FSDP_BACKENDS:
        raise UserError(f"--backend {backend!r}: choose {' or '.join(FSDP_BACKENDS)}")
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes {num_processes}: must be at least 1")
    if device_memory is not None and recipe is None:
        raise UserError("--device-memory needs --recipe: the memory plan is a recipe's")
    if vision is not None and vision not in VISION_MODES:
        raise UserError(f"--vision {vision!r}: choose {', '.join(VISION_MODES)}")


def inspect_command(
    model: str | None,
    recipe: Path | None,
    backend: str | None,
    wrap_classes: str | None,
    num_processes: int | None,
    lora: bool,
    json_out: bool,
    strict: bool,
    device_memory: int | None = None,
    vision: str | None = None,
) -> int:
    """Print the wrap report of MODEL or of the recipe's plan; return 0, or 3 with --strict and warnings.

    Options given on the command line override the recipe's values. `vision` (frozen, the default; lora;
    full) says how a VLM's vision tower trains (MODEL without --recipe only).
    """
    settings = {"backend": "fsdp2", "num_processes": 1, "wrap_classes": None, "flce": False, "ac": "off"}
    check_ambient = True
    plan = recipe_loaded = None
    if recipe is not None:
        # The recipe's Plan is shown when the report is the recipe's: no option overrides it.
        as_recipe_runs = backend is None and wrap_classes is None and num_processes is None
        loaded, built, plan = _recipe_model(recipe, model, with_plan=as_recipe_runs)
        recipe_loaded = loaded.pop("recipe")
        settings.update(loaded)
        check_ambient = loaded["accelerate_config"] is None
        if vision is not None:
            raise UserError(
                "--vision applies to MODEL without --recipe: the run builds the recipe's model as it is"
            )
    else:
        built = build_meta_model(model)
    if recipe is None:
        built = apply_vision_mode(built, vision, lora)
    elif lora and not _has_adapter(built):
        built = apply_default_lora(built)
    backend = backend or settings["backend"]
    if backend not in FSDP_BACKENDS:
        print(
            f"note: the recipe's backend is {backend}, which does not use FSDP; showing what fsdp2 would do "
            "(set distributed.backend: fsdp2, or pass --backend)",
            file=sys.stderr,
        )
        backend = "fsdp2"

    if wrap_classes is not None:
        resolution = resolve_wrap_classes(built, wrap_classes, recipe_origin="--wrap-classes")
    elif plan is not None and plan.wrap_classes is not None:  # the classes the run will use
        resolution = WrapResolution(list(plan.wrap_classes), plan.wrap_source)
    else:
        resolution = resolve_wrap_classes(built, settings["wrap_classes"])
    report = plan_units(
        built,
        resolution,
        backend=backend,
        num_processes=num_processes or settings["num_processes"],
        fused_linear_cross_entropy=settings["flce"],
        activation_checkpointing=settings["ac"],
        check_ambient_config=check_ambient,
        stored_bytes=_stored_bytes(recipe_loaded, built),
    )
    memory = _memory(recipe_loaded, plan, built, device_memory) if plan is not None else None
    if recipe is not None and plan is None:
        print("note: no memory plan: MODEL or --backend/--wrap-classes/--num-processes change what the "
              "recipe runs (use --set on `liger train --dry-run` instead)", file=sys.stderr)  # fmt: skip
    if json_out:
        data = report.to_json()
        if plan is not None:
            data["plan"] = plan.to_dict()
            data["memory"] = memory.to_dict()
        print(json.dumps(data, indent=2))
    else:
        if plan is not None:
            print(plan.render() + "\n")
        print(render_report(report), end="")
        if memory is not None:
            print("\n" + memory.render())
    return 3 if strict and report.warnings else 0


def apply_vision_mode(built: nn.Module, vision: str | None, lora: bool) -> nn.Module:
    """The default LoRA (with --lora) and the vision tower's mode: frozen (the default), lora, full."""
    from liger_cli.model.vision import freeze_vision, tower_path, vision_tower

    tower = tower_path(built)
    if vision is not None and tower is None:
        raise UserError(f"--vision {vision}: this model has no vision tower; leave --vision out")
    mode = vision or "frozen"
    if mode == "lora" and not lora:
        raise UserError("--vision lora puts LoRA adapters into the vision tower: add --lora")
    if lora and not _has_adapter(built):
        built = apply_default_lora(built, exclude=tower if mode != "lora" else None)
    freeze_vision(built, mode)
    if mode == "full" and tower is not None:
        for param in vision_tower(built).parameters():
            param.requires_grad_(True)  # trained in full even beside a LoRA language model
    return built


# --- internals -------------------------------------------------------------------------------------------


def _stored_bytes(recipe: Recipe | None, built: nn.Module) -> dict[int, int]:
    """QLoRA: the base's linear weights at their 4-bit size (packed weights and statistics)."""
    if recipe is None:
        return {}
    from liger_cli.model.quantize import four_bit_bytes

    return {key: packed + stats for key, (packed, stats) in four_bit_bytes(recipe, built).items()}


def _memory(recipe: Recipe, plan: Plan, built: nn.Module, device_memory: int | None):
    """The recipe's memory plan, on the inspected meta model with the run's kernels patched in."""
    from liger_cli.model import patch_kernels
    from liger_cli.plan.memory import plan_memory

    patch_kernels(built, plan)
    return plan_memory(recipe, plan, built, device_memory)


def _from_config(path: Path, trust_remote_code: bool, dtype: torch.dtype | None) -> nn.Module:
    from liger_cli.model import meta_model_from_config

    if path.is_dir() and not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: {_SPEC_HELP}")
    return meta_model_from_config(path, trust_remote_code, dtype)


def _from_factory(spec: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a factory in the user's project, as `python -m` would find it
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as err:
        raise UserError(f"cannot import {module_name} for {spec}: {err}") from None
    except AttributeError:
        raise UserError(f"{module_name} has no {attr!r} (from {spec})") from None
    try:
        with torch.device("meta"):
            built = factory()
    except Exception as err:  # the user's code: report it in one line, the fix is theirs
        raise UserError(f"{spec} failed: {type(err).__name__}: {_first_line(err)}") from None
    if not isinstance(built, nn.Module):
        raise UserError(f"{spec} returned {type(built).__name__}, not a torch.nn.Module")
    return built


def _recipe_model(
    recipe_path: Path, model: str | None, with_plan: bool
) -> tuple[dict, nn.Module, Plan | None]:
    """The recipe's settings, its model as the run builds it (adapter included) on meta, and its
    Plan (None unless asked for, or when MODEL replaces the recipe's model: not what the recipe runs)."""
    from liger_cli.model import add_adapter, build_meta_model_for
    from liger_cli.plan.decide import build_plan
    from liger_cli.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    dist = recipe.distributed
    plan = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecations inside peft
        if model is None:
            built = build_meta_model_for(recipe)
            plan = build_plan(recipe, built) if with_plan else None
        else:  # MODEL replaces the recipe's model; the recipe's adapter still applies
            built = add_adapter(
                build_meta_model(model, recipe.model.trust_remote_code), recipe, low_cpu_mem_usage=True
            )
    settings = {
        "backend": dist.backend,
        "num_processes": dist.num_processes * dist.num_machines,
        "wrap_classes": dist.fsdp.wrap_classes,
        "flce": recipe.kernels.fused_linear_cross_entropy,
        "ac": dist.activation_checkpointing,
        "accelerate_config": dist.accelerate_config,
        "recipe": recipe,
    }
    return settings, built, plan


def _has_adapter(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
