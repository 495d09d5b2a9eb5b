"""The causal-LM loss as a run computes it, in one place: the run's objective
(`liger_cli.run.objectives.causal_lm`) and the twin's accumulation check (`liger_cli.twin`) both call
these two functions, so the check proves the rule the run trains with.

A micro-batch's loss is the sum of its token losses divided by the step's global count of label
tokens (`num_items`, summed over every micro-batch and process of the optimizer step): the model's
own `num_items_in_batch` path (transformers' `ForCausalLMLoss`, and our fused loss the same way).
Added over micro-batches and processes, that is the mean over the step's label tokens, whatever
the split.
"""

from __future__ import annotations

import torch

from liger_cli.data.encode import IGNORE_INDEX


def label_units(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Label tokens of a batch: position t predicts label t + 1, so the first label is never a target."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def causal_lm_loss(model, batch: dict[str, torch.Tensor], num_items: torch.Tensor) -> torch.Tensor:
    """The batch's token losses summed, divided by `num_items` (the model sums, then divides by it)."""
    return model(**batch, num_items_in_batch=num_items).loss
