"""The recipe's `distributed` section: the backend, processes and machines, FSDP's and ZeRO's options."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from liger_cli.recipe.base import RelPath, _Section

SPLIT_OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "grpo", "distill")
"""The objectives whose training pass `distributed.sequence_parallel` splits (liger_cli/run/sequence_parallel.py)."""


def split_names(value: Any) -> Any:
    """`"A, B,"` and `["A", " B "]` both mean ["A", "B"]: trimmed, empties dropped, de-duplicated."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list):
        return value  # let pydantic report the wrong type
    names: list[str] = []
    for item in items:
        if isinstance(item, str) and item.strip() and item.strip() not in names:
            names.append(item.strip())
        elif not isinstance(item, str):
            return value
    return names or None


class FsdpSection(_Section):
    """FSDP's options (backends fsdp1 and fsdp2)."""

    wrap_classes: list[str] | None = None
    """The module classes FSDP wraps as units (default: FSDP_TRANSFORMER_CLS_TO_WRAP, else the model's _no_split_modules)."""
    sharding: Literal["full", "shard_grad_op", "hybrid", "no_shard"] = "full"
    """FSDP's sharding strategy."""
    cpu_offload: bool = False
    """Offload FSDP's parameters to the CPU."""

    _normalise = field_validator("wrap_classes", mode="before")(classmethod(lambda cls, v: split_names(v)))


class DistributedSection(_Section):
    """How many processes on how many machines, and the backend that shards the model across them."""

    backend: Literal["none", "ddp", "fsdp1", "fsdp2", "deepspeed"] = "none"
    """none: one process; ddp, fsdp1, fsdp2 or deepspeed (ZeRO) through accelerate."""
    num_processes: int = Field(1, ge=1)
    """Processes per machine."""
    num_machines: int = Field(1, ge=1)
    """Machines in the job; run the same command on each."""
    machine_rank: int = Field(0, ge=0)
    """This machine's rank (set per machine, e.g. --set distributed.machine_rank=1)."""
    main_process_ip: str | None = None
    """The rank-0 machine's address (multi-node)."""
    main_process_port: int = Field(29500, ge=1, le=65535)
    """The rank-0 machine's port."""
    accelerate_config: RelPath | None = None
    """An accelerate config file to use; otherwise the ambient default config is ignored."""
    fsdp: FsdpSection = Field(default_factory=FsdpSection)
    zero_stage: Literal[2, 3] = 3
    """DeepSpeed's ZeRO stage (backend deepspeed)."""

    activation_checkpointing: Literal["off", "auto", "reentrant", "non_reentrant"] = "off"
    """Recompute activations in backward; auto picks reentrant under FSDP/DeepSpeed, non-reentrant otherwise."""

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _unquoted_off(cls, value):
        """YAML reads an unquoted `off` (in a recipe or a --set) as false: it means "off"."""
        return "off" if value is False else value

    sequence_parallel: int = Field(1, ge=1)
    """Split every sequence of a micro-batch across this many processes (fsdp2 or ZeRO-3; sft, dpo, simpo,
    orpo, grpo, distill): each holds 1/N of its tokens' activations; attention exchanges heads for tokens."""

    @property
    def shards_weights(self) -> bool:
        """The backend shards every weight, frozen ones included: FSDP-1, FSDP-2 and ZeRO-3."""
        return self.backend in ("fsdp1", "fsdp2") or (self.backend == "deepspeed" and self.zero_stage == 3)

    def frozen_model_kept_whole(self) -> str | None:
        """Why a frozen model used beside the trained one (distill's teacher) stays whole on each
        process, or None: its decoder layers are then sharded over every process, as the trained model's
        parameters are under FSDP-1 (full or shard_grad_op), FSDP-2 and ZeRO-3 (torch's fully_shard on
        each layer whatever the backend: a frozen model needs no optimizer, only a gather before each
        layer's forward)."""
        if self.num_processes * self.num_machines == 1:
            return "one process"
        if self.backend in ("none", "ddp"):
            return f"{self.backend} keeps every model whole"
        if self.backend == "deepspeed" and self.zero_stage != 3:
            return f"ZeRO-{self.zero_stage} keeps the parameters whole"
        if self.backend == "fsdp1" and self.fsdp.sharding in ("hybrid", "no_shard"):
            return f"fsdp.sharding {self.fsdp.sharding} does not shard over every process"
        return None

    @property
    def flattens_units(self) -> bool:
        """The backend flattens each unit into one tensor, so one dtype per unit: FSDP-1."""
        return self.backend == "fsdp1"

    @model_validator(mode="after")
    def _consistent(self) -> DistributedSection:
        if self.backend == "none" and (self.num_processes > 1 or self.num_machines > 1):
            raise ValueError(
                f"distributed.backend is none but {self.num_processes} process(es) on {self.num_machines} "
                "machine(s) were asked for: set distributed.backend to ddp, fsdp1, fsdp2 or deepspeed"
            )
        if self.machine_rank >= self.num_machines:
            raise ValueError(
                f"distributed.machine_rank {self.machine_rank} must be below num_machines {self.num_machines}"
            )
        if self.sequence_parallel > 1:
            self._sequence_parallel_needs()
        if self.num_machines > 1 and not self.main_process_ip:
            raise ValueError(
                "distributed.num_machines > 1 needs distributed.main_process_ip (the rank-0 machine)"
            )
        return self

    def _sequence_parallel_needs(self) -> None:
        n, world = self.sequence_parallel, self.num_processes * self.num_machines
        if self.backend not in ("fsdp2", "deepspeed") or (
            self.backend == "deepspeed" and self.zero_stage != 3
        ):
            name = "deepspeed ZeRO-2" if self.backend == "deepspeed" else self.backend
            raise ValueError(
                f"distributed.sequence_parallel {n} needs backend fsdp2 or deepspeed with zero_stage 3 "
                f"(their sharded weights are what a split sequence still needs whole on each process), not "
                f"{name}: set distributed.backend: fsdp2"
            )
        if world % n:
            raise ValueError(
                f"distributed.sequence_parallel {n} must divide the {world} processes (the rest is data "
                f"parallel): use a divisor of {world}, or more processes"
            )
        if self.num_machines > 1 and self.num_processes % n:
            raise ValueError(
                f"distributed.sequence_parallel {n} must divide the {self.num_processes} processes of each "
                "machine (a group spanning machines would exchange every layer's attention over the network): "
                f"use a divisor of {self.num_processes}"
            )
