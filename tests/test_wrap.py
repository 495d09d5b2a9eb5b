"""The FSDP wrap plan: class resolution, units of real architectures, warnings, and agreement with accelerate."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest
import torch
from torch import nn

from liger_cli.errors import UserError
from liger_cli.plan.inspect_wrap import build_meta_model
from liger_cli.plan.wrap import (
    ENV_KEY,
    ROOT,
    WrapResolution,
    plan_units,
    render_report,
    resolve_wrap_classes,
    split_names,
)
from liger_cli.process_state import accelerate_env

CONFIGS = Path(__file__).parent / "configs"

# Published dimensions (tests/configs/*/config.json) and the published parameter totals.
ARCHITECTURES = {
    "llama-3-8b": ("LlamaDecoderLayer", 32, 8_030_261_248, False),
    "qwen2.5-7b": ("Qwen2DecoderLayer", 28, 7_615_616_512, False),
    "qwen2.5-0.5b": ("Qwen2DecoderLayer", 24, 494_032_768, True),
    "mistral-7b": ("MistralDecoderLayer", 32, 7_241_732_096, False),
    "mixtral-8x7b": ("MixtralDecoderLayer", 32, 46_702_792_704, False),
    "gemma-2-9b": ("Gemma2DecoderLayer", 42, 9_241_705_984, True),
}


@cache
def meta_model(name: str) -> nn.Module:
    return build_meta_model(str(CONFIGS / name))


def tiny_config(tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=tied,
    )


def tiny_llama(tied: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(tied))


def tiny_lora(tied: bool = False) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        tiny_llama(tied), LoraConfig(r=4, target_modules="all-linear"), low_cpu_mem_usage=True
    )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class CustomNet(nn.Module):
    """A model of our own: no `_no_split_modules`, so nothing names a class to wrap."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 4)


def codes(report) -> list[str]:
    return [w.code for w in report.warnings]


# --- real architectures ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_real_architecture_units_and_totals(name):
    layer_class, layers, total, tied = ARCHITECTURES[name]
    model = meta_model(name)
    resolution = resolve_wrap_classes(model, env={})
    assert (resolution.classes, resolution.source, resolution.warnings) == (
        [layer_class],
        "no_split_modules",
        [],
    )

    fsdp1 = plan_units(model, resolution, backend="fsdp1", num_processes=8, check_ambient_config=False)
    assert len(fsdp1.units) == layers
    assert {u.cls for u in fsdp1.units} == {layer_class}
    assert fsdp1.total_params == total
    assert sum(u.params for u in fsdp1.units) + fsdp1.root_params == total
    assert fsdp1.tied_embeddings is tied
    assert (fsdp1.lm_head_unit, fsdp1.embed_unit) == (ROOT, ROOT)
    assert fsdp1.warnings == []

    # accelerate's FSDP-2 path adds the embeddings (when untied) and the [norm, lm_head] output group.
    fsdp2 = plan_units(model, resolution, backend="fsdp2", num_processes=8, check_ambient_config=False)
    assert len([u for u in fsdp2.units if u.reason == "wrap_class"]) == layers
    assert len(fsdp2.units) == layers + (1 if tied else 2)
    assert fsdp2.total_params == total and fsdp2.root_params == 0
    assert (
        fsdp2.lm_head_unit
        == fsdp2.final_norm_unit
        == "model.norm + " + ("model.embed_tokens + lm_head" if tied else "lm_head")
    )
    assert fsdp2.warnings == []


def test_llama_unit_sizes_follow_the_published_dimensions():
    # One Llama-3-8B layer: q,o 4096x4096; k,v 4096x1024; gate,up,down 4096x14336; two RMSNorm weights.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    report = plan_units(
        meta_model("llama-3-8b"), ["LlamaDecoderLayer"], "fsdp1", 8, check_ambient_config=False
    )
    assert {u.params for u in report.units} == {layer}
    assert report.units[0].bytes == 2 * layer  # bf16, the config's dtype
    assert report.units[0].bytes_per_rank == 2 * layer // 8
    assert report.root_params == 2 * 128256 * 4096 + 4096  # embed_tokens, lm_head, final norm
    assert report.root_modules == ["model.embed_tokens", "model.norm", "lm_head"]


def test_tied_weight_counted_once_and_kept_together():
    report = plan_units(
        meta_model("qwen2.5-0.5b"), ["Qwen2DecoderLayer"], "fsdp1", 2, check_ambient_config=False
    )
    assert report.tied_embeddings
    assert report.root_params == 151936 * 896 + 896  # the shared embedding once, plus the final norm


