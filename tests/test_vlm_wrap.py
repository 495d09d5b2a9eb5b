"""Wrap plans of vision-language models: image-text-to-text families of the installed transformers,
shrunk from their own config class, saved as a config.json and planned by `inspect-wrap` on the meta device.

A plan is wrong when a decoder layer or a vision block is not a unit of its own, a wrap class names a class
the model lacks, the units do not cover the model, or (FSDP-1) the frozen vision tower shares a unit with
trainable parameters. Families that cannot be built tiny are listed with the reason.

The test plans one family for each path through the planner (`CODE_PATHS`) and the families named in the
docs; `python scripts/vlm_sweep.py` (run by scripts/compat.sh) plans every family with the same checks.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import warnings
from functools import cache
from pathlib import Path

import pytest
import warm_python
from torch import nn

from liger_cli.errors import UserError
from liger_cli.plan.inspect_wrap import apply_vision_mode, build_meta_model
from liger_cli.plan.wrap import ROOT, plan_units, render_report, resolve_wrap_classes

REPO = Path(__file__).resolve().parents[1]


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:160] if text else ''}"


def save_tiny_config(model_type: str, folder: Path, shrink: bool = True) -> Path:
    """The family's default config, shrunk (`liger_cli.twin.shrink`), written as folder/config.json."""
    from transformers import AutoConfig

    from liger_cli.twin.shrink import shrink_config

    config = AutoConfig.for_model(model_type)
    (shrink_config(config) if shrink else config).save_pretrained(folder)
    return folder


def build_default(model_type: str, folder: Path) -> tuple[nn.Module, str]:
    """The family on meta from its shrunk config, else (a shrunk config its validation refuses on
    reading) from its default sizes: on the meta device they cost no memory."""
    try:
        return build_meta_model(str(save_tiny_config(model_type, folder))), "tiny"
    except Exception:
        return build_meta_model(str(save_tiny_config(model_type, folder, shrink=False))), "default sizes"


