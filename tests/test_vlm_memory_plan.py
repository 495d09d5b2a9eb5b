"""The memory plan of a vision-language model against real CPU training runs, within 10%.

A LLaVA of a shape where the model and its activations dominate a process's fixed noise: a CLIP tower
(4 layers, hidden 256, 64 x 64 pictures in 8 x 8 patches: 64 image tokens a picture), a projector, and
test_memory_plan's 4-layer Llama (hidden 512, vocab 32000); the vision recipe's processor and rows, one
picture each. Every step trains the same micro-batch, and `data.max_seq_len` is its longest row, so the
batch the run trains is the one the plan measures on the meta device.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_memory_plan import MODEL, estimate

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "recipes/vision/data"
BAND = 0.10
ROWS = 8
IMAGE_SIZE, PATCH_SIZE = 64, 8
# name: (adapter, train_projector). LoRA on the language model with the projector trained in full (the
# vision recipe's choice), and full fine-tuning of the language model and projector; the tower frozen.
CASES = {"lora-projector": ("lora", True), "full": ("none", True)}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> tuple[Path, Path, int]:
    """The model folder, the rows file (pictures beside it) and the longest row's tokens."""
    import torch
    from PIL import Image
    from transformers import (
        AutoConfig,
        AutoProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    root = tmp_path_factory.mktemp("vlm-memory")
    processor = AutoProcessor.from_pretrained(REPO / "recipes/vision/model")
    processor.image_processor.size = {"shortest_edge": IMAGE_SIZE}
    processor.image_processor.crop_size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    tok = processor.tokenizer
    config = LlavaConfig(
        text_config=AutoConfig.for_model("llama", **MODEL, bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=256,
                                       intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4),
        image_token_id=tok.convert_tokens_to_ids(processor.image_token), vision_feature_select_strategy="default",
        vision_feature_layer=-1, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(root / "model")
    processor.save_pretrained(root / "model")
    rows = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()[:ROWS]]
    (root / "data/img").mkdir(parents=True)
    longest = 0
    for row in rows:
        picture = row["messages"][0]["content"][0]["path"]
        shutil.copy(DATA / picture, root / "data" / picture)
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        ids = processor(text=text, images=[Image.open(DATA / picture).convert("RGB")])["input_ids"][0]
        longest = max(longest, len(ids))
    (root / "data/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "model", root / "data/train.jsonl", longest


def write_recipe(tmp_path: Path, vlm, name: str) -> Path:
    model, rows, longest = vlm
    adapter, projector = CASES[name]
    recipe = {
        "model": {"path": str(model), "train_projector": projector},
        "adapter": {"type": adapter, "r": 16, "alpha": 32, "target_modules": "all-linear"},
        "data": {"train": str(rows), "format": "chat", "max_seq_len": longest, "packing": False},
        "training": {"max_steps": 2, "micro_batch_size": ROWS, "lr": 1e-4, "precision": "fp32"},
        "kernels": {"check": False},
        "distributed": {"activation_checkpointing": "off"},
        "output": {"dir": str(tmp_path / name)},
        "logging": {"every": 1, "tensorboard": False},
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def measured(vlm, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Both cases' `liger train`, one after the other in ONE process (test_train.liger_in_one_process: each
    its own exit code and output), the smaller peak (LoRA) first, as test_memory_plan's `measured` does:
    each run's peak is measured over its own memory right before its model was built, and freed memory
    goes back to the OS between runs, so the first run does not count in the second's peak."""
    from test_train import liger_in_one_process

    root = tmp_path_factory.mktemp("vlm-measured")
    recipes = {name: write_recipe(root, vlm, name) for name in CASES}
    procs = liger_in_one_process(*(["train", str(recipe)] for recipe in recipes.values()), timeout=600)
    return {name: (recipes[name], proc) for name, proc in zip(CASES, procs, strict=True)}


@pytest.mark.parametrize("name", list(CASES))
def test_vlm_estimate_is_within_10_percent_of_the_measured_peak(measured, name):
    recipe, proc = measured[name]
    memory = estimate(recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = (
        json.loads((recipe.parent / name / "final_metrics.json").read_text())["peak_mem_growth_mb"] * 2**20
    )
    ratio = memory["total_bytes"] / found
    print(f"{name}: estimate {memory['total_bytes'] / 2**20:.0f} MiB, measured {found / 2**20:.0f} MiB, "
          f"{ratio:.2f}x {memory['components']}")  # fmt: skip
    assert 1 - BAND <= ratio <= 1 + BAND


def test_the_plan_measures_a_vlm_on_pictures(vlm, tmp_path):
    """The activations are measured on a batch with pictures: a trained projector keeps its input, the
    tower's features of every picture (a text-only measurement would not run the projector at all),
    and the plan says what the batch held."""
    from liger_cli.plan.dry_run import dry_run
    from liger_cli.recipe import load_recipe

    recipe = write_recipe(tmp_path, vlm, "lora-projector")
    plans = {
        trains: json.loads(
            dry_run(load_recipe(recipe, [f"model.train_projector={trains}"]), None, as_json=True)
        )
        for trains in ("true", "false")
    }
    acts = {k: v["memory"]["components"]["activations"] for k, v in plans.items()}
    tokens = (IMAGE_SIZE // PATCH_SIZE) ** 2
    assert acts["true"] - acts["false"] >= ROWS * tokens * 256 * 4, acts  # [pictures, tokens, hidden] fp32
    text = dry_run(load_recipe(recipe, []), None, as_json=False)
    assert f"one {IMAGE_SIZE}x{IMAGE_SIZE} picture a row, {tokens} of its tokens" in text
