"""Multi-turn episodes proved piece by piece with a scripted sampler (the model's turns are given, every
other part is the run's own code): token in, token out; the environment's ids never learned; the
template probe and the per-turn fallback; tool mistakes as data; stops; results in call order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from liger_cli.data.encode import IGNORE_INDEX
from liger_cli.data.tools import ToolError, check_template_takes_tools, load_tools
from liger_cli.errors import UserError
from liger_cli.generate.engine import Completion
from liger_cli.generate.episodes import Segment, Trajectory, TurnRenderer, probe, run_episodes
from liger_cli.generate.prompts import Renderer
from liger_cli.generate.tool_calls import Call, Result, parse_turn
from liger_cli.generate.tool_pool import ToolPool
from liger_cli.recipe.rl_section import RLSection

REPO = Path(__file__).resolve().parents[1]
AGENT_TOKENIZER = REPO / "recipes" / "agent" / "tokenizer"

TOOLS_PY = '''
import time

TABLE = {"17": "391", "5": "twelve"}


def lookup(key: str) -> str:
    """Look a key up in the table.

    Args:
        key: the key to look up
    """
    return TABLE[key]


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    time.sleep(0.002 * (10 - a % 10))  # later calls finish first
    return a + b
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(AGENT_TOKENIZER)


class Toolbox:
    """A ToolSet and its tool processes, as a run holds them."""

    def __init__(self, toolset, workers: int = 4, timeout: float = 60.0, memory_mb: int = 1024):
        self.set, self.schemas = toolset, toolset.schemas
        self.pool = ToolPool(toolset, workers, timeout, memory_mb)


@pytest.fixture()
def tools(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    rl = RLSection(
        rewards=[{"function": "liger_cli.rewards:exact_match"}],
        tools=[f"{tmp_path / 'tools.py'}:lookup", f"{tmp_path / 'tools.py'}:add"],
    )
    box = Toolbox(load_tools(rl))
    yield box
    box.pool.shutdown()


class Script:
    """A sampler that answers each trajectory's turn k with the text given for it (then eos), records
    every prompt it was given, and gives each sampled token a distinct log-prob."""

    def __init__(self, tokenizer, turns: dict[str, list[str]]):
        self.tokenizer, self.turns, self.seen = tokenizer, turns, []

    def __call__(self, prompts, keys, max_new_tokens):
        out = []
        for prompt, key in zip(prompts, keys, strict=True):
            self.seen.append((key, list(prompt)))
            base, _, turn = key.rpartition(":turn")
            text = self.turns[base][int(turn)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            kept = ids[:max_new_tokens]
            lps = [-0.01 * (len(self.seen) + k + 1) for k in range(len(kept))]
            out.append(Completion(kept, "stop" if len(ids) <= max_new_tokens else "length", lps, lps))
        return out


def start(tokenizer, tools, key: str, question: str = "What is 17 in the table?") -> Trajectory:
    messages = [{"role": "user", "content": question}]
    renderer = TurnRenderer(tokenizer, tools.schemas, Renderer(tokenizer, "chat").stop_ids())
    prompt = renderer.encode(messages, generation_prompt=True)
    return Trajectory(key, messages, [Segment(prompt)], tools.pool.open({}, 1))


def episodes(
    tokenizer, tools, trajectories, script, append=True, max_turns=4, max_new_tokens=256, max_seq_len=2048
):
    renderer = TurnRenderer(tokenizer, tools.schemas, Renderer(tokenizer, "chat").stop_ids())
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    return run_episodes(
        trajectories, script, lambda local: local, renderer, append=append, max_turns=max_turns,
        max_new_tokens=max_new_tokens, max_seq_len=max_seq_len, tools=tools.pool, decode=decode,
    )  # fmt: skip


CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "17"}}</tool_call>'


def test_a_trajectory_is_its_prompt_then_sampled_then_environment_ids(tokenizer, tools):
    """The sampler's prompt at turn 2 is exactly the ids before it; the model's ids are the sampled ones,
    never re-encoded; the environment's are what the template adds, and the whole conversation renders
    as these ids (the template is append-only)."""
    t = start(tokenizer, tools, "a")
    script = Script(tokenizer, {"a": [f"Let me look.{CALL}", "It is 391."]})
    episodes(tokenizer, tools, [t], script)
    assert (t.finish_reason, t.turns, t.tool_calls, t.tool_errors) == ("stop", 2, 1, 0)
    seg = t.segments[0]
    eos = tokenizer.eos_token_id
    first = tokenizer(f"Let me look.{CALL}", add_special_tokens=False)["input_ids"] + [eos]
    second = tokenizer("It is 391.", add_special_tokens=False)["input_ids"] + [eos]
    env = seg.ids[len(first) : len(seg.ids) - len(second)]
    assert seg.ids == first + env + second
    assert seg.mask == [1] * len(first) + [0] * len(env) + [1] * len(second)
    assert all(lp == 0.0 for lp, m in zip(seg.logprobs, seg.mask, strict=True) if m == 0)
    assert all(lp < 0 for lp, m in zip(seg.logprobs, seg.mask, strict=True) if m == 1)
    # What the sampler saw at each turn is exactly the trajectory's ids before that turn.
    assert [p for _, p in script.seen] == [seg.prompt_ids, seg.prompt_ids + first + env]
    assert tokenizer.decode(env) == "\n<|user|>\n<tool_response>391</tool_response>\n<|assistant|>\n"
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    assert t.messages[1]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": {"key": "17"}}
    assert t.messages[2]["content"] == "391" and t.messages[3]["content"] == "It is 391."
    whole = TurnRenderer(tokenizer, tools.schemas, [eos]).encode(t.messages, generation_prompt=False)
    assert whole[: len(seg.prompt_ids) + len(seg.ids)] == seg.prompt_ids + seg.ids


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "error: the call is not JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "error: unknown tool 'search'; the tools are: lookup, add"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "error: add: missing a required argument: 'b'"),
        ('<tool_call>{"name": "lookup", "arguments": {"key": "99"}}</tool_call>', "error: lookup raised KeyError: '99'"),
        ('<tool_call>{"name": "lookup", "arguments": {"key": "17"}}', "error: a <tool_call> without its </tool_call>"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'error: a call needs {"name": "tool", "arguments": {...}}'),
    ],
)  # fmt: skip
def test_the_models_mistakes_go_back_to_it_as_tool_results(tokenizer, tools, turn, error):
    t = start(tokenizer, tools, "a")
    episodes(tokenizer, tools, [t], Script(tokenizer, {"a": [turn, "Sorry."]}))
    assert (t.finish_reason, t.turns, t.tool_calls, t.tool_errors) == ("stop", 2, 1, 1)
    assert t.messages[2]["role"] == "tool" and t.messages[2]["content"].startswith(error)
    assert error in tokenizer.decode(t.segments[0].ids)


def test_stops_max_turns_and_length(tokenizer, tools):
    """max_turns: the last turn's calls are not run (nothing follows to read them); length: a turn cut by
    max_new_tokens, and a tool result that would pass max_seq_len (not appended)."""
    calls = Script(
        tokenizer, {"m": [CALL] * 5, "n": ["one two three four five six seven " * 30], "s": [CALL, "x"]}
    )
    m, n = start(tokenizer, tools, "m"), start(tokenizer, tools, "n")
    episodes(tokenizer, tools, [m, n], calls, max_turns=3, max_new_tokens=64)
    assert (m.finish_reason, m.turns, m.tool_calls) == ("max_turns", 3, 2)
    assert m.segments[0].mask[-1] == 1 and m.segments[0].ids[-1] == tokenizer.eos_token_id  # ends sampled
    assert (n.finish_reason, n.turns, len(n.segments[0].ids)) == ("length", 1, 64)
    s = start(tokenizer, tools, "s")
    room = len(s.segments[0].prompt_ids) + len(tokenizer(CALL)["input_ids"]) + 8
    episodes(tokenizer, tools, [s], calls, max_seq_len=room)
    assert (s.finish_reason, s.turns) == ("length", 1) and set(s.segments[0].mask) == {1}
    assert len(s.segments[0].prompt_ids) + len(s.segments[0].ids) <= room


def test_tool_results_are_placed_in_call_order_whatever_the_processes(tokenizer, tools):
    """Calls whose processes finish in reverse order: each result sits after its own call, every run."""
    turns = {
        f"t{k}": ["".join(f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {k}}}}}</tool_call>'
                          for a in range(1, 6)), "done"]
        for k in range(6)
    }  # fmt: skip
    found = []
    for _ in range(2):
        trajectories = [start(tokenizer, tools, f"t{k}") for k in range(6)]
        episodes(
            tokenizer, tools, trajectories, Script(tokenizer, turns), max_new_tokens=1024, max_seq_len=4096
        )
        found.append([[m["content"] for m in t.messages if m["role"] == "tool"] for t in trajectories])
    assert found[0] == found[1] == [[str(a + k) for a in range(1, 6)] for k in range(6)]


THINK_DROPPING = (
    (AGENT_TOKENIZER / "chat_template.jinja")
    .read_text()
    .replace(
        "{{ message.content }}{% for call",
        "{{ message.content if loop.last else message.content.split('</think>')[-1].lstrip() }}{% for call",
    )
)


def test_the_probe_passes_an_append_only_template_and_names_what_breaks_one(tokenizer, tools):
    stops = Renderer(tokenizer, "chat").stop_ids()
    assert probe(TurnRenderer(tokenizer, tools.schemas, stops)) is None
    dropping = _with_template(tokenizer, THINK_DROPPING)
    why = probe(TurnRenderer(dropping, tools.schemas, stops))
    assert why == "the tool result after assistant turn 1 does not render as ids appended to it"
    no_tool_role = _with_template(tokenizer, "{{ tools }}{% for m in messages %}{% if m.role == 'tool' %}"
                                  "{{ raise_exception('no tool role') }}{% endif %}{{ m.content }}{{ eos_token }}{% endfor %}")  # fmt: skip
    with pytest.raises(
        UserError, match="the chat template cannot render a tool conversation: .*no tool role"
    ):
        probe(TurnRenderer(no_tool_role, tools.schemas, stops))
    with pytest.raises(ToolError, match="the chat template takes no tools"):
        check_template_takes_tools(_with_template(tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}"),
                                   tools.schemas)  # fmt: skip


def test_a_template_that_is_not_append_only_trains_each_turn_as_its_own_sample(tokenizer, tools):
    """Per turn: the second turn's prompt is the template's rendering of the conversation so far, exactly
    what its sampler saw; each sample's ids are only what was sampled for it."""
    dropping = _with_template(tokenizer, THINK_DROPPING)
    t = start(dropping, tools, "a")
    script = Script(dropping, {"a": [f"<think>\nlook\n</think>\n\n{CALL}", "It is 391."]})
    episodes(dropping, tools, [t], script, append=False)
    assert t.finish_reason == "stop" and len(t.segments) == 2
    first, second = t.segments
    assert set(first.mask) == {1} and set(second.mask) == {1}
    renderer = TurnRenderer(dropping, tools.schemas, [dropping.eos_token_id])
    assert second.prompt_ids == renderer.encode(t.messages[:3], generation_prompt=True)
    assert [p for _, p in script.seen] == [first.prompt_ids, second.prompt_ids]
    assert "<think>" not in dropping.decode(second.prompt_ids)  # the template dropped it; nothing re-rendered


