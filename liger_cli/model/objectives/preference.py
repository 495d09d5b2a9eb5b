"""Preference objectives (DPO with its IPO / hinge / robust losses, SimPO, ORPO): a loss per pair.

A micro-batch holds B pairs as 2B rows, the chosen answers first, then the rejected ones, so both
go through the model in one forward. That forward is the model's own: only its `loss_function` is
swapped, for the duration of the call, for one that returns each row's summed log-probability of
its learned tokens and their count (`liger_kernels.sequence_logprobs_loss`). With our fused loss
patched in, that function receives lm_head's input instead of logits and never builds them; without
it, it computes them from the logits. Either way the head is used inside the causal-LM module's
forward, where FSDP has gathered it and ZeRO-3's hooks fire.

The reference (DPO) is the same model with its adapter disabled, under no_grad: no second model in
memory. peft's `disable_adapter` can leave frozen adapter weights trainable when it exits, so every
parameter's `requires_grad` and every module's training flag are restored exactly afterwards.
SimPO and ORPO need no reference. The formulas are `liger_kernels.preference` (one line each, in the
README); the loss is a sum over pairs divided by the step's pair count, like every objective.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from liger_cli.data.encode import collate

NEEDS_REFERENCE = ("dpo",)


class Preference:
    unit = "pair"

    def __init__(self, objective: str, options):
        self.objective = objective
        self.options = options

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """2B rows, chosen then rejected, padded together (one forward for both answers)."""
        rows = [
            {"input_ids": ex[f"{side}_input_ids"], "labels": ex[f"{side}_labels"],
             "position_ids": list(range(len(ex[f"{side}_input_ids"])))}
            for side in ("chosen", "rejected")
            for ex in examples
        ]  # fmt: skip
        return collate(rows, pad_id)

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pairs."""
        return torch.tensor(batch["input_ids"].shape[0] // 2)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor):
        from liger_kernels.preference import preference_loss

        o = self.options
        reference = None
        if self.objective in NEEDS_REFERENCE:
            with torch.no_grad(), reference_mode(model):
                reference = sequence_logprobs(model, batch)[0]
        logp, count = sequence_logprobs(model, batch)
        n = logp.shape[0] // 2
        ref = (reference[:n], reference[n:]) if reference is not None else (None, None)
        per_pair, metrics = preference_loss(
            self.objective, logp[:n], logp[n:], count[:n], count[n:], *ref,
            beta=o.beta, loss_type=o.loss_type, label_smoothing=o.label_smoothing,
            gamma=o.gamma if self.objective == "simpo" else 0.0, sft_weight=o.sft_weight,
        )  # fmt: skip
        divide = num_items.to(per_pair.device, per_pair.dtype)
        return per_pair.sum() / divide, {name: v.float().sum() / divide for name, v in metrics.items()}

    def start_note(self, first: dict[str, float]) -> str | None:
        """DPO starts from policy == reference (the adapter's B is zero): every reward 0 and, for the
        sigmoid and robust losses, the loss ln 2. Said either way, so a wrong start is never silent."""
        if self.objective != "dpo":
            return None
        drift = max(abs(first["rewards/chosen"]), abs(first["rewards/rejected"]))
        expected = {
            "sigmoid": math.log(2),
            "robust": math.log(2),
            "hinge": 1.0,
            "ipo": (1 / (2 * self.options.beta)) ** 2,
        }
        if drift < 1e-4:
            return (
                f"start check: step 1 has policy == reference (rewards 0, loss {first['loss']:.4f}; "
                f"{self.options.loss_type} at zero margin: {expected[self.options.loss_type]:.4f})"
            )
        return (
            f"start check: step 1 rewards are {first['rewards/chosen']:.4g} (chosen) and "
            f"{first['rewards/rejected']:.4g} (rejected), not 0, and the loss {first['loss']:.4f}, not "
            f"{expected[self.options.loss_type]:.4f}: the policy differs from its reference at the start "
            "(an adapter initialised away from zero, or dropout outside the adapter?)"
        )


def sequence_logprobs(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of the learned tokens, their count) of every row, through the model's
    own forward with its loss_function swapped for the call."""
    from liger_kernels import sequence_logprobs_loss

    causal_lm = find_causal_lm(model)
    saved = causal_lm.__dict__.get("_loss_function")
    causal_lm.loss_function = sequence_logprobs_loss
    try:
        output = model(**batch, **_no_router_loss(causal_lm))
    finally:
        if saved is None:
            causal_lm.__dict__.pop("_loss_function", None)
        else:
            causal_lm.__dict__["_loss_function"] = saved
    stacked = output.loss
    if stacked is None or stacked.dim() != 2 or stacked.shape[1] != batch["input_ids"].shape[0]:
        raise RuntimeError(
            f"{type(causal_lm).__name__}.forward changed what its loss_function returned (an auxiliary loss "
            "added to it?): the preference objectives need the per-sequence log-probabilities untouched"
        )
    return stacked[0], stacked[1]


def find_causal_lm(model: nn.Module) -> nn.Module:
    """The causal-LM module inside whatever wraps it (DDP, FSDP, a DeepSpeed engine, peft)."""
    for module in model.modules():
        if "lm_head" in module._modules and hasattr(type(module), "loss_function"):
            return module
    raise RuntimeError(f"no causal-LM module with an lm_head inside {type(model).__name__}")


def _no_router_loss(causal_lm: nn.Module) -> dict:
    """Mixture-of-experts models add a router loss to their loss: not to per-sequence log-probs."""
    import inspect

    accepts = "output_router_logits" in inspect.signature(type(causal_lm).forward).parameters
    return {"output_router_logits": False} if accepts else {}


@contextlib.contextmanager
def reference_mode(model: nn.Module):
    """The model with its adapter disabled; requires_grad and training flags exactly as before after."""
    peft_model = next(
        (m for m in model.modules() if hasattr(m, "disable_adapter") and hasattr(m, "peft_config")), None
    )
    if peft_model is None:
        raise RuntimeError("a reference without a copy needs an adapter to disable")
    trainable = [(p, p.requires_grad) for p in model.parameters()]
    training = [(m, m.training) for m in model.modules()]
    try:
        with peft_model.disable_adapter():
            yield
    finally:
        for p, flag in trainable:
            p.requires_grad_(flag)
        for m, flag in training:
            m.training = flag
