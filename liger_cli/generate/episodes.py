"""Multi-turn episodes: the model samples, calls tools, reads their results, and samples again, token in
and token out.

A trajectory is token ids, never text re-encoded: its prompt's ids, then each model turn's ids exactly
as sampled, then each environment turn's ids appended (the chat template's rendering of the tool
results and of the next assistant header: the ids that rendering the conversation with the results
adds to rendering it without them, taken after the model turn's end-of-turn token). The sampler's
prompt at turn k is exactly the ids before it; a mask says which ids were sampled (1) and which came
from the environment (0), and only the sampled ones are ever trained on.

That holds when the template is append-only: rendering a longer conversation only adds ids after
those of a shorter one. `probe` checks this before a run starts with a tool round trip (a call, a
result, a second call, an answer, with reasoning). A template that is not (one that drops earlier
reasoning, merges tokens across a turn boundary, or re-renders an assistant turn) is run per turn:
each model turn is its own sample, its prompt the template's rendering of the conversation so far,
exactly what its sampler saw; nothing sampled is re-rendered. Should a conversation break the
property during a run, that trajectory goes on per turn from there.

A trajectory stops at a model turn without tool calls (`stop`), after `max_turns` model turns
(`max_turns`), or when its sample would pass `max_seq_len` or a turn reaches `max_new_tokens`
(`length`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from liger_cli.errors import UserError
from liger_cli.generate.tool_calls import Result, parse_turn
from liger_cli.generate.tool_pool import ToolPool


@dataclass
class Segment:
    """One training sample: the ids a sampler was given, then what followed it."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1: sampled; 0: the environment's."""
    logprobs: list[float] = field(default_factory=list)
    """The sampler's log-prob of each sampled id (whole vocabulary, sampling temperature); 0 elsewhere."""

    def add(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)


@dataclass
class Trajectory:
    key: str
    """The sampling key (each turn's randomness is keyed by it and the turn)."""
    messages: list[dict]
    """The conversation: the prompt's messages, then each model turn and tool result as chat messages."""
    segments: list[Segment]
    handle: int | None = None
    """Its tools in the tool processes (`ToolPool.open`)."""
    environment: object | None = None
    """With rl.environment, its instance as the episode left it (read back for the reward functions)."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_crashes: int = 0
    finish_reason: str | None = None
    """None while running; then stop, max_turns or length."""
    versions: list = field(default_factory=list)
    """Each model turn's policy version (what its Completion says; rl.max_staleness)."""

    @property
    def context(self) -> list[int]:
        last = self.segments[-1]
        return last.prompt_ids + last.ids


