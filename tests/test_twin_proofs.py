"""The packing and accumulation checks on a tiny twin (liger_cli/twin/pipeline_check.py): a model whose
attention leaks across packed examples is refused before anything runs, the families that honour
position_ids pass, and a loss normalisation that changes with accumulation is caught."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART_MODEL, tiny_llama_settings
from transformers import AutoConfig

from liger_cli.errors import UserError
from liger_cli.twin.pipeline_check import check_pipeline

ALL_ON = dict(rms_norm=True, rope=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
LEAKY_CODE = Path(__file__).resolve().parent / "fixtures" / "leaky_llama"
REPO = Path(__file__).resolve().parents[1]
QUICK_DATA = REPO / "recipes" / "quickstart" / "data"


def save_leaky_model(path: Path, **overrides) -> Path:
    """tests/fixtures/leaky_llama saved as a Hub repo holds it (code + auto_map), quickstart tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    for source in LEAKY_CODE.glob("*.py"):
        shutil.copy(source, path / source.name)
    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    settings = dict(
        model_type="leaky_llama",
        architectures=["LeakyLlamaForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_leaky_llama.LeakyLlamaConfig",
            "AutoModelForCausalLM": "modeling_leaky_llama.LeakyLlamaForCausalLM",
        },
        **tiny_llama_settings(tokenizer),
        **overrides,
    )
    (path / "config.json").write_text(json.dumps(settings))
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, trust_remote_code=True).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def leaky_dir(tmp_path_factory) -> Path:
    return save_leaky_model(tmp_path_factory.mktemp("leaky") / "leaky-llama")


def write_recipe(tmp_path: Path, model_dir: Path, packing: bool = True, **extra: str) -> Path:
    sections = {
        "model": f"{{path: {model_dir}, trust_remote_code: true}}",
        "adapter": "{type: lora, r: 4, alpha: 8}",
        "data": f"{{train: {QUICK_DATA / 'train.jsonl'}, format: instruction, max_seq_len: 48, "
        f"packing: {str(packing).lower()}}}",
        "training": "{max_steps: 2, micro_batch_size: 2, grad_accum: 2}",
        "output": f"{{dir: {tmp_path / 'out'}}}",
    }
    sections.update(extra)
    path = tmp_path / "r.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in sections.items()))
    return path


# --- packing ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma", "qwen3", "phi3", "mixtral"])
def test_families_that_honour_position_ids_pack_and_accumulate_exactly(family: str) -> None:
    config = AutoConfig.for_model(family)  # imports transformers' model modules: seconds on a busy machine
    packing, accumulation = check_pipeline(config, ALL_ON, packing=True, grad_accum=4)
    assert packing.error is None and accumulation.error is None
    assert packing.line == (
        "packing check: packed rows vs each example alone on a tiny twin (sdpa): "
        "every example's loss and every gradient agree"
    )
    assert accumulation.line == (
        "accumulation check: micro-batch 4 x accumulation 1 vs 1 x 4 on a tiny twin "
        "(padding, uneven label counts): loss and every gradient agree"
    )


def test_a_model_whose_mask_ignores_position_ids_is_refused(leaky_dir: Path) -> None:
    config = AutoConfig.from_pretrained(leaky_dir, trust_remote_code=True)
    packing, accumulation = check_pipeline(config, ALL_ON, packing=True, trust_remote_code=True)
    assert packing.error and accumulation.error is None  # unpacked batches are fine on it
    assert packing.error.startswith("data.packing: true would change what LeakyLlamaForCausalLM learns")
    assert "packed examples see each other" in packing.error
    assert packing.error.endswith("; set data.packing: false")
    assert "example 2 of 4 has a summed loss of" in packing.line  # the first one packed after another
    # Packing off: nothing to prove, and nothing refused.
    off, _ = check_pipeline(config, ALL_ON, packing=False, trust_remote_code=True)
    assert off.line == "packing check: not run (packing off)" and off.error is None


def test_when_another_attention_implementation_packs_exactly_the_fix_names_it(tmp_path: Path) -> None:
    leaky_in_sdpa = save_leaky_model(tmp_path / "leaky-sdpa", leak_with=["sdpa"])
    config = AutoConfig.from_pretrained(leaky_in_sdpa, trust_remote_code=True)
    packing, _ = check_pipeline(config, ALL_ON, packing=True, trust_remote_code=True)
    assert packing.error and packing.error.endswith(
        "set model.attn_implementation: eager (packing agrees with it on this model), or set data.packing: false"
    )
    eager, _ = check_pipeline(
        config, ALL_ON, packing=True, trust_remote_code=True, attn_implementation="eager"
    )
    assert eager.error is None and "tiny twin (eager)" in eager.line


