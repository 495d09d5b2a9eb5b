"""The Accelerator for a Plan, and the check that the run is what the Plan asked for.

Measured on CPU machines (../shared/context/fsdp-facts.md): `accelerate launch --use_fsdp` without
CUDA silently gives DDP, or two processes that never synchronise, and accelerate keeps FSDP and
DeepSpeed plugins only on GPU-like devices. We therefore build the backend's plugin ourselves from
the Plan, with every option explicit (accelerate fills unset options from FSDP_* environment
variables), tell accelerate's state the backend on a CPU, and verify world size, backend and
sharding after `prepare`: a run that is not what the recipe asked for stops with an error instead
of training wrongly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch
from torch import nn

from liger_cli.plan import Plan
from liger_cli.recipe import Recipe

PRECISION_TO_ACCELERATE = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
FSDP1_SHARDING = {
    "full": "FULL_SHARD",
    "shard_grad_op": "SHARD_GRAD_OP",
    "hybrid": "HYBRID_SHARD",
    "no_shard": "NO_SHARD",
}
_BACKEND_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")


class DowngradeError(RuntimeError):
    """The run is not what the recipe asked for (world size, backend, sharding)."""


def fsdp_plugin(recipe: Recipe, plan: Plan):
    """accelerate's FSDP plugin for the Plan; the wrap classes are the Plan's, never the environment's."""
    from accelerate import FullyShardedDataParallelPlugin

    fsdp = recipe.distributed.fsdp
    version = 1 if plan.backend == "fsdp1" else 2
    kwargs: dict = {
        "fsdp_version": version,
        # [] means one unit (the whole model): say so rather than let accelerate read the environment.
        "auto_wrap_policy": "transformer_based_wrap" if plan.wrap_classes else "no_wrap",
        "transformer_cls_names_to_wrap": list(plan.wrap_classes or []),
        "cpu_offload": fsdp.cpu_offload,
        "state_dict_type": "SHARDED_STATE_DICT",
        "activation_checkpointing": False,  # applied through transformers (model.py), as the Plan says
        "cpu_ram_efficient_loading": False,
        "ignored_modules": None,
        "backward_prefetch": "NO_PREFETCH",
    }
    if version == 1:
        kwargs |= {
            "sharding_strategy": FSDP1_SHARDING[fsdp.sharding],
            "use_orig_params": True,  # LoRA mixes frozen and trainable parameters in one unit
            "sync_module_states": False,
            "forward_prefetch": False,
        }
    else:
        kwargs["reshard_after_forward"] = fsdp.sharding != "shard_grad_op"
        if fsdp.sharding in ("hybrid", "no_shard"):
            from liger_cli.errors import UserError

            raise UserError(
                f"distributed.fsdp.sharding {fsdp.sharding} is FSDP-1 only: use backend fsdp1, or full"
            )
    return FullyShardedDataParallelPlugin(**kwargs)


def deepspeed_plugin(recipe: Recipe, plan: Plan):
    """ZeRO through accelerate's DeepSpeed plugin, every batch and clipping setting from the recipe."""
    from accelerate import DeepSpeedPlugin

    t = recipe.training
    zero: dict = {"stage": recipe.distributed.zero_stage}
    if zero["stage"] == 3:
        # 0: every parameter is partitioned, so lm_head.weight really is (0,) outside a forward and the
        # fused loss's explicit gather is exercised, not hidden by a size threshold.
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True}
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": plan.global_batch,
        "gradient_clipping": t.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    # zero3_init_flag: transformers' from_pretrained then builds the model under ZeRO-3's init context
    # (field failure 2), each parameter partitioned as it is created.
    return DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=zero["stage"] == 3)