class TurnRenderer:
    """The chat template's ids for the parts of a conversation the environment adds."""

    def __init__(self, tokenizer, schemas: list[dict] | None, stop_ids):
        self.tokenizer, self.schemas, self.stops = tokenizer, schemas, set(stop_ids)

    def encode(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        from liger_cli.data.chat import render

        try:
            text = render(self.tokenizer, messages, self.schemas, generation_prompt=generation_prompt)
        except ValueError as err:
            raise UserError(f"rl.tools: the chat template cannot render a tool conversation: {err}") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix(self, ids: list[int]) -> str:
        """The text before a model turn, for a tokenizer whose response schema parses with it."""
        if getattr(self.tokenizer, "response_template", None) is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def environment_ids(self, messages: list[dict], results: list[dict]) -> list[int] | None:
        """The ids after a model turn (the last of `messages`) up to the next assistant header: what the
        template puts after its end-of-turn, the tool results, the header. None when the template does not
        render the conversation with the results as an extension of the one without them."""
        before = self.encode(messages, generation_prompt=False)
        after = self.encode(messages + results, generation_prompt=True)
        if after[: len(before)] != before:
            return None
        ends = [i for i, t in enumerate(before) if t in self.stops]
        if not ends:
            return None
        return before[ends[-1] + 1 :] + after[len(before) :]


def probe(renderer: TurnRenderer) -> str | None:
    """None when the template is append-only over a tool round trip; else why not (the run goes per turn).
    A template that cannot render tool messages at all is a UserError."""
    name = renderer.schemas[0]["function"]["name"] if renderer.schemas else "lookup"
    call = lambda n: {"type": "function", "function": {"name": name, "arguments": {}}, "id": f"call_{n}"}  # noqa: E731
    think = "<think>\nI need the tool.\n</think>\n\n"
    conversation = [
        {"role": "user", "content": "What is in the table for 17?"},
        {"role": "assistant", "content": think, "tool_calls": [call(0)]},
        {"role": "tool", "name": name, "content": "391", "tool_call_id": "call_0"},
        {"role": "assistant", "content": think, "tool_calls": [call(1)]},
        {"role": "tool", "name": name, "content": "seventeen", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "<think>\nDone.\n</think>\n\nIt is 391, seventeen."},
    ]
    ids = renderer.encode(conversation[:1], generation_prompt=True)
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        full = renderer.encode(conversation[: i + 1], generation_prompt=False)
        if full[: len(ids)] != ids:
            return f"rendering assistant turn {i} changes the ids before it (earlier turns are re-rendered)"
        ends = [k for k in range(len(ids), len(full)) if full[k] in renderer.stops]
        if not ends:
            return f"assistant turn {i} does not end with a token generation stops at"
        ids = full[: ends[0] + 1]  # the model's turn as it would sample it, end-of-turn included
        results = [m for m in conversation[i + 1 : i + 2] if m["role"] == "tool"]
        if results:
            added = renderer.environment_ids(conversation[: i + 1], results)
            if added is None:
                return f"the tool result after assistant turn {i} does not render as ids appended to it"
            ids = ids + added
    whole = renderer.encode(conversation, generation_prompt=False)
    if whole[: len(ids)] != ids:
        return "the whole conversation does not render as the appended ids"
    return None


@dataclass
class EpisodeStats:
    sampling_s: float = 0.0
    tools_s: float = 0.0


def run_episodes(
    trajectories: list[Trajectory],
    sample: Callable,
    any_live: Callable[[bool], bool],
    renderer: TurnRenderer,
    *,
    append: bool,
    max_turns: int,
    max_new_tokens: int,
    max_seq_len: int,
    tools: ToolPool,
    decode: Callable[[list[int]], str],
) -> EpisodeStats:
    """Run every trajectory to its end, in place. `sample(prompts, keys, max_new_tokens)` -> Completions;
    `any_live(local)` says whether any process still has a trajectory running (every process makes the
    same number of sample calls, so sharded generation never waits on one that stopped)."""
    stats = EpisodeStats()
    for turn in range(max_turns):
        live = [t for t in trajectories if t.finish_reason is None]
        if not any_live(bool(live)):
            break
        contexts = [t.context for t in live] or [trajectories[0].segments[0].prompt_ids]  # a stand-in call
        budgets = [min(max_new_tokens, max_seq_len - len(c)) for c in contexts]
        start = time.perf_counter()
        completions = sample(contexts, [f"{t.key}:turn{turn}" for t in live] or ["idle"], max(budgets))
        stats.sampling_s += time.perf_counter() - start
        pending = []
        for t, c, budget in zip(live, completions, budgets, strict=False):
            ids, logprobs = c.ids[:budget], c.full_logprobs[:budget]
            t.segments[-1].add(ids, True, logprobs)
            t.turns += 1
            t.versions.append(c.version)
            stopped = c.finish_reason == "stop" and len(c.ids) <= budget
            text = decode([i for i in ids if i not in renderer.stops])
            content, calls = parse_turn(
                text, renderer.tokenizer, renderer.prefix(t.context[: len(t.context) - len(ids)])
            )
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}, "id": f"call_{k}"}
                    for k, c in enumerate(calls)
                ]  # fmt: skip
            t.messages.append(message if stopped else {"role": "assistant", "content": text})
            if not stopped:
                t.finish_reason = "length"
            elif not calls:
                t.finish_reason = "stop"
            elif turn + 1 >= max_turns:
                t.finish_reason = "max_turns"
            else:
                pending.append((t, calls))
        start = time.perf_counter()
        results = tools.run([(t.handle, calls) for t, calls in pending])
        stats.tools_s += time.perf_counter() - start
        for (t, calls), found in zip(pending, results, strict=True):
            _continue(t, calls, found, renderer, append, max_seq_len)
    for t in trajectories:
        if t.finish_reason is None:
            t.finish_reason = "max_turns"
    return stats


def _continue(
    t: Trajectory, calls, found: list[Result], renderer: TurnRenderer, append: bool, max_seq_len: int
):
    """The tool results appended to the trajectory (or, per turn, a new sample's prompt); `length` when
    no room is left for another model turn."""
    t.tool_calls += len(calls)
    t.tool_errors += sum(r.error for r in found)
    t.tool_timeouts += sum(r.failure == "timeout" for r in found)
    t.tool_crashes += sum(r.failure == "crash" for r in found)
    results = [
        {"role": "tool", "name": r.name or "unknown", "content": r.content, "tool_call_id": f"call_{k}"}
        for k, r in enumerate(found)
    ]
    added = renderer.environment_ids(t.messages, results) if append else None
    if added is not None:
        if len(t.context) + len(added) >= max_seq_len:
            t.finish_reason = "length"
            return
        t.messages += results
        t.segments[-1].add(added, False)
        return
    prompt = renderer.encode(t.messages + results, generation_prompt=True)
    if len(prompt) >= max_seq_len:
        t.finish_reason = "length"
        return
    t.messages += results
    t.segments.append(Segment(prompt))
