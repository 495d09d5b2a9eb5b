"""KTO (Kahneman-Tversky optimisation): a loss per completion, each labelled desirable or undesirable.

With r = log pi(y|x) - log pi_ref(y|x) (summed log-probs of the completion's learned tokens) and z0 the
step's KL estimate, a desirable completion's loss is w_D (1 - sigmoid(beta (r - z0))), an undesirable
one's w_U (1 - sigmoid(beta (z0 - r))); the loss is their sum over the step's completions divided by the
step's completion count, like every objective's.

z0 = max(0, mean over mismatched pairs of log pi(y_j|x_i) - log pi_ref(y_j|x_i)), detached. The
mismatched pair of each example (its prompt, another example's completion) is fixed by the data stage
(liger_cli.data.unpaired: a seeded partner), and `begin_step` computes z0 once per optimizer step, under
no_grad, from every micro-batch of the step on every process (a sum and a count, all-reduced) before
the step's first loss. So z0 is a function of the step's whole global batch: neither accumulation nor
the number of processes changes it. Evaluation computes it the same way over the whole eval set.

The reference is DPO's (liger_cli.model.objectives.preference): the adapter disabled under no_grad, or
with full fine-tuning a table of the untrained model's log-probs of every example and its mismatched
sequence, computed once (`prepare`). Metrics: rewards (beta r) of the desirable and the undesirable
completions as means over each kind in the step, their difference, and kl (z0).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from liger_cli.data.encode import collate
from liger_cli.model.objectives.preference import (
    PAIR_INDEX,
    kept_flags,
    reference_mode,
    sequence_logprobs,
)

LABEL = "label"
KL = "kl_"
"""The prefix of a batch's mismatched sequences (each prompt with another example's completion)."""
MODEL_INPUTS = ("input_ids", "labels", "position_ids", "attention_mask")


class Kto:
    unit = "completion"
    objective = "kto"

    def __init__(self, options, adapter: bool = True):
        self.options = options
        self.adapter = adapter
        self.reference: torch.Tensor | None = None
        """[examples, 2] reference log-probs (the completion, its mismatched sequence), when precomputed."""
        self.step: tuple[torch.Tensor, float, float] | None = None
        """(z0, desirable count, undesirable count) of the step (or eval set) `begin_step` last saw."""

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """B rows, their B mismatched rows (`kl_` keys) padded on their own, and each row's label."""
        batch = {}
        for prefix in ("", KL):
            rows = [
                {"input_ids": ex[f"{prefix}input_ids"], "labels": ex[f"{prefix}labels"],
                 "position_ids": list(range(len(ex[f"{prefix}input_ids"])))}
                for ex in examples
            ]  # fmt: skip
            batch |= {prefix + k: v for k, v in collate(rows, pad_id).items()}
        batch[LABEL] = torch.tensor([bool(ex[LABEL]) for ex in examples])
        if PAIR_INDEX in examples[0]:
            batch[PAIR_INDEX] = torch.tensor([ex[PAIR_INDEX] for ex in examples])
        return batch

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Completions."""
        return torch.tensor(batch["input_ids"].shape[0])

    def prepare(self, precompute) -> None:
        """Without an adapter the reference is the model before training: its log-probs of every example
        and its mismatched sequence are `precompute`d once (the run's table; read back on resume)."""
        if not self.adapter:
            self.reference = precompute(self.reference_logps)

    def reference_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, 2]: each example's (completion, mismatched sequence) log-probs under no_grad in eval mode."""
        with torch.no_grad(), kept_flags(model):
            model.eval()
            found = [sequence_logprobs(model, rows_of(batch, prefix))[0].float() for prefix in ("", KL)]
        return torch.stack(found, dim=1)

    def begin_step(self, model: nn.Module, batches: list[dict], device, reduce, counted=None) -> None:
        """z0 and the label counts of a whole step (every micro-batch; `reduce` sums over processes)
        before its first loss. `counted[k]` False: batch k is run (collective forwards) but not counted."""
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        with torch.no_grad():
            for k, batch in enumerate(batches):
                batch = {name: v.to(device) for name, v in batch.items()}
                policy = sequence_logprobs(model, rows_of(batch, KL))[0]
                shift = policy.double() - self._reference(model, batch, KL).double()
                if counted is None or counted[k]:
                    desirable = batch[LABEL].bool()
                    counts = [shift.numel(), desirable.sum().item(), (~desirable).sum().item()]
                    sums += torch.stack([shift.sum(), *(shift.new_tensor(float(n)) for n in counts)])
        sums = reduce(sums)
        z0 = (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()
        self.step = (z0, float(sums[2]), float(sums[3]))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor):
        if self.step is None:
            raise RuntimeError("the kto loss needs begin_step first (the step's KL estimate z0)")
        o, (z0, n_desirable, n_undesirable) = self.options, self.step
        reference = self._reference(model, batch, "")
        logp = sequence_logprobs(model, rows_of(batch, ""))[0]
        r = logp - reference.to(logp.dtype)
        desirable = batch[LABEL].to(r.device).bool()
        z = z0.to(r.device, r.dtype)
        per_row = torch.where(
            desirable,
            o.desirable_weight * (1 - torch.sigmoid(o.beta * (r - z))),
            o.undesirable_weight * (1 - torch.sigmoid(o.beta * (z - r))),
        )
        divide = num_items.to(per_row.device, per_row.dtype)
        # Means over each kind (and z0) as sums that add up over micro-batches and processes: in
        # training `divide` is the step's completion count; evaluation divides by it afterwards.
        scale = (n_desirable + n_undesirable) / divide
        rewards = o.beta * r.detach().float()
        kinds = {
            "rewards/desirable": rewards[desirable].sum() / _or_nan(n_desirable) * scale,
            "rewards/undesirable": rewards[~desirable].sum() / _or_nan(n_undesirable) * scale,
        }
        stats = {
            **kinds,
            "rewards/margins": kinds["rewards/desirable"] - kinds["rewards/undesirable"],
            "kl": z.detach().float() * len(r) / divide,
        }
        return per_row.sum() / divide, stats

    def _reference(self, model: nn.Module, batch: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        """The reference log-probs of the batch's rows (`""`) or mismatched rows (`KL`): the table's, the
        model with its adapter disabled, or (a twin, no table) the untrained model itself."""
        if self.reference is not None or PAIR_INDEX in batch:
            if self.reference is None or PAIR_INDEX not in batch:
                raise RuntimeError(
                    "a precomputed reference needs both the table (`prepare`) and each example's row"
                )
            return self.reference.to(batch[PAIR_INDEX].device)[batch[PAIR_INDEX], int(prefix == KL)]
        if self.adapter:
            with torch.no_grad(), reference_mode(model):
                return sequence_logprobs(model, rows_of(batch, prefix))[0]
        with torch.no_grad(), kept_flags(model):
            model.eval()
            return sequence_logprobs(model, rows_of(batch, prefix))[0]

    def start_note(self, first: dict[str, float]) -> str | None:
        """KTO starts from policy == reference: every reward 0, z0 0, each completion's loss half its
        weight. Said either way, so a wrong start is never silent."""
        if self.step is None:
            return None
        o, (_, n_desirable, n_undesirable) = self.options, self.step
        expected = (o.desirable_weight * n_desirable + o.undesirable_weight * n_undesirable) / (
            2 * max(n_desirable + n_undesirable, 1)
        )
        rewards = [first[k] for k in ("rewards/desirable", "rewards/undesirable") if math.isfinite(first[k])]
        drift = max([abs(v) for v in rewards] + [abs(first["kl"])])
        if drift < 1e-4:
            return (
                f"start check: step 1 has policy == reference (rewards 0, kl 0, loss {first['loss']:.4f}; "
                f"half of each completion's weight: {expected:.4f})"
            )
        return (
            f"start check: step 1 rewards are {first['rewards/desirable']:.4g} (desirable) and "
            f"{first['rewards/undesirable']:.4g} (undesirable) and kl {first['kl']:.4g}, not 0, and the loss "
            f"{first['loss']:.4f}, not {expected:.4f}: the policy differs from its reference at the start "
            + (
                "(an adapter initialised away from zero, or dropout outside the adapter?)"
                if self.adapter
                else "(dropout in the model? its reference log-probs were computed without it)"
            )
        )


def rows_of(batch: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The model inputs of the batch's rows (`""`) or of its mismatched rows (`KL`)."""
    return {k: batch[prefix + k] for k in MODEL_INPUTS if prefix + k in batch}


def _or_nan(count: float) -> float:
    """A mean over no completion (a step without one kind) is NaN, never 0."""
    return count if count > 0 else math.nan
