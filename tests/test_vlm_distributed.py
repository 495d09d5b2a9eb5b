"""Vision-language models on every backend: 2 real processes on gloo, the shipped tiny LLaVA (recipes/vision).

Each backend must train the model a 1-process run trains (per-step losses within 1e-5, the same saved
weights, the run's final check passed): LoRA with `model.train_projector` under DDP and FSDP-1, full
fine-tuning under FSDP-2 and ZeRO-3. The train and eval rows mix pictures and text, laid out so that
one rank's micro-batch holds images while the other's holds none: every rank must still run the
vision tower (a sharded tower's gathers are collective), and the eval loss and the eval samples
(greedy completions, an image prompt on one rank and a text prompt on the other) must equal one
process's. A run resumed at step 2 repeats the uninterrupted one: bit for bit on one process, within
1e-6 under FSDP-1. The references train in the test worker; the 2-process cases are this file's part
of the suite's ONE 2-process launch (tests/conftest.py `two_process_launch`), under its timeout.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import assert_same_run, losses, run_here, write_recipe

from liger_cli.data.batches import StepBatches, even_shares

REPO = Path(__file__).resolve().parents[1]
VISION = REPO / "recipes" / "vision"
IMAGE_ROWS, TEXT_ROWS = 20, 20
EVAL_KINDS = ["image", "image", "text", "text", "image", "text"]  # eval batch 0 -> rank 0, batch 1 -> rank 1
TEXT_QA = [
    ("Name a colour.", "red"),
    ("Name a shape.", "circle"),
    ("Say blue.", "blue"),
    ("Say square.", "square"),
]
CASES = {  # name -> (backend, adapter)
    "ddp-lora": ("ddp", "lora"),
    "fsdp1-lora": ("fsdp1", "lora"),
    "fsdp2-full": ("fsdp2", "none"),
    "zero3-full": ("deepspeed", "none"),
}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def image_row(line: str) -> str:
    """A row of the shipped vision data with its image path made absolute."""
    row = json.loads(line)
    for part in row["messages"][0]["content"]:
        if part["type"] == "image":
            part["path"] = str(VISION / "data" / part["path"])
    return json.dumps(row)


def text_row(i: int) -> str:
    question, answer = TEXT_QA[i % len(TEXT_QA)]
    return json.dumps(
        {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    )


def mixed(kinds: list[str], source: Path) -> str:
    pictures = iter(source.read_text().splitlines())
    return "".join(
        (image_row(next(pictures)) if kind == "image" else text_row(i)) + "\n" for i, kind in enumerate(kinds)
    )


def kind_of(row: dict) -> str:
    return "image" if isinstance(row["messages"][0]["content"], list) else "text"


@pytest.fixture(scope="module")
def vlm_assets(tmp_path_factory) -> dict:
    return make_assets(tmp_path_factory.mktemp("vlm-dist"))


def make_assets(root: Path) -> dict:
    """Train and eval rows of pictures and text (laid out as EVAL_KINDS and the test below say)."""
    root.mkdir(parents=True, exist_ok=True)
    train, evals = root / "train.jsonl", root / "eval.jsonl"
    train.write_text(mixed(["image", "text"] * IMAGE_ROWS, VISION / "data" / "train.jsonl"))
    evals.write_text(mixed(EVAL_KINDS, VISION / "data" / "eval.jsonl"))
    return {"root": root, "model": VISION / "model", "data": train, "eval": evals}


def vlm_recipe(assets: dict, out: Path, backend: str = "none", adapter: str = "lora", **over) -> Path:
    """test_distributed's recipe (4 steps, global batch 8) on chat rows with pictures; eval samples on."""
    vision = {"data__format": "chat", "data__eval": str(assets["eval"]), "data__max_seq_len": 64,
              "training__eval_samples": 4}  # fmt: skip
    if adapter == "lora":  # full fine-tuning trains the projector by default
        vision["model__train_projector"] = True
    return write_recipe(assets, out, backend, adapter, **(vision | over))


def launch_part(root: Path) -> tuple[list[dict], dict]:
    """This file's cases of the shared 2-process launch (tests/conftest.py `two_process_launch`): DDP,
    FSDP-1 (and its resume), FSDP-2 and ZeRO-3 (last, as every DeepSpeed case of the launch). Returns
    each case's output and the recipes (rank 0's output of each is written beside it)."""
    assets = make_assets(root / "assets")
    outs = {name: root / name for name in (*CASES, "resumed-fsdp1")}
    save = {"output__save_every": 2}
    two = [vlm_recipe(assets, outs[name], backend, adapter, **(save if name == "fsdp1-lora" else {}))
           for name, (backend, adapter) in CASES.items() if backend != "deepspeed"]  # fmt: skip
    resume = str(outs["fsdp1-lora"] / "checkpoints" / "step-2")
    two.append(vlm_recipe(assets, outs["resumed-fsdp1"], "fsdp1", output__resume=resume))
    if HAS_DEEPSPEED:
        two.append(vlm_recipe(assets, outs["zero3-full"], "deepspeed", "none", distributed__zero_stage=3))
    return [{"recipe": str(r)} for r in two], {"outs": outs, "recipes": two}


