"""Generation inside a run, on the model as each backend wraps it, with 2 real processes on gloo.

For DDP, FSDP-1, FSDP-2 and ZeRO-3: a LoRA run and a full fine-tune with `training.eval_samples`
write the samples (and losses) the 1-process run writes, so generating mid-run neither hangs nor
changes training; the engine called through `Backend.generation` makes as many all-gathers for 8 new
tokens as for 2 (parameters gathered once per call, not per token), samples what 1 process samples,
and the model trains on afterwards.

The four backends' runs and generation checks are this file's part of the suite's ONE 2-process launch
(tests/conftest.py `two_process_launch`: each backend's recipes, then its generation check; ZeRO-3
last), and each backend's test reads its part of it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from test_distributed import (  # noqa: F401 - `assets` is a fixture
    STEPS,
    assert_same_run,
    assets,
    losses,
    make_assets,
    run_here,
    write_recipe,
)

from liger_cli.run.samples import SAMPLES_FILE

QUICK_EVAL = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "data" / "eval.jsonl"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
BACKENDS = {  # name -> (backend, extra recipe keys)
    "ddp": ("ddp", {}),
    "fsdp1": ("fsdp1", {}),
    "fsdp2": ("fsdp2", {}),
    "zero3": ("deepspeed", {"distributed__zero_stage": 3}),
}


def sampled(paths: dict, out: Path, backend: str = "none", adapter: str = "lora", **over) -> Path:
    """A run with 3 eval samples (an odd number: the second rank pads its share) at steps 0, 2, 4."""
    return write_recipe(paths, out, backend, adapter, data__eval=str(paths["eval"]), training__eval_every=2,
                        training__eval_samples=3, **over)  # fmt: skip


def eval_rows(root: Path) -> Path:
    """6 eval rows of the quickstart (3 samples a evaluation: the second rank pads its share)."""
    eval_file = root / "gen-eval.jsonl"
    eval_file.write_text("".join(QUICK_EVAL.read_text().splitlines(keepends=True)[:6]))
    return eval_file


@pytest.fixture(scope="module")
def reference(assets) -> dict:  # noqa: F811
    assets["eval"] = eval_rows(assets["root"])
    root = assets["root"] / "gen-ref"
    root.mkdir()
    outs = {"lora": root / "lora", "full": root / "full"}
    recipes = [sampled(assets, outs["lora"]), sampled(assets, outs["full"], adapter="none")]
    generation = write_recipe(assets, root / "gen", adapter="none")
    run_here(
        {
            "cases": [{"recipe": str(r)} for r in recipes]
            + [{"check": "generation", "recipe": str(generation)}]
        }
    )
    return {**outs, "generation": json.loads(generation.with_suffix(".generation.json").read_text())}


def samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]


def launch_part(root: Path) -> tuple[list[dict], dict]:
    """This file's cases of the shared 2-process launch (tests/conftest.py `two_process_launch`): each
    backend's LoRA and full runs with samples, then its generation check (DeepSpeed's ZeRO-3, where it
    is installed, last with every DeepSpeed case). Per backend: its outputs, its generation result file
    and its recipes (rank 0's output of each is written beside it)."""
    files = make_assets(root / "files")
    files["eval"] = eval_rows(files["root"])
    found, cases = {}, []
    for name in (name for name in BACKENDS if name != "zero3" or HAS_DEEPSPEED):
        backend, over = BACKENDS[name]
        folder = root / name
        folder.mkdir()
        outs = {"lora": folder / "lora", "full": folder / "full"}
        recipes = [
            sampled(files, outs["lora"], backend, **over),
            sampled(files, outs["full"], backend, "none", **over),
        ]
        generation = write_recipe(files, folder / "gen", backend, "none", **over)
        cases += [{"recipe": str(r)} for r in recipes] + [{"check": "generation", "recipe": str(generation)}]
        found[name] = {
            "outs": outs,
            "generation": generation.with_suffix(".generation.json"),
            "recipes": recipes,
        }
    return cases, found


@pytest.fixture(scope="module")
def launched(two_process_launch) -> dict:
    """Per backend: its outputs, its generation result file and what rank 0 printed for its runs."""
    found = two_process_launch["test_generate_backends"]
    for run in found.values():
        run["stdout"] = "".join(recipe.with_suffix(".stdout").read_text() for recipe in run["recipes"])
    return found


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(BACKENDS))
def test_generation_under_each_backend_is_the_one_process_generation(name, reference, launched) -> None:
    if name == "zero3":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/setup.sh installs it)")
    outs, stdout = launched[name]["outs"], launched[name]["stdout"]
    for kind, out in outs.items():
        assert_same_run(out, reference[kind])
        assert len(losses(out)) == STEPS
        got, want = samples(out), samples(reference[kind])
        assert [r["step"] for r in got] == [0, 0, 0, 2, 2, 2, 4, 4, 4]
        assert got == want, (kind, got, want)
    assert stdout.count("sample at step") == 6  # printed once (the main process), at each evaluation
    found = json.loads(launched[name]["generation"].read_text())
    assert found["completions"] == reference["generation"]["completions"]
    two, eight = found["gathers"]
    if name != "ddp":  # the sharded backends gather; the count does not grow with the tokens
        assert two > 0 and eight == two, found["gathers"]
    assert found["loss_after"] == pytest.approx(reference["generation"]["loss_after"], abs=1e-5)
