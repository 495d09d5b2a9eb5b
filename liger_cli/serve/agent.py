"""`--tools` and `--environment` for `liger generate` and `liger chat`: the trained agent talks to its
tools exactly as training let it (liger_cli.generate.episodes): the prompt rendered with the tools'
schemas, each model turn's ids as sampled, the tool results appended as the chat template renders them,
tool calls parsed and run the same way, mistakes returned to the model as results. The template is
probed first, as a run probes it; one that is not append-only is re-rendered each turn, as training did.
The tools run in processes of their own with the recipe defaults of `rl.tool_workers`, `rl.tool_timeout`
and `rl.tool_memory_mb`, as a run's do.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from liger_cli.data.tools import ToolSet, check_template_takes_tools, load_tools
from liger_cli.errors import UserError
from liger_cli.generate.engine import Sampling, generate
from liger_cli.generate.episodes import Segment, Trajectory, TurnRenderer, probe, run_episodes
from liger_cli.generate.tool_pool import ToolPool
from liger_cli.recipe.rl_section import RLSection


def load_cli_tools(tools: list[str] | None, environment: str | None, tokenizer, fmt: str) -> ToolSet | None:
    """The tools named on the command line (`FILE.py:name`, relative to the current folder, or
    `package.module:name`), checked against the model's chat template; None without any."""
    if not tools and not environment:
        return None
    if tools and environment:
        raise UserError("--tools and --environment: give one (an environment's methods are its tools)")
    templated = bool(getattr(tokenizer, "chat_template", None))
    if fmt not in ("chat", "preference", "prompt") or not templated:
        raise UserError(
            f"--tools needs a model whose chat template describes tools (this one: format {fmt}"
            f"{'' if templated else ', no chat template'}): a chat or agentic RL run"
        )
    spec = lambda s: _resolved(s, "--environment" if environment else "--tools")  # noqa: E731
    found = load_tools(
        SimpleNamespace(tools=[spec(s) for s in tools or []], environment=environment and spec(environment))
    )
    check_template_takes_tools(tokenizer, found.schemas)
    return found


def _resolved(value: str, option: str) -> str:
    where, _, name = value.rpartition(":")
    if not where or not name.isidentifier():
        raise UserError(f"{option} {value!r}: write FILE.py:name or package.module:name")
    return f"{Path(where).resolve()}:{name}" if where.endswith(".py") else value


def conversation(renderer, row: dict) -> list[dict]:
    """A prompt row's messages; with tools a string prompt is one user message, as training rendered it."""
    messages = renderer.messages(row)
    if messages is not None:
        return messages
    if not isinstance(row.get("prompt"), str):
        raise UserError('with --tools, give {"prompt": "text"} or {"messages": [...]} rows')
    return [{"role": "user", "content": row["prompt"]}]


class ToolSession:
    """Episodes of one model with its tools: a renderer, the probe's verdict, the sampling."""

    def __init__(
        self, model, tokenizer, tools: ToolSet, sampling: Sampling, stops, device, max_turns: int, limit
    ):
        self.model, self.tokenizer, self.tools, self.sampling = model, tokenizer, tools, sampling
        self.device, self.max_turns, self.limit = device, max_turns, limit or 1 << 30
        self.renderer = TurnRenderer(tokenizer, tools.schemas, stops)
        self.per_turn_why = probe(self.renderer)
        defaults = {k: f.default for k, f in RLSection.model_fields.items()}  # as a run's processes run them
        self.pool = ToolPool(
            tools, defaults["tool_workers"], defaults["tool_timeout"], defaults["tool_memory_mb"]
        )

    def start(self, messages: list[dict], key, fields: dict, row: int) -> Trajectory:
        handle = self.pool.open(fields, row)
        prompt = self.renderer.encode(messages, generation_prompt=True)
        return Trajectory(str(key), list(messages), [Segment(prompt)], handle)

    def end(self, trajectories: list[Trajectory]) -> None:
        """Their tools are done with (an environment dropped in its process)."""
        self.pool.close([t.handle for t in trajectories])

    def run(self, trajectories: list[Trajectory]) -> None:
        def sample(prompts, keys, n):
            return generate(
                self.model, prompts, replace(self.sampling, max_new_tokens=n), stop_ids=sorted(self.renderer.stops),
                pad_id=self.tokenizer.pad_token_id, keys=keys, device=self.device,
            )  # fmt: skip

        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        run_episodes(
            trajectories, sample, lambda local: local, self.renderer, append=self.per_turn_why is None,
            max_turns=self.max_turns, max_new_tokens=self.sampling.max_new_tokens, max_seq_len=self.limit,
            tools=self.pool, decode=decode,
        )  # fmt: skip


def trajectory_fields(t: Trajectory) -> dict:
    """What `liger generate` writes of a trajectory: the last model turn's text, every id after the prompt
    with its mask (1 sampled, 0 the environment's), the conversation, turns, calls and why it ended."""
    first = t.segments[0]
    return {"completion": str(t.messages[-1].get("content") or ""), "completion_ids": first.ids,
            "completion_mask": first.mask, "messages": t.messages, "turns": t.turns, "tool_calls": t.tool_calls,
            "tool_errors": t.tool_errors, "finish_reason": t.finish_reason}  # fmt: skip