# --- resolution ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, []),
        ("", []),
        (" , ", []),
        ("LlamaDecoderLayer,", ["LlamaDecoderLayer"]),
        (" LlamaDecoderLayer , LlamaDecoderLayer ", ["LlamaDecoderLayer"]),
        (["A, B", " ", "B", "C"], ["A", "B", "C"]),
    ],
)
def test_split_names(value, expected):
    assert split_names(value) == expected


@pytest.mark.parametrize(
    "env_value, source",
    [
        ("", "no_split_modules"),  # empty counts as unset: falls through to _no_split_modules
        (" , ", "no_split_modules"),
        ("LlamaDecoderLayer,", "env"),
        (" LlamaDecoderLayer , LlamaDecoderLayer ", "env"),
    ],
)
def test_env_values_resolve_cleanly(env_value, source):
    resolution = resolve_wrap_classes(tiny_llama(), env={ENV_KEY: env_value})
    assert (resolution.classes, resolution.source) == (["LlamaDecoderLayer"], source)


def test_precedence_recipe_over_env_over_no_split_modules():
    model = tiny_llama()
    env = {ENV_KEY: "LlamaMLP"}
    assert resolve_wrap_classes(model, "LlamaAttention, LlamaMLP", env).classes == [
        "LlamaAttention",
        "LlamaMLP",
    ]
    assert resolve_wrap_classes(model, ["LlamaAttention"], env).source == "recipe"
    assert resolve_wrap_classes(model, [], env).classes == [
        "LlamaMLP"
    ]  # an empty recipe list counts as unset
    assert resolve_wrap_classes(model, None, env).source == "env"
    assert resolve_wrap_classes(model, None, {}).source == "no_split_modules"


@pytest.mark.parametrize("env_value", [None, "", " , "])
def test_custom_model_without_no_split_modules_gives_empty_list_and_warning(env_value):
    model = CustomNet()
    resolution = resolve_wrap_classes(model, env={} if env_value is None else {ENV_KEY: env_value})
    assert resolution.classes == [] and resolution.source == "none"
    assert [w.code for w in resolution.warnings] == ["NO_WRAP_CLASSES"]
    assert "Block" in resolution.warnings[0].message  # the fix names the repeated block

    report = plan_units(model, resolution, "fsdp1", 2, check_ambient_config=False)
    assert report.units == [] and report.root_params == report.total_params == 3 * 72 + 36
    assert codes(report) == ["NO_WRAP_CLASSES"]  # once, not once per step


def test_unknown_name_lists_model_classes_decoder_layer_first():
    with pytest.raises(UserError) as err:
        resolve_wrap_classes(tiny_llama(), "LlamaDecoderLayer, NotAClass", env={})
    message = str(err.value)
    assert "'NotAClass'" in message and "recipe" in message and "\n" not in message
    # decoder layers first, then repeated classes of the model's own, then the rest (torch builtins)
    assert "classes: LlamaDecoderLayer (x2), LlamaAttention (x2), LlamaMLP (x2)" in message
    assert message.index("LlamaMLP") < message.index("Linear (x15)")

    with pytest.raises(UserError, match=f"{ENV_KEY}.*Block \\(x3\\)"):
        resolve_wrap_classes(CustomNet(), env={ENV_KEY: "Blok"})


def test_peft_model_is_looked_through():
    model = tiny_lora()
    resolution = resolve_wrap_classes(model, env={})
    assert (resolution.classes, resolution.source) == (["LlamaDecoderLayer"], "no_split_modules")
    with pytest.raises(UserError, match="LlamaDecoderLayer"):
        resolve_wrap_classes(model, "Nope", env={})


def test_accelerate_env_removes_stale_values_that_accelerate_rejects(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    model = tiny_llama()
    for stale in ("", "LlamaDecoderLayer,"):
        monkeypatch.setenv(ENV_KEY, stale)
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, auto_wrap_policy="transformer_based_wrap")
        with pytest.raises(ValueError, match="Could not find the transformer layer class"):
            plugin.set_auto_wrap_policy(model)  # accelerate 1.15 as measured: it splits "" into [""]

        accelerate_env(resolve_wrap_classes(model), os.environ)
        assert os.environ[ENV_KEY] == "LlamaDecoderLayer"
        plugin = FullyShardedDataParallelPlugin(fsdp_version=1, auto_wrap_policy="transformer_based_wrap")
        plugin.set_auto_wrap_policy(model)
        assert [c.__name__ for c in plugin.auto_wrap_policy.keywords["transformer_layer_cls"]] == [
            "LlamaDecoderLayer"
        ]

    env = {ENV_KEY: " , "}
    accelerate_env(WrapResolution([], "none"), env)
    assert env == {}


