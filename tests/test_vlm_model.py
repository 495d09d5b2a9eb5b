"""Vision-language models in runs: built by the class their config maps to, what of them trains
(`model.vision`, `model.train_projector`), the Plan's `trains` row, a run on image batches through the real
loop, and `liger merge` of its adapter. Two families throughout: LLaVA (its projector beside the tower) and
Qwen2-VL (its projector, `visual.merger`, inside the tower; a Conv3d patch embedding)."""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import warm_python
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner
from vlm_models import IMAGE_RUN_DRIVER, image_batch, save_tiny_vlm

from liger_cli import cli
from liger_cli.errors import UserError
from liger_cli.model import add_adapter, build_meta_model_for, load_base_model
from liger_cli.model.vision import projectors, vision_tower
from liger_cli.recipe import load_recipe

TESTS = Path(__file__).resolve().parent
QUICK_DATA = TESTS.parent / "recipes" / "quickstart" / "data"
FAMILIES = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}
TOWER = {"llava": "model.vision_tower", "qwen2_vl": "model.visual"}
PROJECTOR = {"llava": "model.multi_modal_projector", "qwen2_vl": "model.visual.merger"}


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory) -> dict[str, Path]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {f: save_tiny_vlm(tmp_path_factory.mktemp(f), f) for f in FAMILIES}


def write_recipe(root: Path, model: str, name: str = "recipe", **sections: str) -> Path:
    text = {
        "model": model,
        "adapter": "{type: lora, r: 4, alpha: 8}",
        "data": f"{{train: {QUICK_DATA / 'train.jsonl'}, format: instruction, max_seq_len: 48}}",
        "training": "{max_steps: 2}",
        "output": f"{{dir: {root / name}}}",
    } | sections
    path = root / f"{name}.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in text.items()))
    return path


