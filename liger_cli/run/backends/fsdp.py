"""FSDP-1 and FSDP-2 through accelerate, with the Plan's wrap classes and every option explicit.

accelerate fills unset plugin options from FSDP_* environment variables, so every option is given
here; the wrap classes are the Plan's (resolved once, on the meta model), never the environment's.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from torch import nn

from liger_cli import process_state
from liger_cli.errors import UserError
from liger_cli.plan.backends import BACKENDS
from liger_cli.run.backends.base import Backend, DowngradeError

FSDP1_SHARDING = {
    "full": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "hybrid": "HYBRID_SHARD",
    "no_shard": "NO_SHARD",
}


class _Fsdp(Backend):
    def plugin_kwargs(self) -> dict:
        raise NotImplementedError

    def plugin(self):
        """accelerate's FSDP plugin for the Plan."""
        from accelerate import FullyShardedDataParallelPlugin

        classes = list(self.plan.wrap_classes)
        process_state.accelerate_env(classes)  # accelerate and child processes read it too
        return FullyShardedDataParallelPlugin(
            fsdp_version=self.facts.fsdp_version,
            # [] means one unit (the whole model): say so rather than let accelerate read the environment.
            auto_wrap_policy="transformer_based_wrap" if classes else "no_wrap",
            transformer_cls_names_to_wrap=classes,
            cpu_offload=self.recipe.distributed.fsdp.cpu_offload,
            state_dict_type="SHARDED_STATE_DICT",
            activation_checkpointing=False,  # applied through transformers (model.py), as the Plan says
            cpu_ram_efficient_loading=False,
            ignored_modules=None,
            backward_prefetch="NO_PREFETCH",
            **self.plugin_kwargs(),
        )

    def accelerator_kwargs(self) -> dict:
        return {"fsdp_plugin": self.plugin()}

    def keep_on_cpu(self, accelerator, kwargs: dict) -> None:
        state = process_state.force_distributed_type_on_cpu("FSDP")
        process_state.keep_fsdp_plugin_on_cpu(state, kwargs["fsdp_plugin"], self.plan.precision)

    def model_to_save(self, model: nn.Module) -> nn.Module:
        inner = super().model_to_save(model)
        if hasattr(inner, "peft_config") and self.active:
            from liger_cli.model import meta_twin

            # peft cannot name the adapter's weights through FSDP's wrappers
            # (see docs/fsdp-facts.md#saving-and-resuming).
            return meta_twin(inner)
        return inner

    # --- the no-silent-downgrade check --------------------------------------------------------------

    def check(self, model: nn.Module) -> str:
        """A wrapped decoder layer (or, with no wrap classes, the root) holds 1/world of its parameters."""
        if self.plan.num_processes == 1:
            return "single process"
        world = self.accelerator.num_processes
        d = self.recipe.distributed
        shards = {"no_shard": 1, "hybrid": world // d.num_machines}.get(d.fsdp.sharding, world)
        four_bit = self.check_four_bit(model, shards)  # first: it names the 4-bit downgrade exactly
        name, unit = self._unit(model)
        local, full = self.shard_sizes(model, name, unit)
        if not (local <= self.most_held(unit, full, shards) and (shards == 1 or local < full)):
            raise DowngradeError(
                f"{name} holds {local} of its {full} parameters on this rank, not 1/{shards}: "
                f"the model is not sharded as the recipe asks ({self.name})"
            )
        return f"{self.name}: {name} holds {local} of {full} parameters on this rank (1/{shards}){four_bit}"

    def shard_sizes(self, model: nn.Module, name: str, unit: nn.Module) -> tuple[int, int]:
        raise NotImplementedError

    def most_held(self, unit: nn.Module, full: int, shards: int) -> int:
        """The most parameters one rank of a sharded unit holds: 1/shards of its flat parameter, padded."""
        return -(-full // shards) + shards

    def _unit(self, model: nn.Module) -> tuple[str, nn.Module]:
        classes = set(self.plan.wrap_classes)
        for name, module in model.named_modules():
            # FSDP-2 swaps a unit's class for a subclass (FSDPLlamaDecoderLayer): look through it.
            names = {cls.__name__ for cls in type(module).__mro__}
            if names & classes and any(True for _ in module.parameters()):
                return name, module
        return "(root)", model


class Fsdp1(_Fsdp):
    facts = BACKENDS["fsdp1"]

    def plugin_kwargs(self) -> dict:
        return {
            "sharding_strategy": FSDP1_SHARDING[self.recipe.distributed.fsdp.sharding],
            "use_orig_params": True,  # LoRA mixes frozen and trainable parameters in one unit
            "sync_module_states": False,
            "forward_prefetch": False,
        }

    def shard_sizes(self, model: nn.Module, name: str, unit: nn.Module) -> tuple[int, int]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrapped = [m for m in model.modules() if isinstance(m, FSDP) and (m.module is unit or m is unit)]
        sizes = process_state.fsdp1_shard_sizes(wrapped[0]) if wrapped else None
        if sizes is None:
            raise DowngradeError(f"the recipe asks for FSDP-1 but {name} is not an FSDP unit")
        return sizes

    @contextlib.contextmanager
    def generation(self, model: nn.Module):
        """Every unit's parameters gathered once (`summon_full_params`, no write-back) and each FSDP
        wrapper's forward bypassed for the call, so decoding steps run the plain modules on whole
        parameters: no all-gather per layer per token (see docs/generation.md#under-sharding)."""
        if not self.active:
            with super().generation(model) as found:
                yield found
            return
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrappers = [m for m in model.modules() if isinstance(m, FSDP)]
        with FSDP.summon_full_params(model, writeback=False, recurse=True):
            for wrapper in wrappers:
                wrapper.forward = wrapper.module.__call__  # an instance attribute: shadows FSDP.forward
            try:
                yield self.accelerator.unwrap_model(model), self.any_running
            finally:
                for wrapper in wrappers:
                    del wrapper.forward

    def stored_trainable(self, model: nn.Module) -> list:
        """Each parameter's view of its unit's local shard (use_orig_params), every unit resharded."""
        if self.active:
            process_state.fsdp1_reshard_all(model)
        return super().stored_trainable(model)

    def full_state_dict(self, model: nn.Module) -> dict:
        """accelerate's FSDP-1 path offloads to the CPU while gathering, which crashes when the
        parameters already live on the CPU (see docs/fsdp-facts.md#saving-and-resuming): there we
        gather without offload."""
        if not (self.active and self.accelerator.device.type == "cpu"):
            return super().full_state_dict(model)
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
        return self.drop_tied_duplicates(model, state)

    def load_state(self, model: nn.Module, optimizer, checkpoint_dir: Path) -> None:
        init_optimizer_state(optimizer)  # the checkpoint reader fills only state that exists
        super().load_state(model, optimizer, checkpoint_dir)


class Fsdp2(_Fsdp):
    facts = BACKENDS["fsdp2"]

    def plugin_kwargs(self) -> dict:
        sharding = self.recipe.distributed.fsdp.sharding
        if sharding in ("hybrid", "no_shard"):
            raise UserError(
                f"distributed.fsdp.sharding {sharding} is FSDP-1 only: use backend fsdp1, or full"
            )
        return {"reshard_after_forward": sharding != "shard_grad_op"}

    def prepare(self, model: nn.Module, optimizer):
        model, optimizer = super().prepare(model, optimizer)
        process_state.register_fsdp2_classes(model)  # a vision tower unit still returns its hidden states
        return model, optimizer

    def shard_sizes(self, model: nn.Module, name: str, unit: nn.Module) -> tuple[int, int]:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        params = list(unit.parameters())
        if not isinstance(unit, FSDPModule) or not all(isinstance(p, DTensor) for p in params):
            raise DowngradeError(
                f"the recipe asks for FSDP-2 but {name} is not a fully_shard unit of DTensors"
            )
        return sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)

    def most_held(self, unit: nn.Module, full: int, shards: int) -> int:
        """FSDP-2 cuts each parameter along dim 0, a rank holding up to ceil(rows / shards) rows of each
        (a vision tower's 17 position embeddings: 9 rows on rank 0)."""
        return sum(
            -(-p.shape[0] // shards) * (p.numel() // p.shape[0]) if p.dim() and p.shape[0] else p.numel()
            for p in unit.parameters()
        )

    @contextlib.contextmanager
    def generation(self, model: nn.Module):
        """Every fully_shard unit unsharded once and kept whole through the call's forwards (no reshard
        after forward), then resharded: no all-gather per layer per token."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not (self.active and units):
            with super().generation(model) as found:
                yield found
            return
        after_forward = [process_state.fsdp2_reshard_after_forward(unit) for unit in units]
        for unit in units:
            unit.unshard()
            unit.set_reshard_after_forward(False, recurse=False)
        try:
            yield model, self.any_running
        finally:
            for unit, before in zip(units, after_forward, strict=True):
                process_state.restore_fsdp2_reshard_after_forward(unit, before)
                unit.reshard()

    def stored_trainable(self, model: nn.Module) -> list:
        """Each DTensor parameter's local tensor (the shard's storage), every unit resharded."""
        from torch.distributed.fsdp import FSDPModule

        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()
        return [p.to_local() if hasattr(p, "to_local") else p for p in super().stored_trainable(model)]

    def gather_for_fused_loss(self, model: nn.Module) -> str | None:
        """accelerate's FSDP-2 path gathers lm_head's unit in the final norm's forward, but does not
        find that norm through a peft model: unshard it explicitly before the causal-LM forward
        (measured correct; `full_tensor()` is silently wrong:
        see docs/fsdp-facts.md#where-a-fused-loss-may-read-lm_head)."""
        from torch.distributed.fsdp import FSDPModule

        causal_lm = fused_loss_module(model)
        if causal_lm is None or not isinstance(causal_lm.lm_head, FSDPModule):
            return None
        lm_head = causal_lm.lm_head
        causal_lm.register_forward_pre_hook(lambda module, args: lm_head.unshard())
        return "lm_head's FSDP-2 unit is unsharded before the causal-LM forward"


def fused_loss_module(model: nn.Module) -> nn.Module | None:
    """The causal-LM module whose forward our fused linear cross-entropy replaced, if any."""
    return next(
        (m for m in model.modules() if getattr(m, "_liger_kernel", None) == "fused_linear_cross_entropy"),
        None,
    )


def init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state (Adam's moments) by one step with zero gradients and lr 0.

    FSDP-1 checkpoints are read with torch.distributed.checkpoint, which fills only the state that
    already exists: an optimizer that never stepped has none, so a resume would silently restart
    Adam's moments from zero (see docs/fsdp-facts.md#saving-and-resuming). The step leaves the
    weights unchanged; the loaded checkpoint then overwrites the state and step counts.
    """
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    if inner.state:
        return
    lrs = [group["lr"] for group in inner.param_groups]
    for group in inner.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    inner.step()
    inner.zero_grad(set_to_none=True)
    for group, lr in zip(inner.param_groups, lrs, strict=True):
        group["lr"] = lr
