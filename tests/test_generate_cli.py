"""`liger generate` and `liger chat` on a real run's output, as a user runs them: a real `liger generate`
process, a real pseudo-terminal for chat, `accelerate launch` for 2 processes; the other commands run in
this process through the same Typer app (`invoke`: no 5-8 s interpreter start each).

Every way of naming the model (the run folder, its final/, a checkpoint, the base with --adapter,
`liger merge`'s output) gives the same greedy completions; 2 processes write the file 1 process
writes; every user mistake is one line, exit 2, and no file.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_distributed import child_env, free_port
from test_output_safety import one_line_error
from test_train import QUICK_DATA, REPO, liger, recipe_text
from typer.testing import CliRunner

from liger_cli import cli

PROMPTS = [json.loads(line) for line in (QUICK_DATA / "eval.jsonl").read_text().splitlines()[:5]]


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A LoRA run of 4 steps with checkpoints at 2 and 4, and 3 eval samples at each evaluation."""
    root = tmp_path_factory.mktemp("gen-run")
    out = root / "out"
    recipe = root / "r.yaml"
    recipe.write_text(recipe_text(
        tiny_model_dir, out,
        training="{max_steps: 4, micro_batch_size: 4, lr: 5.0e-3, seed: 3, eval_every: 2, eval_samples: 3}",
        output=f"{{dir: {out}, save_every: 2, overwrite: true}}",
    ))  # fmt: skip
    proc = liger("train", str(recipe), timeout=900)  # generous: the machine may be shared
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [*PROMPTS, {"prompt": "Write the number in words.\n347", "id": "mine"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generated(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def invoke(*args: str) -> subprocess.CompletedProcess:
    """A liger command run in this process (the CLI's own parsing, error handling and exit code), shaped
    as `liger(...)`'s result so the same checks read it: stdout and stderr apart. An exception the
    command did not turn into an exit code is raised here, traceback and all."""
    result = CliRunner().invoke(cli.app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def test_generate_writes_each_row_with_its_completion(run: Path, prompts: Path, tmp_path: Path) -> None:
    """The one `liger generate` of this file run as its own process, as a user starts it."""
    out = tmp_path / "out.jsonl"
    proc = liger("generate", str(run), "--prompts", str(prompts), "--out", str(out), "--logprobs",
                 "--max-new-tokens", "12", "--batch-size", "4")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote 6 completions to {out}" in proc.stdout and "format instruction" in proc.stdout
    rows = generated(out)
    assert [r.get("id") for r in rows] == [None] * 5 + ["mine"]  # input order, fields carried
    assert [{k: r[k] for k in PROMPTS[0]} for r in rows[:5]] == PROMPTS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "final")
    for row in rows:
        ids, reason = row["completion_ids"], row["finish_reason"]
        assert len(row["logprobs"]) == len(ids) <= 12 and all(lp <= 0 for lp in row["logprobs"])
        assert reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
        assert row["completion"] == tok.decode(
            ids[:-1] if reason == "stop" else ids, skip_special_tokens=True
        )


def test_every_way_of_naming_the_model_gives_the_same_completions(
    run: Path, prompts: Path, tmp_path: Path
) -> None:
    """The run folder, final/, the last checkpoint (the same weights), the base with --adapter, the merged
    model, our kernels patched in: the same greedy completions. An earlier checkpoint is another model.
    In this process: each name is the same command line, parsed by the same app."""
    base = json.loads((run / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    merged = tmp_path / "merged"
    assert invoke("merge", str(run), str(merged)).returncode == 0
    names = {
        "run": [str(run)],
        "final": [str(run / "final")],
        "step-4": [str(run / "checkpoints" / "step-4")],
        "adapter": [base, "--adapter", str(run / "final"), "--format", "instruction"],
        "merged": [str(merged), "--format", "instruction"],
        "step-2": [str(run / "checkpoints" / "step-2")],
        "kernels": [str(run), "--kernels"],  # proved on the twin first; last: patches nothing else
    }
    found = {}
    for name, args in names.items():
        out = tmp_path / f"{name}.jsonl"
        proc = invoke(
            "generate", *args, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "10"
        )
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        found[name] = [r["completion_ids"] for r in generated(out)]
    assert (
        found["final"]
        == found["run"]
        == found["step-4"]
        == found["adapter"]
        == found["merged"]
        == found["kernels"]
    )
    assert found["step-2"] != found["final"]


def test_two_processes_write_what_one_writes(run: Path, prompts: Path, tmp_path: Path) -> None:
    """Sampled, 2 completions per prompt, batches of 3: dealt over 2 processes by `accelerate launch`
    (on a CPU its multi-GPU launcher with ACCELERATE_USE_CPU: `--cpu` alone starts one process); the
    1-process file is written in this process."""
    options = ["--prompts", str(prompts), "--temperature", "1.0", "--top-p", "0.9", "--seed", "7",
               "--num-return-sequences", "2", "--batch-size", "3", "--max-new-tokens", "8", "--logprobs"]  # fmt: skip
    one = tmp_path / "one.jsonl"
    assert invoke("generate", str(run), *options, "--out", str(one)).returncode == 0
    two = tmp_path / "two.jsonl"
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--main_process_port", str(free_port()), "-m", "liger_cli", "generate", str(run), *options,
            "--out", str(two)]  # fmt: skip
    env = child_env(ACCELERATE_USE_CPU="1")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote 12 completions") == 1 and "over 2 processes" in proc.stdout
    rows, theirs = generated(one), generated(two)
    for mine, other in zip(rows, theirs, strict=True):  # the same tokens; log-probs to float rounding
        assert {**mine, "logprobs": None} == {**other, "logprobs": None}
        assert mine["logprobs"] == pytest.approx(other["logprobs"], abs=1e-5)
    assert [r["sample_index"] for r in rows] == [0, 1] * 6
    assert any(a["completion_ids"] != b["completion_ids"] for a, b in zip(rows[::2], rows[1::2], strict=True))


def test_eval_samples_are_written_at_each_evaluation(run: Path) -> None:
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 3 + [2] * 3 + [4] * 3
    assert [r["reference"] for r in rows[:3]] == [p["output"] for p in PROMPTS[:3]]
    assert rows[0]["prompt"].startswith("### Instruction:\n" + PROMPTS[0]["instruction"])
    assert rows[0]["prompt"].endswith("### Response:\n")
    # eval_sample_match: the share of each evaluation's completions equal to their reference
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    matches = {m["step"]: m["eval_sample_match"] for m in logged if "eval_sample_match" in m}
    assert matches == {
        step: sum(r["completion"].strip() == r["reference"].strip() for r in rows if r["step"] == step) / 3
        for step in (0, 2, 4)
    }


def test_user_mistakes_are_one_line_and_write_nothing(run: Path, prompts: Path, tmp_path: Path) -> None:
    """In this process: the error line, exit 2 and no file come from the command itself (stderr is kept
    apart from stdout as a process's is)."""
    out = tmp_path / "out.jsonl"
    unsaved = tmp_path / "unsaved"
    unsaved.mkdir()
    for name in ("recipe.yaml", "plan.txt"):
        shutil.copy(run / name, unsaved / name)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a"}\n{"prompt": \n')
    no_prompt = tmp_path / "none.jsonl"
    no_prompt.write_text('{"question": "a"}\n')
    chat_row = tmp_path / "chat.jsonl"
    chat_row.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    folders = {name: tmp_path / name for name in ("broken", "bad-adapter", "baseless", "untokenized", "sharded",
                                                  "foreign")}  # fmt: skip
    for folder in list(folders.values())[:4]:
        folder.mkdir()
    (folders["broken"] / "recipe.yaml").write_text("model: [unclosed\n")
    (folders["broken"] / "plan.txt").write_text("")
    (folders["bad-adapter"] / "adapter_config.json").write_text("not json")
    (folders["baseless"] / "adapter_config.json").write_text('{"base_model_name_or_path": "/nowhere"}')
    (folders["untokenized"] / "config.json").write_text('{"model_type": "llama"}')
    (unsaved / "checkpoints" / "step-3").mkdir(parents=True)
    for name in ("sharded", "foreign"):  # a checkpoint as FSDP writes it, and one of another model
        shutil.copytree(run, folders[name], ignore=shutil.ignore_patterns("final", "step-2"))
    (folders["sharded"] / "checkpoints" / "step-4" / "model.safetensors").unlink()
    save_file({"x": torch.zeros(2)}, folders["foreign"] / "checkpoints" / "step-4" / "model.safetensors")
    cases = {
        "no final model and no complete checkpoint": [str(unsaved), "--prompts", str(prompts)],
        "bad.jsonl line 2: not JSON": [str(run), "--prompts", str(bad_json)],
        'none.jsonl line 1: a row needs "prompt"': [str(run), "--prompts", str(no_prompt)],
        "chat.jsonl row 1: a messages prompt, but the run trained on format instruction": [
            str(run),
            "--prompts",
            str(chat_row),
        ],  # fmt: skip
        "exceed the model's maximum length 256": [
            str(run),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "250",
        ],
        "identical completions: set --temperature": [
            str(run),
            "--prompts",
            str(prompts),
            "--num-return-sequences",
            "2",
        ],  # fmt: skip
        "--top-p 1.5: must be in (0, 1]": [str(run), "--prompts", str(prompts), "--top-p", "1.5"],
        "no such run or model folder": [str(tmp_path / "nowhere"), "--prompts", str(prompts)],
        "--format xml: choose one of text, instruction, chat": [str(run), "--prompts", str(prompts), "--format", "xml"],
        "no adapter_config.json there; give a peft adapter folder": [str(run), "--adapter", str(tmp_path), "--prompts", str(prompts)],
        "--adapter goes on a base model folder (with config.json)": [str(tmp_path), "--adapter", str(run / "final"), "--prompts", str(prompts)],
        "broken/recipe.yaml is not a liger run's recipe": [str(folders["broken"]), "--prompts", str(prompts)],
        "step-3 holds no saved model": [str(unsaved / "checkpoints" / "step-3"), "--prompts", str(prompts)],
        "bad-adapter/adapter_config.json is not a peft adapter config": [str(folders["bad-adapter"]), "--prompts", str(prompts)],
        "the adapter's base model '/nowhere' is not a local model folder": [str(folders["baseless"]), "--prompts", str(prompts)],
        "untokenized has no tokenizer (no tokenizer_config.json or tokenizer.json)": [str(folders["untokenized"]), "--prompts", str(prompts)],
        "written by a sharding backend": [str(folders["sharded"]), "--prompts", str(prompts)],
        "does not fit the run's model (1 unexpected": [str(folders["foreign"]), "--prompts", str(prompts)],
    }  # fmt: skip
    for expected, args in cases.items():
        line = one_line_error(invoke("generate", *args, "--out", str(out)))
        assert expected in line, (expected, line)
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    line = one_line_error(invoke("generate", str(run), "--prompts", str(prompts), "--out", str(tmp_path)))
    assert "is a folder" in line


# --- liger chat, through a real pseudo-terminal --------------------------------------------------------------


class Terminal:
    """A command on a pseudo-terminal: type lines, read what it prints."""

    def __init__(self, argv: list[str]):
        self.fd, child = pty.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=child, stdout=child, stderr=child, env=child_env(), close_fds=True
        )
        os.close(child)
        self.seen = ""

    def read_until(self, text: str, timeout: float = 120) -> str:
        """Everything printed up to and including `text` (from where the last read stopped)."""
        end = time.monotonic() + timeout
        while text not in self.seen:
            assert time.monotonic() < end, f"no {text!r} in {self.seen[-2000:]!r}"
            if select.select([self.fd], [], [], 0.5)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    assert text in self.seen, self.seen[-2000:]
        cut = self.seen.index(text) + len(text)
        found, self.seen = self.seen[:cut], self.seen[cut:]
        return found

    def type(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


def reply(terminal: Terminal) -> str:
    """The streamed reply after "model> ", up to the next prompt."""
    terminal.read_until("model> ")
    return terminal.read_until("you> ")[: -len("you> ")].replace("\r\n", "\n").strip("\n")


def generate_one(run: Path, row: dict, tmp_path: Path, *args: str) -> str:
    """`liger generate`'s completion of one row (in this process)."""
    path, out = tmp_path / "one.jsonl", tmp_path / "one-out.jsonl"
    path.write_text(json.dumps(row) + "\n")
    proc = invoke(
        "generate", str(run), "--prompts", str(path), "--out", str(out), "--max-new-tokens", "10", *args
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return generated(out)[0]["completion"]


@pytest.mark.timeout(900)
def test_chat_streams_the_reply_generate_gives(run: Path, tmp_path: Path) -> None:
    """An instruction run: a message continued with a backslash (instruction, then input) is answered as
    `liger generate` answers the same prompt. With --format chat the conversation is kept: the second
    reply is generate's for the whole conversation; /reset and /system start over."""
    term = Terminal([sys.executable, "-m", "liger_cli", "chat", str(run), "--max-new-tokens", "10"])
    banner = term.read_until("you> ")
    assert "format instruction, each message answered on its own" in banner and "/reset" in banner
    term.type("Write the number in words.\\")
    term.read_until("...> ")
    term.type("347")
    assert reply(term) == generate_one(run, {"prompt": "Write the number in words.\n347"}, tmp_path)
    term.type("/exit")
    assert term.proc.wait(timeout=30) == 0

    term = Terminal(
        [sys.executable, "-m", "liger_cli", "chat", str(run), "--max-new-tokens", "10", "--format", "chat"]
    )
    assert "format chat)" in term.read_until("you> ")
    term.type("hello there")
    first = reply(term)
    term.type("and again")
    second = reply(term)
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "and again"}]  # fmt: skip
    assert second == generate_one(run, {"messages": history}, tmp_path, "--format", "chat")
    term.type("/reset")
    term.read_until("(conversation reset)")
    term.type("and again")
    assert reply(term) == generate_one(run, {"messages": history[2:]}, tmp_path, "--format", "chat")
    term.type("/system Be brief.")
    term.read_until("(system message set; conversation reset)")
    term.type("/exit")
    assert term.proc.wait(timeout=30) == 0


def test_chat_answers_or_explains_each_kind_of_message(run: Path, tmp_path: Path, monkeypatch) -> None:
    """In this process, the messages a terminal session rarely sends: an empty line is skipped, `/image`
    on a text model is refused, a conversation past the model's 256 positions asks for /reset, and a
    message still continued at end of input is answered. --kernels reports what the twin proved."""
    import io

    from liger_cli.generate.engine import Sampling
    from liger_cli.serve.chat import chat_command

    long = " ".join(["seven"] * 300)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"\n/image {tmp_path / 'x.png'}\n{long}\nhello\\\n"))
    said = io.StringIO()
    assert chat_command(run, None, Sampling(4, 0.0), True, "chat", None, out=said) == 0
    text = said.getvalue()
    assert "kernels: " in text and "rms_norm" in text, text
    assert "(this model takes no images: /image needs a vision-language run" in text
    assert "tokens, the model's limit is 256: /reset to go on)" in text
    assert text.count("model> ") == 1  # only the continued "hello" was answered
    assert text.index("model> ") > text.index("the model's limit is 256")


def test_an_online_run_is_chatted_with_as_its_prompts_were_rendered(tmp_path: Path) -> None:
    """`format: prompt` runs render each prompt by its shape: message lists (or any prompt, given tools)
    through the chat template, text as text. `liger chat`/`generate` on such a run, without --format,
    render the same way: read off the run's first training prompt; a run whose data is gone is told to
    pass --format."""
    from liger_cli.errors import UserError
    from liger_cli.generate.load import run_format
    from liger_cli.recipe import load_recipe

    recipes = REPO / "recipes"
    # message-list prompts (its adapter.init is the SFT run's, made by training: not needed here)
    assert run_format(load_recipe(recipes / "smollm2-grpo.yaml", ["adapter.init=null"])) == "chat"
    assert run_format(load_recipe(recipes / "grpo.yaml", [])) == "text"  # text prompts
    assert run_format(load_recipe(recipes / "agent.yaml", [])) == "chat"  # tools: through the template
    moved = tmp_path / "prompts.jsonl"
    shutil.copy(recipes / "grpo" / "train.jsonl", moved)
    recipe = load_recipe(recipes / "grpo.yaml", [f"data.train={moved}"])
    moved.unlink()
    with pytest.raises(UserError, match="pass --format chat or --format text"):
        run_format(recipe)
