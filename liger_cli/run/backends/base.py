"""What every backend does, and the single-process behaviour that each one refines.

A backend object is made from the recipe and the Plan (`backends.backend_for`), builds its
Accelerator, and then answers the training loop's questions: how to prepare, how to run one
micro-batch, how to check the run is what the Plan asked for, what the fused loss needs gathered,
how to gather the whole state dict and how to load a checkpoint. The loop never names a backend.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from liger_cli import process_state
from liger_cli.errors import RunFailed
from liger_cli.plan.backends import BACKENDS, PRECISION_TO_ACCELERATE, BackendFacts
from liger_cli.run import checkpoint
from liger_cli.run.plain_state import check_distributed_checkpoint_index

if TYPE_CHECKING:
    from liger_cli.plan import Plan
    from liger_cli.recipe import Recipe


class DowngradeError(RunFailed):
    """The run is not what the recipe asked for (world size, backend, sharding)."""


class Backend:
    facts: ClassVar[BackendFacts]
    """What the plan knows about this backend (liger_cli.plan.backends)."""

    @property
    def name(self) -> str:
        return self.facts.name

    def __init__(self, recipe: Recipe, plan: Plan):
        self.recipe, self.plan = recipe, plan
        self.accelerator = None

    # --- set-up -------------------------------------------------------------------------------------

    def make_accelerator(self):
        """An Accelerator that runs the Plan's backend, on GPUs or (with gloo) on CPUs."""
        from accelerate import Accelerator

        process_state.reset_for_new_run()
        kwargs = {
            "mixed_precision": PRECISION_TO_ACCELERATE[self.plan.precision],
            "cpu": self.plan.device == "cpu",
        }
        kwargs |= self.accelerator_kwargs()
        accelerator = Accelerator(**kwargs)
        if self.plan.device == "cpu" and self.plan.num_processes > 1:
            self.keep_on_cpu(accelerator, kwargs)
        self.accelerator = accelerator
        self.check_world()
        return accelerator

    def accelerator_kwargs(self) -> dict:
        return {}

    def shard_frozen(self, module: nn.Module) -> str:
        """Shard a frozen model used beside the trained one (distill's teacher) where the trained one is
        sharded (`frozen_model_kept_whole`): each of its decoder layers (its own wrap classes) a
        fully_shard unit over every process, whatever the backend, so that a forward gathers one layer
        at a time and frees it after. Its embeddings, final norm and lm_head stay whole on each process
        (the fused divergence reads the head as a plain tensor). A 4-bit model's packed weights shard
        too (stored in its compute dtype, `load_teacher`), their statistics stay whole on each process
        (bitsandbytes keeps them on the layer). Returns how, for the log."""
        if why := self.recipe.distributed.frozen_model_kept_whole():
            return f"whole on each process: {why}"
        if not self.active:
            return f"whole on each process: {self.name} is not running"
        from torch.distributed.fsdp import fully_shard

        from liger_cli.plan.wrap import resolve_wrap_classes

        classes = set(resolve_wrap_classes(module, None, env={}).classes)
        layers = [m for m in module.modules() if type(m).__name__ in classes]
        for layer in layers:
            fully_shard(layer, reshard_after_forward=True)
        names = ", ".join(sorted(classes))
        return f"its {len(layers)} {names} sharded over {self.plan.num_processes} processes by FSDP-2"

    def keep_on_cpu(self, accelerator, kwargs: dict) -> None:
        """Undo what accelerate does on a CPU to a backend it supports only on GPUs (default: nothing)."""

    @property
    def active(self) -> bool:
        """accelerate really runs this backend (one CPU process trains plainly under any backend)."""
        return self.accelerator.distributed_type.name in self.facts.accelerate_types

    def check_world(self) -> None:
        """The number of processes and the backend must be the ones the Plan launched."""
        accelerator, plan = self.accelerator, self.plan
        if accelerator.num_processes != plan.num_processes:
            raise DowngradeError(
                f"the recipe asks for {plan.num_processes} processes but this run has {accelerator.num_processes}; "
                "launch with `liger train RECIPE` (it starts the processes) or match distributed.num_processes"
            )
        if plan.num_processes > 1 and not torch.distributed.is_initialized():
            raise DowngradeError("no process group: the processes would train without synchronising")
        if plan.num_processes > 1 and not self.active:
            got = accelerator.distributed_type.name
            raise DowngradeError(
                f"the recipe asks for {plan.backend} but accelerate set up {got}; refusing to train"
            )

    def prepare(self, model: nn.Module, optimizer):
        """Wrap model and optimizer together (FSDP-2 swaps the optimizer's parameters)."""
        return self.accelerator.prepare(model, optimizer)

    def check(self, model: nn.Module) -> str:
        """After `prepare`: the model is wrapped and sharded as planned (no silent downgrade); says how."""
        return "single process"

    def check_four_bit(self, model: nn.Module, shards: int) -> str:
        """QLoRA under a sharding backend: the 4-bit weights' packed bytes held by this rank, summed over
        the ranks, must be the model's 4-bit bytes x world/shards (each byte held by one rank of a
        shard group, give or take ZeRO-3's padding), not x world: replicated on every rank, the
        downgrade users meet (uint8 storage under accelerate's FSDP-2). The sum, not each rank's
        share, is checked: FSDP-1 cuts its flat units where they fall, so one rank may hold more of
        the 4-bit bytes than another. Collective: every rank calls it."""
        from liger_cli.model import quantize

        layers = quantize.four_bit_layers(model)
        if not layers:
            return ""
        world = self.accelerator.num_processes
        full = sum(quantize.packed_bytes(layer) for layer in layers)
        local = sum(_local_bytes(layer.weight) for layer in layers)
        held = torch.tensor([local], dtype=torch.int64, device=self.accelerator.device)
        total = int(self.accelerator.reduce(held, reduction="sum").item())
        expected = full * (world // shards)
        padding = world * 8 * len(layers)  # ZeRO-3 pads each partition to whole elements
        if not expected <= total <= expected + padding:
            raise DowngradeError(
                f"the 4-bit weights are held {total / full:.3g} times over the {world} ranks, not "
                f"{world // shards}: they are not sharded as the recipe asks ({self.name})"
            )
        return f"; 4-bit weights: {local} of {full} bytes on this rank, each held once per shard group"

    def gather_for_fused_loss(self, model: nn.Module) -> str | None:
        """Make the fused loss see the whole lm_head.weight; says what was done (None: nothing needed).

        The fused loss runs inside the causal-LM forward but outside lm_head's own forward
        (see docs/field-failures.md#fused-loss-reads-a-sharded-lm_head)."""
        return None

    # --- the loop -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def micro_batch(self, model: nn.Module, last: bool):
        """Wraps one micro-batch's forward and backward; yields the `backward(loss)` to call on its loss.

        The loss is this micro-batch's share of the step's global mean (a sum over its tokens divided
        by the step's token count over all ranks), so gradients must be summed over ranks and micro-
        batches, never averaged: DDP, FSDP and ZeRO average over ranks, hence the `* world`. Gradients
        are synchronised only on the last micro-batch (`no_sync` must cover the forward too); the
        loop then clips and steps.
        """
        world = self.accelerator.num_processes
        with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
            yield lambda loss: self.accelerator.backward(loss * world)

    # --- generation ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def generation(self, model: nn.Module):
        """For one call of the generation engine: the module to generate with, its parameters whole for
        the whole call (gathered once, never per token), and `any_running(local) -> bool`, which keeps
        every rank stepping until all are done. Collective under sharding: every rank enters it."""
        yield self.accelerator.unwrap_model(model), self.any_running

    def any_running(self, local: bool) -> bool:
        """Whether any rank is still generating (a max over ranks; the local flag with one process)."""
        if self.accelerator.num_processes == 1:
            return local
        flag = torch.tensor([int(local)], device=self.accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    # --- state --------------------------------------------------------------------------------------

    def stored_trainable(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors this process stores for the trainable parameters, with every sharded unit back
        to its shard (a forward may leave one gathered): writing into them (GRPO's reference swap) is
        what the next forward computes with. Call under no_grad."""
        return [p for p in model.parameters() if p.requires_grad]

    def full_state_dict(self, model: nn.Module) -> dict:
        """The whole model's state dict on rank 0 (gathered from every rank: call it on all of them)."""
        return self.drop_tied_duplicates(model, self.accelerator.get_state_dict(model))

    def drop_tied_duplicates(self, model: nn.Module, state: dict) -> dict:
        """FSDP writes a tied weight under each of its names as separate tensors; keep the first name
        only, as a 1-process save does (the others are re-tied on load)."""
        first: dict[int, str] = {}
        for name, param in self.accelerator.unwrap_model(model).named_parameters(remove_duplicate=False):
            name = process_state.clean_parameter_name(name)
            if first.setdefault(id(param), name) != name:
                state.pop(name, None)
        return state

    def model_to_save(self, model: nn.Module) -> nn.Module:
        """The module whose `save_pretrained` writes the final model (with the gathered state dict)."""
        return self.accelerator.unwrap_model(model)

    def load_state(self, model: nn.Module, optimizer, checkpoint_dir: Path) -> None:
        """Resume from a checkpoint; with an adapter, only the trainable weights are in it."""
        adapter = self.recipe.adapter.type != "none"
        if adapter:
            checkpoint.check_adapter_checkpoint(self.accelerator, model, checkpoint_dir)
        check_distributed_checkpoint_index(checkpoint_dir)  # FSDP's sharded index, before torch unpickles it
        # weights_only: the optimizer state (accelerate's pickle format) is read as tensors and numbers only
        self.accelerator.load_state(
            str(checkpoint_dir), load_kwargs={"weights_only": True}, strict=not adapter
        )


def _local_bytes(param: torch.Tensor) -> int:
    """The bytes of `param` this rank stores: ZeRO-3's partition, FSDP-2's local shard, or FSDP-1's
    view of its flat unit's shard (empty when it lies on another rank)."""
    if hasattr(param, "ds_tensor"):
        param = param.ds_tensor
    elif hasattr(param, "to_local"):
        param = param.to_local()
    return param.numel() * param.element_size()


class SingleProcess(Backend):
    facts = BACKENDS["none"]