def test_parse_turn_reads_hermes_calls_and_openai_shapes():
    text = 'Sure.<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"function": {"name": "b"}}</tool_call>'
    assert parse_turn(text) == ("Sure.", [Call("a", {"x": 1}), Call("b", {})])
    assert parse_turn("no calls here") == ("no calls here", [])


def test_an_environment_is_built_per_trajectory_from_its_row(tmp_path):
    (tmp_path / "env.py").write_text(
        "class Shop:\n"
        "    def __init__(self, stock: int, answer: str = ''):\n"
        "        if stock < 0:\n            raise ValueError('negative stock')\n"
        "        self.stock = stock\n\n"
        "    def buy(self, n: int) -> str:\n"
        '        """Buy items.\n\n        Args:\n            n: how many\n        """\n'
        "        self.stock -= n\n        return str(self.stock)\n\n"
        "    def _secret(self):\n        return 1\n"
    )
    rl = RLSection(
        rewards=[{"function": "liger_cli.rewards:exact_match"}], environment=f"{tmp_path / 'env.py'}:Shop"
    )
    tools = load_tools(rl)
    assert [s["function"]["name"] for s in tools.schemas] == ["buy"]
    assert tools.schemas[0]["function"]["parameters"]["properties"] == {
        "n": {"type": "integer", "description": "how many"}
    }
    pool = ToolPool(tools, 2, 60.0, 1024)
    try:
        first, second = pool.open({"stock": 5, "answer": "x"}, 1), pool.open({"stock": 5}, 2)
        assert pool.run([(first, [Call("buy", {"n": 2})]), (second, [Call("buy", {"n": 1})])]) == [
            [Result("buy", "3", False)],
            [Result("buy", "4", False)],
        ]
        assert pool.state(first).stock == 3 and pool.state(second).stock == 4  # each its own instance
        with pytest.raises(
            ToolError, match=r"Shop\(\*\*row fields\) raised on prompt row 7: ValueError: negative stock"
        ):
            pool.open({"stock": -1}, 7)
    finally:
        pool.shutdown()


