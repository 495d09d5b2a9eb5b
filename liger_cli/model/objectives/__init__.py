"""What a micro-batch's loss is: the one thing the training loop and evaluation ask of an objective.

An objective makes a batch from examples (`collate`), counts the units its loss is a mean over
(`units`: label tokens for the causal-LM loss), and returns a micro-batch's loss as a sum over its
units divided by the step's global count of units (`loss`), so neither gradient accumulation nor
the number of processes changes the math. Beside the loss it may return its own metrics, summed
over the same units and divided the same way (`stats`); the loop sums them over micro-batches and
ranks, which gives their means, and logs them. `fit` and `evaluate` call nothing else (and
`start_note` once, after a fresh run's first step); set-up calls `prepare` once before `fit`, with
the run's way to compute per-example values from the untrained model (DPO's reference log-probs
without an adapter). A new objective is a new file here and one line in `objective_for`. The objectives sit in the model stage so that the twin's checks (kernels,
accumulation) run the very loss the run trains with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from liger_cli.model.objectives.causal_lm import CausalLM
from liger_cli.model.objectives.preference import PAIR_INDEX, Preference

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from liger_cli.recipe import Recipe


__all__ = ["PAIR_INDEX", "CausalLM", "Objective", "Preference", "objective_for"]


class Objective(Protocol):
    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """One padded batch of tensors from a list of examples."""

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """How many units (tokens, pairs) of the loss's mean this batch holds: a 0-d integer tensor."""

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's loss summed over its units, divided by `num_items`; its metrics the same way."""

    def prepare(self, precompute: Callable[[Callable], torch.Tensor]) -> None:
        """Once before `fit`: `precompute(values)` gives `values(model, batch)` ([B, k] per example) for
        every train then eval example, from the model before its first step (stored; read on resume)."""

    def start_note(self, first: dict[str, float]) -> str | None:
        """A line for the run log about a fresh run's first step (its loss and metrics), or None."""


def objective_for(recipe: Recipe) -> Objective:
    """The recipe's `training.objective`: sft (the causal-LM loss over label tokens), a preference
    objective (a loss per pair: dpo, simpo, orpo), grpo (online RL; its reward functions are
    imported here, so a broken one stops the run before the model is built) or distill (online: the
    student's samples, a divergence to a frozen teacher per token)."""
    objective = recipe.training.objective
    if objective == "sft":
        return CausalLM()
    if objective == "grpo":  # online: its batches are sampled during the run (grpo.py)
        from liger_cli.model.objectives.grpo import Grpo
        from liger_cli.model.objectives.rewards import load_rewards

        return Grpo(
            recipe.rl, load_rewards(recipe.rl.rewards), recipe.training.seed, recipe.adapter.type != "none"
        )
    if objective == "distill":  # online too (distill.py); its teacher loads before the first step
        from liger_cli.model.objectives.distill import Distill

        return Distill(recipe)
    return Preference(objective, recipe.preference, adapter=recipe.adapter.type != "none")
