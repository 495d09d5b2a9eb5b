"""The kernel check on a tiny twin: a kernel that changes the loss or any gradient is switched off, and
the check says which and why. Also: what patch_model proves by probes on models whose own code does
more than the standard math (a remote-code model with multipliers, MoE router losses)."""

from __future__ import annotations

import copy

import liger_kernels.patch_loss
import liger_kernels.patch_swiglu
import pytest
import torch
from conftest import save_remote_code_model
from liger_kernels import patch_model
from transformers import AutoConfig, AutoModelForCausalLM

from liger_cli.twin.kernel_check import check_kernels, compare_kernels, disagreement, train_step
from liger_cli.twin.tiny import tiny_batch, tiny_causal_lm

ALL_ON = dict(rms_norm=True, rope=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)


def test_agreeing_kernels_stay_on():
    check = check_kernels(AutoConfig.for_model("llama"), ALL_ON)
    assert check.switched_off == {} and check.not_run is None
    assert check.kernels == ALL_ON
    assert check.lines() == [
        "kernel check: one step on a tiny twin, patched vs unpatched: loss, every gradient and greedy generation agree"
    ]
    assert 0 < check.seconds < 60
    assert "swiglu: patched 2 modules (LlamaMLP)" in check.twin_report


def break_swiglu_after_patching(monkeypatch):
    """A SwiGLU kernel 0.1% off. patch_model's probes use the kernel too and would refuse it, so the
    fault starts only once patching is done, as a fault the probes cannot see would."""
    import liger_kernels

    real_swiglu, real_patch_model = liger_kernels.patch_swiglu.swiglu, liger_kernels.patch_model
    faulty = {"on": False}

    def swiglu(gate, up):
        return real_swiglu(gate, up) * (1.001 if faulty["on"] else 1.0)

    def patch_model(model, **kernels):
        faulty["on"] = False
        report = real_patch_model(model, **kernels)
        faulty["on"] = True
        return report

    monkeypatch.setattr(liger_kernels.patch_swiglu, "swiglu", swiglu)
    monkeypatch.setattr(liger_kernels, "patch_model", patch_model)


def test_a_kernel_that_changes_the_math_is_switched_off(monkeypatch):
    # The check must catch the fault on the twin's gradients and switch off that kernel alone.
    break_swiglu_after_patching(monkeypatch)
    check = check_kernels(AutoConfig.for_model("llama"), ALL_ON)
    assert set(check.switched_off) == {"swiglu"}, check.switched_off
    assert "differs" in check.switched_off["swiglu"]
    assert check.kernels == {**ALL_ON, "swiglu": False}
    assert check.lines()[0].endswith("switched off swiglu")
    assert check.lines()[1].startswith("  swiglu off: ")


def test_a_kernel_wrong_only_when_decoding_is_switched_off(monkeypatch):
    """An RMSNorm kernel wrong only on one-token inputs (the KV-cache decoding step: training never
    sees them) passes the training step and is caught by the greedy generation comparison."""
    import liger_kernels.patch_rms_norm as patch_rms_norm

    real = patch_rms_norm.rms_norm

    def decode_step_off(x, weight, eps, offset=0.0):
        out = real(x, weight, eps, offset)
        return out * 3.0 if x.shape[-2] == 1 else out

    monkeypatch.setattr(patch_rms_norm, "rms_norm", decode_step_off)
    check = check_kernels(AutoConfig.for_model("llama"), ALL_ON)
    assert check.switched_off == {
        "rms_norm": "greedy generation chooses other tokens than the unpatched model"
    }


def _fused_loss_without_router_loss(causal_lm):
    """The fused forward as it was: decoder, then the fused loss; anything else the forward adds is lost."""
    import types

    from liger_kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self, *args, labels=None, **kwargs):
        if not (self.training and labels is not None):
            return type(self).forward(self, *args, labels=labels, **kwargs)
        kwargs.pop("output_router_logits", None)
        hidden = self.model(*args, **kwargs).last_hidden_state
        targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, targets.reshape(-1)
        )
        return CausalLMOutputWithPast(loss=loss)

    causal_lm.forward = types.MethodType(forward, causal_lm)
    return True


