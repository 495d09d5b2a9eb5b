"""Reward models (`training.objective: reward`): one score per sequence, trained on preference pairs.

The model is the family's own sequence-classification class with one label (`model.reward_config`):
its forward scores each row's last non-pad token through a `score` head, the head trained in full
beside a LoRA adapter (peft's SEQ_CLS task: `modules_to_save`) or with the whole model. A micro-batch
holds B pairs as 2B rows, the chosen answers first, then the rejected ones (the rows DPO takes), so
both go through the model in one forward. Per pair, with `r_c`, `r_r` the two scores and `m` the
pair's margin (`reward.margin_field`, else 0), the Bradley-Terry loss

    -log σ(r_c - r_r - m) + center_coefficient · (r_c + r_r)²

summed over the pairs and divided by the step's pair count, like every objective. Its metrics:
`accuracy` (the share of pairs with r_c > r_r), `score_gap` (r_c - r_r), `scores/chosen` and
`scores/rejected`, means over the same pairs (`eval_` ones in evaluation). There is no vocabulary head
and no cross-entropy: the Plan switches the loss kernels off and says why.
"""

from __future__ import annotations

import json
import math

import torch
from torch import nn

from liger_cli.data.encode import collate_pairs
from liger_cli.data.preference import FIELDS_COLUMN as FIELDS
from liger_cli.errors import UserError

MARGIN = "margin"
"""Each pair's margin in a batch (only with `reward.margin_field`); never passed to the model."""
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


class Reward:
    unit = "pair"
    objective = "reward"

    def __init__(self, options=None):
        self.margin_field = getattr(options, "margin_field", None)
        self.center_coefficient = getattr(options, "center_coefficient", 0.0)

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """2B rows, chosen then rejected, padded together; no labels (a score has none), and each pair's
        margin when the recipe names a margin field."""
        batch = {k: v for k, v in collate_pairs(examples, pad_id).items() if k in MODEL_INPUTS}
        if self.margin_field is not None:
            batch[MARGIN] = torch.tensor([self._margin(ex) for ex in examples], dtype=torch.float32)
        return batch

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pairs."""
        return torch.tensor(batch["input_ids"].shape[0] // 2)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor):
        import torch.nn.functional as F

        scores = sequence_scores(model, batch)
        n = scores.shape[0] // 2
        chosen, rejected = scores[:n], scores[n:]
        gap = chosen - rejected
        margin = batch[MARGIN].to(gap) if MARGIN in batch else torch.zeros_like(gap)
        per_pair = -F.logsigmoid(gap - margin)
        if self.center_coefficient:
            per_pair = per_pair + self.center_coefficient * (chosen + rejected) ** 2
        divide = num_items.to(per_pair.device, per_pair.dtype)
        metrics = {"accuracy": (gap > 0).float(), "score_gap": gap, "scores/chosen": chosen,
                   "scores/rejected": rejected}  # fmt: skip
        return per_pair.sum() / divide, {name: v.detach().sum() / divide for name, v in metrics.items()}

    def prepare(self, precompute) -> None:
        return None

    def start_note(self, first: dict[str, float]) -> str | None:
        return None

    def check_data(self, dataset, split: str) -> None:
        """Every pair has a finite number in `reward.margin_field` (checked before the first step)."""
        if self.margin_field is None or dataset is None:
            return
        for k in range(len(dataset)):
            self._margin(dataset[k], f"{split} pair {k + 1}")

    def _margin(self, example: dict, where: str = "a pair") -> float:
        if FIELDS not in example:  # a twin check's pairs (made, not read): no data, no margin
            return 0.0
        value = json.loads(example[FIELDS] or "{}").get(self.margin_field)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise UserError(
                f"reward.margin_field {self.margin_field}: {where} has {value!r} there, not a finite number; "
                f"give every pair a numeric {self.margin_field!r} field, or remove reward.margin_field"
            )
        return float(value)


def sequence_scores(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows] fp32: each row's score, the sequence-classification forward's own (the last non-pad token's)."""
    output = model(**{k: v for k, v in batch.items() if k in MODEL_INPUTS})
    logits = output.logits
    if logits.dim() != 2 or logits.shape[1] != 1:
        raise RuntimeError(
            f"a reward model gives one score per sequence, and {type(model).__name__} gave logits of shape "
            f"{tuple(logits.shape)}"
        )
    return logits[:, 0].float()