def test_tools_that_cannot_load_or_be_described_are_named(tmp_path):
    (tmp_path / "t.py").write_text("def f(x):\n    return x\n\nraise_me = 1\n")
    (tmp_path / "broken.py").write_text("import nothing_here\n")
    cases = {
        f"{tmp_path / 't.py'}:f": "tool f cannot be described to the model",
        f"{tmp_path / 'broken.py'}:f": "importing .* failed: ModuleNotFoundError",
        f"{tmp_path / 'missing.py'}:f": "no such file",
        f"{tmp_path / 't.py'}:g": "has no function g",
        f"{tmp_path / 't.py'}:raise_me": "not a function",
    }
    for spec, message in cases.items():
        rl = RLSection(rewards=[{"function": "liger_cli.rewards:exact_match"}], tools=[spec])
        with pytest.raises(ToolError, match=message):
            load_tools(rl)


def test_the_rl_section_lists_its_keys_for_an_unknown_one(tmp_path, tiny_model_dir):
    from liger_cli.recipe import load_recipe

    (tmp_path / "p.jsonl").write_text('{"prompt": "hi", "answer": "x"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{path: {tiny_model_dir}}}\ndata: {{train: p.jsonl, format: prompt}}\n"
        "training: {objective: grpo}\nrl: {rewards: [{function: liger_cli.rewards:exact_match}], max_turnz: 3}\n"
    )
    with pytest.raises(UserError, match=r"rl.max_turnz.*did you mean `rl.max_turns`"):
        load_recipe(recipe)
    recipe.write_text(recipe.read_text().replace("max_turnz: 3", "zzz: 1"))
    with pytest.raises(UserError, match=r"allowed keys: num_generations, .*tools, environment, max_turns"):
        load_recipe(recipe)


