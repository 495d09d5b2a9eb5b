"""What is saved is what was trained: a run reloads its final output from disk and compares it with the
model in memory; `liger merge` compares the merged model with base + adapter. Each breakage is made on
purpose right after the real save (a zeroed adapter tensor, a dropped full-model tensor, an adapter
config that scales differently, a merge that merged nothing) and must be a one-line exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_train import recipe_text

# Trains through the real command line (`liger train`) with the final save wrapped: the real save,
# then a tampering of what it wrote, chosen by argv[2].
TAMPER_DRIVER = """
import json, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
from liger_cli import cli
from liger_cli.run import train

recipe, mode = sys.argv[1], sys.argv[2]
real_save_final = train.save_final

def save_final(backend, model, tokenizer, out):
    state = real_save_final(backend, model, tokenizer, out)
    final = Path(out) / "final"
    if mode == "zero-lora-b":
        weights = load_file(final / "adapter_model.safetensors")
        key = sorted(k for k in weights if "lora_B" in k)[0]
        weights[key] = weights[key] * 0
        save_file(weights, final / "adapter_model.safetensors")
    elif mode == "alpha":
        config = json.loads((final / "adapter_config.json").read_text())
        config["lora_alpha"] *= 4
        (final / "adapter_config.json").write_text(json.dumps(config))
    elif mode == "drop-norm":
        weights = load_file(final / "model.safetensors")
        weights["model.norm.weight"] = weights["model.norm.weight"] + 1
        save_file(weights, final / "model.safetensors", metadata={"format": "pt"})
    return state

train.save_final = save_final
sys.argv = ["liger", "train", recipe]
cli.main()
"""

MERGE_NOTHING_DRIVER = """
import sys
from peft import PeftModel
from liger_cli import cli

PeftModel.merge_and_unload = lambda self, *a, **k: self.get_base_model()  # a merge that merged nothing
sys.argv = ["liger", "merge", sys.argv[1], sys.argv[2]]
cli.main()
"""


def run(driver: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", driver, *args], capture_output=True, text=True, timeout=600)


def write_recipe(model_dir: Path, root: Path, name: str, **extra: str) -> Path:
    extra.setdefault("training", "{max_steps: 2, micro_batch_size: 4, lr: 2.0e-2, seed: 3}")
    extra.setdefault("output", f"{{dir: {root / name}}}")
    recipe = root / f"{name}.yaml"
    recipe.write_text(recipe_text(model_dir, root / name, **extra))
    return recipe


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def verified_run(model_dir: Path, root: Path, adapter: str) -> subprocess.CompletedProcess:
    recipe = write_recipe(model_dir, root, adapter, adapter=f"{{type: {adapter}}}")
    return run(TAMPER_DRIVER, str(recipe), "none")


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir: Path, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """A LoRA run saved untouched: the merge test below merges it too."""
    root = tmp_path_factory.mktemp("saved")
    return verified_run(tiny_model_dir, root, "lora"), root / "lora"


@pytest.mark.parametrize("adapter", ["lora", "none"])
def test_a_run_reloads_its_final_output_and_says_verified(
    adapter, lora_run, tiny_model_dir, tmp_path
) -> None:
    if adapter == "lora":
        proc, out = lora_run
    else:
        proc, out = verified_run(tiny_model_dir, tmp_path, adapter), tmp_path / adapter
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("final model verified")]
    assert len(verdict) == 1 and "every tensor equal" in verdict[0], proc.stdout[-2000:]
    assert (out / "final_metrics.json").is_file()


@pytest.mark.parametrize(
    ("adapter", "mode", "expected"),
    [
        ("lora", "zero-lora-b", "1 of"),  # an adapter saved partly empty: the tensor is named
        ("none", "drop-norm", "model.norm.weight"),  # a full model whose saved tensor is not the trained one
        ("lora", "alpha", "computes other logits"),  # the tensors are right, the config scales them wrong
    ],
)
def test_a_saved_output_that_differs_is_an_error_naming_what(
    adapter, mode, expected, tiny_model_dir, tmp_path
) -> None:
    recipe = write_recipe(tiny_model_dir, tmp_path, mode, adapter=f"{{type: {adapter}}}")
    proc = run(TAMPER_DRIVER, str(recipe), mode)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert expected in lines[0] and "final model" in lines[0], lines[0]
    if mode == "zero-lora-b":
        weights = load_file(tmp_path / mode / "final" / "adapter_model.safetensors")
        zeroed = sorted(k for k in weights if "lora_B" in k)[0].replace(".weight", ".default.weight")
        assert zeroed in lines[0], lines[0]
    assert not (tmp_path / mode / "final_metrics.json").exists()  # the run is not marked complete
    assert "final model verified" not in proc.stdout


def test_verification_can_be_turned_off(tiny_model_dir, tmp_path) -> None:
    output = f"{{dir: {tmp_path / 'off'}, verify: false}}"
    recipe = write_recipe(tiny_model_dir, tmp_path, "off", output=output)
    proc = run(TAMPER_DRIVER, str(recipe), "alpha")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final model not verified (output.verify: false)" in proc.stdout


def test_a_merge_that_changes_the_logits_writes_nothing(lora_run, tiny_model_dir, tmp_path) -> None:
    proc, out = lora_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = tmp_path / "merged"
    proc = run(MERGE_NOTHING_DRIVER, str(out), str(merged))
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1 and "does not compute what base + adapter computes" in lines[0], proc.stderr
    assert not merged.exists() and not list(tmp_path.glob(".merged.tmp-*"))
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == tiny_model_dir
