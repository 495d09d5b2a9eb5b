"""`liger inspect-wrap`: meta models from every kind of MODEL, the recipe path, and the CLI's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import warm_python

from liger_cli.errors import UserError
from liger_cli.plan.inspect_wrap import build_meta_model, inspect_command

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "configs"
LLAMA_8B = 8_030_261_248

FACTORY_MODULE = """
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)


class CustomNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(64, 10)


def build():
    return CustomNet()


def not_a_module():
    return 42
"""


@pytest.fixture
def factory_dir(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def run_cli(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env.setdefault(
        "HF_HOME", str(cwd / ".no-hf-home")
    )  # no ambient accelerate config unless a test adds one
    return warm_python.run(["-m", "liger_cli", "inspect-wrap", *args], timeout=120, cwd=cwd, env=full_env)


def run_here(monkeypatch, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`liger inspect-wrap ARGS` in this process (test_train.liger_here: exit code, stdout, stderr), with
    `env` set; the strict test below runs it as a real process (its ambient accelerate config is found
    under HF_HOME when accelerate is imported, which only a fresh process can be given)."""
    from test_train import liger_here

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return liger_here("inspect-wrap", *args)


# --- building MODEL on the meta device --------------------------------------------------------------------


def test_folder_and_config_file_build_on_meta():
    for spec in (CONFIGS / "llama-3-8b", CONFIGS / "llama-3-8b" / "config.json"):
        model = build_meta_model(str(spec))
        params = list(model.parameters())
        assert all(p.is_meta for p in params)
        assert sum(p.numel() for p in params) == LLAMA_8B
        assert (
            params[0].dtype.is_floating_point and str(params[0].dtype) == "torch.bfloat16"
        )  # the config's dtype


def test_70b_config_builds_on_meta_without_allocating():
    model = build_meta_model(str(CONFIGS / "llama-3-70b"))
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 70_553_706_496


def test_factory_builds_on_meta(factory_dir):
    model = build_meta_model("my_models:build")
    assert type(model).__name__ == "CustomNet"
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no/such/folder", "not found"),
        ("my_models:missing", "has no 'missing'"),
        ("no_such_module_xyz:build", "cannot import no_such_module_xyz"),
        ("my_models:not_a_module", "returned int, not a torch.nn.Module"),
    ],
)
def test_bad_specs_are_user_errors(factory_dir, spec, message):
    with pytest.raises(UserError, match=message):
        build_meta_model(spec)