def heaviest_list(module: nn.Module | None) -> nn.ModuleList | None:
    """The outermost ModuleList in `module` holding the most parameters: its decoder layers, or its vision
    blocks (the test's own reading, independent of liger's)."""
    if module is None:
        return None
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    nested = {id(inner) for outer in lists for inner in list(outer.modules())[1:]}
    outer = [m for m in lists if id(m) not in nested and any(True for _ in m.parameters())]
    return max(outer, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def blocks_of(lst: nn.ModuleList | None):
    """The blocks of a list; a list of lists (Florence-2's stages) holds its blocks one level down."""
    for item in lst or []:
        yield from blocks_of(item) if isinstance(item, nn.ModuleList) else [item]


def image_encoder(model: nn.Module) -> nn.Module | None:
    """transformers' own answer, else the module built from config.vision_config, else the outermost
    sub-model whose forward takes pixel_values first; never one that also reads the text (T5Gemma 2's)."""
    try:
        embed = model.get_input_embeddings()
    except NotImplementedError:
        embed = None

    def image_only(module) -> bool:
        return (
            isinstance(module, nn.Module)
            and module is not model
            and any(True for _ in module.parameters())
            and not any(m is embed for m in module.modules())
        )

    encoder = model.get_encoder(modality="image")
    if image_only(encoder):
        return encoder
    vision_config = getattr(model.config, "vision_config", None)
    built_from = [m for m in model.modules() if m is not model and getattr(m, "config", 0) is vision_config]
    if built_from and image_only(built_from[0]):
        return built_from[0]
    from transformers import PreTrainedModel

    for module in model.modules():
        first = next(iter(inspect.signature(module.forward).parameters), None)
        if isinstance(module, PreTrainedModel) and first == "pixel_values" and image_only(module):
            return module
    return None


def shares_outside(block: nn.Module, model: nn.Module) -> bool:
    """Whether a parameter of `block` is also held by a module outside it (a unit would split it)."""
    inside = {id(m) for m in block.modules()}
    mine = {id(p) for p in block.parameters()}
    return any(
        id(p) in mine for m in model.modules() if id(m) not in inside for p in m.parameters(recurse=False)
    )


def wrong_in_plan(model: nn.Module) -> tuple[list[str], dict]:
    """What is wrong with the default plans of `model` (vision tower frozen), and the plans' facts."""
    resolution = resolve_wrap_classes(model, env={})
    paths = {id(m): name for name, m in model.named_modules()}
    present = {type(m).__name__ for m in model.modules()}
    decoder = model.get_decoder()
    layers = heaviest_list(decoder if decoder is not model else None)
    tower = image_encoder(model)
    blocks = heaviest_list(tower)
    unique = {id(p): p for p in model.parameters()}.values()
    named = list(getattr(model, "_no_split_modules", None) or [])
    wrong, facts = [], {}
    if tower is not None and any(p.requires_grad for p in tower.parameters()):
        wrong.append("the vision tower is not frozen by default")
    for backend in ("fsdp1", "fsdp2"):
        report = plan_units(model, resolution, backend, num_processes=2, check_ambient_config=False)
        units = {u.path for u in report.units}
        codes = [w.code for w in report.warnings]
        for what, lst in (("decoder layer", layers), ("vision block", blocks)):
            for block in blocks_of(lst):
                if paths[id(block)] in units:
                    continue
                same_class = [m for m in model.modules() if type(m) is type(block)]
                if type(block).__name__ in report.kept_whole and any(
                    shares_outside(m, model) for m in same_class
                ):
                    continue  # rightly not a unit: a unit of its class would split a shared weight
                wrong.append(f"{backend}: {what} {paths[id(block)]} is not a unit")
                break
        unknown = [name for name in report.wrap_classes if name not in present]
        if unknown:
            wrong.append(f"{backend}: wrap classes the model lacks: {unknown}")
        if sum(u.params for u in report.units) + report.root_params != sum(p.numel() for p in unique):
            wrong.append(f"{backend}: the units do not cover the model")
        if "FSDP1_FROZEN_VISION_SHARED" in codes:
            wrong.append("the frozen vision tower shares an FSDP-1 unit with trainable parameters")
        if backend == "fsdp1" and "TIED_SPLIT" in codes:
            wrong.append("fsdp1: a shared weight is split over units")
        if report.dropped_no_split != [n for n in named if n not in present]:
            wrong.append(f"dropped _no_split_modules not reported: {report.dropped_no_split}")
        facts[f"{backend}_warnings"] = codes
        facts["units"] = len(units)
    facts |= {
        "layers": len(list(blocks_of(layers))),
        "vision_blocks": len(list(blocks_of(blocks))),
        "tower": type(tower).__name__ if tower is not None else None,
        "dropped": resolution.dropped,
        "kept_whole": resolution.kept_whole,
    }
    return wrong, facts


# One family for each path a plan takes (what the full sweep, scripts/vlm_sweep.py, found on transformers
# 5.23), and the families the docs name. The fact after each is asserted, so a family that leaves its path
# is noticed.
CODE_PATHS = {
    "llava": "CLIP tower beside the language model; CLIPTextEmbeddings dropped from _no_split_modules",
    "qwen2_vl": "M-RoPE; the projector (merger) inside the tower; nothing dropped",
    "qwen2_5_vl": "window and full vision blocks",
    "gemma3": "SigLIP tower; a VLM in the causal-LM mapping too",
    "idefics3": "pixel-shuffle connector",
    "mllama": "cross-attention layers; a tower of local and global blocks",
    "paligemma": "SigLIP tower, the projector one linear",
    "florence2": "vision blocks in a list of lists (stages); FSDP-2 warns of a split shared weight",
    "blip": "a shared weight: its class kept whole; FSDP-2 warns",
    "udop": "no tower (patches into the encoder); shared weights, classes kept whole",
    "vision-encoder-decoder": "an encoder-decoder; the text embeddings kept whole",
    "t5gemma2": "an encoder that also reads the text: the tower is the SigLIP inside it",
    "fuyu": "no tower: patches go straight to the language model",
    "emu3": "a VQ image tokenizer, no tower of blocks",
    "granite_docling": "its shrunk config refused on reading: planned at default sizes",
    "fast_vlm": "not built: needs timm (listed with the reason)",
    "chameleon": "not built: transformers raises on its default config",
    "evolla": "not built: not an image-text-to-text class (a UserError)",
}


def sweep_of(families, mktemp) -> dict[str, dict]:
    """The plan of each family (`mktemp(name)` gives it a folder): built or why not, what is wrong."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    rows = {}
    for model_type in families:
        folder = mktemp(model_type.replace(".", "_"))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, sizes = build_default(model_type, folder)
                model = apply_vision_mode(model, None, False)
        except (UserError, Exception) as err:
            rows[model_type] = {"built": False, "reason": _first_line(err)}
            continue
        wrong, facts = wrong_in_plan(model)
        rows[model_type] = {
            "built": True,
            "class": type(model).__name__,
            "sizes": sizes,
            "wrong": wrong,
            **facts,
        }
    return rows


def every_family_wrong(sweep: dict[str, dict], every: bool = True) -> list[str]:
    """What is wrong in a sweep (scripts/vlm_sweep.py); of every family (`every`), also the counts
    docs/distributed.md gives."""
    built = {t: r for t, r in sweep.items() if r["built"]}
    with_tower = [t for t, r in built.items() if r["tower"] and r["vision_blocks"]]
    problems = [f"{t}: {r['wrong']}" for t, r in built.items() if r["wrong"]]
    problems += [f"{t}: not built, no reason" for t, r in sweep.items() if not r["built"] and not r["reason"]]
    if not every:
        return problems
    if list(sweep) != _families():
        problems.append("not every family of the mapping, once")
    if len(built) < 87:  # transformers 5.23: 87 of 97
        problems.append(f"only {len(built)} families built")
    if len(with_tower) < 81:  # the rest: Fuyu's patches, Emu3's VQ tokenizer, text-only defaults
        problems.append(f"only {len(with_tower)} built families with a vision tower of blocks")
    return problems


def summary(sweep: dict[str, dict]) -> str:
    built = {t: r for t, r in sweep.items() if r["built"]}
    not_built = {t: r["reason"] for t, r in sweep.items() if not r["built"]}
    default_sizes = [t for t, r in built.items() if r["sizes"] != "tiny"]
    fsdp2_split = [t for t, r in built.items() if "TIED_SPLIT" in r["fsdp2_warnings"]]
    return (
        f"{len(sweep)} families, {len(built)} built on meta ({len(default_sizes)} at default sizes: "
        f"{default_sizes}), {sum(bool(r['wrong']) for r in built.values())} wrong plans, "
        f"not built: {json.dumps(not_built, indent=1)}\n"
        f"FSDP-2: accelerate's output unit splits a weight shared by more modules (warned): {fsdp2_split}\n"
        f"kept whole: { {t: r['kept_whole'] for t, r in built.items() if r['kept_whole']} }"
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[str, dict]:
    return sweep_of(sorted(CODE_PATHS), tmp_path_factory.mktemp)


def test_each_code_path_gets_a_right_plan(sweep):
    assert set(CODE_PATHS) <= set(_families())  # each still a family of the installed transformers
    assert list(sweep) == sorted(CODE_PATHS)
    print("\n" + summary(sweep))
    built = {t: r for t, r in sweep.items() if r["built"]}
    not_built = {t: r["reason"] for t, r in sweep.items() if not r["built"]}
    wrong = {t: r["wrong"] for t, r in built.items() if r["wrong"]}
    assert wrong == {}, f"wrong plans: {wrong}"
    assert all(reason for reason in not_built.values())  # listed with why, not skipped
    for family in ("qwen2_vl", "qwen2_5_vl", "gemma3", "llava", "idefics3", "mllama", "paligemma"):
        row = built[family]
        assert row["layers"] >= 2 and row["vision_blocks"] >= 1 and row["tower"], (family, row)
    # Each family still takes the path it stands for.
    assert set(not_built) == {"fast_vlm", "chameleon", "evolla"}, not_built
    assert "timm" in not_built["fast_vlm"] and not_built["evolla"].startswith("UserError")
    assert [t for t, r in built.items() if r["sizes"] != "tiny"] == ["granite_docling"]
    no_tower = [t for t, r in built.items() if not (r["tower"] and r["vision_blocks"])]
    assert no_tower == ["emu3", "fuyu", "udop"], no_tower
    split = [t for t, r in built.items() if "TIED_SPLIT" in r["fsdp2_warnings"]]
    assert split == ["blip", "florence2", "t5gemma2", "udop", "vision-encoder-decoder"], split
    kept = {t: r["kept_whole"] for t, r in built.items() if r["kept_whole"]}
    assert kept == {"blip": ["BlipTextEmbeddings"], "udop": ["RelativePositionBias1D", "UdopBlock"],
                    "vision-encoder-decoder": ["BertEmbeddings"]}, kept  # fmt: skip
    assert built["florence2"]["vision_blocks"] > built["florence2"]["layers"]  # blocks one level down
    assert built["t5gemma2"]["tower"] == "SiglipVisionModel"


def test_no_split_names_the_model_lacks_are_dropped_and_reported(sweep):
    assert "CLIPTextEmbeddings" in sweep["llava"]["dropped"]
    assert sweep["qwen2_vl"]["dropped"] == []


@cache
def tiny_folder(model_type: str, root: str) -> Path:
    return save_tiny_config(model_type, Path(root) / model_type)


def test_detection_goes_by_the_config(tmp_path):
    from liger_cli.model import meta_model_from_config

    folder = tiny_folder("qwen2_vl", str(tmp_path))
    assert type(build_meta_model(str(folder))).__name__ == "Qwen2VLForConditionalGeneration"
    built = meta_model_from_config(folder)  # what `train` builds: the same class, from the same detection
    assert type(built).__name__ == "Qwen2VLForConditionalGeneration"
    with pytest.raises(UserError, match="not a causal language model or vision-language model"):
        meta_model_from_config(save_tiny_config("clip", tmp_path / "clip", shrink=False))  # neither
    llama = build_meta_model(str(REPO / "tests" / "configs" / "llama-3-8b"))
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert resolve_wrap_classes(llama, env={}).added == []


def test_frozen_tower_sharing_a_unit_is_reported_under_fsdp1(tmp_path):
    model = apply_vision_mode(build_meta_model(str(tiny_folder("llava", str(tmp_path)))), None, False)
    default = plan_units(model, resolve_wrap_classes(model, env={}), "fsdp1", 2, check_ambient_config=False)
    assert "CLIPVisionModel" in default.wrap_classes and default.warnings == []
    assert "model.vision_tower" in {u.path for u in default.units}
    parts = {p.name: (p.params, p.trainable_params) for p in default.parts}
    assert parts["vision tower"][1] == 0 and parts["vision tower"][0] > 0
    assert (
        parts["other (projector, ...)"][0] == parts["other (projector, ...)"][1] > 0
    )  # the projector trains
    assert default.mixed_units == []

    layers_only = resolve_wrap_classes(model, "LlamaDecoderLayer,CLIPEncoderLayer", env={})
    fsdp1 = plan_units(model, layers_only, "fsdp1", 2, check_ambient_config=False)
    [warning] = [w for w in fsdp1.warnings if w.code == "FSDP1_FROZEN_VISION_SHARED"]
    assert "(root)" in warning.message and "CLIPVisionModel" in warning.message
    assert fsdp1.mixed_units == [ROOT]
    text = render_report(fsdp1)
    assert "Units mixing frozen and trainable parameters: (root)" in text
    assert "vision tower model.vision_tower" in text
    default_text = render_report(default)
    assert "(dropped): CLIPTextEmbeddings" in default_text and "leaves out): CLIPVisionModel" in default_text
    fsdp2 = plan_units(model, layers_only, "fsdp2", 2, check_ambient_config=False)
    assert "FSDP1_FROZEN_VISION_SHARED" not in [w.code for w in fsdp2.warnings]

    full = apply_vision_mode(build_meta_model(str(tiny_folder("llava", str(tmp_path)))), "full", False)
    assert all(p.requires_grad for p in full.parameters())
    assert "FSDP1_FROZEN_VISION_SHARED" not in [
        w.code for w in plan_units(full, layers_only, "fsdp1", 2, check_ambient_config=False).warnings
    ]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return warm_python.run(["-m", "liger_cli", "inspect-wrap", *args], timeout=300, cwd=REPO)


def invoke_cli(*args: str) -> subprocess.CompletedProcess:
    """`inspect-wrap` in this process (the same app: parsing, errors, exit code), stderr apart."""
    from typer.testing import CliRunner

    from liger_cli import cli

    result = CliRunner().invoke(cli.app, ["inspect-wrap", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def test_cli_lora_stays_out_of_a_frozen_tower(tmp_path):
    """The first command is a real `liger inspect-wrap` process; the others run in this process."""
    folder = str(tiny_folder("qwen2_vl", str(tmp_path)))
    parts = {}
    for vision, run in (("frozen", run_cli), ("lora", invoke_cli)):
        done = run(folder, "--lora", "--vision", vision, "--backend", "fsdp1", "--json")
        assert done.returncode == 0, done.stderr[-2000:]
        parts[vision] = {p["name"]: p for p in json.loads(done.stdout)["parts"]}
    assert parts["frozen"]["vision tower"]["trainable_params"] == 0  # all-linear kept out of the tower
    assert parts["lora"]["vision tower"]["trainable_params"] > 0  # LoRA adapters in the tower
    assert parts["frozen"]["language model"]["trainable_params"] > 0

    done = invoke_cli(folder, "--vision", "lora")
    assert done.returncode == 2 and "vision tower: add --lora" in done.stderr
    done = invoke_cli(str(REPO / "tests" / "configs" / "llama-3-8b"), "--vision", "full")
    assert done.returncode == 2 and "has no vision tower" in done.stderr
    done = invoke_cli(folder, "--vision", "half")
    assert done.returncode == 2 and "choose frozen, lora, full" in done.stderr


FSDP1_SCRIPT = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import AutoConfig, AutoModelForImageTextToText
from liger_cli.plan.inspect_wrap import apply_vision_mode

def units_of(model):
    names = {id(m): n.replace("_fsdp_wrapped_module.", "").removesuffix("._fsdp_wrapped_module") or "(root)"
             for n, m in model.named_modules()}
    return {names[id(m)]: sum(s.numel() for s in m._handle.flat_param._shapes) if m._handle else 0
            for m in model.modules() if isinstance(m, FSDP)}

dist.init_process_group("gloo", rank=0, world_size=1)
results = []
for names, use_orig_params in json.loads(sys.argv[2]):
    AcceleratorState._reset_state(True)
    model = apply_vision_mode(AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(sys.argv[1])), None, False)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=names, use_orig_params=use_orig_params)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    state = AcceleratorState()  # real FSDP on CPU: set the type before prepare
    state.distributed_type, state.device, state.fsdp_plugin = DistributedType.FSDP, torch.device("cpu"), plugin
    try:
        model = accelerator.prepare(model)
        results.append({"units": units_of(model)})
    except ValueError as err:
        results.append({"error": str(err)})
print("RESULT " + json.dumps(results))
dist.destroy_process_group()
"""


def test_real_fsdp1_builds_the_planned_units_and_the_frozen_tower_failure(tmp_path):
    """accelerate's FSDP-1 (gloo, one process) on a tiny LLaVA with its tower frozen: the default plan's units
    are exactly what FSDP builds, even without use_orig_params; the layers-only plan that leaves the tower
    in the root unit with the projector fails as the field saw it, and the plan warned."""
    import os

    folder = tiny_folder("llava", str(tmp_path))
    model = apply_vision_mode(build_meta_model(str(folder)), None, False)
    default = resolve_wrap_classes(model, env={})
    layers_only = ["LlamaDecoderLayer", "CLIPEncoderLayer"]
    cases = [(default.classes, False), (default.classes, True), (layers_only, False)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29900 + os.getpid() % 90)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = warm_python.run(["-c", FSDP1_SCRIPT, folder, json.dumps(cases)], timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    strict, orig, broken = json.loads(done.stdout.split("RESULT ", 1)[1])
    report = plan_units(model, default, "fsdp1", 1, check_ambient_config=False)
    planned = {u.path: u.params for u in report.units} | {ROOT: report.root_params}
    assert strict["units"] == planned and orig["units"] == planned
    assert "uniform `requires_grad`" in broken["error"]
    warned = plan_units(model, layers_only, "fsdp1", 1, check_ambient_config=False)
    assert "FSDP1_FROZEN_VISION_SHARED" in [w.code for w in warned.warnings]
