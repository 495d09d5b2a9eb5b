"""`liger train` end to end on one process: outputs, eval, output protection, NaN stop, merge (crash
safety and resume: tests/test_resume.py)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
QUICK_DATA = REPO / "recipes" / "quickstart" / "data"


def recipe_text(model_dir: Path, out: Path, **extra: str) -> str:
    sections = {
        "model": f"{{path: {model_dir}}}",
        "adapter": "{type: lora, r: 4, alpha: 8}",
        "data": f"{{train: {QUICK_DATA / 'train.jsonl'}, eval: {QUICK_DATA / 'eval.jsonl'}, "
        "format: instruction, max_seq_len: 48}",
        "training": "{max_steps: 6, micro_batch_size: 4, grad_accum: 2, lr: 5.0e-3, warmup_steps: 1, "
        "eval_every: 3, seed: 3}",
        "output": f"{{dir: {out}, save_every: 2}}",
        "logging": "{every: 1, tensorboard: true}",
    }
    sections.update(extra)
    return "".join(f"{k}: {v}\n" for k, v in sections.items())


def liger(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`liger ARGS` in a process of its own (tests/warm_python.py: forked warm)."""
    return warm_python.run(["-m", "liger_cli", *args], timeout=timeout)


def liger_here(*args: str) -> subprocess.CompletedProcess:
    """`liger ARGS` in this process (typer's CliRunner), returned as `liger` returns a real process: for
    the further cases of a command whose real process other tests start (docs/testing.md, rule 6), about
    6 s of imports saved each. An exception that escapes the command is written to stderr as the
    traceback a real process would print (so `"Traceback" not in stderr` still catches it), with exit 1.
    What the command changes process-wide is put back (`restored_process_state`)."""
    import traceback
    import warnings

    from typer.testing import CliRunner

    from liger_cli import cli

    with restored_process_state(), warnings.catch_warnings():
        result = CliRunner().invoke(cli.app, list(args))
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_tb(result.exc_info[2]))
        stderr += f"{type(result.exception).__name__}: {result.exception}\n"
    return subprocess.CompletedProcess(["liger", *args], result.exit_code, result.stdout, stderr)


@contextlib.contextmanager
def restored_process_state():
    """Run a command or a training in this process, then put back what it changed process-wide, so later
    tests of this worker see nothing of it: the environment, transformers' log level and progress bars,
    the DeepSpeed logger's level, accelerate's singletons and the user's files it imported (rewards,
    tools: user_code.py keeps them in sys.modules by path, where a fresh process would import them
    anew). peft is imported first (bitsandbytes visible, as in the worker), so the run does not hide
    bitsandbytes from the rest of the worker (`hide_bitsandbytes_unless_quantized` leaves a process
    alone once peft is imported). glibc's mmap threshold, which a CPU launch lowers to 256 KiB, stays
    lowered: it only makes freed memory go back to the OS sooner."""
    import logging
    import os

    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers.utils import logging as hf_logging

    from liger_cli import process_state

    process_state.silence_hub_kernel_notice()
    import peft  # noqa: F401  (before the run: see the docstring)

    env = dict(os.environ)
    modules = set(sys.modules)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    deepspeed_level = logging.getLogger("DeepSpeed").level
    accelerate_was_set = bool(PartialState._shared_state)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        for name in set(sys.modules) - modules:  # the user's files (rewards, tools): a fresh import next time
            if name.startswith("liger_user_"):
                del sys.modules[name]
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        logging.getLogger("DeepSpeed").setLevel(deepspeed_level)
        process_state.reset_for_new_run()
        if not accelerate_was_set:
            PartialState._reset_state()
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


IN_ONE_PROCESS = """
import ctypes, gc, importlib, json, os, sys
sys.path.insert(0, sys.argv[1])
from check_memo import memoize_twin_checks
from test_train import liger_here

memoize_twin_checks()  # the commands share the twin checks of equal inputs (tests/check_memo.py)
done = []
for step in json.loads(sys.argv[2]):
    if isinstance(step, dict):  # {"call": "module.function", "args": [...]}: the test's own work between runs
        module, function = step["call"].rsplit(".", 1)
        getattr(importlib.import_module(module), function)(*step["args"])
        continue
    done.append(liger_here(*step))
    gc.collect()
    try:  # the freed heap back to the OS: the next command starts from what it holds, as a fresh process
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
print(json.dumps([[p.returncode, p.stdout, p.stderr] for p in done]), flush=True)
os._exit(0)  # what the commands wrote is closed; the teardown of every module would cost ~1.7 CPU s
"""


