"""Agentic RL end to end on the shipped agent model (recipes/agent: a made-up code table the model must
call a tool to read): what a multi-turn run writes (every trajectory's ids, mask, log-probs, messages,
stops) and logs, the Plan's verdict on the template, accumulation (2 x 1 = 1 x 2 micro-batches of
prompts), and a stopped run resumed to the uninterrupted run's weights. The runs are `liger train` in
the test's process (test_train.liger_here: the runs are not what the tests are about); the resume is a
fresh `liger train` process, as after a crash."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from test_train import liger, liger_here

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO / "recipes" / "agent"
FIELDS = ["step", "prompt", "prompt_ids", "completion", "completion_ids", "completion_mask", "sampler_logprobs",
          "messages", "turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_crashes", "finish_reason",
          "policy_version", "key", "rewards", "reward", "turn_versions", "advantage"]  # fmt: skip
pytestmark = pytest.mark.timeout(1800)


def agent_recipe(root: Path, out: Path, **training) -> Path:
    recipe = yaml.safe_load((REPO / "recipes" / "agent.yaml").read_text())
    train, held = root / "train.jsonl", root / "eval.jsonl"
    train.write_text("".join((AGENT / "train.jsonl").read_text().splitlines(keepends=True)[:8]))
    held.write_text("".join((AGENT / "eval.jsonl").read_text().splitlines(keepends=True)[:4]))
    recipe["model"]["path"] = str(AGENT / "model")
    recipe["data"] |= {"train": str(train), "eval": str(held)}
    recipe["training"] |= {"max_steps": 3, "micro_batch_size": 2, "eval_every": 3, **training}
    recipe["rl"] |= {"num_generations": 4, "max_turns": 2, "tools": [f"{AGENT / 'tools.py'}:lookup"],
                     "rewards": [{"function": f"{AGENT / 'rewards.py'}:correct"}]}  # fmt: skip
    recipe["output"] = {"dir": str(out), "overwrite": True, "save_every": 1}
    recipe["logging"] = {"every": 1, "tensorboard": False}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """In this process (test_train.liger_here, each its own exit code and output): the run (2 prompts a
    micro-batch), the same as 1 x 2 accumulated, and the run stopped after step 2."""
    root = tmp_path_factory.mktemp("agent")
    outs = {name: root / name for name in ("whole", "accumulated", "stopped")}
    cases = [agent_recipe(root, outs["whole"]),
             agent_recipe(root, outs["accumulated"], micro_batch_size=1, grad_accum=2),
             agent_recipe(root, outs["stopped"], max_steps=2)]  # fmt: skip
    for case in cases:
        proc = liger_here("train", str(case))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "final model verified" in proc.stdout, proc.stdout[-3000:]
        assert (
            "the chat template is append-only: one sample per trajectory, token in, token out" in proc.stdout
        )
    return {"root": root, **outs}


def test_every_trajectory_is_written_token_exact(runs) -> None:
    """Each row: the ids after the prompt (sampled and environment), a mask that says which, the sampler's
    log-probs where sampled (0 elsewhere), and the environment ids are exactly the template's tool turns
    for the tool results in `messages`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(AGENT / "model")
    spec = importlib.util.spec_from_file_location("agent_tools", AGENT / "tools.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    TABLE = tools.TABLE  # noqa: N806
    rows = lines(runs["whole"] / "rollouts.jsonl")
    assert len(rows) == 3 * 2 * 4 and all(list(r) == FIELDS for r in rows)
    # Synchronous: every model turn sampled by the weights its step trains.
    assert all(
        r["turn_versions"] == [r["step"] - 1] * r["turns"] == [r["policy_version"]] * r["turns"] for r in rows
    )
    for r in rows:
        ids, mask, logprobs = r["completion_ids"], r["completion_mask"], r["sampler_logprobs"]
        assert len(ids) == len(mask) == len(logprobs) and mask[0] == 1
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
        runs_of = _runs(ids, mask)
        sampled, environment = runs_of[1], runs_of[0]
        assert len(sampled) == r["turns"] == sum(m["role"] == "assistant" for m in r["messages"][1:])
        results = [m["content"] for m in r["messages"] if m["role"] == "tool"]
        assert [tokenizer.decode(e) for e in environment] == [
            f"\n<|user|>\n<tool_response>{c}</tool_response>\n<|assistant|>\n" for c in results
        ]
        assert r["tool_calls"] == len(results) and r["finish_reason"] in ("stop", "max_turns", "length")
        if r["finish_reason"] == "stop":
            assert sampled[-1][-1] == tokenizer.eos_token_id
        if r["finish_reason"] == "max_turns":
            assert r["turns"] == 2 and sampled[-1][-1] == tokenizer.eos_token_id
        answer = TABLE[r["prompt"].rsplit(" ", 1)[1].rstrip("?")]  # the code of the prompt's key
        assert r["reward"] == float(r["completion"].strip() == answer)
    assert sum(r["tool_calls"] for r in rows) > 0 and any(r["reward"] == 1.0 for r in rows)


def _runs(ids: list[int], mask: list[int]) -> dict[int, list[list[int]]]:
    """The ids split into runs of equal mask: {1: sampled runs, 0: environment runs}."""
    found: dict[int, list[list[int]]] = {0: [], 1: []}
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if i == 0 or m != mask[i - 1]:
            found[m].append([])
        found[m][-1].append(t)
    return found


def test_the_run_logs_turns_tool_calls_and_time_in_tools(runs) -> None:
    steps = [m for m in lines(runs["whole"] / "metrics.jsonl") if "loss" in m]
    rows = lines(runs["whole"] / "rollouts.jsonl")
    assert len(steps) == 3
    for k, m in enumerate(steps, start=1):
        mine = [r for r in rows if r["step"] == k]
        assert m["turns"] == pytest.approx(sum(r["turns"] for r in mine) / len(mine))
        assert m["tool/calls"] == pytest.approx(sum(r["tool_calls"] for r in mine) / len(mine))
        assert m["tool/errors"] == pytest.approx(sum(r["tool_errors"] for r in mine) / len(mine))
        assert m["time/tools_s"] >= 0 and m["time/sampling_s"] > 0
        sampled = sum(sum(r["completion_mask"]) for r in mine) / len(mine)
        assert m["completion_length"] == pytest.approx(sampled)  # sampled tokens only
    evals = [m for m in lines(runs["whole"] / "metrics.jsonl") if "eval_reward" in m]
    assert [m["step"] for m in evals] == [0, 3]


def test_accumulation_trains_what_one_micro_batch_trains(runs) -> None:
    """2 prompts in one micro-batch = 1 prompt x 2 accumulated: the same trajectories, losses, adapter."""
    whole, accumulated = runs["whole"], runs["accumulated"]
    assert [r["completion_ids"] for r in lines(accumulated / "rollouts.jsonl")] == [
        r["completion_ids"] for r in lines(whole / "rollouts.jsonl")
    ]
    for mine, theirs in zip(
        lines(accumulated / "metrics.jsonl"), lines(whole / "metrics.jsonl"), strict=True
    ):
        if "loss" in theirs:
            assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
    _same_adapter(accumulated, whole, atol=2e-5)  # other batch shapes: fp32 rounding apart


def test_a_stopped_agent_run_resumes_to_the_same_weights(runs) -> None:
    out = runs["stopped"]
    proc = liger("train", str(agent_recipe(runs["root"], out)), "--set", "output.resume=auto",
                 "--set", "output.overwrite=false", timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_adapter(out, runs["whole"])
    assert [r["completion_ids"] for r in lines(out / "rollouts.jsonl")] == [
        r["completion_ids"] for r in lines(runs["whole"] / "rollouts.jsonl")
    ]


def _same_adapter(out: Path, reference: Path, atol: float = 1e-6) -> None:
    got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (out, reference))
    assert got.keys() == want.keys() and got
    for key in want:
        assert (got[key] - want[key]).abs().max() < atol, key


def test_generate_and_chat_run_the_tools_as_training_ran_them(runs, tmp_path, monkeypatch) -> None:
    """`liger generate --tools` on the trained run: greedy trajectories of the run's eval prompts, scored as
    the run scored them, give the run's last eval_reward; each row's environment ids are the template's
    tool turns. `liger chat --tools` calls the tool and answers with its result."""
    import io

    from typer.testing import CliRunner

    from liger_cli import cli
    from liger_cli.generate.engine import Sampling
    from liger_cli.serve.chat import chat_command

    out, tools = tmp_path / "gen.jsonl", f"{AGENT / 'tools.py'}:lookup"
    held = runs["root"] / "eval.jsonl"
    args = ["generate", str(runs["whole"] / "final"), "--prompts", str(held), "--out", str(out), "--tools", tools,
            "--max-turns", "2", "--max-new-tokens", "80"]  # fmt: skip
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    rows, answers = lines(out), lines(held)
    assert len(rows) == 4 and all(r["tool_calls"] >= 1 for r in rows)
    correct = sum(r["completion"].strip() == a["answer"] for r, a in zip(rows, answers, strict=True)) / 4
    last_eval = [m for m in lines(runs["whole"] / "metrics.jsonl") if "eval_reward" in m][-1]
    assert correct == last_eval["eval_reward"]
    for r in rows:
        assert len(r["completion_ids"]) == len(r["completion_mask"]) and r["messages"][0]["role"] == "user"
    bad = CliRunner().invoke(cli.app, [*args[:-6], "--tools", "missing.py:f"])
    assert bad.exit_code == 2 and "no such file" in bad.output
    # A second message goes on the same trajectory; an empty line is skipped; /system starts over.
    chat = f"{answers[0]['prompt']}\nand {answers[1]['prompt']}\n\n/system Be brief.\n/exit\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(chat))
    said = io.StringIO()
    code = chat_command(runs["whole"] / "final", None, Sampling(80, 0.0), False, None, None, out=said,
                        agent=((tools,), None, 2))  # fmt: skip
    text = said.getvalue()
    assert code == 0 and "(tools: lookup;" in text and text.endswith("(conversation reset)\n"), text
    # The chat is the same greedy trajectory as generate's first row: the same call, result and answer.
    call, result, answer = rows[0]["messages"][1:4]
    assert f"[call lookup({call['tool_calls'][0]['function']['arguments']})]" in text, text
    assert f"[lookup -> {result['content']}]\n{answer['content']}\n" in text, text


ENVIRONMENT = '''
from tools import TABLE


class Table:
    """The code table as an environment: one per trajectory, built from its row's fields."""

    def __init__(self, answer: str, broken: bool = False):
        if broken:
            raise ValueError("this row breaks the constructor")
        self.answer, self.asked = answer, []

    def lookup(self, key: str) -> str:
        """Look a key up in the code table.

        Args:
            key: the key
        """
        self.asked.append(key)
        return TABLE[key.strip()]


def asked(environment, **kwargs):
    return [float(len(env.asked) > 0) for env in environment]
'''


def test_an_environment_per_trajectory_and_its_constructor_failing_on_a_row(tmp_path) -> None:
    """rl.environment: each trajectory's own instance (built from its row), its methods the tools, and
    the instance handed to the reward; a constructor that raises is a one-line exit 2 naming the class
    and the row."""
    import shutil

    from typer.testing import CliRunner

    from liger_cli import cli

    shutil.copy(AGENT / "tools.py", tmp_path / "tools.py")
    (tmp_path / "env.py").write_text(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n" + ENVIRONMENT)
    out = tmp_path / "env-run"
    path = agent_recipe(tmp_path, out, max_steps=1, micro_batch_size=1, eval_every=None)
    recipe = yaml.safe_load(path.read_text())
    recipe["data"].pop("eval")
    recipe["rl"] |= {
        "environment": f"{tmp_path / 'env.py'}:Table",
        "rewards": [{"function": f"{tmp_path / 'env.py'}:asked"}],
    }
    recipe["rl"].pop("tools")
    path.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(cli.app, ["train", str(path)])
    assert result.exit_code == 0, result.output
    rows = lines(out / "rollouts.jsonl")
    assert len(rows) == 4 and any(r["tool_calls"] for r in rows)
    for r in rows:  # 1.0 where a call reached the instance's method (it raised or not)
        reached = [m for m in r["messages"] if m["role"] == "tool" and
                   (not m["content"].startswith("error:") or m["content"].startswith("error: lookup raised"))]  # fmt: skip
        assert r["reward"] == float(bool(reached))
    prompts = Path(recipe["data"]["train"])
    broken = [json.loads(line) | {"broken": True} for line in prompts.read_text().splitlines()]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in broken))
    result = CliRunner().invoke(cli.app, ["train", str(path), "--set", f"output.dir={tmp_path / 'broken'}"])
    assert result.exit_code == 2
    line = next(x for x in result.output.splitlines() if x.startswith("error:"))  # one line, no traceback
    assert re.search(r"rl.environment: .*env.py:Table: Table\(\*\*row fields\) raised on prompt row \d: ValueError: "
                     "this row breaks the constructor", line), result.output  # fmt: skip
    assert not (tmp_path / "broken" / "final").exists() and "Traceback" not in result.output
