"""The memory plan: estimates against real CPU training runs, the verdict and its suggestions."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import warm_python
import yaml
from conftest import QUICKSTART_MODEL

REPO = Path(__file__).resolve().parents[1]
BAND = 0.25  # the estimate is within +-25% of the measured peak
# Big enough that a step's tensors dominate a process's noise (~1 GB), small enough for seconds a run.
MODEL = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False,
)  # fmt: skip
# name: (adapter, fused loss, activation checkpointing, backend). Together: LoRA and full fine-tuning,
# the fused loss on and off, checkpointing on and off, one process and FSDP-2 on 2 processes.
CASES = {
    "lora": ("lora", True, "off", "none"),
    "lora-eager-loss-checkpointed": ("lora", False, "non_reentrant", "none"),
    "full": ("none", True, "off", "none"),
    "fsdp2-2-processes-full-eager-loss": ("none", False, "off", "fsdp2"),
}


@pytest.fixture(scope="module")
def memory_model(tmp_path_factory) -> Path:
    return save_memory_model(tmp_path_factory.mktemp("memory-model"))


def save_memory_model(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model("llama", **MODEL)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(QUICKSTART_MODEL).save_pretrained(path)
    return path


def write_recipe(tmp_path: Path, model: Path, name: str, steps: int = 2, **distributed) -> Path:
    adapter, fused, ckpt, backend = CASES[name]
    recipe = {
        "model": {"path": str(model)},
        "adapter": {"type": adapter, "r": 16, "alpha": 32, "target_modules": "all-linear"},
        "data": {"train": str(REPO / "recipes/bench/train.jsonl"), "format": "text", "max_seq_len": 256},
        "training": {"max_steps": steps, "micro_batch_size": 4, "lr": 1e-4, "precision": "fp32"},
        "kernels": {"rms_norm": True, "rope": True, "swiglu": True, "fused_linear_cross_entropy": fused,
                    "check": False},
        "distributed": {"backend": backend, "num_processes": 2 if backend != "none" else 1,
                        "activation_checkpointing": ckpt, **distributed},
        "output": {"dir": str(tmp_path / name)},
        "logging": {"every": 1, "tensorboard": False},
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def liger(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return warm_python.run(["-m", "liger_cli", *args], timeout=timeout)


def estimate(recipe: Path, *overrides: str, device_memory: int | None = None) -> dict:
    """What `liger train RECIPE --dry-run --json` prints under "memory" (in this process: faster)."""
    from liger_cli.plan.dry_run import dry_run
    from liger_cli.recipe import load_recipe

    return json.loads(dry_run(load_recipe(recipe, list(overrides)), device_memory, as_json=True))["memory"]


@pytest.fixture(scope="module")
def measured(memory_model, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The 1-process cases' `liger train`, one after the other in ONE process (test_train.liger_in_one_process:
    each its own exit code and output), the smallest peak first. Each run's peak is measured over its own
    memory right before its model was built (run/metrics.py's MemoryWatch); a CPU launch gives freed
    tensors back to the OS (launch/start.py) and the driver its freed heap between runs, so an earlier
    run does not count in a later one's peak. The FSDP-2 case is the first case of the suite's shared
    2-process launch (`launch_part`)."""
    from test_train import liger_in_one_process

    root = tmp_path_factory.mktemp("measured")
    names = [name for name in CASES if CASES[name][3] == "none"]
    recipes = {name: write_recipe(root, memory_model, name) for name in names}
    procs = liger_in_one_process(*(["train", str(recipe)] for recipe in recipes.values()))
    return {name: (recipes[name], proc) for name, proc in zip(names, procs, strict=True)}


def launch_part(root: Path) -> tuple[list[dict], dict[str, Path]]:
    """The FSDP-2 case in the suite's shared 2-process launch (tests/conftest.py `two_process_launch`),
    its first case: its ranks hold nothing but their imports when its model is built, as a `liger train`
    rank does (tests/dist_driver.py gives freed memory back to the OS as `liger train` does)."""
    root.mkdir(parents=True)
    model = save_memory_model(root / "model")
    recipes = {name: write_recipe(root, model, name) for name in CASES if CASES[name][3] != "none"}
    return [{"recipe": str(r)} for r in recipes.values()], recipes


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_is_within_25_percent_of_the_measured_peak(request, name):
    if CASES[name][3] == "none":
        recipe, proc = request.getfixturevalue("measured")[name]
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout = proc.stdout
    else:  # trained in the shared 2-process launch: rank 0's output is beside the recipe
        recipe = request.getfixturevalue("two_process_launch")["test_memory_plan"][name]
        stdout = recipe.with_suffix(".stdout").read_text()
    memory = estimate(recipe)
    found = (
        json.loads((recipe.parent / name / "final_metrics.json").read_text())["peak_mem_growth_mb"] * 2**20
    )
    ratio = memory["total_bytes"] / found
    print(f"{name}: estimate {memory['total_bytes'] / 2**20:.0f} MiB, measured {found / 2**20:.0f} MiB, "
          f"{ratio:.2f}x {memory['components']}")  # fmt: skip
    assert 1 - BAND <= ratio <= 1 + BAND
    assert "memory: peak" in stdout


