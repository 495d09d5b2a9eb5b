"""What a micro-batch's loss is: the one thing the training loop and evaluation ask of an objective.

An objective makes a batch from examples (`collate`), counts the units its loss is a mean over
(`units`: label tokens for the causal-LM loss), and returns a micro-batch's loss as a sum over its
units divided by the step's global count of units (`loss`), so neither gradient accumulation nor
the number of processes changes the math. Beside the loss it may return its own metrics, summed
over the same units and divided the same way (`stats`); the loop sums them over micro-batches and
ranks, which gives their means, and logs them. `fit` and `evaluate` call nothing else (and
`start_note` once, after a fresh run's first step, and `begin_step` where an objective has it); set-up
calls `prepare` once before `fit`, with the run's way to compute per-example values from the untrained
model (DPO's and KTO's reference log-probs without an adapter).

`begin_step` (optional) is for a loss that depends on the whole step, not only on its micro-batch:
`fit` calls it once per optimizer step with all of this process's micro-batches of the step before the
first loss, and `evaluate` once with all of its eval batches; the objective runs its no-grad passes over
them and sums what it needs over processes with `reduce` (KTO's KL estimate z0 and label counts), so
the step's math is the same however it is cut into micro-batches and processes. Every process must make
the same forwards (FSDP and ZeRO-3 forwards are collective); `counted` marks evaluation's padding
batches, which are run but not counted. An objective with a `split` attribute (preference, grpo) is
given the run's sequence parallelism, if any, to add a row's sums over the processes holding its parts
(`liger_cli.run.sequence_parallel`). A new objective is a new file here and one line in `objective_for`. The objectives sit in the model stage so that the twin's checks (kernels,
accumulation) run the very loss the run trains with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from liger_cli.model.objectives.causal_lm import CausalLM
from liger_cli.model.objectives.kto import Kto
from liger_cli.model.objectives.preference import PAIR_INDEX, Preference

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from liger_cli.recipe import Recipe


__all__ = ["PAIR_INDEX", "CausalLM", "Kto", "Objective", "Preference", "objective_for"]


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

    # optional: begin_step(model, batches, device, reduce, counted=None) -> None (see the module docstring)


def objective_for(recipe: Recipe) -> Objective:
    """The recipe's `training.objective`: sft (the causal-LM loss over label tokens), a preference
    objective (a loss per pair: dpo, simpo, orpo), a reward model (the Bradley-Terry loss per pair), kto (a loss
    per labelled completion), grpo (online RL; its reward functions are imported here, so a broken one
    stops the run before the model is built) or distill (online: the student's samples, a divergence to
    a frozen teacher per token)."""
    objective = recipe.training.objective
    if objective == "sft":
        return CausalLM()
    if objective == "kto":
        return Kto(recipe.kto, adapter=recipe.adapter.type != "none")
    if objective == "grpo":  # online: its batches are sampled during the run (grpo.py)
        from liger_cli.model.objectives.grpo import Grpo
        from liger_cli.model.objectives.rewards import load_rewards

        return Grpo(
            recipe.rl, load_rewards(recipe.rl.rewards), recipe.training.seed, recipe.adapter.type != "none"
        )
    if objective == "reward":  # a score head on pairs (reward.py)
        from liger_cli.model.objectives.reward import Reward

        return Reward(recipe.reward)
    if objective == "distill":  # online too (distill.py); its teacher loads before the first step
        from liger_cli.model.objectives.distill import Distill

        return Distill(recipe)
    return Preference(objective, recipe.preference, adapter=recipe.adapter.type != "none")
