"""Tools and environments that hang, exit, segfault or exhaust memory: the model's problem, not the run's.

Each runs in a tool process (liger_cli.generate.tool_pool): its call's result is an error the model
reads, counted (`tool_timeouts`, `tool_crashes`), the process is replaced, the episode goes on, and the
outcome is the same every time. The episodes are scripted (the model's turns given, as in
test_agent_episodes); one `liger train` run with such a tool closes the file."""

from __future__ import annotations

import json

import pytest
import yaml
from test_agent_episodes import AGENT_TOKENIZER, Script, Toolbox, episodes, start
from test_agent_train import agent_recipe, lines
from test_train import liger_here

from liger_cli.data.tools import load_tools
from liger_cli.generate.tool_calls import Call, Result
from liger_cli.generate.tool_pool import ToolPool
from liger_cli.recipe.rl_section import RLSection

FAULTY_PY = '''
import ctypes
import os
import threading


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    if key == "sleep":
        threading.Event().wait()  # never returns
    if key == "exit":
        os._exit(1)
    if key == "segv":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if key == "hog":
        held = []
        while True:
            held.append(bytearray(32 << 20))
    return "391"
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(AGENT_TOKENIZER)


def call(key: str) -> str:
    return f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'


@pytest.fixture()
def faulty(tmp_path):
    (tmp_path / "faulty.py").write_text(FAULTY_PY)
    rl = RLSection(
        rewards=[{"function": "liger_cli.rewards:exact_match"}], tools=[f"{tmp_path / 'faulty.py'}:lookup"]
    )
    box = Toolbox(load_tools(rl), workers=2, timeout=1.0, memory_mb=256)
    yield box
    box.pool.shutdown()


OUTCOMES = {  # key -> (the start of the model's tool result, timeouts, crashes)
    "sleep": ("error: lookup did not return within 1 s (rl.tool_timeout) and was stopped", 1, 0),
    "exit": ("error: lookup ended its process (it exited with code 1); the process was replaced", 0, 1),
    "segv": ("error: lookup ended its process (it was killed by SIGSEGV); the process was replaced", 0, 1),
    "hog": ("error: lookup ran out of memory (rl.tool_memory_mb 256) and its process was replaced", 0, 1),
    "17": ("391", 0, 0),
}


def test_a_tool_that_hangs_exits_segfaults_or_exhausts_memory_is_an_error_the_model_reads(tokenizer, faulty):
    """Every fault in one step, beside a good call on the same processes: each trajectory gets its error
    (or its result) and a second model turn; the counts add up; the same outcome twice."""
    found = []
    for _ in range(2):
        keys = [*OUTCOMES, "17"]  # the good call again, after every replacement
        turns = {f"t{k}": [f"Looking.{call(key)}", "Done."] for k, key in enumerate(keys)}
        trajectories = [start(tokenizer, faulty, f"t{k}") for k in range(len(keys))]
        episodes(tokenizer, faulty, trajectories, Script(tokenizer, turns))
        found.append([(t.messages[2]["content"], t.tool_timeouts, t.tool_crashes, t.tool_errors, t.finish_reason,
                       t.turns, t.segments[0].ids) for t in trajectories])  # fmt: skip
    assert found[0] == found[1]
    for (content, timeouts, crashes, errors, finish, turns, _), key in zip(
        found[0], [*OUTCOMES, "17"], strict=True
    ):
        text, want_timeouts, want_crashes = OUTCOMES[key]
        assert content == text, key
        assert (timeouts, crashes, errors) == (want_timeouts, want_crashes, int(key != "17")), key
        assert (finish, turns) == ("stop", 2), key


def environment_pool(source, name: str) -> ToolPool:
    """One tool process (5 s a call, 512 MiB) for the environment class `name` in the file `source`."""
    rl = RLSection(rewards=[{"function": "liger_cli.rewards:exact_match"}], environment=f"{source}:{name}")
    return ToolPool(load_tools(rl), 1, 5.0, 512)


def test_an_environment_survives_its_process_being_replaced(tmp_path):
    """Two environments in one process; a call crashes it: the other environment is rebuilt from its
    row and given its earlier calls again, so its state is where it was; the one whose call crashed
    keeps its state too (its crashing call never happened)."""
    (tmp_path / "env.py").write_text(
        "import os\n\n"
        "class Counter:\n"
        "    def __init__(self, start: int):\n        self.total = start\n\n"
        "    def add(self, n: int) -> int:\n"
        '        """Add.\n\n        Args:\n            n: how much\n        """\n'
        "        if n < 0:\n            os._exit(3)\n"
        "        self.total += n\n        return self.total\n"
    )
    pool = environment_pool(tmp_path / "env.py", "Counter")
    try:
        a, b = pool.open({"start": 10}, 1), pool.open({"start": 100}, 2)
        assert pool.run([(a, [Call("add", {"n": 1}), Call("add", {"n": 2})]), (b, [Call("add", {"n": 5})])]) == [
            [Result("add", "11", False), Result("add", "13", False)], [Result("add", "105", False)]]  # fmt: skip
        crashed = pool.run(
            [(b, [Call("add", {"n": -1}), Call("add", {"n": 1})]), (a, [Call("add", {"n": 1})])]
        )
        assert crashed[0][0].failure == "crash" and "exited with code 3" in crashed[0][0].content
        assert crashed[0][1:] == [Result("add", "106", False)] and crashed[1] == [Result("add", "14", False)]
        assert pool.state(a).total == 14 and pool.state(b).total == 106
    finally:
        pool.shutdown()


HANGING_TOOL = '''
import ctypes
import sys
import threading

