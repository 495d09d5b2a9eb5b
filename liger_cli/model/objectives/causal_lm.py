"""Supervised fine-tuning: the model's own causal-LM loss, a mean over the tokens whose label is set.

A micro-batch's loss is the sum of its token losses divided by the step's global count of label
tokens (`num_items`, summed over every micro-batch and process of the optimizer step): the model's
own `num_items_in_batch` path (transformers' `ForCausalLMLoss`, and our fused loss the same way).
Added over micro-batches and processes, that is the mean over the step's label tokens, whatever the
split; the twin's accumulation check (`liger_cli.twin.pipeline_check`) proves it on the user's model
through these same functions. Every key of the batch goes to the forward as a keyword: a
vision-language model's `pixel_values`, `image_grid_thw`, ... reach its `ForConditionalGeneration`
forward, whose loss (ours, fused, or transformers') takes the same `num_items_in_batch`.
"""

from __future__ import annotations

import torch

from liger_cli.data.encode import IGNORE_INDEX, collate


def label_units(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Label tokens of a batch: position t predicts label t + 1, so the first label is never a target
    (a sequence-parallel shard carries its targets already shifted, `shift_labels`)."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def causal_lm_loss(model, batch: dict[str, torch.Tensor], num_items: torch.Tensor) -> torch.Tensor:
    """The batch's token losses summed, divided by `num_items` (the model sums, then divides by it)."""
    return model(**batch, num_items_in_batch=num_items).loss


class CausalLM:
    unit = "label token"

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        return collate(examples, pad_id)

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return label_units(batch)

    def loss(self, model, batch: dict[str, torch.Tensor], num_items: torch.Tensor):
        return causal_lm_loss(model, batch, num_items), {}

    def prepare(self, precompute) -> None:
        return None

    def start_note(self, first: dict[str, float]) -> str | None:
        return None