# --- warnings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend, consequence", [("fsdp1", "silently unties"), ("fsdp2", "refuses")])
def test_tied_embeddings_split_across_units(backend, consequence):
    model = tiny_llama(tied=True)
    report = plan_units(model, ["LlamaDecoderLayer", "Embedding"], backend, 2, check_ambient_config=False)
    [warning] = [w for w in report.warnings if w.code == "TIED_SPLIT"]
    assert consequence in warning.message and "model.embed_tokens" in warning.message
    assert (
        report.total_params == sum(u.params for u in report.units) + report.root_params
    )  # still counted once

    together = plan_units(model, ["LlamaDecoderLayer"], backend, 2, check_ambient_config=False)
    assert "TIED_SPLIT" not in codes(together)


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_flce_with_lm_head_in_its_own_unit(backend):
    model = tiny_llama()
    report = plan_units(
        model,
        ["LlamaDecoderLayer", "Linear"],
        backend,
        2,
        fused_linear_cross_entropy=True,
        check_ambient_config=False,
    )
    assert report.lm_head_unit == "lm_head"
    assert "FLCE_LM_HEAD_OWN_UNIT" in codes(report)
    without_flce = plan_units(model, ["LlamaDecoderLayer", "Linear"], backend, 2, check_ambient_config=False)
    assert "FLCE_LM_HEAD_OWN_UNIT" not in codes(without_flce)
    default = plan_units(
        model, ["LlamaDecoderLayer"], backend, 2, fused_linear_cross_entropy=True, check_ambient_config=False
    )
    assert not [c for c in codes(default) if c.startswith("FLCE")]


def test_flce_lm_head_not_gathered_for_peft_model_under_fsdp2():
    # accelerate finds no final norm under a PeftModel, so lm_head sits alone in its output unit.
    report = plan_units(tiny_lora(), ["LlamaDecoderLayer"], "fsdp2", 2, fused_linear_cross_entropy=True)
    assert report.lm_head_unit == "base_model.model.lm_head"
    assert report.final_norm_unit == ROOT
    assert "FLCE_LM_HEAD_NOT_GATHERED" in codes(report)
    tied = plan_units(
        tiny_lora(tied=True), ["LlamaDecoderLayer"], "fsdp2", 2, fused_linear_cross_entropy=True
    )
    assert "FLCE_LM_HEAD_NOT_GATHERED" not in codes(tied)  # the embeddings in the group gather it first


def test_flce_with_adapter_on_lm_head():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]), low_cpu_mem_usage=True
    )
    report = plan_units(model, ["LlamaDecoderLayer"], "fsdp1", 2, fused_linear_cross_entropy=True)
    assert "FLCE_LM_HEAD_ADAPTER" in codes(report)


def test_fsdp1_mixed_requires_grad_needs_use_orig_params():
    model = tiny_lora()
    report = plan_units(
        model, ["LlamaDecoderLayer"], "fsdp1", 2, use_orig_params=False, check_ambient_config=False
    )
    [warning] = [w for w in report.warnings if w.code == "FSDP1_MIXED_REQUIRES_GRAD"]
    assert "2 units" in warning.message and "use_orig_params=True" in warning.message
    assert 0 < report.units[0].trainable_params < report.units[0].params
    for ok in (
        plan_units(
            model, ["LlamaDecoderLayer"], "fsdp1", 2, use_orig_params=True, check_ambient_config=False
        ),
        plan_units(model, ["LlamaDecoderLayer"], "fsdp2", 2, check_ambient_config=False),
        plan_units(
            tiny_llama(), ["LlamaDecoderLayer"], "fsdp1", 2, use_orig_params=False, check_ambient_config=False
        ),
    ):
        assert "FSDP1_MIXED_REQUIRES_GRAD" not in codes(ok)


def test_activation_checkpointing_with_kv_cache():
    model = tiny_llama()
    assert model.config.use_cache
    on = plan_units(
        model, ["LlamaDecoderLayer"], activation_checkpointing="reentrant", check_ambient_config=False
    )
    assert "AC_WITH_KV_CACHE" in codes(on)
    off = plan_units(
        model,
        ["LlamaDecoderLayer"],
        activation_checkpointing="reentrant",
        use_cache=False,
        check_ambient_config=False,
    )
    assert "AC_WITH_KV_CACHE" not in codes(off)
    assert "AC_WITH_KV_CACHE" not in codes(
        plan_units(model, ["LlamaDecoderLayer"], check_ambient_config=False)
    )