sys.path.insert(0, {agent!r})
from tools import lookup as table  # noqa: E402


def lookup(key: str) -> str:
    """Look a key up in the code table.

    Args:
        key: the key
    """
    digit = sum(map(ord, key)) % 3
    if digit == 0:
        threading.Event().wait()  # never returns
    if digit == 1:
        ctypes.string_at(0)  # SIGSEGV
    return table(key)
'''


def test_a_run_whose_tool_hangs_and_crashes_finishes_the_same_twice(tmp_path):
    """`liger train` on the agent recipe with a tool that hangs on a third of the keys and segfaults on
    another third: the run finishes, counts them (metrics and rollouts.jsonl), and a second run samples,
    scores and trains exactly the same."""
    from test_agent_train import AGENT

    (tmp_path / "tools.py").write_text(HANGING_TOOL.format(agent=str(AGENT)))
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        path = agent_recipe(tmp_path, out, max_steps=2, eval_every=None)
        recipe = yaml.safe_load(path.read_text())
        recipe["data"].pop("eval")
        recipe["rl"] |= {"tools": [f"{tmp_path / 'tools.py'}:lookup"], "tool_timeout": 3.0, "tool_workers": 2}
        path.write_text(yaml.safe_dump(recipe))
        proc = liger_here("train", str(path))
        assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (lines(out / "rollouts.jsonl") for out in outs)
    assert sum(r["tool_timeouts"] for r in first) > 0 and sum(r["tool_crashes"] for r in first) > 0
    drop = ("step_time_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in first] == [
        {k: v for k, v in r.items() if k not in drop} for r in second
    ]
    metrics = [json.loads(x) for x in (outs[0] / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "tool/timeouts" in m]
    assert len(logged) == 2
    per_step = {}
    for r in first:
        per_step.setdefault(r["step"], []).append(r)
    for m in logged:
        rows = per_step[m["step"]]
        assert m["tool/timeouts"] == pytest.approx(sum(r["tool_timeouts"] for r in rows) / len(rows))
        assert m["tool/crashes"] == pytest.approx(sum(r["tool_crashes"] for r in rows) / len(rows))
    assert (outs[0] / "final" / "adapter_model.safetensors").read_bytes() == (
        outs[1] / "final" / "adapter_model.safetensors"
    ).read_bytes()


def test_chat_runs_its_tools_in_processes_too(tmp_path, monkeypatch):
    """`liger chat --tools` with a tool that segfaults: the model reads the error, the chat goes on."""
    import io

    from test_agent_train import AGENT

    from liger_cli.generate.engine import Sampling
    from liger_cli.serve.chat import chat_command

    (tmp_path / "tools.py").write_text(
        "import ctypes\n\n\ndef lookup(key: str) -> str:\n"
        '    """Look a key up in the code table.\n\n    Args:\n        key: the key\n    """\n'
        "    ctypes.string_at(0)\n"
    )
    question = json.loads((AGENT / "eval.jsonl").read_text().splitlines()[0])["prompt"]
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{question}\n/reset\n{question}\n/exit\n"))
    said = io.StringIO()
    code = chat_command(AGENT / "model", None, Sampling(80, 0.0), False, None, None, out=said,
                        agent=((f"{tmp_path / 'tools.py'}:lookup",), None, 2))  # fmt: skip
    text = said.getvalue()
    crashed = (
        "[lookup -> error: lookup ended its process (it was killed by SIGSEGV); the process was replaced]"
    )
    assert code == 0 and text.count(crashed) == 2, text  # the second conversation: the replacement process


def test_an_environment_that_cannot_be_read_back_is_named(tmp_path):
    """Reward functions read each environment back from its process (pickled): one holding a lock cannot
    be, and the error says so and how to fix it, instead of the rewards reading something else."""
    (tmp_path / "env.py").write_text(
        "import threading\n\n"
        "class Locked:\n"
        "    def __init__(self):\n        self.lock = threading.Lock()\n\n"
        "    def ping(self) -> str:\n"
        '        """Ping."""\n'
        "        return 'pong'\n"
    )
    from liger_cli.data.tools import ToolError

    pool = environment_pool(tmp_path / "env.py", "Locked")
    try:
        handle = pool.open({}, 1)
        assert pool.run([(handle, [Call("ping", {})])]) == [[Result("ping", "pong", False)]]
        with pytest.raises(
            ToolError,
            match=r"env.py:Locked: its instance cannot be pickled \(TypeError: .*lock.*__getstate__",
        ):
            pool.state(handle)
    finally:
        pool.shutdown()
