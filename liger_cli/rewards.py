"""Reward functions that ship with liger, for `rl.rewards` (`{function: liger_cli.rewards:exact_match}`).

The contract every reward function keeps (yours too): it is called with keyword arguments,
`f(completions=list[str], prompts=list, completion_ids=list[list[int]], **fields)`, where `fields`
are the prompt rows' other columns, one value per completion (a row's `answer` arrives as
`answer=[...]`); it returns one `float` (or `None`: not applicable, left out of that function's mean)
per completion. Accept `**kwargs` to ignore the fields you do not use.
"""

from __future__ import annotations


def exact_match(completions: list[str], answer: list, **kwargs) -> list[float]:
    """1.0 where the stripped completion equals the row's `answer` (stripped), else 0.0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]
