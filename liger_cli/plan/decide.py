"""The Plan: every decision the launcher makes, made once, frozen, and printed.

`build_plan` is the one place that decides: from the recipe and the model built on the meta device
(FSDP wrap classes are resolved on it, before any plugin exists). `liger train --dry-run`,
`liger inspect-wrap --recipe` and the run's own log all print this same object, and later steps
(model, backend, loop) only read it. What set-up learns afterwards (what the kernels patched) is
not written into the Plan: it comes back as an `Applied` value, printed beside it.

The twin checks (`liger_cli.twin`: the kernels, packing, accumulation) run here, each verdict one
`note:` line in words that do not change between runs; a check that finds the run would train
something other than what the recipe means is a UserError here, before anything runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from liger_cli.errors import UserError
from liger_cli.model import adapter_in_model_dtype, build_meta_model_for
from liger_cli.model.vision import is_vision_language
from liger_cli.model.vision_training import describe as describe_training
from liger_cli.plan.backends import BACKENDS, BackendFacts
from liger_cli.plan.wrap.resolve import resolve_wrap_classes
from liger_cli.recipe import Recipe


@dataclass(frozen=True)
class Plan:
    backend: str
    num_processes: int
    """Total processes over all machines (accelerate's meaning of --num_processes)."""
    num_machines: int
    device: str
    precision: str
    model: str
    adapter: str
    kernels: dict[str, bool]
    """The kernels to patch (name -> on)."""
    activation_checkpointing: str
    activation_checkpointing_reason: str
    global_batch: int
    """Examples (sequences, pairs or prompts) per optimizer step, over every process."""
    length: str
    kernels_off: dict[str, str] = field(default_factory=dict)
    """Kernels the recipe asked for but the launcher switched off, with the reason."""
    completions_per_example: int = 0
    """Online RL: completions sampled per prompt (0 otherwise)."""
    wrap_classes: tuple[str, ...] | None = None
    """FSDP wrap classes, resolved on the model (None: the backend does not wrap)."""
    wrap_source: str | None = None
    quantize: str = "none"
    """The base's 4-bit quantization (QLoRA), or none."""
    trains: str | None = None
    """A vision-language model's parts and how each trains (None for a text model)."""
    notes: tuple[str, ...] = ()

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    def to_dict(self) -> dict[str, Any]:
        """The Plan as JSON values (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def render(self) -> str:
        on = [name for name, enabled in self.kernels.items() if enabled]
        rows = [
            ("backend", f"{BACKENDS[self.backend].display} ({self.backend})"),
            ("processes", f"{self.num_processes} on {self.num_machines} machine(s)"),
            ("device / precision", f"{self.device} / {self.precision}"),
            ("model", self.model),
            *([("quantize", self.quantize)] if self.quantize != "none" else []),
            ("adapter", self.adapter),
            *([("trains", self.trains)] if self.trains else []),
            ("kernels requested", ", ".join(on) or "none"),
            ("activation ckpt", f"{self.activation_checkpointing} ({self.activation_checkpointing_reason})"),
            (
                "global batch",
                f"{self.global_batch} sequences per optimizer step"
                if not self.completions_per_example
                else f"{self.global_batch} prompts x {self.completions_per_example} completions per optimizer step",
            ),
            ("length", self.length),
        ]
        if self.kernels_off:
            rows.append(("kernels off", "; ".join(f"{k}: {why}" for k, why in self.kernels_off.items())))
        if self.wrap_classes is not None:
            classes = ", ".join(self.wrap_classes) or "[] (the whole model is one unit)"
            rows.append(("FSDP wrap classes", f"{classes} (from {self.wrap_source})"))
        width = max(len(name) for name, _ in rows)
        lines = ["# plan"] + [f"{name:<{width}}  {value}" for name, value in rows]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class Applied:
    """What set-up did that the Plan could only ask for; printed beside the Plan, never written into it."""

    kernels_patched: tuple[str, ...] = ()
    """Our kernels' patch report, one line per kernel."""

    def render(self) -> str:
        return "\n".join(f"kernels patched    {line}" for line in self.kernels_patched)


def render_with(plan: Plan, applied: Applied) -> str:
    """The Plan and, beside it, what set-up applied: the text of the run log and `plan.txt`."""
    return "\n".join(part for part in (plan.render(), applied.render()) if part)


def build_plan(recipe: Recipe, model: nn.Module | None = None, env: Mapping[str, str] | None = None) -> Plan:
    """Decide everything the recipe leaves to the launcher.

    `model` is the recipe's model (meta or real) that FSDP wrap classes are resolved against; when it
    is needed and not given, it is built on the meta device (structure only, no weights read).
    """
    import torch

    env = os.environ if env is None else env
    dist = recipe.distributed
    backend = BACKENDS[dist.backend]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.num_processes * dist.num_machines
    t = recipe.training
    ac_mode, ac_reason = _activation_checkpointing(recipe, backend)
    kernels = recipe.kernels.requested()
    kernels_off: dict[str, str] = {}
    m = recipe.model
    notes: list[str] = []
    config = _read_config(recipe)
    if t.objective == "reward":  # no vocabulary head: the loss kernels have nothing to replace
        why = (
            "a reward model's score head has no cross-entropy (one score per sequence, no vocabulary logits)"
        )
        kernels_off = {k: why for k in ("cross_entropy", "fused_linear_cross_entropy") if kernels.get(k)}
        kernels = {k: on and k not in kernels_off for k, on in kernels.items()}
    quantize = _quantize(recipe)
    if recipe.kernels.check and any(kernels.values()):
        check = _check_kernels(recipe, config, kernels)
        kernels, kernels_off = check.kernels, {**kernels_off, **check.switched_off}
        notes += check.lines()
    for verdict in _check_pipeline(recipe, config, kernels, world):  # the twin as the run trains it
        if verdict.error:
            raise UserError(verdict.error)
        notes.append(verdict.line)
    if model is None and is_vision_language(config):  # the Plan says which of its parts train
        model = build_meta_model_for(recipe)
    trains = describe_training(model) if model is not None else None
    wrap_classes = wrap_source = None
    if backend.fsdp_version:
        model = build_meta_model_for(recipe) if model is None else model
        resolution = resolve_wrap_classes(model, dist.fsdp.wrap_classes, env)
        wrap_classes, wrap_source = tuple(resolution.classes), resolution.source
        notes += [f"[{w.code}] {w.message}" for w in resolution.warnings]
    if adapter_in_model_dtype(recipe):
        notes.append(
            f"adapter weights in {m.dtype}, the model's dtype: FSDP-1 flattens each unit into one dtype "
            "(float32 adapter weights: model.dtype float32 with training.precision bf16, or backend fsdp2)"
        )
    if device == "cpu" and any(kernels.values()):
        notes.append("on a CPU the kernels run their PyTorch paths (Triton needs a GPU)")
    if recipe.rl is not None and recipe.rl.agentic:
        notes.append(_rollout_note(recipe))
    if dist.sequence_parallel > 1:  # the model's attention must be one the split serves
        from liger_cli.plan.sequence_parallel import split_note, unsplittable

        if why := unsplittable(config, dist.sequence_parallel):
            raise UserError(
                f"distributed.sequence_parallel {dist.sequence_parallel}: {why}; remove distributed.sequence_parallel"
            )
        notes.append(split_note(config, dist.sequence_parallel, world))
    if t.objective == "distill":  # the teacher's tokenizer and forward, checked before any weight loads
        from liger_cli.model.teacher import check_teacher

        notes.append(check_teacher(recipe))
    return Plan(
        backend=dist.backend,
        num_processes=world,
        num_machines=dist.num_machines,
        device=device,
        precision=_precision(recipe, device),
        model=f"{m.path} (from_pretrained)" if m.path else f"{m.config} (from_config, random init)",
        adapter=_adapter(recipe),
        kernels=kernels,
        kernels_off=kernels_off,
        activation_checkpointing=ac_mode,
        activation_checkpointing_reason=ac_reason,
        global_batch=t.micro_batch_size * t.grad_accum * world // recipe.distributed.sequence_parallel,
        completions_per_example=recipe.rl.num_generations if recipe.rl else 0,
        length=f"{t.max_steps} optimizer steps" if t.max_steps else f"{t.epochs or 1:g} epoch(s)",
        wrap_classes=wrap_classes,
        wrap_source=wrap_source,
        quantize=quantize,
        trains=trains,
        notes=tuple(notes),
    )


def _rollout_note(recipe: Recipe) -> str:
    """How a multi-turn run's trajectories become samples: the chat template probed with a tool round trip
    (liger_cli.generate.episodes.probe); a template that cannot take tools stops here (exit 2)."""
    from liger_cli.data.tokenizer import load_tokenizer
    from liger_cli.data.tools import check_template_takes_tools, load_tools
    from liger_cli.generate.episodes import TurnRenderer, probe
    from liger_cli.generate.prompts import Renderer

    tokenizer = load_tokenizer(recipe)
    tools = load_tools(recipe.rl)
    check_template_takes_tools(tokenizer, tools.schemas)
    stops = Renderer(tokenizer, "chat").stop_ids(_generation_config(recipe))
    why = probe(TurnRenderer(tokenizer, tools.schemas, stops))
    names = ", ".join(s["function"]["name"] for s in tools.schemas)
    head = f"rollouts: up to {recipe.rl.max_turns} model turns with tools {names}"
    if why is None:
        return f"{head}; the chat template is append-only: one sample per trajectory, token in, token out"
    return f"{head}; the chat template is not append-only ({why}): each model turn is its own sample"


def _generation_config(recipe: Recipe):
    """The model's generation_config.json (its eos ids stop a turn too), or None."""
    from transformers import GenerationConfig

    if recipe.model.path is None:
        return None
    try:
        return GenerationConfig.from_pretrained(recipe.model.path)
    except (OSError, ValueError):
        return None


def _quantize(recipe: Recipe) -> str:
    """The Plan's quantize row; a quantized recipe on a machine where bitsandbytes does not load is a
    UserError here, before anything runs."""
    if recipe.model.quantize == "none":
        return "none"
    from liger_cli.model import model_dtype
    from liger_cli.model import quantize as q

    q.require_bitsandbytes(recipe.model.quantize)
    return q.describe(recipe, model_dtype(recipe))


def _read_config(recipe: Recipe):
    """The model's config as the run builds it (a reward model's: its sequence-classification class)."""
    from liger_cli.model import recipe_config

    return recipe_config(recipe)


def _check_kernels(recipe: Recipe, config, kernels: dict[str, bool]):
    """Each requested kernel on a tiny twin of the recipe's model (liger_cli.twin.kernel_check)."""
    from liger_cli.model import twin_adapter
    from liger_cli.model.objectives import objective_for
    from liger_cli.twin.kernel_check import check_kernels

    m = recipe.model
    return check_kernels(
        config, kernels, m.trust_remote_code, twin_adapter(recipe), objective=objective_for(recipe)
    )


def _check_pipeline(recipe: Recipe, config, kernels: dict[str, bool], world: int):
    """Packing and accumulation on a tiny twin with the Plan's kernels (liger_cli.twin.pipeline_check)."""
    from liger_cli.model import twin_adapter
    from liger_cli.model.objectives import objective_for
    from liger_cli.twin.pipeline_check import check_pipeline

    m = recipe.model
    return check_pipeline(
        config,
        kernels,
        packing=recipe.data.packing,
        grad_accum=recipe.training.grad_accum,
        processes=world,
        trust_remote_code=m.trust_remote_code,
        add_adapter=twin_adapter(recipe),
        attn_implementation=m.attn_implementation,
        objective=objective_for(recipe),
    )


def _precision(recipe: Recipe, device: str) -> str:
    asked = recipe.training.precision
    if asked == "auto":
        if device == "cuda":
            import torch

            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if asked == "fp16" and device == "cpu":
        raise UserError("training.precision fp16 needs a GPU; on a CPU use fp32 (or bf16)")
    return asked


def _activation_checkpointing(recipe: Recipe, backend: BackendFacts) -> tuple[str, str]:
    """Pick a checkpointing implementation known to work for the backend.

    Non-reentrant checkpointing under FSDP failed in the field (a KV cache growing during recompute;
    see docs/field-failures.md#checkpointing-recomputes-different-shapes); reentrant is the pairing
    users confirmed under sharding. Under DDP, reentrant checkpointing conflicts with DDP's
    gradient-ready hooks, so non-reentrant is the safe choice there. The cache is always off.
    """
    mode = recipe.distributed.activation_checkpointing
    if mode == "off":
        return "off", "recipe"
    if mode != "auto":
        return mode, "recipe; use_cache off"
    if backend.shards_parameters:
        return "reentrant", f"auto for {backend.name}: the pairing confirmed under sharding; use_cache off"
    return "non_reentrant", f"auto for {backend.name}: safe with DDP's hooks; use_cache off"


def _adapter(recipe: Recipe) -> str:
    a = recipe.adapter
    if a.type == "none":
        return "none (full fine-tuning)"
    if a.init is not None:
        return f"{a.type} from {a.init} (its r, alpha and targets), trainable"
    targets = a.target_modules if isinstance(a.target_modules, str) else ",".join(a.target_modules)
    return f"{a.type} r={a.r} alpha={a.alpha:g} dropout={a.dropout:g} targets={targets}"