def _with_template(tokenizer, template: str):
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


# --- the objective: environment ids never learned, on every path ---------------------------------------------


class FakeSampler:
    """What Grpo asks of the run's sampler, over scripted episodes."""

    def __init__(self, tokenizer, tools, script, append=True, max_turns=4):
        self.tokenizer, self.tools, self.script, self.append = tokenizer, tools, script, append
        self.max_turns = max_turns
        self.stop_ids = Renderer(tokenizer, "chat").stop_ids()

    def trajectories(self, rows, keys, greedy=False):
        found = [start(self.tokenizer, self.tools, str(k)) for k in keys]
        episodes(self.tokenizer, self.tools, found, self.script, append=self.append, max_turns=self.max_turns)
        for t in found:
            t.environment = self.tools.pool.state(t.handle)
        return found

    def text(self, t):
        return t.messages[-1]["content"]


def test_grpo_learns_the_sampled_ids_only_and_writes_every_field(tokenizer, tools):
    from liger_cli.model.objectives.grpo import Grpo
    from liger_cli.model.objectives.rewards import load_rewards

    rl = RLSection(
        rewards=[{"function": "liger_cli.rewards:exact_match"}], num_generations=2, tools=["x.py:f"]
    )
    objective = Grpo(rl, load_rewards(rl.rewards), 0, True)
    turns = {"0:0:0": [CALL, "391"], "0:0:1": ["12"]}
    prompts = [
        {
            "prompt": json.dumps("What is 17?"),
            "fields": json.dumps({"answer": "391"}),
            "row": 0,
            "prompt_ids": [],
        }
    ]
    batch, rows = objective._sample(0, prompts, FakeSampler(tokenizer, tools, Script(tokenizer, turns)))
    assert [r["reward"] for r in rows] == [1.0, 0.0] and [r["turns"] for r in rows] == [2, 1]
    first = rows[0]
    n = len(first["prompt_ids"])
    assert len(first["completion_ids"]) == len(first["completion_mask"]) == len(first["sampler_logprobs"])
    learned = batch["labels"][0, n:].tolist()
    for tok, m, label in zip(first["completion_ids"], first["completion_mask"], learned, strict=False):
        assert label == (tok if m else IGNORE_INDEX)
    assert batch["completion_mask"][0].sum() == sum(first["completion_mask"])
    # The sampler's log-probs sit at the positions that predict each token; 0 where the environment wrote.
    aligned = batch["sampler_logp"][0, n - 1 : n - 1 + len(first["completion_ids"])].tolist()
    assert aligned == pytest.approx(first["sampler_logprobs"])
    assert objective.units(batch) == 2 and torch.equal(batch["trajectory"], torch.tensor([0, 1]))


