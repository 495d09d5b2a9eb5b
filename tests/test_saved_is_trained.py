"""What is saved is what was trained: a run reloads its final output from disk and compares it with the
model in memory; `liger merge` compares the merged model with base + adapter. Each breakage is made on
purpose right after the real save (a zeroed adapter tensor, a dropped full-model tensor, an adapter
config that scales differently, a merge that merged nothing) and must be a one-line exit 1."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import warm_python
from safetensors.torch import load_file
from test_train import recipe_text

TESTS = Path(__file__).resolve().parent
_REAL_SAVE_FINAL = []


def tamper_with_the_final_save(mode: str) -> None:
    """Wrap `train.save_final`: the real save, then a tampering of what it wrote ("none": untouched)."""
    from safetensors.torch import save_file

    from liger_cli.run import train

    if not _REAL_SAVE_FINAL:
        _REAL_SAVE_FINAL.append(train.save_final)
    real_save_final = _REAL_SAVE_FINAL[0]

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


# Trains through the real command line (`liger train RECIPE`, its own process) with the final save
# wrapped, the tampering chosen by argv[2].
TAMPER_DRIVER = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from test_saved_is_trained import tamper_with_the_final_save
from liger_cli import cli

recipe, mode = sys.argv[1], sys.argv[2]
tamper_with_the_final_save(mode)
sys.argv = ["liger", "train", recipe]
cli.main()
"""

# The other cases, one after the other in ONE process (a process costs ~6 s of imports): each
# `liger train` (or the merge) through the CLI in that process (test_train.liger_here: exit code,
# stdout and stderr of each command, an escaped exception as a traceback on its stderr).
CASES_DRIVER = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
from test_saved_is_trained import run_cases

run_cases(sys.argv[1])
"""


def run_cases(spec_path: str) -> None:
    """CASES_DRIVER's work. SPEC: {"train": [[RECIPE, MODE], ...], "merge_nothing": [RUN, OUT] or null};
    writes [returncode, stdout, stderr] per case to SPEC.results.json (trainings by recipe, "merge")."""
    from test_train import liger_here

    spec = json.loads(Path(spec_path).read_text())
    results = {}
    for recipe, mode in spec["train"]:
        tamper_with_the_final_save(mode)
        proc = liger_here("train", recipe)
        results[recipe] = [proc.returncode, proc.stdout, proc.stderr]
    if spec.get("merge_nothing"):
        from peft import PeftModel

        PeftModel.merge_and_unload = lambda self, *a, **k: (
            self.get_base_model()
        )  # a merge that merged nothing
        proc = liger_here("merge", *spec["merge_nothing"])
        results["merge"] = [proc.returncode, proc.stdout, proc.stderr]
    Path(spec_path).with_suffix(".results.json").write_text(json.dumps(results))


def run(driver: str, *args: str) -> subprocess.CompletedProcess:
    return warm_python.run(["-c", driver, *args], timeout=600)


def write_recipe(model_dir: Path, root: Path, name: str, **extra: str) -> Path:
    extra.setdefault("training", "{max_steps: 2, micro_batch_size: 4, lr: 2.0e-2, seed: 3}")
    extra.setdefault("output", f"{{dir: {root / name}}}")
    recipe = root / f"{name}.yaml"
    recipe.write_text(recipe_text(model_dir, root / name, **extra))
    return recipe


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


# name: (adapter section, tampering, output section or None). "zero-lora-b" is a real process (below).
CASES = {
    "lora": ("{type: lora}", "none", None),  # saved untouched: the merge case merges it too
    "none": ("{type: none}", "none", None),
    "drop-norm": ("{type: none}", "drop-norm", None),
    "alpha": ("{type: lora}", "alpha", None),
    "off": ("{type: lora, r: 4, alpha: 8}", "alpha", "{{dir: {out}, verify: false}}"),
}


@pytest.fixture(scope="module")
def cases(tiny_model_dir: Path, tmp_path_factory) -> tuple[dict, Path]:
    """CASES, then `liger merge` of the "lora" run with a merge that merged nothing, in one process.
    Returns each case's CompletedProcess (the merge's as "merge") and the folder of their outputs."""
    root = tmp_path_factory.mktemp("cases")
    spec: dict = {"train": [], "merge_nothing": [str(root / "lora"), str(root / "merged")]}
    recipes = {}
    for name, (adapter, mode, output) in CASES.items():
        extra = {"output": output.format(out=root / name)} if output else {}
        recipes[name] = str(write_recipe(tiny_model_dir, root, name, adapter=adapter, **extra))
        spec["train"].append([recipes[name], mode])
    (root / "spec.json").write_text(json.dumps(spec))
    driver = run(CASES_DRIVER, str(root / "spec.json"))
    assert driver.returncode == 0, driver.stderr[-3000:]
    found = json.loads((root / "spec.results.json").read_text())
    procs = {
        name: subprocess.CompletedProcess(["liger", "train", path], *found[path])
        for name, path in recipes.items()
    }
    procs["merge"] = subprocess.CompletedProcess(["liger", "merge"], *found["merge"])
    return procs, root


@pytest.fixture(scope="module")
def lora_run(cases) -> tuple[subprocess.CompletedProcess, Path]:
    """The LoRA run saved untouched (the first of `cases`, in that process's fresh start)."""
    return cases[0]["lora"], cases[1] / "lora"


@pytest.mark.parametrize("adapter", ["lora", "none"])
def test_a_run_reloads_its_final_output_and_says_verified(adapter, cases) -> None:
    proc, out = cases[0][adapter], cases[1] / adapter
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("final model verified")]
    assert len(verdict) == 1 and "every tensor equal" in verdict[0], proc.stdout[-2000:]
    assert (out / "final_metrics.json").is_file()


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("zero-lora-b", "1 of"),  # an adapter saved partly empty: the tensor is named
        ("drop-norm", "model.norm.weight"),  # a full model whose saved tensor is not the trained one
        ("alpha", "computes other logits"),  # the tensors are right, the config scales them wrong
    ],
)
def test_a_saved_output_that_differs_is_an_error_naming_what(
    mode, expected, cases, tiny_model_dir, tmp_path
) -> None:
    if mode == "zero-lora-b":  # a real `liger train` process: exit 1 and one line on its stderr
        recipe = write_recipe(tiny_model_dir, tmp_path, mode, adapter="{type: lora}")
        proc, out = run(TAMPER_DRIVER, str(recipe), mode), tmp_path / mode
    else:
        proc, out = cases[0][mode], cases[1] / mode
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert expected in lines[0] and "final model" in lines[0], lines[0]
    if mode == "zero-lora-b":
        weights = load_file(out / "final" / "adapter_model.safetensors")
        zeroed = sorted(k for k in weights if "lora_B" in k)[0].replace(".weight", ".default.weight")
        assert zeroed in lines[0], lines[0]
    assert not (out / "final_metrics.json").exists()  # the run is not marked complete
    assert "final model verified" not in proc.stdout


def test_verification_can_be_turned_off(cases) -> None:
    proc = cases[0]["off"]  # the alpha tampering, which a verified run refuses (above)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final model not verified (output.verify: false)" in proc.stdout


def test_a_merge_that_changes_the_logits_writes_nothing(lora_run, cases, tiny_model_dir) -> None:
    proc, out = lora_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, root = cases[0]["merge"], cases[1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc)
    assert len(lines) == 1 and "does not compute what base + adapter computes" in lines[0], proc.stderr
    assert not (root / "merged").exists() and not list(root.glob(".merged.tmp-*"))
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == tiny_model_dir
