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
parameter's `requires_grad` and every module's training flag are restored exactly afterwards. With
full fine-tuning there is no adapter to disable: the reference is the model before its first step,
its log-probs computed once for every pair (`prepare`; the run computes, stores and reads them back)
and looked up by each pair's row (`PAIR_INDEX`, carried by the batch, never passed to the model).
The twin's checks, which run no `prepare`, take the untrained twin itself as its reference.
SimPO and ORPO need no reference. The formulas are `liger_kernels.preference` (one line each, in
docs/objectives.md); the loss is a sum over pairs divided by the step's pair count, like every objective.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from liger_cli.data.encode import collate_pairs

NEEDS_REFERENCE = ("dpo",)
PAIR_INDEX = "pair"
"""A pair's row in the run's reference table, in examples and batches (only when the run has a table)."""


class Preference:
    unit = "pair"

    def __init__(self, objective: str, options, adapter: bool = True):
        self.objective = objective
        self.options = options
        self.adapter = adapter
        self.reference: torch.Tensor | None = None
        """[pairs, 2] (chosen, rejected) reference log-probs, when precomputed (full fine-tuning)."""
        self.split = None
        """The run's sequence parallelism (`liger_cli.run.sequence_parallel`, set by the run), or None:
        each process then holds a part of every row, and a row's log-prob sums are added over its
        group (`split.sum_over_group`) before the loss, which is then the same on each of them."""

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """2B rows, chosen then rejected, padded together (one forward for both answers)."""
        batch = collate_pairs(examples, pad_id)
        if PAIR_INDEX in examples[0]:
            batch[PAIR_INDEX] = torch.tensor([ex[PAIR_INDEX] for ex in examples])
        return batch

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pairs."""
        return torch.tensor(batch["input_ids"].shape[0] // 2)

    def prepare(self, precompute) -> None:
        """DPO without an adapter: the reference is the model before training, so its log-probs are
        `precompute`d for every pair once (the run's table; read back on resume)."""
        if self.objective in NEEDS_REFERENCE and not self.adapter:
            self.reference = precompute(self.reference_logps)

    def reference_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, 2]: each pair's (chosen, rejected) log-probs under no_grad in eval mode (dropout off);
        every flag as it was afterwards."""
        with torch.no_grad(), kept_flags(model):
            model.eval()
            logp = self._whole(sequence_logprobs(model, batch))[0].float()
        n = logp.shape[0] // 2
        return torch.stack([logp[:n], logp[n:]], dim=1)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor):
        from liger_kernels.preference import preference_loss

        o = self.options
        ref = self._reference(model, batch) if self.objective in NEEDS_REFERENCE else (None, None)
        logp, count = self._whole(sequence_logprobs(model, batch))
        n = logp.shape[0] // 2
        per_pair, metrics = preference_loss(
            self.objective, logp[:n], logp[n:], count[:n], count[n:], *ref,
            beta=o.beta, loss_type=o.loss_type, label_smoothing=o.label_smoothing,
            gamma=o.gamma if self.objective == "simpo" else 0.0, sft_weight=o.sft_weight,
        )  # fmt: skip
        divide = num_items.to(per_pair.device, per_pair.dtype)
        return per_pair.sum() / divide, {name: v.float().sum() / divide for name, v in metrics.items()}

    def _reference(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probs: the table's rows, the model with its adapter
        disabled, or (a twin, no table) the untrained model itself."""
        if self.reference is not None or PAIR_INDEX in batch:
            if self.reference is None or PAIR_INDEX not in batch:
                raise RuntimeError(
                    "a precomputed reference needs both the table (`prepare`) and each pair's row"
                )
            rows = self.reference.to(batch[PAIR_INDEX].device)[batch[PAIR_INDEX]]
            return rows[:, 0], rows[:, 1]
        if self.adapter:
            with torch.no_grad(), reference_mode(model):
                logp = self._whole(sequence_logprobs(model, batch))[0]
            n = logp.shape[0] // 2
            return logp[:n], logp[n:]
        rows = self.reference_logps(model, batch)
        return rows[:, 0], rows[:, 1]

    def _whole(self, sums: torch.Tensor) -> torch.Tensor:
        return self.split.sum_over_group(sums) if self.split else sums

    def start_note(self, first: dict[str, float]) -> str | None:
        """DPO starts from policy == reference (the adapter's B is zero; without an adapter the
        reference is the untrained model itself): every reward 0 and, for the
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
            + (
                "(an adapter initialised away from zero, or dropout outside the adapter?)"
                if self.adapter
                else "(dropout in the model? its reference log-probs were computed without it)"
            )
        )


def sequence_logprobs(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, rows]: (summed log-probability of the learned tokens, their count) of every row, through the
    model's own forward with its loss_function swapped for the call."""
    from liger_kernels import sequence_logprobs_loss

    causal_lm = find_causal_lm(model)
    with loss_function_swapped(causal_lm, sequence_logprobs_loss):
        inputs = {k: v for k, v in batch.items() if k != PAIR_INDEX}
        output = model(**inputs, **_no_router_loss(causal_lm))
    stacked = output.loss
    if stacked is None or stacked.dim() != 2 or stacked.shape[1] != batch["input_ids"].shape[0]:
        raise RuntimeError(
            f"{type(causal_lm).__name__}.forward changed what its loss_function returned (an auxiliary loss "
            "added to it?): the preference objectives need the per-sequence log-probabilities untouched"
        )
    return stacked


@contextlib.contextmanager
def loss_function_swapped(causal_lm: nn.Module, loss_function):
    """The causal-LM module's `loss_function` replaced for a forward (log-probs instead of a loss), then
    exactly what it was (an instance attribute or the class's)."""
    from liger_cli.process_state import entry_set

    # transformers' loss_function setter stores the instance attribute _loss_function
    with entry_set(causal_lm.__dict__, "_loss_function", loss_function):
        yield


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
def kept_flags(model: nn.Module):
    """Every parameter's requires_grad and every module's training flag exactly as before, afterwards."""
    trainable = [(p, p.requires_grad) for p in model.parameters()]
    training = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for p, flag in trainable:
            p.requires_grad_(flag)
        for m, flag in training:
            m.training = flag


@contextlib.contextmanager
def reference_mode(model: nn.Module):
    """The model with its adapter disabled; requires_grad and training flags exactly as before after."""
    peft_model = next(
        (m for m in model.modules() if hasattr(m, "disable_adapter") and hasattr(m, "peft_config")), None
    )
    if peft_model is None:
        raise RuntimeError("a reference without a copy needs an adapter to disable")
    with kept_flags(model), peft_model.disable_adapter():
        yield