def make_accelerator(recipe: Recipe, plan: Plan):
    """An Accelerator that runs the Plan's backend, on GPUs or (with gloo) on CPUs."""
    if plan.backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        from liger_cli.errors import UserError

        raise UserError(
            "distributed.backend deepspeed needs the deepspeed package: "
            "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed (or choose fsdp2)"
        )
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType

    # Each run gets the backend its Plan asks for, even after another run in this process: accelerate's
    # state is a process-wide singleton, and a plugin sets ACCELERATE_USE_* for every later Accelerator.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if "_liger_replaced_type" in PartialState._shared_state:  # undo the CPU override of an earlier run
        PartialState._shared_state["distributed_type"] = PartialState._shared_state.pop(
            "_liger_replaced_type"
        )
    for key in _BACKEND_ENV:
        os.environ.pop(key, None)
    # transformers loads under ZeRO-3 while a DeepSpeed config is registered; a later run must not.
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()

    kwargs: dict = {"mixed_precision": PRECISION_TO_ACCELERATE[plan.precision], "cpu": plan.device == "cpu"}
    if plan.backend == "ddp":
        # Frozen base weights have no gradient: DDP must not wait for them.
        kwargs["kwargs_handlers"] = [DistributedDataParallelKwargs(find_unused_parameters=False)]
    elif plan.backend in ("fsdp1", "fsdp2"):
        kwargs["fsdp_plugin"] = fsdp_plugin(recipe, plan)
    elif plan.backend == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", plan.device)
        kwargs["deepspeed_plugin"] = deepspeed_plugin(recipe, plan)
        if plan.device != "cpu" or plan.num_processes > 1:  # the engine runs (one CPU process trains plainly)
            # The engine's accumulation count, also accelerate's (else it warns that they differ). Never
            # without the engine: accelerate's own backward would divide the loss by it.
            kwargs["gradient_accumulation_steps"] = recipe.training.grad_accum
    accelerator = Accelerator(**kwargs)

    state = AcceleratorState()
    if plan.device == "cpu" and plan.backend in ("fsdp1", "fsdp2", "deepspeed") and plan.num_processes > 1:
        # accelerate keeps these plugins only for GPU-like devices; on a CPU it would silently run DDP.
        # Both singletons are set, as accelerate itself does on a GPU: a later AcceleratorState()
        # copies PartialState's values over its own.
        kind = DistributedType.DEEPSPEED if plan.backend == "deepspeed" else DistributedType.FSDP
        PartialState._shared_state["_liger_replaced_type"] = state.distributed_type
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):
            shared["distributed_type"], shared["device"] = kind, torch.device("cpu")
        if plan.backend == "deepspeed":
            _select_deepspeed_on_cpu(state, kwargs["deepspeed_plugin"], accelerator)
        else:
            state.fsdp_plugin = kwargs["fsdp_plugin"]
            if plan.precision != "fp32":
                state.fsdp_plugin.set_mixed_precision(plan.precision)
    check_world(accelerator, plan)
    return accelerator


def _select_deepspeed_on_cpu(state, plugin, accelerator) -> None:
    import deepspeed

    # DeepSpeed's CPU communication layer compiles a shared-memory all-reduce op on first use (~95 s on 2
    # cores, measured); only inference's all-reduce uses it, training's collectives go through gloo.
    # Marking it incompatible makes DeepSpeed fall back to gloo instead of compiling (its probe result is
    # one module-level dict, read when the communication layer starts).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # deepspeed's own communication layer wraps the existing gloo group (accelerate does this only on GPUs).
    deepspeed.init_distributed(dist_backend="gloo")
    plugin.set_mixed_precision(state._mixed_precision)
    # select() registers the config with transformers (HfDeepSpeedConfig), so from_pretrained loads
    # under ZeRO-3's init context.
    plugin.select(_from_accelerator_state=True)
    state.deepspeed_plugins = plugin
    state._mixed_precision = "no"
    accelerator.deepspeed_engine_wrapped = None


@contextlib.contextmanager
def micro_batch(accelerator, model: nn.Module, last: bool):
    """Wraps one micro-batch's forward and backward; yields the `backward(loss)` to call on its loss.

    The loss is this micro-batch's share of the step's global mean (a sum over its tokens divided by
    the step's token count over all ranks), so the gradients must be summed over ranks and micro-
    batches, never averaged: DDP, FSDP and ZeRO average over ranks, hence the `* world`.

    DDP/FSDP: gradients are synchronised only on the last micro-batch (`no_sync` must cover the
    forward too); the loop then clips and steps. DeepSpeed: the engine clips (its
    `gradient_clipping`), steps and zeroes the gradients itself inside the last backward. We set its
    accumulation boundary explicitly and stop it from dividing the loss by the accumulation count
    again (`scale_wrt_gas=False`); accelerate's own backward would step the engine after EVERY
    micro-batch unless its `accumulate` counter drives it, and would scale the loss by 1/grad_accum.
    """
    world = accelerator.num_processes
    if accelerator.distributed_type.name == "DEEPSPEED":
        engine = accelerator.deepspeed_engine_wrapped.engine
        engine.set_gradient_accumulation_boundary(last)

        def backward(loss: torch.Tensor) -> None:
            engine.backward(loss * world, scale_wrt_gas=False)
            if last:
                engine.step()

        yield backward
        return
    with contextlib.nullcontext() if last else accelerator.no_sync(model):
        yield lambda loss: accelerator.backward(loss * world)