def test_a_recipe_that_does_not_fit_gets_ranked_changes_each_re_estimated(memory_model, tmp_path):
    recipe = write_recipe(tmp_path, memory_model, "lora-eager-loss-checkpointed")
    before = estimate(recipe, "distributed.activation_checkpointing=off")
    device = before["total_bytes"] // 2
    memory = estimate(recipe, "distributed.activation_checkpointing=off", device_memory=device)
    assert memory["fits"] is False and memory["device_memory_bytes"] == device
    assert memory["total_bytes"] == sum(memory["components"].values()) == before["total_bytes"]
    changes = [tuple(s["set"]) for s in memory["suggestions"]]
    assert ("kernels.fused_linear_cross_entropy=true",) in changes
    assert ("distributed.activation_checkpointing=auto",) in changes
    fitting = [s["total_bytes"] <= device for s in memory["suggestions"]]
    assert fitting == sorted(fitting, reverse=True) and fitting[0]  # those that fit come first
    for suggestion in memory["suggestions"]:  # each total is what the changed recipe estimates
        after = estimate(recipe, "distributed.activation_checkpointing=off", *suggestion["set"])
        # (a smaller micro-batch scales the measured activations: a few shared tensors do not scale)
        assert after["total_bytes"] == pytest.approx(suggestion["total_bytes"], rel=1e-3), suggestion


def cli(*args: str):
    from typer.testing import CliRunner

    from liger_cli import cli

    return CliRunner().invoke(cli.app, list(args))


def test_dry_run_prints_the_memory_block_the_verdict_and_the_changes(memory_model, tmp_path):
    recipe = write_recipe(tmp_path, memory_model, "lora-eager-loss-checkpointed")
    proc = cli("train", str(recipe), "--dry-run", "--device-memory", "0.3GB")
    assert proc.exit_code == 0, proc.output[-2000:]
    plan, _, memory = proc.stdout.partition("# memory per rank (estimate)")
    assert "# plan" in plan and "activation ckpt     non_reentrant" in plan
    for part in ("parameters", "gradients", "optimizer", "activations", "loss", "total"):
        assert f"\n{part} " in memory
    assert "verdict: does not fit" in memory
    assert "--set kernels.fused_linear_cross_entropy=true  ->" in memory
    fits = cli("train", str(recipe), "--dry-run", "--device-memory", "80GB")
    assert "verdict: fits" in fits.stdout and "--set" not in fits.stdout.split("# memory per rank")[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--dry-run", "--device-memory", "lots"],
            "--device-memory 'lots': give a size such as 80GB, 24GiB or 16384MB",
        ),
        (["--device-memory", "80GB"], "--device-memory and --json go with --dry-run: add --dry-run"),
    ],
)
def test_bad_device_memory_is_one_line_and_exit_2(tmp_path, args, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {config: x}\n")
    proc = cli("train", str(recipe), *args)
    assert proc.exit_code == 2
    assert proc.stderr.strip().splitlines() == [f"error: {message}"]


def test_device_memory_sizes():
    from liger_cli.plan.device_memory import parse_device_memory

    assert parse_device_memory("80GB") == parse_device_memory("80GiB") == 80 * 2**30
    assert parse_device_memory("16384MB") == 16 * 2**30
    assert parse_device_memory("1.5 tb") == int(1.5 * 2**40)


def test_70b_on_8_processes_from_its_config_alone(tmp_path):
    """Llama-3-70B's config (no weights exist): FSDP-2 over 8 ranks, LoRA, bf16 weights, 4 x 4096."""
    recipe = tmp_path / "70b.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(REPO / "tests/configs/llama-3-70b/config.json"), "dtype": "bfloat16",
                  "tokenizer": str(QUICKSTART_MODEL)},
        "adapter": {"type": "lora", "r": 16, "alpha": 32, "target_modules": "all-linear"},
        "data": {"train": str(REPO / "recipes/bench/train.jsonl"), "format": "text", "max_seq_len": 4096},
        "training": {"max_steps": 1, "micro_batch_size": 4},
        "kernels": {"fused_linear_cross_entropy": True, "check": False},
        "distributed": {"backend": "fsdp2", "num_processes": 8, "activation_checkpointing": "auto"},
        "output": {"dir": str(tmp_path / "out")},
    }))  # fmt: skip
    start = time.perf_counter()
    proc = liger("inspect-wrap", "--recipe", str(recipe), "--json", "--device-memory", "80GB")
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    memory = json.loads(proc.stdout)["memory"]
    parts = memory["components"]
    assert abs(parts["parameters"] * 8 / (2 * 70.55e9) - 1) < 0.01  # bf16, 1/8 of 70.55 B per rank
    assert 0 < parts["gathered unit"] < parts["parameters"]
    assert parts["activations"] > 0 and memory["fits"] is True
    print(
        f"70B, 8 processes: {elapsed:.1f} s in a fresh process, {memory['total_bytes'] / 2**30:.1f} GiB per rank"
    )


def test_a_forward_that_cannot_run_on_meta_is_not_guessed(tmp_path):
    """Mixtral routes tokens by their values: no meta measurement, so no verdict either."""
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": str(REPO / "tests/configs/mixtral-8x7b/config.json"), "dtype": "bfloat16",
                  "tokenizer": str(QUICKSTART_MODEL)},
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        "data": {"train": str(REPO / "recipes/bench/train.jsonl"), "format": "text", "max_seq_len": 1024},
        "training": {"max_steps": 1},
        "kernels": {"check": False},
        "distributed": {"backend": "fsdp2", "num_processes": 8},
        "output": {"dir": str(tmp_path / "out")},
    }))  # fmt: skip
    memory = estimate(recipe, device_memory=80 * 2**30)
    assert memory["components"]["activations"] == 0 and memory["fits"] is None
    text = cli("train", str(recipe), "--dry-run", "--device-memory", "80GB").stdout
    assert "NOT MEASURED (its forward cannot run on the meta device" in text
    assert "verdict: unknown (the lower bound is" in text