def test_ambient_accelerate_config(tmp_path):
    config = tmp_path / "default_config.yaml"
    model = tiny_llama()
    assert "AMBIENT_ACCELERATE_CONFIG" not in codes(
        plan_units(model, ["LlamaDecoderLayer"], accelerate_config=config)
    )
    config.write_text("distributed_type: MULTI_GPU\n")
    [warning] = [w for w in plan_units(model, ["LlamaDecoderLayer"], accelerate_config=config).warnings]
    assert warning.code == "AMBIENT_ACCELERATE_CONFIG" and str(config) in warning.message
    skipped = plan_units(model, ["LlamaDecoderLayer"], accelerate_config=config, check_ambient_config=False)
    assert skipped.warnings == []


def test_render_and_json():
    report = plan_units(
        meta_model("llama-3-8b"), ["LlamaDecoderLayer"], "fsdp2", 8, check_ambient_config=False
    )
    text = render_report(report)
    assert "model.layers.{0..31}  LlamaDecoderLayer" in text
    assert "model.norm + lm_head" in text and "No warnings." in text and "\x1b[" not in text
    data = json.loads(json.dumps(report.to_json()))
    assert data["units"][0] == {
        "path": "model.embed_tokens",
        "class": "Embedding",
        "params": 128256 * 4096,
        "trainable_params": 128256 * 4096,
        "bytes": 2 * 128256 * 4096,
        "bytes_per_rank": 2 * 128256 * 4096 // 8,
        "reason": "accelerate_embeddings",
    }


# --- the plan is what accelerate builds ----------------------------------------------------------------

ACCELERATE_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM
from tests.test_wrap import tiny_config

def real(tied, lora):
    model = AutoModelForCausalLM.from_config(tiny_config(tied))
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    return model

def units_of(model, version):
    names = {id(m): n.replace("_fsdp_wrapped_module.", "").removesuffix("._fsdp_wrapped_module") or "(root)"
             for n, m in model.named_modules()}
    units = {}
    if version == 2:
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule):
                state = m._get_fsdp_state()
                group = state._fsdp_param_group
                key = " + ".join(names[id(x)] for x in state._modules)
                units[key] = sum(p._orig_size.numel() for p in group.fsdp_params) if group else 0
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        for m in model.modules():
            if isinstance(m, FSDP):
                flat = m._handle.flat_param if m._handle else None
                units[names[id(m)]] = sum(s.numel() for s in flat._shapes) if flat is not None else 0
    return units

dist.init_process_group("gloo", rank=0, world_size=1)
results = []
for version, tied, lora in json.loads(sys.argv[1]):
    AcceleratorState._reset_state(True)
    model = real(tied, lora)
    extra = {"use_orig_params": True} if version == 1 else {}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], **extra)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    state = AcceleratorState()  # real FSDP on CPU (fsdp-facts.md): set the type before prepare
    state.distributed_type, state.device, state.fsdp_plugin = DistributedType.FSDP, torch.device("cpu"), plugin
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # What fused linear cross-entropy sees: lm_head.weight right after the decoder stack, inside the forward.
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    seen = []
    causal_lm.model.register_forward_hook(lambda *_: seen.append(type(causal_lm.lm_head.weight).__name__))
    model(input_ids=torch.tensor([[1, 2, 3]]))
    results.append({"units": units_of(model, version), "lm_head_weight": seen[0]})
print("RESULT " + json.dumps(results))
dist.destroy_process_group()
"""


def test_plan_matches_the_units_accelerate_builds():
    """Real FSDP-1 / FSDP-2 through accelerate (gloo, one process) gives exactly the planned units."""
    cases = [
        (2, False, False),
        (2, True, False),
        (2, False, True),
        (2, True, True),
        (1, False, False),
        (1, True, True),
    ]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29400 + os.getpid() % 500)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    import warm_python  # here: ACCELERATE_SCRIPT imports this module where tests/ is not on the path

    done = warm_python.run(["-c", ACCELERATE_SCRIPT, json.dumps(cases)], timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.split("RESULT ", 1)[1])
    for (version, tied, lora), result in zip(cases, results, strict=True):
        model = tiny_lora(tied) if lora else tiny_llama(tied)
        report = plan_units(
            model,
            ["LlamaDecoderLayer"],
            f"fsdp{version}",
            1,
            fused_linear_cross_entropy=True,
            check_ambient_config=False,
        )
        planned = {u.path: u.params for u in report.units} | {ROOT: report.root_params}
        assert planned == result["units"], (version, tied, lora)
        # Where our warning says FLCE would read a shard, accelerate hands it a DTensor.
        not_gathered = "FLCE_LM_HEAD_NOT_GATHERED" in codes(report)
        assert not_gathered == (result["lm_head_weight"] == "DTensor"), (version, tied, lora, result)