def test_mask_truncated_leaves_a_cut_trajectory_out_of_the_loss(tokenizer, tools):
    from liger_cli.model.objectives.grpo import Grpo

    for mask_truncated in (False, True):
        rl = RLSection(rewards=[{"function": "liger_cli.rewards:exact_match"}], num_generations=2,
                       tools=["x.py:f"], mask_truncated=mask_truncated, max_turns=2)  # fmt: skip
        objective = Grpo(rl, [], 0, True)
        turns = {"0:0:0": [CALL, CALL], "0:0:1": ["12"]}
        prompts = [{"prompt": '"q"', "fields": "{}", "row": 0, "prompt_ids": []}]
        batch, rows = objective._sample(
            0, prompts, FakeSampler(tokenizer, tools, Script(tokenizer, turns), max_turns=2)
        )
        assert [r["finish_reason"] for r in rows] == ["max_turns", "stop"]
        assert (batch["completion_mask"][0].sum() == 0) == mask_truncated
        assert int(objective.units(batch)) == (1 if mask_truncated else 2)


def test_a_kernel_that_leaks_environment_tokens_into_the_loss_is_switched_off(monkeypatch):
    """The twin's kernel check runs the grpo loss on rollout rows with environment ids inside: a fused
    path that learns them (as TRL's once did) disagrees with the plain one and is not patched in."""
    import importlib

    from transformers import AutoConfig

    from liger_cli.model.objectives.grpo import Grpo
    from liger_cli.twin.kernel_check import check_kernels

    flp = importlib.import_module("liger_kernels.fused_linear_logprob")
    real = flp.fused_linear_token_logprob

    def leaking(hidden, weight, labels, *args, **kwargs):
        logp, learned = real(hidden, weight, labels, *args, **kwargs)
        inside = (
            learned.int().cummax(dim=1).values.bool() & learned.flip(1).int().cummax(1).values.flip(1).bool()
        )
        gap = inside & ~learned  # environment ids between sampled ones
        return logp - gap.to(logp.dtype), learned | gap

    requested = {"rms_norm": False, "rope": False, "swiglu": False, "cross_entropy": False,
                 "fused_linear_cross_entropy": True}  # fmt: skip
    config = AutoConfig.for_model("llama")
    objective = Grpo(
        RLSection(rewards=[{"function": "liger_cli.rewards:exact_match"}], loss="dapo"), [], 0, True
    )
    assert check_kernels(config, requested, objective=objective).switched_off == {}
    monkeypatch.setattr(flp, "fused_linear_token_logprob", leaking)
    off = check_kernels(config, requested, objective=objective).switched_off
    assert "fused_linear_cross_entropy" in off, off


def test_rewards_see_the_conversation_and_the_environment(tokenizer, tmp_path):
    """Reward functions get each trajectory's messages and its environment as its tool process left it."""
    (tmp_path / "r.py").write_text(
        "def used_tool(completions, messages, **kwargs):\n"
        "    return [float(any(m['role'] == 'tool' for m in ms)) for ms in messages]\n"
        "def looked(completions, environment, **kwargs):\n"
        "    return [float(len(e.seen)) for e in environment]\n"
    )
    (tmp_path / "env.py").write_text(
        "class Table:\n"
        "    def __init__(self):\n        self.seen = []\n\n"
        "    def lookup(self, key: str) -> str:\n"
        '        """Look a key up.\n\n        Args:\n            key: the key\n        """\n'
        "        self.seen.append(key)\n        return '391'\n"
    )
    from liger_cli.model.objectives.grpo import Grpo
    from liger_cli.model.objectives.rewards import load_rewards

    rl = RLSection(rewards=[{"function": f"{tmp_path / 'r.py'}:used_tool"}, {"function": f"{tmp_path / 'r.py'}:looked"}],
                   num_generations=2, environment=f"{tmp_path / 'env.py'}:Table")  # fmt: skip
    box = Toolbox(load_tools(rl), workers=2)
    objective = Grpo(rl, load_rewards(rl.rewards), 0, True)
    turns = {"0:0:0": [CALL + CALL, "391"], "0:0:1": ["12"]}
    prompts = [{"prompt": '"q"', "fields": "{}", "row": 0, "prompt_ids": []}]
    try:
        _, rows = objective._sample(0, prompts, FakeSampler(tokenizer, box, Script(tokenizer, turns)))
    finally:
        box.pool.shutdown()
    assert [r["rewards"] for r in rows] == [
        {"used_tool": 1.0, "looked": 2.0},
        {"used_tool": 0.0, "looked": 0.0},
    ]
