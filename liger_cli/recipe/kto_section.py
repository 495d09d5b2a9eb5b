"""The recipe's `kto` section (`training.objective: kto` on `data.format: unpaired`) and what KTO needs
of the rest of the recipe; the math is in docs/objectives.md and liger_cli/model/objectives/kto.py."""

from __future__ import annotations

from pydantic import Field

from liger_cli.recipe.base import _Section


class KtoSection(_Section):
    """KTO's options (training.objective kto only)."""

    beta: float = Field(0.1, gt=0)
    """The reward scale: a completion's reward is beta x (its log-prob under the model - under the reference)."""
    desirable_weight: float = Field(1.0, gt=0)
    """The weight of each desirable (label true) completion's loss."""
    undesirable_weight: float = Field(1.0, gt=0)
    """The weight of each undesirable (label false) completion's loss."""


def check_kto(recipe) -> None:
    """KTO trains on unpaired completions, with its own section (never the preference one), and the kto
    section goes with KTO only (the Recipe's validator calls this)."""
    objective = recipe.training.objective
    if objective != "kto" and "kto" in recipe.model_fields_set:
        raise ValueError(f"the kto section applies to training.objective kto, not {objective}; remove it")
    if objective != "kto":
        raise ValueError(
            "data.format unpaired (completions labelled true or false) goes with training.objective kto: "
            "set it, or use data.format preference with dpo, simpo or orpo"
        )
    if recipe.data.format != "unpaired":
        raise ValueError(
            "training.objective kto trains on completions labelled true or false: set data.format: unpaired "
            '(rows {"prompt": ..., "completion": ..., "label": true})'
        )
    if "preference" in recipe.model_fields_set:
        raise ValueError(
            "the preference section applies to dpo, simpo and orpo; kto's options are the kto section "
            "(beta, desirable_weight, undesirable_weight): move them there"
        )
    if recipe.training.eval_samples:
        raise ValueError(
            "training.eval_samples compares greedy completions with a reference answer, and an unpaired "
            "row's completion may be an undesirable one: remove training.eval_samples"
        )