def test_every_command_refuses_packing_on_a_leaking_model(leaky_dir: Path, tmp_path: Path) -> None:
    """`liger train`, `--dry-run` and `inspect-wrap --recipe`: exit 2, one line, nothing written."""
    from test_train import liger_here
    from typer.testing import CliRunner

    from liger_cli.cli import app
    from liger_cli.plan import build_plan
    from liger_cli.recipe import load_recipe

    recipe = write_recipe(tmp_path, leaky_dir)
    with pytest.raises(UserError, match="LeakyLlamaForCausalLM.*data.packing: false"):
        build_plan(load_recipe(recipe))
    for args in (["train", str(recipe), "--dry-run"], ["inspect-wrap", "--recipe", str(recipe)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "data.packing: true would change what LeakyLlamaForCausalLM learns" in result.stderr
    proc = liger_here("train", str(recipe))  # train's real process refusing: test_recipe.py's
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.packing: true would change"), proc.stderr
    assert not (tmp_path / "out").exists()

    # packing: false trains it: the Plan says the packing check did not run, and why, the same way in
    # --dry-run and inspect-wrap --recipe.
    recipe = write_recipe(tmp_path, leaky_dir, packing=False)
    plan = build_plan(load_recipe(recipe))
    assert "packing check: not run (packing off)" in plan.notes
    assert any(n.startswith("accumulation check: ") and n.endswith("agree") for n in plan.notes)
    for args in (["train", str(recipe), "--dry-run"], ["inspect-wrap", "--recipe", str(recipe)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert plan.render() in result.stdout


def test_a_twin_that_cannot_be_built_leaves_packing_on_and_says_so(monkeypatch, leaky_dir: Path, tmp_path):
    import liger_cli.twin.tiny
    from liger_cli.plan import build_plan
    from liger_cli.recipe import load_recipe

    def no_twin(*args, **kwargs):
        raise liger_cli.twin.tiny.TinyModelError(
            "LeakyLlamaConfig: the shrunk model still has 9,999,999 parameters"
        )

    monkeypatch.setattr(liger_cli.twin.tiny, "tiny_causal_lm", no_twin)
    plan = build_plan(load_recipe(write_recipe(tmp_path, leaky_dir)))
    reason = "no tiny twin: LeakyLlamaConfig: the shrunk model still has 9,999,999 parameters"
    assert f"packing check: not run ({reason}); packing stays on, not proven on this model" in plan.notes
    assert f"accumulation check: not run ({reason})" in plan.notes
    flash = check_pipeline(AutoConfig.for_model("llama"), {}, True, attn_implementation="flash_attention_2")
    assert flash[0].line.startswith(
        "packing check: not run (the CPU twin cannot run attention flash_attention_2)"
    )


# --- accumulation -----------------------------------------------------------------------------------------------
def mean_per_micro_batch(model, batch, num_items):
    """A classic mistake: each micro-batch's own mean, whatever the step's count."""
    return model(**batch).loss


def mean_over_accumulation(model, batch, num_items):
    """The other classic: each micro-batch's mean divided by the accumulation steps (here 4)."""
    return model(**batch).loss / 4


@pytest.mark.parametrize("wrong", [mean_per_micro_batch, mean_over_accumulation])
def test_a_wrong_loss_normalisation_is_caught(monkeypatch, wrong) -> None:
    import liger_cli.model.objectives.causal_lm as rule
    from liger_cli.model.objectives import CausalLM

    config = AutoConfig.for_model("llama")
    monkeypatch.setattr(rule, "causal_lm_loss", wrong)
    _, accumulation = check_pipeline(config, ALL_ON, packing=False, grad_accum=2)
    assert accumulation.error and accumulation.error.startswith(
        "training.grad_accum: 2 on 1 process(es) would change what LlamaForCausalLM learns"
    )
    assert "differ" in accumulation.line
    _, two_processes = check_pipeline(config, ALL_ON, packing=False, grad_accum=1, processes=2)
    assert two_processes.error and "on 2 process(es)" in two_processes.error
    # One micro-batch per step on one process: the split never happens, so nothing is refused.
    _, single = check_pipeline(config, ALL_ON, packing=False, grad_accum=1)
    assert single.error is None and single.line.endswith(
        "not used by this run (one micro-batch per step, one process)"
    )
    # The run's objective calls the same rule: what the check proves is what trains.
    from liger_cli.twin.tiny import tiny_batch, tiny_causal_lm

    model = tiny_causal_lm(config)
    batch = tiny_batch(model)
    got, _ = CausalLM().loss(model, batch, torch.tensor(1000))
    torch.testing.assert_close(got, wrong(model, batch, None))
