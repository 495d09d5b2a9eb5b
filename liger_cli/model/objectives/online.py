"""What every online objective (grpo, distill) shares: its batches are sampled during the run.

There is one rollout path. The run hands an online objective its sampler (`liger_cli.run.online.Sampler`:
the engine behind one interface, single turns or episodes with tools), and the objective reads its
trajectories from it through `group`: G of each prompt row, keyed (step, prompt row, index), so that a
completion depends on the seed, the step, its prompt and its index only, never on how the prompts are
spread over micro-batches and processes. `rollout_row` is the part of a `rollouts.jsonl` row every
online objective writes. The run asks once whether its objective is one (`isinstance(objective, Online)`).
"""

from __future__ import annotations

import json

import torch
from torch import nn

from liger_cli.data.encode import IGNORE_INDEX, collate
from liger_cli.model.objectives.preference import find_causal_lm, loss_function_swapped

ROLLOUTS_FILE = "rollouts.jsonl"
"""Every sampled trajectory of the run, one JSON row each (written by the main process)."""


class Online:
    """The base of grpo and distill: the rollout's shared steps and the loop's questions they answer alike."""

    def __init__(self, rl):
        self.rl = rl
        self.step_stats: dict[str, float] = {}
        """The last rollout's metrics (means over every completion of the step, all processes)."""
        self.samples: list[dict] = []
        """The last rollout's rows for rollouts.jsonl (this process's completions)."""

    def data_step(self, step: int) -> int:
        """Which step's prompts serve optimizer step `step` (grpo: each batch serves num_iterations)."""
        return step

    def group(self, data_step: int, prompts: list[dict], sample) -> tuple[list[dict], list]:
        """rl.num_generations trajectories of each prompt row: the rows (each repeated G times) and their
        trajectories, keyed (data_step, prompt row, index)."""
        g = self.rl.num_generations
        rows = [p for p in prompts for _ in range(g)]
        keys = [f"{data_step}:{p['row']}:{k}" for p in prompts for k in range(g)]
        return rows, sample.trajectories(rows, keys)

    @staticmethod
    def rollout_row(row: dict, t, text: str) -> dict:
        """The rollouts.jsonl fields of a trajectory `t` that every online objective writes: the prompt as
        written and its ids; the completion's text, ids (sampled and the environment's), which were
        sampled, their sampler log-probs; the conversation, its turns and tool calls; why it ended; the
        policy version that sampled it (its oldest turn's) and its sampling key (with training.seed, all
        of its randomness: `liger_cli.generate.engine.sequence_seed`)."""
        first = t.segments[0]
        return {"prompt": json.loads(row["prompt"]), "prompt_ids": first.prompt_ids, "completion": text,
                "completion_ids": first.ids, "completion_mask": first.mask, "sampler_logprobs": first.logprobs,
                "messages": t.messages, "turns": t.turns, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
                "tool_timeouts": t.tool_timeouts, "tool_crashes": t.tool_crashes,
                "finish_reason": t.finish_reason,
                "policy_version": min((v for v in t.versions if v is not None), default=None),
                "key": t.key}  # fmt: skip

    def collate(self, examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
        """The prompts alone as a batch (the final check's probe); training batches come from rollout."""
        features = [{"input_ids": e["prompt_ids"], "labels": e["prompt_ids"],
                     "position_ids": list(range(len(e["prompt_ids"])))} for e in examples]  # fmt: skip
        return collate(features, pad_id)

    def prepare(self, precompute) -> None:
        return None

    def start_note(self, first: dict[str, float]) -> str | None:
        return None

    @staticmethod
    def random_rows(vocab: int, rows: int, g: torch.Generator) -> list[tuple[list[int], list[int]]]:
        """(prompt, completion) ids below `vocab` of different lengths, for the twin's rollout batches."""
        return [
            (torch.randint(3, vocab, (3 + i % 3,), generator=g).tolist(),
             torch.randint(3, vocab, (2 + (i * 5) % 7,), generator=g).tolist())
            for i in range(rows)
        ]  # fmt: skip


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Labels moved one position left: position t holds the label of token t + 1 (what t predicts)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def token_logprobs(model: nn.Module, batch: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position t, the log-prob of token t + 1 at `temperature` and whether it is a completion token,
    through the model's own forward with its loss_function swapped for the call (fused when our loss
    kernel is patched in)."""
    from liger_kernels import token_logprobs_loss

    causal_lm = find_causal_lm(model)
    names = (
        "input_ids",
        "labels",
        "attention_mask",
        "position_ids",
        "shift_labels",
    )  # shift_labels: a split's
    with loss_function_swapped(causal_lm, token_logprobs_loss(temperature)):
        output = model(**{k: batch[k] for k in names if k in batch})
    stacked = output.loss
    if stacked is None or stacked.dim() != 3 or stacked.shape[1:] != batch["input_ids"].shape:
        raise RuntimeError(
            f"{type(causal_lm).__name__}.forward changed what its loss_function returned: online objectives need the "
            "per-token log-probabilities untouched"
        )
    return stacked[0], stacked[1] > 0


def aligned(values: list[list[float]], prompt_lengths: list[int], batch: dict) -> torch.Tensor:
    """Per-token values of the completions at the positions that predict them (t predicts t + 1)."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for row, (v, n) in enumerate(zip(values, prompt_lengths, strict=True)):
        out[row, n - 1 : n - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out
