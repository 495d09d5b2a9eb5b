"""The recipe's `preference` section: the options of the pair objectives (dpo with its loss types,
simpo, orpo), and which objective honours which (an option set for one that ignores it is refused)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from liger_cli.recipe.base import _Section


class PreferenceSection(_Section):
    """The preference objectives' options; each one applies to the objectives its comment names."""

    beta: float = Field(0.1, gt=0)
    """dpo, simpo: the reward scale; orpo: the weight of the odds-ratio term."""
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """dpo only."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """dpo (loss_type sigmoid or robust) and simpo: the assumed share of pairs whose labels are flipped."""
    gamma: float = Field(0.5, ge=0)
    """simpo only: the target reward margin."""
    sft_weight: float = Field(0.0, ge=0)
    """dpo, simpo: add this times the chosen answer's mean NLL (orpo always has it)."""

    def applies(self, objective: str) -> dict[str, bool]:
        """Which options the objective honours."""
        return {
            "loss_type": objective == "dpo",
            "gamma": objective == "simpo",
            "label_smoothing": objective == "simpo"
            or (objective == "dpo" and self.loss_type in ("sigmoid", "robust")),
            "sft_weight": objective in ("dpo", "simpo"),
            "beta": True,
        }

    def check(self, objective: str) -> None:
        """An option the objective cannot honour is an error, never ignored."""
        applies = self.applies(objective)
        for name in sorted(self.model_fields_set):
            if not applies[name] and not (name == "label_smoothing" and self.label_smoothing == 0):
                where = f"training.objective {objective}" + (
                    f" with loss_type {self.loss_type}" if objective == "dpo" else ""
                )
                raise ValueError(f"preference.{name} does not apply to {where}; remove it")
