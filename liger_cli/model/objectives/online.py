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

from liger_cli.data.encode import IGNORE_INDEX, collate

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
        sampled, their sampler log-probs; the conversation, its turns and tool calls; why it ended."""
        first = t.segments[0]
        return {"prompt": json.loads(row["prompt"]), "prompt_ids": first.prompt_ids, "completion": text,
                "completion_ids": first.ids, "completion_mask": first.mask, "sampler_logprobs": first.logprobs,
                "messages": t.messages, "turns": t.turns, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
                "tool_timeouts": t.tool_timeouts, "tool_crashes": t.tool_crashes,
                "finish_reason": t.finish_reason}  # fmt: skip

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
