"""Supervised fine-tuning: the model's own causal-LM loss, a mean over the tokens whose label is set.

The rule itself (what a unit is, how a micro-batch's loss is divided) lives in
`liger_cli.model.loss`, where the twin's accumulation check proves it on the user's model.
"""

from __future__ import annotations

import torch

from liger_cli.data import collate
from liger_cli.model import loss as rule


class CausalLM:
    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        return collate(examples, pad_id)

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Label tokens: position t predicts label t + 1, so the first label is never a target."""
        return rule.label_units(batch)

    def loss(self, model, batch: dict[str, torch.Tensor], num_items: torch.Tensor):
        """transformers sums the token losses and divides by `num_items_in_batch` (the fused loss too)."""
        return rule.causal_lm_loss(model, batch, num_items), {}

    def start_note(self, first: dict[str, float]) -> str | None:
        return None