def liger_in_one_process(*steps: list[str] | dict, timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """Several `liger` commands one after the other in ONE fresh process, each through liger_here (its
    own exit code, stdout and stderr): what several runs cost with one process's imports. Between two
    commands the garbage is collected and glibc's freed heap given back to the OS. Only what the
    command prints through Python's sys.stdout is its stdout: a launch's ranks write to the process's.
    A step is a command (a list of arguments) or {"call": "module.function", "args": [...]}: a function
    of a test module called in that process between two commands (to copy or plant files). Returns the
    commands' results, in order."""
    proc = warm_python.run(
        ["-c", IN_ONE_PROCESS, str(Path(__file__).resolve().parent), json.dumps(steps)], timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    commands = [s for s in steps if not isinstance(s, dict)]
    return [subprocess.CompletedProcess(["liger", *c], *f) for c, f in zip(commands, found, strict=True)]


def adapter_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "adapter_model.safetensors")


NAN_OVERRIDES = [  # an absurd learning rate with no clipping: the weights overflow and the loss follows
    "--set", "training.lr=1e30", "--set", "training.max_grad_norm=null",
    "--set", "training.warmup_steps=0", "--set", "adapter.type=none",
]  # fmt: skip


@pytest.fixture(scope="module")
def module_runs(tiny_model_dir: Path, tmp_path_factory) -> dict:
    """In ONE process (test_train.liger_in_one_process): the uninterrupted 6-step run, then its
    `liger merge`, then the run whose loss becomes NaN. `liger train`'s real processes are other files'
    (test_resume's crash test among them); `liger merge`'s is test_output_safety's."""
    root = tmp_path_factory.mktemp("uninterrupted")
    recipe = root / "r.yaml"
    recipe.write_text(recipe_text(tiny_model_dir, root / "out"))
    nan_recipe, nan_out = root / "nan.yaml", root / "nan-out"
    nan_recipe.write_text(recipe_text(tiny_model_dir, nan_out, output=f"{{dir: {nan_out}, save_every: 1}}"))
    merged = root / "merged"
    train, merge, nan = liger_in_one_process(
        ["train", str(recipe)],
        ["merge", str(root / "out"), str(merged)],
        ["train", str(nan_recipe), *NAN_OVERRIDES],
    )
    assert train.returncode == 0, train.stderr[-3000:]
    return {"out": root / "out", "merge": merge, "merged": merged, "nan": nan, "nan_out": nan_out}


@pytest.fixture(scope="module")
def uninterrupted(module_runs: dict) -> Path:
    return module_runs["out"]


def test_outputs_of_a_run(uninterrupted: Path) -> None:
    out = uninterrupted
    assert (out / "recipe.yaml").is_file() and (out / "plan.txt").read_text().startswith("# plan")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
        assert (out / "final" / name).is_file(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    for r in records:
        if "loss" in r:
            assert set(r) >= {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb"}
            assert r["loss"] > 0 and r["tokens_per_s"] > 0
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 3, 6]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # checkpoints of an adapter run hold only the adapter's weights, not the frozen base
    saved = load_file(out / "checkpoints" / "step-2" / "model.safetensors")
    assert saved and all("lora_" in key for key in saved)


def test_adapter_loads_in_peft_and_reproduces_eval_loss(uninterrupted: Path, tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from liger_cli.data import build_datasets, collate
    from liger_cli.recipe import load_recipe

    recipe = load_recipe(uninterrupted / "recipe.yaml")
    tokenizer = AutoTokenizer.from_pretrained(uninterrupted / "final")
    _, eval_ds = build_datasets(recipe.data, tokenizer, recipe.training.seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, uninterrupted / "final").eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(eval_ds), 4):
            batch = collate(
                [eval_ds[i] for i in range(start, min(start + 4, len(eval_ds)))], tokenizer.pad_token_id
            )
            total += model(**batch, num_items_in_batch=torch.tensor(1)).loss.item()
            tokens += int((batch["labels"][:, 1:] != -100).sum())
    expected = json.loads((uninterrupted / "final_metrics.json").read_text())["eval_loss"]
    assert total / tokens == pytest.approx(expected, rel=1e-5)


def test_output_dir_protection(uninterrupted: Path, tmp_path: Path) -> None:
    before = sorted(p.name for p in uninterrupted.rglob("*"))
    proc = liger_here("train", str(uninterrupted / "recipe.yaml"))  # in this process: a refusal
    assert proc.returncode == 2
    assert "is not empty" in proc.stderr and "output.overwrite=true" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in uninterrupted.rglob("*")) == before
    # overwrite never deletes a folder that is not a liger run
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("do not delete")
    text = (uninterrupted / "recipe.yaml").read_text()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    proc = liger_here(
        "train", str(recipe), "--set", f"output.dir={foreign}", "--set", "output.overwrite=true"
    )
    assert proc.returncode == 2 and "not a liger run folder" in proc.stderr
    assert (foreign / "thesis.tex").read_text() == "do not delete"


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(module_runs: dict) -> None:
    proc, out = module_runs["nan"], module_runs["nan_out"]  # trained with NAN_OVERRIDES
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")][0]
    assert "loss is" in line and "at step" in line and "last good checkpoint" in line
    step = int(line.split("at step ")[1].split(":")[0])
    assert step >= 2
    assert (out / "checkpoints" / f"step-{step - 1}" / "trainer_state.json").is_file()
    assert not (out / "final").exists()


def test_merge_gives_the_adapter_models_logits(
    module_runs: dict, uninterrupted: Path, tiny_model_dir: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    proc, merged_dir = module_runs["merge"], module_runs["merged"]  # merged in module_runs' process
    assert proc.returncode == 0, proc.stderr[-2000:]
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("merge verified")]
    assert len(verdict) == 1 and float(verdict[0].rsplit("difference ", 1)[1].rstrip(")")) < 1e-4, proc.stdout
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), uninterrupted / "final"
    ).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, atol=1e-5, rtol=1e-5)
    again = liger_here("merge", str(uninterrupted), str(merged_dir))  # the refusal, in this process
    assert again.returncode == 2 and "--overwrite" in again.stderr
