"""QLoRA (model.quantize): the recipe's rules, exact adapter gradients through the 4-bit base (also after
an evaluation pass, where bitsandbytes' CPU path has a trap), the quantized kernel-check twin, a real
run with its final check, `liger merge` into the full-precision base, and no bitsandbytes notice on
plain runs."""

from __future__ import annotations

import gc
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model
from safetensors.torch import load_file
from test_train import liger, liger_here, recipe_text

bnb = pytest.importorskip("bitsandbytes")

from liger_cli.errors import UserError  # noqa: E402
from liger_cli.recipe import Recipe  # noqa: E402
from liger_cli.recipe.load import load_recipe  # noqa: E402

NOTICE_WORDS = ("kernels-community", "gemm_4bit")


@pytest.fixture(scope="module")
def model64(tmp_path_factory) -> Path:
    """Hidden 64: bitsandbytes' CPU inference repacking (the trap) needs whole 64-weight blocks per row."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny64"), hidden_size=64, intermediate_size=128)


def recipe_for(model_dir: Path, tmp_path: Path, **model) -> Recipe:
    return Recipe.model_validate(
        {
            "model": {"path": str(model_dir), **model},
            "adapter": {"type": "lora", "r": 4, "alpha": 8},
            "data": {"train": str(tmp_path / "train.jsonl")},
        }
    )


# --- the recipe's rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("adapter: {type: none}\n", ["model.quantize nf4", "full fine-tuning", "adapter.type lora"]),
        (
            "distributed: {backend: fsdp1, num_processes: 2, fsdp: {cpu_offload: true}}\n",
            ["nf4 with distributed.fsdp.cpu_offload", "cpu_offload: false"],
        ),
    ],
)
def test_refused_combinations(tmp_path: Path, tiny_model_dir: Path, extra: str, words: list[str]) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(f"model: {{path: {tiny_model_dir}, quantize: nf4}}\ndata: {{train: t.jsonl}}\n{extra}")
    with pytest.raises(UserError) as err:
        load_recipe(path)
    for word in words:
        assert word in str(err.value)


def test_quantize_keys(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "r.yaml"
    for model, words in (
        ("quantize_double: false", "quantize_double applies with model.quantize"),
        ("quantize: nf4, load_kwargs: {quantization_config: {}}", "set model.quantize"),
        ("quantize: int3", "quantize"),
    ):
        path.write_text(f"model: {{path: {tiny_model_dir}, {model}}}\ndata: {{train: t.jsonl}}\n")
        with pytest.raises(UserError, match=words):
            load_recipe(path)
    path.write_text(
        f"model: {{path: {tiny_model_dir}, quantize: fp4, quantize_double: false}}\ndata: {{train: t.jsonl}}\n"
    )
    (tmp_path / "t.jsonl").write_text('{"text": "x"}\n')
    recipe = load_recipe(path)
    assert (recipe.model.quantize, recipe.model.quantize_double) == ("fp4", False)


def test_refusal_is_one_line_exit_2(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(recipe_text(tiny_model_dir, tmp_path / "out", adapter="{type: none}").replace(
        f"{{path: {tiny_model_dir}}}", f"{{path: {tiny_model_dir}, quantize: nf4}}"
    ))  # fmt: skip
    proc = liger_here("train", str(path), "--dry-run")  # in this process: train's real process refusing
    assert proc.returncode == 2, proc.stderr  # is test_recipe.py's
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "full fine-tuning" in proc.stderr and not (tmp_path / "out").exists()


# --- exact training -----------------------------------------------------------------------------------


def _randomize_lora_b(model, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.1


def _step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _qlora(recipe: Recipe):
    from liger_cli.model import add_adapter, load_base_model

    torch.manual_seed(0)  # lora_A's initialisation
    model = add_adapter(load_base_model(recipe), recipe)
    _randomize_lora_b(model)
    return model


BATCH = {"input_ids": torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))}
BATCH["labels"] = BATCH["input_ids"]


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_gradients_equal_dequantized(model64: Path, tmp_path: Path, kind: str) -> None:
    """The adapter's loss and gradients through the 4-bit base equal the same adapter's on a plain model
    holding the dequantized weights (fp32 compute)."""
    from transformers import AutoModelForCausalLM

    from liger_cli.model import add_adapter
    from liger_cli.model.quantize import dequantized_weight

    recipe = recipe_for(model64, tmp_path, quantize=kind)
    qlora = _qlora(recipe)
    dense = AutoModelForCausalLM.from_pretrained(model64, dtype=torch.float32)
    layers = [(n, m) for n, m in qlora.get_base_model().named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14  # 7 linear layers x 2 decoder layers; lm_head stays full precision
    for name, layer in layers:
        dense.get_submodule(name.replace(".base_layer", "")).weight.data = dequantized_weight(layer).float()
    dense = add_adapter(dense, recipe_for(model64, tmp_path))
    dense.load_state_dict({k: v for k, v in qlora.state_dict().items() if "lora_" in k}, strict=False)
    loss4, grads4 = _step(qlora, BATCH)
    loss, grads = _step(dense, BATCH)
    assert grads4.keys() == grads.keys() and len(grads) == 28
    assert abs(loss4 - loss) <= 1e-6 * abs(loss)
    for name, grad in grads.items():
        assert (grads4[name] - grad).abs().max() <= 1e-6 * grad.abs().max(), name


def test_eval_pass_between_steps_changes_nothing(model64: Path, tmp_path: Path) -> None:
    """An eval-mode forward under no_grad (an evaluation) between two steps leaves the next step's
    gradients exactly as without it. Without liger's fix, on a CPU with AVX512-BF16, bitsandbytes repacks
    the weights for inference there and the next backward is wrong (shown when this CPU has the path)."""
    recipe = recipe_for(model64, tmp_path, quantize="nf4")
    clean = _step(_qlora(recipe), BATCH)

    def after_eval(model):
        model.eval()
        with torch.no_grad():
            model(input_ids=BATCH["input_ids"])
        return _step(model, BATCH)

    fixed = after_eval(_qlora(recipe))
    assert torch.equal(fixed[0], clean[0])
    for name, grad in clean[1].items():
        assert torch.equal(fixed[1][name], grad), name
    if bnb.functional.has_avx512bf16():  # the trap itself, on the CPUs that have it
        trapped = _qlora(recipe)
        for module in trapped.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                module.support_avx512bf16_for_cpu = True
        with pytest.warns(UserWarning):
            _, grads = after_eval(trapped)
        assert any(not torch.allclose(grads[n], g, atol=1e-6) for n, g in clean[1].items())


def test_kernel_check_twin_is_quantized(model64: Path, tmp_path: Path) -> None:
    from liger_cli.model import read_config, twin_adapter
    from liger_cli.twin.kernel_check import check_kernels
    from liger_cli.twin.tiny import tiny_causal_lm

    recipe = recipe_for(model64, tmp_path, quantize="nf4")
    config = read_config(model64)
    twin = twin_adapter(recipe)(tiny_causal_lm(config))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in twin.modules())
    kernels = recipe.kernels.requested()
    check = check_kernels(config, kernels, add_adapter=twin_adapter(recipe))
    assert check.not_run is None and not check.switched_off, check.lines()


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps `path` (Linux's /proc/self/maps)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            low, high = fields[0].split("-")
            found.append((int(low, 16), int(high, 16)))
    return found


def _in_ranges(model, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [
        t for t in [*model.parameters(), *model.buffers()] if any(a <= t.data_ptr() < b for a, b in ranges)
    ]


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
def test_no_tensor_keeps_the_checkpoint_mapped(model64: Path, tmp_path: Path) -> None:
    """from_pretrained maps the checkpoint and keeps what it does not quantize (embeddings, norms, lm_head)
    as views into that map, which keeps every full-precision page the quantizer read resident (on the
    1B shape, most of a step's peak: bench/README.md). liger's load copies them out: none of its
    tensors lies in the map, and the map itself is gone."""
    from transformers import AutoModelForCausalLM

    from liger_cli.model import load_base_model
    from liger_cli.model.quantize import quantization_config

    checkpoint = (model64 / "model.safetensors").resolve()
    plain = AutoModelForCausalLM.from_pretrained(
        model64, quantization_config=quantization_config("nf4", True, torch.float32)
    )
    assert _in_ranges(plain, _mapped_ranges(checkpoint))  # what liger's load must not leave
    del plain
    gc.collect()
    model = load_base_model(recipe_for(model64, tmp_path, quantize="nf4"))
    assert not _in_ranges(model, _mapped_ranges(checkpoint))
    gc.collect()
    assert _mapped_ranges(checkpoint) == []


# --- a real run, its final check, merge -----------------------------------------------------------------


def test_qlora_run_and_merge(model64: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    path = tmp_path / "r.yaml"
    text = recipe_text(
        model64, out, training="{max_steps: 3, micro_batch_size: 4, lr: 5.0e-3, eval_every: 1, seed: 3}"
    )
    path.write_text(text.replace(f"{{path: {model64}}}", f"{{path: {model64}, quantize: nf4}}"))
    proc = liger("train", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "quantize            nf4 4-bit linear layers (double quantization), compute in float32" in proc.stdout
    )
    assert "final model verified: reloaded from final/, every tensor equal" in proc.stdout
    assert not any(word in proc.stderr for word in NOTICE_WORDS), proc.stderr
    proc = liger_here("merge", str(out), str(tmp_path / "merged"))  # in this process: `liger merge` as a
    assert proc.returncode == 0, proc.stderr[-3000:]  # process is test_train.py's and test_output_safety.py's
    line = next(s for s in proc.stdout.splitlines() if "adapter on the 4-bit base vs merged" in s)
    quantization_error = float(line.split("merged: ")[1].split()[0])
    assert 0 < quantization_error < 1
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not hasattr(merged.config, "quantization_config")  # full precision, never the 4-bit weights
    base = AutoModelForCausalLM.from_pretrained(model64, dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, out / "final").eval()
    with torch.no_grad():
        want = expected(input_ids=BATCH["input_ids"]).logits
        got = merged.eval()(input_ids=BATCH["input_ids"]).logits
    assert (want - got).abs().max() < 1e-4


def test_plain_run_has_no_bitsandbytes_notice(tiny_model_dir: Path, tmp_path: Path) -> None:
    """peft imports bitsandbytes whenever it is installed: its hub notice stays off every run's output."""
    path = tmp_path / "r.yaml"
    path.write_text(
        recipe_text(tiny_model_dir, tmp_path / "out", training="{max_steps: 1, micro_batch_size: 2}")
    )
    proc = liger("train", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(word in proc.stderr + proc.stdout for word in NOTICE_WORDS), proc.stderr
    # ... and it is really there to hide: a bare import in a fresh process prints it (where the CPU has the path)
    bare = subprocess.run(
        [sys.executable, "-c", "import bitsandbytes"], capture_output=True, text=True, cwd=tmp_path
    )
    if bnb.functional.has_avx512bf16():
        assert "kernels-community" in bare.stderr


# --- two real processes --------------------------------------------------------------------------------


OVER = {"model__quantize": "nf4", "data__eval_fraction": 0.125, "training__eval_every": 2}


def make_qlora_assets(root: Path) -> dict:
    """The tiny 64-wide model and 64 instruction rows, under `root`."""
    from test_distributed import QUICK_TRAIN

    root.mkdir(parents=True, exist_ok=True)
    data = root / "train.jsonl"
    data.write_text("".join(QUICK_TRAIN.read_text().splitlines(keepends=True)[:64]))
    return {"model": save_tiny_model(root / "tiny64", hidden_size=64, intermediate_size=128), "data": data}


@pytest.fixture(scope="module")
def qlora_assets(tmp_path_factory) -> dict:
    """The assets and the 1-process QLoRA run every backend is compared with."""
    from test_distributed import run_here, write_recipe

    root = tmp_path_factory.mktemp("qlora-dist")
    assets = make_qlora_assets(root)
    (root / "ref").mkdir()
    ref = write_recipe(assets, root / "ref" / "out", **OVER)
    run_here({"cases": [{"recipe": str(ref)}]})
    return {**assets, "ref": root / "ref" / "out"}


SHARDED = "4-bit weights: 18432 of 36864 bytes on this rank, each held once per shard group"
BACKENDS = {  # test id -> (backend, recipe keys, what its sharding check says)
    "ddp": ("ddp", {}, "DDP: gradients all-reduced over 2 processes"),
    "fsdp1": ("fsdp1", {}, "; 4-bit weights: "),
    "fsdp2": ("fsdp2", {}, SHARDED),
    "zero3": ("deepspeed", {}, SHARDED),
    "zero2": ("deepspeed", {"distributed__zero_stage": 2}, "ZeRO-2: parameters replicated"),
}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def launch_part(root: Path) -> tuple[list[dict], dict[str, Path]]:
    """This file's cases of the shared 2-process launch (tests/conftest.py `two_process_launch`): each
    backend's QLoRA run and its resume, the bfloat16 bases under FSDP-1, then the replicated 4-bit
    weights that must stop (FSDP-2, uint8 storage); DeepSpeed's run last, as every DeepSpeed case of the
    launch. Returns each case's output folder; rank 0's output of a case is in RECIPE.stdout beside it."""
    from test_distributed import write_recipe

    assets = make_qlora_assets(root / "assets")
    outs, cases = {}, []
    for name, (backend, over, _) in BACKENDS.items():
        if backend == "deepspeed" and not HAS_DEEPSPEED:
            continue
        outs[name], outs[f"{name}-resumed"] = root / name, root / f"{name}-resumed"
        recipe = write_recipe(assets, outs[name], backend, **OVER, **over, output__save_every=2)
        resume = str(outs[name] / "checkpoints" / "step-2")
        resumed = write_recipe(
            assets, outs[f"{name}-resumed"], backend, **OVER, **over, output__resume=resume
        )
        cases += [{"recipe": str(recipe)}, {"recipe": str(resumed)}]
    for quantize in ("nf4", "none"):
        outs[f"bf16-{quantize}"] = root / f"bf16-{quantize}"
        over = {**OVER, "model__quantize": quantize, "model__dtype": "bfloat16"}
        cases.append({"recipe": str(write_recipe(assets, outs[f"bf16-{quantize}"], "fsdp1", **over))})
    # The 4-bit weights loaded the way other launchers load them under FSDP-2: the case must stop.
    outs["uint8"] = root / "uint8"
    uint8 = write_recipe(assets, outs["uint8"], "fsdp2", **OVER)
    cases.append({"recipe": str(uint8), "uint8_storage": True, "expect_error": True})
    return cases, outs


@pytest.fixture(scope="module")
def qlora_runs(two_process_launch) -> dict[str, Path]:
    return two_process_launch["test_qlora"]


def case_stdout(out: Path) -> str:
    """Rank 0's output of the case whose output folder is `out` (tests/dist_driver.py)."""
    return out.with_name(f"{out.name}.stdout").read_text()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", BACKENDS)
def test_two_processes_train_the_one_process_qlora(qlora_assets: dict, qlora_runs: dict, name: str) -> None:
    """QLoRA with 2 processes on gloo under every backend: per-step losses, eval losses and the saved
    adapter equal a 1-process run with the same global batch, and a resume from its checkpoint gives
    the same last steps. Where the backend shards weights, the 4-bit weights are held once over the
    ranks (the sharding check counts them; the 64-wide model's 36,864 packed bytes split evenly under
    FSDP-2 and ZeRO-3). The final check reloads onto the 4-bit base."""
    backend, _, says = BACKENDS[name]
    if backend == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/setup.sh installs it)")
    from test_distributed import assert_same_run, losses

    out, resumed = qlora_runs[name], qlora_runs[f"{name}-resumed"]
    log = case_stdout(out) + case_stdout(resumed)
    assert says in log, log[-3000:]
    assert log.count("final model verified") == 2
    assert_same_run(out, qlora_assets["ref"])
    got, want = (losses(d, "eval_loss") for d in (out, qlora_assets["ref"]))
    assert len(want) >= 2 and got == pytest.approx(want, abs=1e-5, rel=0)
    # Resumed from its step-2 checkpoint under the same backend: the same last steps and adapter.
    assert losses(resumed) == pytest.approx(losses(out)[2:], abs=1e-5, rel=0)
    got, want = (load_file(d / "final" / "adapter_model.safetensors") for d in (resumed, out))
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_fsdp1_bfloat16_base_trains_with_the_adapter_in_its_dtype(
    qlora_assets: dict, qlora_runs: dict, quantize
):
    """A bfloat16 base (4-bit or not) with LoRA under FSDP-1: peft would keep the adapter in float32 and
    FSDP-1 could not flatten the units ("Must flatten tensors with uniform dtype"); the adapter takes the
    model's dtype, the Plan says so, and the losses stay within 0.02 of the float32 QLoRA run's."""
    from test_distributed import losses

    out = qlora_runs[f"bf16-{quantize}"]
    plan = (out / "plan.txt").read_text()
    assert "adapter weights in bfloat16, the model's dtype: FSDP-1 flattens each unit into one dtype" in plan
    stdout = case_stdout(out)
    assert "final model verified" in stdout
    assert ("; 4-bit weights: " in stdout) == (quantize == "nf4")
    want = losses(qlora_assets["ref"])
    assert losses(out) == pytest.approx(want, abs=0.02, rel=0)


def test_a_checkpoint_loads_back_strictly_and_checks_the_statistics(model64: Path, tmp_path: Path) -> None:
    """bitsandbytes writes each 4-bit layer's statistics into the state dict but does not read them back,
    so a strict load (FSDP-1's resume) would refuse its own checkpoint: liger checks them against the
    loaded base's, bit for bit, and takes them out; a changed one is an error naming it."""
    from liger_cli.model import load_base_model

    model = load_base_model(recipe_for(model64, tmp_path, quantize="nf4"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("weight.absmax") for k in state)
    model.load_state_dict(state, strict=True)
    key = next(k for k in state if k.endswith("q_proj.weight.absmax"))
    state[key] = state[key] + 1
    with pytest.raises(
        RuntimeError, match=f"{key}: the checkpoint's 4-bit statistics are not the loaded base's"
    ):
        model.load_state_dict(state, strict=True)


@pytest.mark.timeout(1200)
def test_replicated_4bit_weights_are_a_downgrade(qlora_runs: dict) -> None:
    """The 4-bit weights loaded the way other launchers load them under FSDP-2 (uint8 storage, which
    accelerate leaves out of sharding, whole on every rank) stop the run (a RunFailed, which ends a
    `liger train` rank with exit 1) with the count, not a silent replication."""
    out = qlora_runs["uint8"]
    message = out.with_name("uint8.error.txt").read_text()
    assert message.startswith("DowngradeError: "), message
    assert "the 4-bit weights are held 2 times over the 2 ranks, not 1" in message, message
    assert not (out / "metrics.jsonl").exists()


def cli_json(*args: str) -> dict:
    """A `liger` command's --json output, run in this process (the same CLI code without 5-8 s of
    imports; test_sharded_plans_count_4bit_bytes runs `liger train --dry-run` as a real process)."""
    from typer.testing import CliRunner

    from liger_cli import cli

    result = CliRunner().invoke(cli.app, list(args))
    assert result.exit_code == 0, result.output[-2000:]
    return json.loads(result.stdout)


@pytest.mark.parametrize(("double", "dtype"), [(True, "float32"), (False, "float32"), (True, "bfloat16")])
def test_memory_plan_counts_4bit_bytes(double: bool, dtype: str) -> None:
    """--dry-run's parameters: the model as the run builds it (4-bit base as bitsandbytes stores it,
    what stays unquantized, the adapter), counted from its state dict, within 1%. With a bf16
    model.dtype the k-bit preparation casts what stays unquantized (the embeddings, lm_head, norms)
    to fp32, and the plan counts it so."""
    from test_train import REPO

    from liger_cli.model import add_adapter, load_base_model

    recipe = REPO / "recipes" / "qlora.yaml"
    overrides = [f"model.quantize_double={str(double).lower()}", f"model.dtype={dtype}"]
    args = ["train", str(recipe), "--dry-run", "--json", *(x for o in overrides for x in ("--set", o))]
    planned = cli_json(*args)["memory"]["components"]["parameters"]
    loaded = load_recipe(recipe, overrides)
    model = add_adapter(load_base_model(loaded), loaded)
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}  # a tied weight once
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    embedding = model.get_input_embeddings().weight
    assert embedding.dtype == torch.float32  # also under bf16: peft's k-bit preparation upcasts it
    assert planned == pytest.approx(stored, rel=0.01)


def _stored_4bit(model) -> tuple[int, int, int]:
    """(packed 4-bit bytes, their statistics' bytes, every other tensor's bytes) of a loaded model."""
    packed = stats = other = 0
    four_bit = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    for name, tensor in model.state_dict().items():
        nbytes = tensor.numel() * tensor.element_size()
        if name in four_bit:
            packed += nbytes
        elif any(name.startswith(f"{w}.") for w in four_bit):
            stats += nbytes
        else:
            other += nbytes
    return packed, stats, other


def test_sharded_plans_count_4bit_bytes(tmp_path: Path) -> None:
    """Under FSDP-2 with 2 processes the memory plan shards the packed 4-bit weights and keeps their
    statistics whole on every rank; `inspect-wrap --recipe` sizes each decoder layer at its stored
    (4-bit) bytes, with float32 storage as the run loads it: all against a loaded model, within 1%."""
    from test_train import REPO
    from transformers import AutoModelForCausalLM

    from liger_cli.model import quantize

    recipe_path = tmp_path / "qlora-fsdp2.yaml"
    text = (
        (REPO / "recipes" / "qlora.yaml").read_text().replace(" quickstart/", f" {REPO}/recipes/quickstart/")
    )
    recipe_path.write_text(text + "distributed: {backend: fsdp2, num_processes: 2}\n")
    proc = liger_here("train", str(recipe_path), "--dry-run", "--json")  # a real dry run: test_cli.py's
    assert proc.returncode == 0, proc.stderr[-2000:]
    planned = json.loads(proc.stdout)["memory"]["components"]["parameters"]
    config = quantize.quantization_config("nf4", True, torch.float32, storage=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        REPO / "recipes" / "quickstart" / "model", quantization_config=config
    )
    packed, stats, other = _stored_4bit(model)
    adapter = 74_752 * 4
    assert planned == pytest.approx((packed + other + adapter) / 2 + stats, rel=0.01)

    units = [u for u in cli_json("inspect-wrap", "--recipe", str(recipe_path), "--json")["units"]
             if u["class"] == "LlamaDecoderLayer"]  # fmt: skip
    layer = model.model.layers[0]
    stored = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    layer_adapter = 37_376 * 4  # the inspected layer's LoRA weights (r 16), fp32
    assert units and all(u["bytes"] == pytest.approx(stored + layer_adapter, rel=0.01) for u in units)


def test_without_bitsandbytes_is_a_user_error(monkeypatch, tiny_model_dir: Path, tmp_path: Path) -> None:
    from liger_cli.model.quantize import require_bitsandbytes

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(UserError, match="model.quantize nf4 needs bitsandbytes, which does not load here"):
        require_bitsandbytes(recipe_for(tiny_model_dir, tmp_path, quantize="nf4").model.quantize)
