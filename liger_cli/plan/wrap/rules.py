"""The warning rules: plans that fail, or cost more than they must, named with a stable code and the fix.

Each rule is a failure that was measured or seen in the field (see docs/field-failures.md and
docs/fsdp-facts.md): tied weights split over units, a fused loss reading a sharded lm_head, FSDP-1
flattening frozen and trainable parameters together (a VLM's frozen vision tower sharing a unit with
trainable parts), checkpointing with the KV cache on, and an
accelerate config file that `accelerate launch` would apply behind the recipe's back.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from liger_cli.model.vision import vision_tower
from liger_cli.plan.backends import display_name
from liger_cli.plan.wrap.report import ROOT, WrapReport, WrapWarning
from liger_cli.plan.wrap.resolve import no_wrap_warning


def ambient_accelerate_config(path: Path | str | None = None) -> Path | None:
    """accelerate's default config file if it exists (it lives under HF_HOME, read when accelerate imports)."""
    if path is None:
        from accelerate.commands.config import default_config_file

        path = default_config_file
    path = Path(path)
    return path if path.is_file() else None


def frozen_tower_sharing(
    model: nn.Module, report: WrapReport, owners: dict[int, list[int | None]]
) -> list[tuple[str, int, int]]:
    """(unit, frozen vision-tower parameters, trainable parameters) for each unit that holds both."""
    tower = vision_tower(model)
    if tower is None:
        return []
    in_tower = {id(p) for p in tower.parameters()}
    counts: dict[int | None, list[int]] = {}
    for p in model.parameters():
        count = counts.setdefault(owners[id(p)][0], [0, 0])
        if p.requires_grad:
            count[1] += p.numel()
        elif id(p) in in_tower:
            count[0] += p.numel()
    return [
        (ROOT if unit is None else report.units[unit].path, frozen, trainable)
        for unit, (frozen, trainable) in counts.items()
        if frozen and trainable
    ]


def plan_warnings(
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
    backend_name = display_name(report.backend)
    if not report.wrap_classes:
        warnings.insert(0, no_wrap_warning(model, report.root_bytes))

    split = [p for p in model.parameters() if len(owners[id(p)]) > 1]
    if split:
        consequence = (
            "FSDP-1 silently unties them (use_orig_params=False) or errors (use_orig_params=True)"
            if report.backend == "fsdp1"
            else "FSDP-2 refuses a parameter shared with another FSDP group"
        )
        head_weight = getattr(output_embed, "weight", None)
        tied = report.tied_embeddings and any(p is head_weight for p in split)  # `in` would compare values
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

    shared = frozen_tower_sharing(model, report, owners) if report.backend == "fsdp1" else []
    if shared:
        where, frozen, trainable = shared[0]
        tower = type(vision_tower(model)).__name__
        warnings.append(
            WrapWarning(
                "FSDP1_FROZEN_VISION_SHARED",
                f"{len(shared)} FSDP-1 unit(s) hold frozen vision-tower parameters together with trainable ones "
                f"({where}: {frozen:,} frozen, {trainable:,} trainable): FSDP-1 flattens a unit into one tensor, "
                "so without use_orig_params this fails ('Must flatten tensors with uniform requires_grad'); "
                "with use_orig_params=True (what liger sets) it runs, but the unit's gradient also covers the "
                f"frozen parameters. Fix: keep {tower} in wrap_classes (liger's default for a VLM) so the "
                "frozen tower is a unit of its own, or the fsdp2 backend.",
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
