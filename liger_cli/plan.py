"""The Plan: every decision the launcher makes, in one printable object.

`liger train --dry-run`, `liger inspect-wrap --recipe` and the run's own log all print this same
object, so what the user reads is what runs. Decisions are made here and nowhere else; later
steps (model, wrap, launch, loop) read them from the Plan instead of re-deciding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from liger_cli.recipe import Recipe

BACKEND_NAMES = {
    "none": "single process",
    "ddp": "DDP",
    "fsdp1": "FSDP-1",
    "fsdp2": "FSDP-2",
    "deepspeed": "DeepSpeed",
}


@dataclass
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
    activation_checkpointing: str
    activation_checkpointing_reason: str
    global_batch: int
    length: str
    wrap_classes: list[str] | None = None
    wrap_source: str | None = None
    kernel_report: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        on = [name for name, enabled in self.kernels.items() if enabled]
        rows = [
            ("backend", f"{BACKEND_NAMES[self.backend]} ({self.backend})"),
            ("processes", f"{self.num_processes} on {self.num_machines} machine(s)"),
            ("device / precision", f"{self.device} / {self.precision}"),
            ("model", self.model),
            ("adapter", self.adapter),
            ("kernels requested", ", ".join(on) or "none"),
            ("activation ckpt", f"{self.activation_checkpointing} ({self.activation_checkpointing_reason})"),
            ("global batch", f"{self.global_batch} sequences per optimizer step"),
            ("length", self.length),
        ]
        if self.backend in ("fsdp1", "fsdp2"):
            classes = ", ".join(self.wrap_classes or []) or "[] (the whole model is one unit)"
            rows.append(("FSDP wrap classes", f"{classes} (from {self.wrap_source})"))
        width = max(len(name) for name, _ in rows)
        lines = ["# plan"] + [f"{name:<{width}}  {value}" for name, value in rows]
        lines += [f"kernels patched    {line}" for line in self.kernel_report]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _precision(recipe: Recipe, device: str) -> str:
    asked = recipe.training.precision
    if asked == "auto":
        if device == "cuda":
            import torch

            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if asked == "fp16" and device == "cpu":
        from liger_cli.errors import UserError

        raise UserError("training.precision fp16 needs a GPU; on a CPU use fp32 (or bf16)")
    return asked


def _activation_checkpointing(recipe: Recipe) -> tuple[str, str]:
    """Pick a checkpointing implementation known to work for the backend (field failure 3).

    FSDP with non-reentrant checkpointing failed in the field with "Recomputed values ... have
    different metadata" (a KV cache growing during recompute); reentrant is the pairing users
    confirmed. Under DDP, reentrant checkpointing conflicts with DDP's gradient-ready hooks, so
    non-reentrant is the safe choice there. The cache is always off while training.
    """
    mode = recipe.distributed.activation_checkpointing
    backend = recipe.distributed.backend
    if mode == "off":
        return "off", "recipe"
    if mode != "auto":
        return mode, "recipe; use_cache off"
    if backend in ("fsdp1", "fsdp2", "deepspeed"):
        return "reentrant", f"auto for {backend}: the pairing confirmed under sharding; use_cache off"
    return "non_reentrant", f"auto for {backend}: safe with DDP's hooks; use_cache off"


def _adapter(recipe: Recipe) -> str:
    a = recipe.adapter
    if a.type == "none":
        return "none (full fine-tuning)"
    targets = a.target_modules if isinstance(a.target_modules, str) else ",".join(a.target_modules)
    return f"{a.type} r={a.r} alpha={a.alpha:g} dropout={a.dropout:g} targets={targets}"


def build_plan(recipe: Recipe, model: Any = None, env: Mapping[str, str] | None = None) -> Plan:
    """Decide everything the recipe leaves to the launcher.

    `model` (meta or real) is needed to resolve FSDP wrap classes against the classes it contains.
    """
    import torch

    env = os.environ if env is None else env
    dist = recipe.distributed
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.num_processes * dist.num_machines
    t = recipe.training
    ac_mode, ac_reason = _activation_checkpointing(recipe)
    m = recipe.model
    source = f"{m.path} (from_pretrained)" if m.path else f"{m.config} (from_config, random init)"
    plan = Plan(
        backend=dist.backend,
        num_processes=world,
        num_machines=dist.num_machines,
        device=device,
        precision=_precision(recipe, device),
        model=source,
        adapter=_adapter(recipe),
        kernels=recipe.kernels.model_dump(),
        activation_checkpointing=ac_mode,
        activation_checkpointing_reason=ac_reason,
        global_batch=t.micro_batch_size * t.grad_accum * world,
        length=f"{t.max_steps} optimizer steps" if t.max_steps else f"{t.epochs or 1:g} epoch(s)",
    )
    if dist.backend in ("fsdp1", "fsdp2") and model is not None:
        from liger_cli.wrap import resolve_wrap_classes

        resolution = resolve_wrap_classes(model, dist.fsdp.wrap_classes, env)
        plan.wrap_classes = resolution.classes
        plan.wrap_source = resolution.source
        plan.notes += [f"[{w.code}] {w.message}" for w in resolution.warnings]
    if device == "cpu" and any(recipe.kernels.model_dump().values()):
        plan.notes.append("on a CPU the kernels run their PyTorch paths (Triton needs a GPU)")
    return plan
