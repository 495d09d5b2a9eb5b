"""The recipe's `reward` section (`training.objective: reward`: a reward model on preference pairs) and what
such a recipe cannot ask for yet."""

from __future__ import annotations

from pydantic import Field

from liger_cli.recipe.base import _Section


class RewardSection(_Section):
    """training.objective reward only: the Bradley-Terry loss's options."""

    margin_field: str | None = None
    """A numeric column of the pairs: the score gap the chosen answer must clear (per pair)."""
    center_coefficient: float = Field(0.0, ge=0)
    """Adds this times (r_chosen + r_rejected)^2 per pair: keeps the scores centred on 0."""


REFUSED = {
    "preference": "its options are dpo, simpo and orpo's; a reward model has the reward section",
    "adapter.init": "a causal-LM adapter has no score head; train the reward model's own adapter",
    "model.quantize": "a 4-bit reward model is not supported yet",
    "training.eval_samples": "a reward model scores, it does not generate; eval logs accuracy",
}


def check_reward(recipe) -> None:
    """A reward model trains a score head on text pairs; what it cannot do yet is refused (the Recipe's
    validator calls this); the reward section goes with it only."""
    if recipe.reward is not None and recipe.training.objective != "reward":
        raise ValueError("the reward section applies to training.objective reward; remove it")
    if recipe.training.objective != "reward":
        return
    found = {
        "preference": "preference" in recipe.model_fields_set,
        "adapter.init": recipe.adapter.init is not None,
        "model.quantize": recipe.model.quantize != "none",
        "training.eval_samples": bool(recipe.training.eval_samples),
    }
    for key, why in REFUSED.items():
        if found[key]:
            raise ValueError(f"{key} does not apply to training.objective reward ({why}); remove it")
