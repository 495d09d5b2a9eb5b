"""The recipe's reward functions, loaded and called in one place; each of their failures is a user error.

`rl.rewards: [{function: SPEC, weight: W}]`, SPEC a `file.py:name` (anchored at the recipe's folder)
or an importable `package.module:name`. The contract is `liger_cli.rewards`' docstring: keyword
arguments `completions`, `prompts`, `completion_ids` and every other field of the prompt rows (one
value per completion), one float or None per completion back. The reward of a completion is the
weighted sum of its functions' values, a None counting as nothing (and left out of that function's
mean in the metrics).

Anything else is an exit-2 error naming the function, the prompt row and the value: a file or module
that does not import, a missing name, a function that raises, does not return within
`rl.reward_timeout` seconds, returns another number of values, a NaN or infinity, or something that
is not a number. A function runs in a thread of its own so that one that never returns is seen; it
cannot be stopped, so the run stops (its last checkpoint kept) and the thread ends with the process.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from liger_cli.errors import UserError
from liger_cli.user_code import load_object, said


class RewardError(UserError):
    """A reward function that cannot be loaded or that broke its contract."""


@dataclass(frozen=True)
class Reward:
    name: str
    spec: str
    weight: float
    function: object


def load_rewards(specs) -> list[Reward]:
    """Import every `rl.rewards` entry; names are the functions' (a repeated one gets _2, _3), a reward
    model's its run folder's name. A reward model's weights load at its first call (`ModelReward`)."""
    rewards: list[Reward] = []
    for entry in specs:
        if getattr(entry, "model", None) is not None:
            function = ModelReward(entry.model)
            name, spec = function.final.parent.name, str(function.final.parent)
        else:
            function, name, spec = _load(entry.function), entry.function.rpartition(":")[2], entry.function
        taken = {r.name for r in rewards}
        if name in taken:
            name = next(f"{name}_{k}" for k in range(2, len(taken) + 3) if f"{name}_{k}" not in taken)
        rewards.append(Reward(name, spec, entry.weight, function))
    return rewards


class ModelReward:
    """A trained reward model as a reward function (`rl.rewards: [{model: RUN}]`): each prompt + completion
    rendered with the reward model's own tokenizer and template as its training rendered them, scored in
    batches under no_grad (`liger_cli.model.reward_model`). Loaded once per process, whole on every rank
    (frozen and small), on its first call: planning (`--dry-run`) reads no weights."""

    BATCH = 16

    def __init__(self, path):
        from liger_cli.model.reward_model import check_reward_run

        self.final = check_reward_run(path, "rl.rewards model")
        self.model = None

    def __call__(self, completions: list[str], prompts: list, **kwargs) -> list[float]:
        import torch

        from liger_cli.model.reward_model import RewardModel

        if self.model is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            self.model = RewardModel(self.final, device)
        ids = [self.model.encode(p, c) for p, c in zip(prompts, completions, strict=True)]
        return self.model.scores(ids, self.BATCH)


def _load(spec: str):
    function = load_object(spec, "rl.rewards", RewardError)
    if not callable(function):
        raise RewardError(f"rl.rewards: {spec}: {spec.rpartition(':')[2]} is not a function")
    return function


def score(rewards: list[Reward], completions: list[str], prompts: list, completion_ids: list[list[int]],
          fields: dict[str, list], rows: list[int], extra: dict[str, list] | None = None, *, timeout: float,
          ) -> tuple[list[float], dict[str, list[float | None]]]:  # fmt: skip
    """(each completion's total reward, each function's values); `rows` are the completions' prompt rows
    (in their file), named in errors. `extra`: further keyword arguments, one value per completion (a
    multi-turn run's `messages` and `environment`); `timeout`: seconds each call may take."""
    per_function: dict[str, list[float | None]] = {}
    for reward in rewards:
        kwargs = {"completions": completions, "prompts": prompts, "completion_ids": completion_ids, **fields,
                  **(extra or {})}  # fmt: skip
        try:
            values = _within(timeout, reward.function, kwargs)
        except TimeoutError:
            row = _failing_row(reward, kwargs, rows, timeout)
            raise RewardError(
                f"reward {reward.name} ({reward.spec}) did not return within {timeout:g} s (rl.reward_timeout) "
                f"on prompt row {row}: make it return (or raise) sooner, or raise rl.reward_timeout"
            ) from None
        except Exception as err:  # noqa: BLE001 - find the completion it fails on, for the message
            row = _failing_row(reward, kwargs, rows, timeout)
            raise RewardError(
                f"reward {reward.name} ({reward.spec}) raised on prompt row {row}: {said(err)}"
            ) from None
        per_function[reward.name] = _checked(reward, values, len(completions), rows)
    totals = [
        sum(r.weight * per_function[r.name][i] for r in rewards if per_function[r.name][i] is not None)
        for i in range(len(completions))
    ]
    return totals, per_function


def _checked(reward: Reward, values, n: int, rows: list[int]) -> list[float | None]:
    where = f"reward {reward.name} ({reward.spec})"
    if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
        raise RewardError(f"{where} returned {type(values).__name__}, not a list of {n} numbers")
    values = list(values)
    if len(values) != n:
        raise RewardError(
            f"{where} returned {len(values)} values for {n} completions: return one per completion"
        )
    out: list[float | None] = []
    for value, row in zip(values, rows, strict=True):
        if value is None:
            out.append(None)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardError(f"{where} returned {value!r} for prompt row {row}: return a float or None")
        if not math.isfinite(float(value)):
            raise RewardError(
                f"{where} returned {float(value)} for prompt row {row}: return a finite float or None"
            )
        out.append(float(value))
    return out


def _within(timeout: float, function, kwargs: dict):
    """function(**kwargs), or TimeoutError after `timeout` seconds (the call goes on in a daemon thread)."""
    import threading

    found: list = []

    def call() -> None:
        try:
            found.append((True, function(**kwargs)))
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            found.append((False, err))

    thread = threading.Thread(target=call, name="liger-reward", daemon=True)
    thread.start()
    thread.join(timeout)
    if not found:
        raise TimeoutError
    returned, value = found[0]
    if not returned:
        raise value
    return value


def _failing_row(reward: Reward, kwargs: dict, rows: list[int], timeout: float):
    """The first prompt row whose completion alone makes the function raise or hang ("?" if none alone
    does)."""
    for i, row in enumerate(rows):
        one = {k: v[i : i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
        try:
            _within(timeout, reward.function, one)
        except Exception:  # noqa: BLE001 - TimeoutError included
            return row
    return "?"