def apply_wrap_plan(accelerator, model: nn.Module, recipe: Recipe, plan: Plan) -> None:
    """Resolve the FSDP wrap classes on the built model, put them in the Plan and into the plugin.

    The Plan is made before the model exists (ZeRO-3 must be set up before loading), so the classes
    are resolved here, with the same function `inspect-wrap` uses. FSDP_TRANSFORMER_CLS_TO_WRAP is
    cleaned too, since accelerate splits it naively ("" -> [""]) and child processes inherit it.
    """
    if plan.backend not in ("fsdp1", "fsdp2"):
        return
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from liger_cli.wrap import accelerate_env, resolve_wrap_classes

    resolution = resolve_wrap_classes(model, recipe.distributed.fsdp.wrap_classes)
    accelerate_env(resolution)
    plan.wrap_classes, plan.wrap_source = resolution.classes, resolution.source
    plan.notes += [f"[{w.code}] {w.message}" for w in resolution.warnings]
    plugin = accelerator.state.fsdp_plugin
    plugin.transformer_cls_names_to_wrap = list(resolution.classes)
    plugin.auto_wrap_policy = transformer_auto_wrap_policy if resolution.classes else None


def gather_lm_head_for_fused_loss(model: nn.Module, plan: Plan) -> str | None:
    """Make the fused loss see the whole lm_head.weight under sharding backends (after `prepare`).

    The fused loss runs inside the causal-LM forward but outside lm_head's own forward (field
    failure 1). FSDP-1 keeps lm_head in the root unit, which that forward has gathered. FSDP-2 puts
    lm_head in a unit whose gather is triggered by the final norm's forward, and accelerate does
    not find that norm through a peft model: we unshard lm_head's unit explicitly before the
    causal-LM forward (measured correct; `full_tensor()` is silently wrong). ZeRO-3 gathers a
    module's parameters only around its own forward: lm_head.weight is registered as an external
    parameter of the causal-LM module, so ZeRO gathers it for that forward and its backward.
    """
    causal_lm = next(
        (m for m in model.modules() if getattr(m, "_liger_kernel", None) == "fused_linear_cross_entropy"),
        None,
    )
    if causal_lm is None or plan.backend not in ("fsdp2", "deepspeed"):
        return None
    lm_head = causal_lm.lm_head
    if plan.backend == "deepspeed":
        if not hasattr(lm_head.weight, "ds_id"):
            return None
        import deepspeed

        deepspeed.zero.register_external_parameter(causal_lm, lm_head.weight)
        return "lm_head.weight registered with ZeRO-3 as a parameter of the causal-LM forward"
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(lm_head, FSDPModule):
        return None
    causal_lm.register_forward_pre_hook(lambda module, args: lm_head.unshard())
    return "lm_head's FSDP-2 unit is unsharded before the causal-LM forward"


def full_state_dict(accelerator, model: nn.Module) -> dict:
    """The whole model's state dict on rank 0 (gathered from every rank: call it on all of them).

    accelerate's FSDP-1 path offloads to the CPU while gathering, which crashes (SIGSEGV, measured
    with torch 2.13) when the parameters already live on the CPU; there we gather without offload.
    """
    if (
        accelerator.distributed_type.name == "FSDP"
        and not accelerator.is_fsdp2
        and accelerator.device.type == "cpu"
    ):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = model.state_dict()
    else:
        state = accelerator.get_state_dict(model)
    # FSDP writes a tied weight under each of its names as separate tensors; keep the first name only,
    # as a 1-process save does (the others are re-tied on load).
    first: dict[int, str] = {}
    for name, param in accelerator.unwrap_model(model).named_parameters(remove_duplicate=False):
        name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        if first.setdefault(id(param), name) != name:
            state.pop(name, None)
    return state


