"""What the plan knows about each distributed backend: names, whether it shards, what each rank holds.

These facts decide the plan (activation checkpointing, wrap classes, the memory plan) before any
process starts; the objects that run a backend (`liger_cli.run.backends`) carry the same facts.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISION_TO_ACCELERATE = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class BackendFacts:
    name: str
    display: str
    accelerate_types: tuple[str, ...]
    """accelerate's `distributed_type` names that mean this backend really runs."""
    shards_parameters: bool = False
    """Parameters are sharded over ranks (FSDP, ZeRO): decides `activation_checkpointing: auto`."""
    fsdp_version: int | None = None
    gradient_copies: int = 1
    """Gradient-sized buffers per rank (the memory plan): DDP adds its all-reduce buckets."""
    shards: frozenset[str] = frozenset()
    """Of "parameters", "gradients" and "optimizer", what each rank holds 1/N of (the memory plan)."""
    zero3_shards: frozenset[str] | None = None
    """What each rank holds 1/N of under ZeRO-3, where that differs from `shards` (ZeRO-2)."""

    def memory_shards(self, zero_stage: int) -> frozenset[str]:
        if zero_stage == 3 and self.zero3_shards is not None:
            return self.zero3_shards
        return self.shards


_ALL = frozenset({"parameters", "gradients", "optimizer"})
BACKENDS: dict[str, BackendFacts] = {
    facts.name: facts
    for facts in (
        BackendFacts("none", "single process", ("NO",)),
        # DDP: the gradients and its all-reduce buckets (not views of them by default).
        BackendFacts("ddp", "DDP", ("MULTI_CPU", "MULTI_GPU"), gradient_copies=2),
        BackendFacts("fsdp1", "FSDP-1", ("FSDP",), shards_parameters=True, fsdp_version=1, shards=_ALL),
        BackendFacts("fsdp2", "FSDP-2", ("FSDP",), shards_parameters=True, fsdp_version=2, shards=_ALL),
        BackendFacts(
            "deepspeed",
            "DeepSpeed",
            ("DEEPSPEED",),
            shards_parameters=True,
            shards=frozenset({"gradients", "optimizer"}),
            zero3_shards=_ALL,
        ),
    )
}
FSDP_BACKENDS = tuple(name for name, facts in BACKENDS.items() if facts.fsdp_version)


def display_name(backend: str) -> str:
    return BACKENDS[backend].display