def test_check_catches_a_fused_loss_that_drops_the_router_loss(monkeypatch):
    import liger_kernels.patch as patch

    config = AutoConfig.for_model("mixtral")
    assert check_kernels(config, ALL_ON).switched_off == {}  # ours keeps the router loss
    monkeypatch.setattr(patch, "patch_fused_linear_cross_entropy", _fused_loss_without_router_loss)
    check = check_kernels(config, ALL_ON)
    assert set(check.switched_off) == {"fused_linear_cross_entropy"}, check.switched_off
    assert check.kernels["fused_linear_cross_entropy"] is False and check.kernels["swiglu"] is True


def test_moe_fused_loss_keeps_the_router_loss_and_experts_take_swiglu():
    config = AutoConfig.for_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    model = tiny_causal_lm(config)
    batch = tiny_batch(model)
    reference = train_step(model, batch)
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    assert "Qwen3MoeExperts" in report.classes["swiglu"], str(report)
    assert report.patched["fused_linear_cross_entropy"] == 1
    assert disagreement(train_step(patched, batch), reference) is None
    # The router loss is really in there: without it the loss is different.
    model.config.output_router_logits = False
    assert disagreement(train_step(model, batch), reference) is not None


def test_a_twin_that_cannot_be_built_leaves_the_kernels_as_requested(monkeypatch):
    import liger_cli.twin.tiny

    def no_twin(*args, **kwargs):
        raise liger_cli.twin.tiny.TinyModelError(
            "LlamaConfig: the shrunk model still has 9,999,999 parameters"
        )

    monkeypatch.setattr(liger_cli.twin.tiny, "tiny_causal_lm", no_twin)
    check = check_kernels(AutoConfig.for_model("llama"), ALL_ON)
    assert check.not_run and "9,999,999 parameters" in check.not_run
    assert check.kernels == ALL_ON and check.lines()[0].startswith("kernel check: not run (no tiny twin")


@pytest.fixture(scope="module")
def remote_model_dir(tmp_path_factory):
    return save_remote_code_model(tmp_path_factory.mktemp("remote") / "scaled-llama")


def test_remote_code_model_with_multipliers_patches_only_what_is_proven(remote_model_dir):
    def load():
        return AutoModelForCausalLM.from_pretrained(
            remote_model_dir, trust_remote_code=True, dtype=torch.float32
        )

    model = load()
    assert type(model).__name__ == "ScaledLlamaForCausalLM"
    batch = tiny_batch(model)
    wrong, crashed, report = compare_kernels(load, batch, ALL_ON)
    assert wrong == {} and crashed == {}
    # The MLP halves its output: left alone, with the reason. The logit multiplier is a plain number,
    # which the fused loss moves onto the hidden state: patched, and exact (compared above).
    assert report[2].startswith(
        "swiglu: not patched: ScaledLlamaMLP.forward is not down(silu(gate(x)) * up(x))"
    )
    assert report[4] == "fused_linear_cross_entropy: patched 1 module (ScaledLlamaForCausalLM)"
    check = check_kernels(model.config, ALL_ON, trust_remote_code=True)
    assert check.switched_off == {} and check.not_run is None


def test_a_logit_transform_the_fused_loss_cannot_express_is_left_alone(remote_model_dir):
    # A learned logit scale (a tensor, not a number) must not be moved into the fused loss.
    model = AutoModelForCausalLM.from_pretrained(
        remote_model_dir, trust_remote_code=True, dtype=torch.float32
    )
    model.config.logit_multiplier = torch.tensor(2.0)
    report = patch_model(copy.deepcopy(model))
    assert "fused_linear_cross_entropy" not in report.patched
    assert "does more with its logits than the loss" in report.skipped["fused_linear_cross_entropy"]