def init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state (Adam's moments) by one step with zero gradients and lr 0.

    FSDP-1 checkpoints are read with torch.distributed.checkpoint, which fills only the state that
    already exists: an optimizer that never stepped has none, so a resume would silently restart
    Adam's moments from zero (measured: the loss after the first resumed step differs). The step
    leaves the weights unchanged; the loaded checkpoint then overwrites the state and step counts.
    """
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


EXPECTED_TYPE = {
    "none": "NO",
    "ddp": "MULTI_CPU|MULTI_GPU",
    "fsdp1": "FSDP",
    "fsdp2": "FSDP",
    "deepspeed": "DEEPSPEED",
}


def check_world(accelerator, plan: Plan) -> None:
    """The number of processes and the backend must be the ones the Plan launched."""
    if accelerator.num_processes != plan.num_processes:
        raise DowngradeError(
            f"the recipe asks for {plan.num_processes} processes but this run has {accelerator.num_processes}; "
            "launch with `liger train RECIPE` (it starts the processes) or match distributed.num_processes"
        )
    if plan.num_processes > 1 and not torch.distributed.is_initialized():
        raise DowngradeError("no process group: the processes would train without synchronising")
    got = accelerator.distributed_type.name
    if plan.num_processes > 1 and got not in EXPECTED_TYPE[plan.backend].split("|"):
        raise DowngradeError(
            f"the recipe asks for {plan.backend} but accelerate set up {got}; refusing to train"
        )


def check_sharding(model: nn.Module, recipe: Recipe, plan: Plan, world: int) -> str:
    """After `prepare`: the model is really wrapped and sharded as planned; returns what was found.

    For FSDP a wrapped decoder layer (or, with no wrap classes, the root) must hold 1/world of its
    parameters locally; for ZeRO-3 every parameter must be partitioned; for DDP the model must be
    a DistributedDataParallel. Anything else raises DowngradeError.
    """
    if plan.num_processes == 1 or plan.backend == "none":
        return "single process"
    if plan.backend == "ddp":
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            raise DowngradeError(f"the recipe asks for DDP but the model is a {type(model).__name__}")
        return f"DDP: gradients all-reduced over {world} processes"
    if plan.backend == "deepspeed":
        return _check_zero(model, recipe, world)
    sharding = recipe.distributed.fsdp.sharding
    shards = {"no_shard": 1, "hybrid": world // recipe.distributed.num_machines}.get(sharding, world)
    return _check_fsdp(model, plan, shards)


def _fsdp_unit(model: nn.Module, plan: Plan) -> tuple[str, nn.Module]:
    classes = set(plan.wrap_classes or [])
    for name, module in model.named_modules():
        # FSDP-2 swaps a unit's class for a subclass (FSDPLlamaDecoderLayer): look through it.
        names = {cls.__name__ for cls in type(module).__mro__}
        if names & classes and any(True for _ in module.parameters()):
            return name, module
    return "(root)", model


def _check_fsdp(model: nn.Module, plan: Plan, shards: int) -> str:
    name, unit = _fsdp_unit(model, plan)
    if plan.backend == "fsdp2":
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        params = list(unit.parameters())
        if not isinstance(unit, FSDPModule) or not all(isinstance(p, DTensor) for p in params):
            raise DowngradeError(
                f"the recipe asks for FSDP-2 but {name} is not a fully_shard unit of DTensors"
            )
        local = sum(p.to_local().numel() for p in params)
        full = sum(p.numel() for p in params)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrapped = [m for m in model.modules() if isinstance(m, FSDP) and (m.module is unit or m is unit)]
        if not wrapped or wrapped[0]._flat_param is None:
            raise DowngradeError(f"the recipe asks for FSDP-1 but {name} is not an FSDP unit")
        flat = wrapped[0]._flat_param
        local = flat.numel()  # the local shard, padded to a multiple of the world size
        full = flat._unpadded_unsharded_size.numel()
    if not (local <= -(-full // shards) + shards and (shards == 1 or local < full)):
        raise DowngradeError(
            f"{name} holds {local} of its {full} parameters on this rank, not 1/{shards}: "
            f"the model is not sharded as the recipe asks ({plan.backend})"
        )
    return f"{plan.backend}: {name} holds {local} of {full} parameters on this rank (1/{shards})"


def _check_zero(model: nn.Module, recipe: Recipe, world: int) -> str:
    if recipe.distributed.zero_stage != 3:
        return f"deepspeed ZeRO-{recipe.distributed.zero_stage}: parameters replicated, optimizer state partitioned"
    params = list(model.parameters())
    if not all(hasattr(p, "ds_numel") for p in params):
        raise DowngradeError("the recipe asks for DeepSpeed ZeRO but the parameters are not ZeRO parameters")
    full = sum(p.ds_numel for p in params)
    local = sum(p.ds_tensor.numel() for p in params)
    if not local <= -(-full // world) + world * len(params) or local >= full:
        raise DowngradeError(f"ZeRO-3 holds {local} of {full} parameters on this rank, not 1/{world}")
    return f"deepspeed ZeRO-3: {local} of {full} parameters on this rank (1/{world})"
