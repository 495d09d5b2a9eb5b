"""DeepSpeed ZeRO (stage 2 or 3) through accelerate's DeepSpeed plugin.

The engine clips (its `gradient_clipping`), steps and zeroes the gradients itself inside the last
backward; every batch and clipping setting comes from the recipe.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

from torch import nn

from liger_cli import process_state
from liger_cli.errors import UserError
from liger_cli.plan.backends import BACKENDS
from liger_cli.run.backends.base import Backend, DowngradeError
from liger_cli.run.backends.fsdp import fused_loss_module


class DeepSpeed(Backend):
    facts = BACKENDS["deepspeed"]

    def plugin(self):
        from accelerate import DeepSpeedPlugin

        t, plan = self.recipe.training, self.plan
        zero: dict = {"stage": self.recipe.distributed.zero_stage}
        if zero["stage"] == 3:
            # 0: every parameter is partitioned, so lm_head.weight really is (0,) outside a forward and the
            # fused loss's explicit gather is exercised, not hidden by a size threshold.
            zero |= {
                "stage3_param_persistence_threshold": 0,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        config = {
            "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": t.grad_accum,
            # DeepSpeed's own count: micro-batches x processes (a sequence-parallel group's share one)
            "train_batch_size": t.micro_batch_size * t.grad_accum * plan.num_processes,
            "gradient_clipping": t.max_grad_norm or 0.0,
            "zero_optimization": zero,
            "bf16": {"enabled": plan.precision == "bf16"},
            "fp16": {"enabled": plan.precision == "fp16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        # zero3_init_flag: transformers' from_pretrained then builds the model under ZeRO-3's init context,
        # each parameter partitioned as it is created (see docs/field-failures.md#zero-3-loading-drops-an-argument).
        return DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=zero["stage"] == 3)

    def accelerator_kwargs(self) -> dict:
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError(
                "distributed.backend deepspeed needs the deepspeed package: "
                "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed (or choose fsdp2)"
            )
        process_state.set_deepspeed_accelerator(self.plan.device)
        kwargs: dict = {"deepspeed_plugin": self.plugin()}
        if (
            self.plan.device != "cpu" or self.plan.num_processes > 1
        ):  # the engine runs (one CPU process trains plainly)
            # The engine's accumulation count, also accelerate's (else it warns that they differ). Never
            # without the engine: accelerate's own backward would divide the loss by it.
            kwargs["gradient_accumulation_steps"] = self.recipe.training.grad_accum
        return kwargs

    def keep_on_cpu(self, accelerator, kwargs: dict) -> None:
        state = process_state.force_distributed_type_on_cpu("DEEPSPEED")
        process_state.keep_deepspeed_on_cpu(state, kwargs["deepspeed_plugin"], accelerator)

    def check(self, model: nn.Module) -> str:
        """ZeRO-3: every parameter is partitioned and this rank holds 1/world of them."""
        if self.plan.num_processes == 1:
            return "single process"
        world, stage = self.accelerator.num_processes, self.recipe.distributed.zero_stage
        if stage != 3:
            return f"deepspeed ZeRO-{stage}: parameters replicated, optimizer state partitioned"
        params = list(model.parameters())
        if not all(hasattr(p, "ds_numel") for p in params):
            raise DowngradeError(
                "the recipe asks for DeepSpeed ZeRO but the parameters are not ZeRO parameters"
            )
        full = sum(p.ds_numel for p in params)
        local = sum(p.ds_tensor.numel() for p in params)
        if not local <= -(-full // world) + world * len(params) or local >= full:
            raise DowngradeError(f"ZeRO-3 holds {local} of {full} parameters on this rank, not 1/{world}")
        four_bit = self.check_four_bit(model, world)
        return f"deepspeed ZeRO-3: {local} of {full} parameters on this rank (1/{world}){four_bit}"

    def gather_for_fused_loss(self, model: nn.Module) -> str | None:
        """ZeRO-3 gathers a module's parameters only around its own forward: lm_head.weight is
        registered as an external parameter of the causal-LM module, so ZeRO gathers it for that
        forward and its backward."""
        causal_lm = fused_loss_module(model)
        if causal_lm is None or not hasattr(causal_lm.lm_head.weight, "ds_id"):
            return None
        import deepspeed

        deepspeed.zero.register_external_parameter(causal_lm, causal_lm.lm_head.weight)
        return "lm_head.weight registered with ZeRO-3 as a parameter of the causal-LM forward"

    @contextlib.contextmanager
    def generation(self, model: nn.Module):
        """ZeRO-3: every parameter gathered once for the call and the engine's per-module fetch and
        release hooks lifted meanwhile, so decoding steps run on whole parameters (no gather per layer
        per token); the hooks are registered again after. ZeRO-2 shards no parameter."""
        if not (self.active and self.recipe.distributed.zero_stage == 3):
            with super().generation(model) as found:
                yield found
            return
        import deepspeed

        engine = self.accelerator.deepspeed_engine_wrapped.engine
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            with process_state.zero3_hooks_lifted(engine):
                yield engine.module, self.any_running

    @contextlib.contextmanager
    def micro_batch(self, model: nn.Module, last: bool):
        """We set the engine's accumulation boundary explicitly and stop it from dividing the loss by
        the accumulation count again (`scale_wrt_gas=False`); accelerate's own backward would step the
        engine after EVERY micro-batch unless its `accumulate` counter drives it, and would scale the
        loss by 1/grad_accum. The engine steps inside the last backward."""
        if not self.active:
            with super().micro_batch(model, last) as backward:
                yield backward
            return
        world = self.accelerator.num_processes
        engine = self.accelerator.deepspeed_engine_wrapped.engine
        engine.set_gradient_accumulation_boundary(last)

        def backward(loss) -> None:
            engine.backward(loss * world, scale_wrt_gas=False)
            if last:
                engine.step()

        yield backward

    def stored_trainable(self, model: nn.Module) -> list:
        """ZeRO-3: each parameter's partition (gathered copies are released after each module's use)."""
        return [getattr(p, "ds_tensor", p) for p in super().stored_trainable(model)]

    def load_state(self, model: nn.Module, optimizer, checkpoint_dir: Path) -> None:
        if not self.active:
            return super().load_state(model, optimizer, checkpoint_dir)
        self.accelerator.load_state(str(checkpoint_dir))  # the engine's own sharded checkpoint; no `strict`