@pytest.fixture(scope="module")
def runs(vlm_assets, two_process_launch) -> dict:
    """The 1-process references (and a resume), in this worker, and the 2-process cases of the shared
    launch, with what rank 0 printed for them."""
    root = vlm_assets["root"]
    outs = {name: root / name for name in ("ref-lora", "ref-full", "resumed-1")}
    refs = [
        vlm_recipe(vlm_assets, outs["ref-lora"], output__save_every=2),
        vlm_recipe(vlm_assets, outs["ref-full"], adapter="none"),
        vlm_recipe(
            vlm_assets, outs["resumed-1"], output__resume=str(outs["ref-lora"] / "checkpoints" / "step-2")
        ),
    ]
    run_here({"cases": [{"recipe": str(r)} for r in refs]})
    two = two_process_launch["test_vlm_distributed"]
    stdout = "".join(recipe.with_suffix(".stdout").read_text() for recipe in two["recipes"])
    return outs | two["outs"] | {"stdout": stdout, "launched": len(two["recipes"])}


def test_the_data_puts_pictures_on_one_rank_and_text_on_the_other(vlm_assets) -> None:
    """The layout the other tests rely on: a training micro-batch and an eval batch where rank 0 has
    pictures and rank 1 none (the forwards that hang when only one rank runs the vision tower)."""
    rows = [json.loads(line) for line in vlm_assets["data"].read_text().splitlines()]
    ranks = [StepBatches(len(rows), 2, 2, rank, seed=3) for rank in (0, 1)]
    kinds = [[{kind_of(rows[i]) for i in batches.indices(g)} for batches in ranks] for g in range(8)]
    assert any("image" in a and b == {"text"} or a == {"text"} and "image" in b for a, b in kinds), kinds
    shares = [even_shares(len(EVAL_KINDS), 2, 2, rank)[0][0] for rank in (0, 1)]
    assert [{EVAL_KINDS[i] for i in share} for share in shares] == [{"image"}, {"text"}]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", CASES)
def test_two_processes_train_the_one_process_vlm(name: str, runs) -> None:
    backend, adapter = CASES[name]
    if backend == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed (scripts/setup.sh installs it)")
    out, ref = runs[name], runs["ref-lora" if adapter == "lora" else "ref-full"]
    if backend != "deepspeed":
        assert_same_run(out, ref)  # per-step losses within 1e-5, the same saved weights
    else:  # ZeRO-3's file names the weights otherwise (language_model.model.model.*); transformers loads both
        from transformers import AutoModelForImageTextToText

        assert losses(out) == pytest.approx(losses(ref), abs=1e-5, rel=0)
        got, want = (
            AutoModelForImageTextToText.from_pretrained(p / "final").state_dict() for p in (out, ref)
        )
        assert got.keys() == want.keys() and got
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=2e-5, rtol=1e-4, msg=key)
    plan = (out / "plan.txt").read_text()
    assert f"({backend})" in plan and "2 on 1 machine(s)" in plan
    assert "vision tower (model.vision_tower): frozen" in plan
    trains = "full (peft modules_to_save)" if adapter == "lora" else "full"
    assert f"projector (model.multi_modal_projector): {trains}" in plan
    stdout = runs["stdout"]
    verified = [line for line in stdout.splitlines() if line.startswith("final model verified")]
    assert len(verified) == runs["launched"], stdout[-3000:]  # every case of the launch reloaded final/


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", CASES)
def test_eval_with_pictures_on_one_rank_equals_one_process(name: str, runs) -> None:
    """Eval loss and eval samples (step 0 and the end) over picture and text rows spread unevenly."""
    if CASES[name][0] == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed (scripts/setup.sh installs it)")
    out, ref = runs[name], runs["ref-lora" if CASES[name][1] == "lora" else "ref-full"]
    assert len(losses(out, "eval_loss")) == 2
    assert losses(out, "eval_loss") == pytest.approx(losses(ref, "eval_loss"), abs=1e-4, rel=1e-5)
    assert losses(out, "eval_sample_match") == losses(ref, "eval_sample_match")
    got, want = (
        [json.loads(line) for line in (p / "samples.jsonl").read_text().splitlines()] for p in (out, ref)
    )
    assert len(got) == 8 and [r["completion"] for r in got] == [r["completion"] for r in want]


@pytest.mark.timeout(1200)
def test_a_resumed_vlm_run_repeats_the_uninterrupted_one(runs) -> None:
    """Resumed at step 2: the same image batches in the same order, so the same steps 3-4 and weights."""
    for resumed, whole, exact in (("resumed-1", "ref-lora", True), ("resumed-fsdp1", "fsdp1-lora", False)):
        got, want = losses(runs[resumed]), losses(runs[whole])[2:]
        assert len(got) == 2 and (got == want if exact else got == pytest.approx(want, abs=1e-6, rel=0)), (
            resumed
        )
        a, b = (load_file(runs[p] / "final" / "adapter_model.safetensors") for p in (resumed, whole))
        assert a.keys() == b.keys() and any("multi_modal_projector" in k for k in a)
        for key in a:
            if exact:
                assert torch.equal(a[key], b[key]), key
            else:
                torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5, msg=key)