def test_folder_without_config_and_unknown_model_type(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        build_meta_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-real-architecture"}))
    with pytest.raises(UserError, match="cannot read a model config"):
        build_meta_model(str(tmp_path))


# --- inspect_command ------------------------------------------------------------------------------------


def write_recipe(tmp_path: Path, **distributed) -> Path:
    import yaml

    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    recipe = {
        "model": {
            "config": str(CONFIGS / "llama-3-8b" / "config.json"),
            "tokenizer": str(REPO / "recipes" / "quickstart" / "model"),
        },
        "adapter": {"type": "lora", "r": 8},
        "data": {"train": str(tmp_path / "train.jsonl")},
        "kernels": {"fused_linear_cross_entropy": True},
        "distributed": {
            "backend": "fsdp2",
            "num_processes": 4,
            "fsdp": {"wrap_classes": ["LlamaDecoderLayer"]},
            "activation_checkpointing": "auto",
            **distributed,
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def inspect_json(capsys, **kwargs) -> dict:
    options = dict(
        model=None, recipe=None, backend=None, wrap_classes=None, num_processes=None, lora=False, strict=False
    )
    options.update(kwargs)
    assert inspect_command(json_out=True, **options) == 0
    return json.loads(capsys.readouterr().out)


def test_recipe_plan_is_inspected(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    data = inspect_json(capsys, recipe=write_recipe(tmp_path))
    assert (data["backend"], data["num_processes"], data["wrap_source"]) == ("fsdp2", 4, "recipe")
    assert 0 < data["trainable_params"] < data["total_params"]  # the recipe's LoRA is applied
    codes = [w["code"] for w in data["warnings"]]
    # The run turns the KV cache off, so checkpointing is safe; the peft-wrapped lm_head under FLCE is not.
    assert codes == ["FLCE_LM_HEAD_NOT_GATHERED"]


def test_command_line_overrides_the_recipe(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    data = inspect_json(
        capsys, recipe=write_recipe(tmp_path), backend="fsdp1", num_processes=2, wrap_classes="LlamaMLP"
    )
    assert (data["backend"], data["num_processes"], data["wrap_classes"]) == ("fsdp1", 2, ["LlamaMLP"])
    assert len(data["units"]) == 32 and data["warnings"] == []
    with pytest.raises(UserError, match="from --wrap-classes"):
        inspect_json(capsys, recipe=write_recipe(tmp_path), wrap_classes="Nope")


def test_recipe_without_fsdp_shows_fsdp2_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    recipe = write_recipe(tmp_path, backend="ddp", fsdp={})
    assert inspect_command(None, recipe, None, None, None, False, False, False) == 0
    out, err = capsys.readouterr()
    assert "backend is ddp" in err and "FSDP-2 over 4 process(es)" in out


def test_lora_flag_mixes_frozen_and_trainable(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    data = inspect_json(capsys, model=str(CONFIGS / "qwen2.5-0.5b"), lora=True, backend="fsdp1")
    layer = data["units"][0]
    assert 0 < layer["trainable_params"] < layer["params"]
    assert data["tied_embeddings"] is True and data["lm_head_unit"] == data["embed_unit"] == "(root)"


# --- the CLI --------------------------------------------------------------------------------------------


def test_cli_json_with_stale_env_value(monkeypatch):
    done = run_here(
        monkeypatch,
        str(CONFIGS / "llama-3-8b"),
        "--json",
        "--num-processes",
        "8",
        FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer,",
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    for key in (
        "model_type", "wrap_classes", "wrap_source", "units", "root_params", "total_params",
        "lm_head_unit", "embed_unit", "tied_embeddings", "warnings",
    ):  # fmt: skip
        assert key in data
    assert (data["model_type"], data["wrap_classes"], data["wrap_source"]) == (
        "llama",
        ["LlamaDecoderLayer"],
        "env",
    )
    assert data["total_params"] == LLAMA_8B and len(data["units"]) == 34
    assert set(data["units"][1]) >= {"path", "class", "params", "trainable_params"}
    assert data["lm_head_unit"] == "model.norm + lm_head" and data["embed_unit"] == "model.embed_tokens"


def test_cli_unknown_class_exits_2_with_the_class_list(monkeypatch):
    done = run_here(
        monkeypatch,
        str(CONFIGS / "mixtral-8x7b"),
        "--wrap-classes",
        "MixtralDecoderLayer,MistralDecoderLayer",
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: FSDP wrap class 'MistralDecoderLayer'")
    assert "MixtralDecoderLayer (x32)" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_cli_custom_model_strict_exits_3_with_warnings(tmp_path):
    (tmp_path / "my_models.py").write_text(FACTORY_MODULE)
    hf_home = tmp_path / "hf"
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text("distributed_type: MULTI_GPU\n")
    done = run_cli(
        "my_models:build", "--strict", cwd=tmp_path, HF_HOME=str(hf_home), FSDP_TRANSFORMER_CLS_TO_WRAP=" , "
    )
    assert done.returncode == 3, done.stderr
    assert "wrap classes: [] (from nothing named anywhere)" in done.stdout
    assert "NO_WRAP_CLASSES" in done.stdout and "e.g. Block" in done.stdout
    assert "AMBIENT_ACCELERATE_CONFIG" in done.stdout and "default_config.yaml" in done.stdout
    assert "(root)" in done.stdout and "Root unit keeps: blocks, head" in done.stdout


def test_recipe_prints_the_plan_the_run_prints(tmp_path, capsys, monkeypatch):
    """inspect-wrap --recipe shows the recipe's own Plan (the object `liger train` prints), and its
    units come from that Plan's wrap classes."""
    from liger_cli.model import build_meta_model_for
    from liger_cli.plan import build_plan
    from liger_cli.recipe import load_recipe

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    recipe_path = write_recipe(tmp_path, fsdp={"wrap_classes": None})  # from _no_split_modules
    recipe = load_recipe(recipe_path)
    plan = build_plan(recipe, build_meta_model_for(recipe))
    assert inspect_command(None, recipe_path, None, None, None, False, False, False) == 0
    out = capsys.readouterr().out
    assert out.startswith(plan.render() + "\n")
    assert "FSDP wrap classes   LlamaDecoderLayer (from no_split_modules)" in out
    data = inspect_json(capsys, recipe=recipe_path)
    assert data["plan"] == plan.to_dict()
    assert data["plan"]["wrap_classes"] == ["LlamaDecoderLayer"] == data["wrap_classes"]
    assert data["wrap_source"] == "no_split_modules"
