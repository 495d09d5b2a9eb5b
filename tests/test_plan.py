"""The Plan: built once from the recipe and the meta model, frozen, printed the same everywhere."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from liger_cli.plan import Applied, build_plan, render_with
from liger_cli.recipe import load_recipe


def recipe_for(tiny_model_dir: Path, tmp_path: Path, *overrides: str):
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {{path: {tiny_model_dir}}}\ndata: {{train: {tmp_path / 'train.jsonl'}}}\n")
    return load_recipe(path, list(overrides))


def test_fsdp_plan_resolves_wrap_classes_on_the_meta_model(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer,")  # stale, as users leave it
    recipe = recipe_for(tiny_model_dir, tmp_path, "distributed.backend=fsdp1", "distributed.num_processes=2")
    plan = build_plan(recipe)
    assert (plan.wrap_classes, plan.wrap_source) == (("LlamaDecoderLayer",), "env")
    assert plan.activation_checkpointing == "off" and plan.global_batch == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.wrap_classes = ("LlamaMLP",)
    ddp = build_plan(
        recipe_for(tiny_model_dir, tmp_path, "distributed.backend=ddp", "distributed.num_processes=2")
    )
    assert ddp.wrap_classes is None and "FSDP wrap classes" not in ddp.render()


def test_plan_with_no_wrap_classes_says_so(tmp_path, monkeypatch) -> None:
    from torch import nn

    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    recipe = recipe_for(
        Path(__file__).parent / "configs" / "llama-3-8b", tmp_path, "distributed.backend=fsdp2"
    )
    plan = build_plan(recipe, nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert plan.wrap_classes == () and plan.wrap_source == "none"
    assert "[] (the whole model is one unit) (from none)" in plan.render()
    assert any(note.startswith("[NO_WRAP_CLASSES]") for note in plan.notes)


def test_switched_off_kernels_and_what_set_up_applied_print_beside_the_plan(tiny_model_dir, tmp_path) -> None:
    plan = build_plan(recipe_for(tiny_model_dir, tmp_path))
    assert plan.kernels_off == {} and "kernels off" not in plan.render()
    off = dataclasses.replace(
        plan, kernels={**plan.kernels, "rope": False}, kernels_off={"rope": "no rotary function found"}
    )
    text = render_with(off, Applied(kernels_patched=("rms_norm: patched 5 modules",)))
    assert "kernels off         rope: no rotary function found" in text
    assert "kernels requested   rms_norm, swiglu, fused_linear_cross_entropy" in text
    assert text.endswith("kernels patched    rms_norm: patched 5 modules")
    assert text.startswith(off.render())