def built(model_dir: Path, tmp_path: Path, **sets) -> nn.Module:
    """The run's model (real weights, from_pretrained) with the recipe's adapter and vision settings."""
    overrides = [f"{k.replace('__', '.')}={v}" for k, v in sets.items()]
    recipe = load_recipe(write_recipe(tmp_path, f"{{path: {model_dir}}}"), overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return add_adapter(load_base_model(recipe), recipe)


def paths_of(model: nn.Module, kind) -> set[str]:
    """Paths (peft's prefix dropped) of the modules of `kind` in the model's base."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {name for name, m in base.named_modules() if isinstance(m, kind)}


def lora_paths(model: nn.Module) -> set[str]:
    base = model.get_base_model()
    return {name for name, m in base.named_modules() if hasattr(m, "lora_A")}


def under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


# --- what is built ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_vlm_config_builds_its_image_text_class(vlm_dirs, family, tmp_path) -> None:
    from transformers import AutoModelForImageTextToText

    recipe = load_recipe(write_recipe(tmp_path, f"{{path: {vlm_dirs[family]}}}", adapter="{type: none}"))
    assert type(build_meta_model_for(recipe)).__name__ == FAMILIES[family]
    model = load_base_model(recipe)
    assert type(model).__name__ == FAMILIES[family]
    reference = AutoModelForImageTextToText.from_pretrained(vlm_dirs[family]).state_dict()
    assert model.state_dict().keys() == reference.keys()
    assert all(torch.equal(t, reference[k]) for k, t in model.state_dict().items())  # the real weights


def test_gemma3_a_vlm_in_the_causal_lm_mapping_too_builds_its_vlm_class(tmp_path) -> None:
    from test_vlm_wrap import save_tiny_config

    save_tiny_config("gemma3", tmp_path / "gemma3")
    tokenizer = TESTS.parent / "recipes" / "quickstart" / "model"
    model = f"{{config: {tmp_path / 'gemma3' / 'config.json'}, tokenizer: {tokenizer}}}"
    recipe = load_recipe(write_recipe(tmp_path, model))
    built = build_meta_model_for(recipe).get_base_model()
    assert type(built).__name__ == "Gemma3ForConditionalGeneration"
    assert [n for n, m in built.named_modules() if m in projectors(built)] == ["model.multi_modal_projector"]


def test_a_text_model_still_builds_its_causal_lm_class(tiny_model_dir, tmp_path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, f"{{path: {tiny_model_dir}}}"))
    assert type(load_base_model(recipe)).__name__ == "LlamaForCausalLM"


# --- what trains --------------------------------------------------------------------------------------


def linears_under(model_dir: Path, tmp_path: Path, prefix: str) -> set[str]:
    plain = built(model_dir, tmp_path, adapter__type="none")
    return {p for p in paths_of(plain, nn.Linear) if under(p, prefix)}


@pytest.mark.parametrize("family", FAMILIES)
def test_default_lora_reaches_every_language_model_linear_and_nothing_else(vlm_dirs, family, tmp_path):
    model = built(vlm_dirs[family], tmp_path)
    assert lora_paths(model) == linears_under(vlm_dirs[family], tmp_path, "model.language_model")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".language_model." in n for n in trainable)


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_lora_puts_lora_into_the_towers_linears_never_a_conv(vlm_dirs, family, tmp_path) -> None:
    model = built(vlm_dirs[family], tmp_path, model__vision="lora")
    tower_linears = linears_under(vlm_dirs[family], tmp_path, TOWER[family])
    tower_lora = {p for p in lora_paths(model) if under(p, TOWER[family])}
    assert tower_lora == {
        p for p in tower_linears if not under(p, PROJECTOR[family])
    }  # projector: never LoRA
    plain = built(vlm_dirs[family], tmp_path, adapter__type="none")
    convs = {p for p in paths_of(plain, (nn.Conv2d, nn.Conv3d)) if under(p, TOWER[family])}
    assert convs and not convs & lora_paths(model)  # the patch embedding (Conv2d, Conv3d) stays plain


@pytest.mark.parametrize("family", FAMILIES)
def test_train_projector_with_lora_trains_a_copy_peft_saves(vlm_dirs, family, tmp_path) -> None:
    from peft.utils import get_peft_model_state_dict

    model = built(vlm_dirs[family], tmp_path, model__train_projector="true")
    trainable = {n.removeprefix("base_model.model.") for n, p in model.named_parameters() if p.requires_grad}
    copies = {n for n in trainable if ".modules_to_save." in n}
    assert copies and all(n.startswith(PROJECTOR[family] + ".modules_to_save.default.") for n in copies)
    assert trainable - copies == {
        n for n in trainable if "lora_" in n and n.startswith("model.language_model.")
    }
    saved = get_peft_model_state_dict(model)
    assert {k for k in saved if k.startswith(f"base_model.model.{PROJECTOR[family]}.")}  # in the adapter file
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".original_module." in n)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("sets", "tower", "projector"),
    [
        ({}, False, True),
        ({"model__train_projector": "false"}, False, False),
        ({"model__vision": "full"}, True, True),
    ],
)
def test_full_fine_tuning_trains_the_projector_and_language_model_not_the_tower(
    vlm_dirs, family, tmp_path, sets, tower, projector
) -> None:
    model = built(vlm_dirs[family], tmp_path, adapter__type="none", **sets)
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    assert all(grads[n] == projector for n in grads if under(n, PROJECTOR[family]))
    in_tower = [n for n in grads if under(n, TOWER[family]) and not under(n, PROJECTOR[family])]
    assert in_tower and all(grads[n] == tower for n in in_tower)
    assert all(grads[n] for n in grads if not under(n, TOWER[family]) and not under(n, PROJECTOR[family]))


def test_projectors_are_found_without_names(vlm_dirs) -> None:
    from transformers import AutoModelForImageTextToText

    for family, folder in vlm_dirs.items():
        model = AutoModelForImageTextToText.from_pretrained(folder)
        paths = {id(m): n for n, m in model.named_modules()}
        assert [paths[id(m)] for m in projectors(model)] == [PROJECTOR[family]]
        assert paths[id(vision_tower(model))] == TOWER[family]


def test_vision_keys_where_they_cannot_apply_are_errors(tiny_model_dir, vlm_dirs, tmp_path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, f"{{path: {tiny_model_dir}, vision: full}}"))
    with pytest.raises(UserError, match=r"LlamaForCausalLM has no vision tower: remove them"):
        build_meta_model_for(recipe)
    with pytest.raises(UserError, match=r"model.vision lora .* adapter.type is none: set adapter.type lora"):
        load_recipe(
            write_recipe(tmp_path, f"{{path: {vlm_dirs['llava']}, vision: lora}}", adapter="{type: none}")
        )
    llava = vlm_dirs["llava"]
    with pytest.raises(
        UserError, match=r"model.quantize nf4 loads the linear layers in 4 bits, which cannot train"
    ):
        load_recipe(write_recipe(tmp_path, f"{{path: {llava}, quantize: nf4, train_projector: true}}"))
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(
        UserError, match=r"adapter.init brings its own .*: remove model.vision and model.train_"
    ):
        load_recipe(
            write_recipe(
                tmp_path, f"{{path: {llava}, vision: lora}}", adapter=f"{{init: {tmp_path / 'adapter'}}}"
            )
        )
    text_model = write_recipe(tmp_path, f"{{path: {tiny_model_dir}, train_projector: true}}", "text")
    result = CliRunner().invoke(cli.app, ["train", str(text_model), "--dry-run"])  # the CLI, in this process
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no vision tower: remove them" in lines[0] and "Traceback" not in result.stderr


# --- the forward -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_loss_in_a_vlm_forward_is_its_own_loss_on_an_image_batch(vlm_dirs, family) -> None:
    """The run's SFT loss (`causal_lm_loss`: every batch key to the forward, a step's token count as
    `num_items_in_batch`) with our fused loss at the language head equals transformers' own, and so do
    the gradients reaching the vision tower and the projector through the image features."""
    from liger_kernels import patch_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    from liger_cli.model.objectives.causal_lm import causal_lm_loss, label_units

    config = AutoConfig.from_pretrained(vlm_dirs[family])
    batch = image_batch(config, [([5, 6, 7, 8, 9], [-100, -100, 7, 8, 9]), ([10, 11], [10, 11])], seed=5)
    num_items = label_units(batch) + 4  # the step's count: this micro-batch and others
    found = []
    for fused in (False, True):
        model = AutoModelForImageTextToText.from_pretrained(vlm_dirs[family])
        if fused:
            report = patch_model(model, rms_norm=False, rope=False, swiglu=False)
            assert report.patched == {"fused_linear_cross_entropy": 1}, report.lines()
        loss = causal_lm_loss(model, batch, num_items)
        loss.backward()
        found.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain, plain_grads), (fused, fused_grads) = found
    assert torch.allclose(plain, fused, rtol=1e-5) and plain.item() > 0
    assert plain_grads.keys() == fused_grads.keys()
    assert any(under(n, TOWER[family]) for n in plain_grads) and any(
        under(n, PROJECTOR[family]) for n in plain_grads
    )
    for name, grad in plain_grads.items():
        assert torch.allclose(grad, fused_grads[name], rtol=1e-4, atol=1e-6), name


# --- the Plan -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "sets", "expected"),
    [
        ("llava", [], "vision tower (model.vision_tower): frozen; projector (model.multi_modal_projector): "
         "frozen; language model (model.language_model): lora; lm_head: frozen"),
        ("llava", ["model.train_projector=true"], "vision tower (model.vision_tower): frozen; projector "
         "(model.multi_modal_projector): full (peft modules_to_save); language model (model.language_model): "
         "lora; lm_head: frozen"),
        ("qwen2_vl", ["adapter.type=none"], "vision tower (model.visual): frozen; projector (model.visual.merger): "
         "full; language model (model.language_model): full; lm_head: full"),
        ("qwen2_vl", ["model.vision=lora"], "vision tower (model.visual): lora; projector (model.visual.merger): "
         "frozen; language model (model.language_model): lora; lm_head: frozen"),
    ],
)  # fmt: skip
def test_dry_run_says_which_parts_train(vlm_dirs, tmp_path, family, sets, expected) -> None:
    from liger_cli.plan.dry_run import dry_run

    recipe = load_recipe(write_recipe(tmp_path, f"{{path: {vlm_dirs[family]}}}"), sets)
    text = dry_run(recipe)
    assert f"\ntrains              {expected}\n" in text, text
    assert json.loads(dry_run(recipe, as_json=True))["plan"]["trains"] == expected


def test_a_text_models_plan_has_no_trains_row(tiny_model_dir, tmp_path) -> None:
    from liger_cli.plan import build_plan

    recipe = load_recipe(write_recipe(tmp_path, f"{{path: {tiny_model_dir}}}"), ["kernels.check=false"])
    plan = build_plan(recipe)
    assert plan.trains is None and "\ntrains " not in plan.render()


# --- runs on image batches ----------------------------------------------------------------------------


def image_recipe(root: Path, model_dir: Path, name: str, model: str, adapter: str) -> Path:
    """A 6-step run of the real loop on image batches (`IMAGE_RUN_DRIVER`)."""
    data = (f"{{train: {QUICK_DATA / 'train.jsonl'}, eval: {QUICK_DATA / 'eval.jsonl'}, format: instruction, "
            "max_seq_len: 48}")  # fmt: skip
    return write_recipe(
        root, f"{{path: {model_dir}, {model}}}" if model else f"{{path: {model_dir}}}", name,
        adapter=adapter, data=data, logging="{every: 1}",
        training="{max_steps: 6, micro_batch_size: 4, grad_accum: 2, lr: 2.0e-2, eval_every: 3, seed: 3}",
    )  # fmt: skip


@pytest.fixture(scope="module")
def image_runs(vlm_dirs, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Qwen2-VL fully fine-tuned and LLaVA with LoRA + its projector, both on image batches, trained one
    after the other in ONE driver process (one interpreter start): each run's folder and the output."""
    root = tmp_path_factory.mktemp("image-runs")
    recipes = {
        "full": image_recipe(root, vlm_dirs["qwen2_vl"], "full", "", "{type: none}"),
        "lora": image_recipe(root, vlm_dirs["llava"], "lora", "train_projector: true", "{type: lora, r: 4, alpha: 8}"),
    }  # fmt: skip
    proc = warm_python.run(["-c", IMAGE_RUN_DRIVER, TESTS, *recipes.values()], timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verified = [line for line in proc.stdout.splitlines() if line.startswith("final model verified")]
    assert len(verified) == len(recipes), proc.stdout[-2000:]  # each run's probe carried its images
    return {name: root / name for name in recipes}


def image_run(out: Path) -> tuple[Path, dict, set]:
    """A run's folder, trained state and trainable names; its 6 losses went down."""
    losses = [
        r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
    with safe_open(str(out / "trained.safetensors"), "pt") as f:
        trainable = set(f.metadata()["trainable"].split(","))
    return out, load_file(out / "trained.safetensors"), trainable


def loaded_state(folder: Path) -> dict[str, torch.Tensor]:
    """A saved model's tensors under its module names (transformers renames some keys on disk)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder).state_dict()


@pytest.mark.timeout(1800)  # the first to ask for `image_runs`: both runs (generous: a shared machine)
def test_full_fine_tuning_on_image_batches_leaves_the_tower_bit_identical(vlm_dirs, image_runs) -> None:
    base = loaded_state(vlm_dirs["qwen2_vl"])
    out, trained, trainable = image_run(image_runs["full"])
    plan = (out / "plan.txt").read_text()
    assert (
        "trains              vision tower (model.visual): frozen; projector (model.visual.merger): full"
        in plan
    )
    final = loaded_state(out / "final")
    assert base.keys() == trained.keys() == final.keys()
    for name, start in base.items():
        frozen = under(name, "model.visual") and not under(name, "model.visual.merger")
        assert (name in trainable) != frozen, name
        assert torch.equal(trained[name], start) == frozen, name  # frozen: bit-identical; trained: changed
        assert torch.equal(final[name], trained[name]), name


@pytest.mark.timeout(1800)
def test_lora_with_projector_on_image_batches_then_merge_gives_the_adapters_logits(
    vlm_dirs, image_runs, tmp_path
) -> None:
    """The group's real `liger merge` process."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = vlm_dirs["llava"]
    base = loaded_state(folder)
    out, trained, trainable = image_run(image_runs["lora"])
    for name, tensor in trained.items():  # every frozen weight bit-identical, every trainable one changed
        start = name.removeprefix("base_model.model.")
        for wrapper in (".base_layer", ".original_module", ".modules_to_save.default"):
            start = start.replace(wrapper, "")
        if name not in trainable:
            assert torch.equal(tensor, base[start]), name
        elif "lora_A" not in name:  # lora_A starts random: lora_B (from zero) and the projector's copy
            assert not torch.equal(tensor, base.get(start, torch.zeros_like(tensor))), name
    assert any(".modules_to_save.default." in n for n in trainable)
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert not any(".vision_tower." in k for k in adapter)

    merged = tmp_path / "merged"
    proc = warm_python.run(["-m", "liger_cli", "merge", out, merged], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = AutoConfig.from_pretrained(folder)
    probe = image_batch(config, [([5, 6, 7, 8], [5, 6, 7, 8]), ([9, 10], [9, 10])], seed=11)
    probe.pop("labels")
    with torch.no_grad():
        plain = AutoModelForImageTextToText.from_pretrained(folder).eval()
        adapted = PeftModel.from_pretrained(
            AutoModelForImageTextToText.from_pretrained(folder), out / "final"
        ).eval()
        expected = adapted(**probe).logits
        found = AutoModelForImageTextToText.from_pretrained(merged).eval()(**probe).logits
        assert (found - expected).abs().max() < 1e-4
        assert (
            plain(**probe).logits - expected
        ).abs().max() > 1e-2  # the adapter (and projector) changed them