def test_fused_forward_refuses_at_run_time_what_it_cannot_reproduce(remote_model_dir):
    # Patched while the multiplier was a number, changed to a tensor afterwards: an error, not a wrong loss.
    model = AutoModelForCausalLM.from_pretrained(
        remote_model_dir, trust_remote_code=True, dtype=torch.float32
    )
    patch_model(model)
    model.config.logit_multiplier = torch.tensor(2.0)
    model.train()
    with pytest.raises(liger_kernels.patch_loss.LogitsTransformed):
        model(**tiny_batch(model))


def test_remote_code_run_trains_the_same_with_kernels_on_and_off(remote_model_dir, tmp_path):
    """`liger train` on a trusted remote-code model with an MLP multiplier and a logit multiplier: the
    losses and the adapter equal those of a run with every kernel off, and the run says what it left."""
    import json

    from safetensors.torch import load_file
    from test_train import liger_in_one_process, recipe_text

    recipes = {}
    for name, kernels in {
        # off first: the run with kernels on then patches a process whose classes nothing patched before
        "off": "{rms_norm: false, rope: false, swiglu: false, fused_linear_cross_entropy: false}",
        "on": "{rms_norm: true, rope: true, swiglu: true, fused_linear_cross_entropy: true}",
    }.items():
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(
            recipe_text(
                remote_model_dir,
                tmp_path / name,
                model=f"{{path: {remote_model_dir}, trust_remote_code: true}}",
                kernels=kernels,
                training="{max_steps: 3, micro_batch_size: 4, grad_accum: 1, lr: 5.0e-3, eval_every: 3}",
            )
        )
        recipes[name] = recipe
    runs = {}  # both runs in one process (test_train.liger_in_one_process): one process's imports
    for name, done in zip(
        recipes, liger_in_one_process(*(["train", str(r)] for r in recipes.values())), strict=True
    ):
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = (done.stdout, tmp_path / name)

    def losses(out):
        return [
            r["loss"]
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r
        ]

    assert len(losses(runs["on"][1])) == 3
    torch.testing.assert_close(losses(runs["on"][1]), losses(runs["off"][1]), rtol=1e-5, atol=1e-6)
    on = load_file(runs["on"][1] / "final" / "adapter_model.safetensors")
    off = load_file(runs["off"][1] / "final" / "adapter_model.safetensors")
    assert on.keys() == off.keys() and on
    for key in on:
        torch.testing.assert_close(on[key], off[key], rtol=1e-4, atol=1e-6)

    plan = (runs["on"][1] / "plan.txt").read_text()
    assert "swiglu: not patched: ScaledLlamaMLP.forward is not down(silu(gate(x)) * up(x))" in plan
    assert "fused_linear_cross_entropy: patched 1 module (ScaledLlamaForCausalLM)" in plan
    assert "kernel check: one step on a tiny twin, patched vs unpatched" in plan
    assert "kernel check" in runs["on"][0] and "ScaledLlamaMLP" in runs["on"][0]  # the run log says it too


def test_the_plan_says_which_kernel_the_check_switched_off(monkeypatch, tiny_model_dir, tmp_path):
    from test_train import recipe_text

    from liger_cli.plan import build_plan
    from liger_cli.recipe import load_recipe

    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(recipe_text(tiny_model_dir, tmp_path / "out"))
    break_swiglu_after_patching(monkeypatch)
    plan = build_plan(load_recipe(recipe_path))
    assert plan.kernels["swiglu"] is False and plan.kernels["rms_norm"] is True
    assert set(plan.kernels_off) == {"swiglu"}
    rendered = plan.render()
    assert "kernels off" in rendered and "differs" in rendered.split("kernels off")[1].splitlines()[0]
    assert "note: kernel check: one step on a tiny twin" in rendered and "switched off swiglu" in rendered
    assert not (tmp_path / "out").exists()  # planning writes nothing

    # And with the check off in the recipe, the kernel stays as requested.
    off = build_plan(load_recipe(recipe_path, ["kernels.check=false"]))
    assert off.kernels["swiglu"] is True and off.kernels_off == {}
