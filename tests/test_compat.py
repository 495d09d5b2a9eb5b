"""What newer transformers releases change under our patches, checked on whichever one is installed.

- transformers 5.24 decorates every attention forward (`deprecate_kwarg`): RoPE must still be found and
  patched below the decorator, and the decorator must still run. Simulated here on the pinned release
  too, so CI on the pin exercises the unwrapping.
- The `kernels` hub decorator turns `apply_rotary_pos_emb` into a callable module: the function that
  really runs is what is probed.
- A head that subclasses nn.Linear (5.24's Dory scales its logits by a learned vector) is the fused
  loss's `F.linear(h, weight, bias)` only when it holds no other parameter and its forward is proven
  linear: otherwise the fused loss is left off, with the reason.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
from liger_kernels import patch_model
from test_patch import assert_same_training, batch, counting, tiny_model
from torch import nn

# Families whose attention calls the standard rotate_half apply_rotary_pos_emb (2 layers each).
STANDARD_ROTARY = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")


@pytest.mark.parametrize("family", STANDARD_ROTARY)
def test_rope_is_patched_in_every_standard_rotary_family(family, tmp_path, monkeypatch):
    reference = tiny_model(family, tmp_path)
    patched = copy.deepcopy(reference)
    report = patch_model(patched, rms_norm=False, swiglu=False, fused_linear_cross_entropy=False)
    assert report.patched.get("rope") == 2, str(report)

    calls = counting(monkeypatch)
    for model in (patched, reference):
        model.train()
    got, want = patched(**batch()), reference(**batch())
    assert calls == {"apply_rope": 2}  # the patched forward really calls our kernel, once per layer
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.logits, want.logits)


def _counting_decorator(forward, seen: list):
    """A decorator as transformers writes them (functools.wraps, the wrapped function in a closure)."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        seen.append(type(self).__name__)
        return forward(self, *args, **kwargs)

    return wrapper


def test_rope_is_patched_below_forward_decorators(tmp_path, monkeypatch):
    # Two layers of decorators on top of whatever the installed release has (5.24: one already).
    seen: list = []
    attention = modeling_llama.LlamaAttention
    wrapped = _counting_decorator(_counting_decorator(attention.forward, seen), seen)
    monkeypatch.setattr(attention, "forward", wrapped)
    reference = tiny_model("llama", tmp_path)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert report.patched["rope"] == 2, str(report)

    calls = counting(monkeypatch)
    patched.train()
    patched(**batch())
    assert calls["apply_rope"] == 2
    assert seen == ["LlamaAttention"] * 4  # both decorators still run on each of the 2 layers
    seen.clear()
    assert_same_training(patched, reference)


def test_a_decorator_that_hides_the_forward_leaves_rope_alone(tmp_path, monkeypatch):
    hidden = {}  # the wrapped forward is reached through a dict, not a closure cell: no copy is proven

    def opaque(forward):
        hidden["forward"] = forward

        @functools.wraps(forward)
        def wrapper(self, *args, **kwargs):
            return hidden["forward"](self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        modeling_llama.LlamaAttention, "forward", opaque(modeling_llama.LlamaAttention.forward)
    )
    reference = tiny_model("llama", tmp_path)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert "rope" not in report.patched
    assert "which we cannot copy" in report.skipped["rope"], str(report)
    assert_same_training(patched, reference)


class _HubFunction(nn.Module):
    """What the `kernels` hub decorator makes of a function: a module instance whose forward calls it."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *args, **kwargs):
        return self.function(*args, **kwargs)


def test_rope_probes_the_hub_decorated_function_that_really_runs(tmp_path, monkeypatch):
    original = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _HubFunction(original))
    reference = tiny_model("llama", tmp_path)
    patched = copy.deepcopy(reference)
    assert patch_model(patched).patched["rope"] == 2
    assert_same_training(patched, reference)

    # A hub kernel that computes something else is probed as what it is, and left alone.
    monkeypatch.setattr(
        modeling_llama, "apply_rotary_pos_emb", _HubFunction(lambda q, k, *args, **kwargs: (q, k))
    )
    other = tiny_model("llama", tmp_path)
    report = patch_model(other)
    assert "rope" not in report.patched and "not the rotate_half formula" in report.skipped["rope"]


# --- lm_head subclasses ----------------------------------------------------------------------------


class ScaledHead(nn.Linear):
    """A head with a learned per-token logit scale (as transformers 5.24's DoryLMHead)."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, out_features))

    def forward(self, hidden):
        return super().forward(hidden) * self.scale


class ClampedHead(nn.Linear):
    """No parameter of its own, but a forward that is not F.linear."""

    def forward(self, hidden):
        return super().forward(hidden).clamp(-0.05, 0.05)


class RenamedHead(nn.Linear):
    """An nn.Linear subclass whose forward is F.linear written out: the fused loss reproduces it."""

    def forward(self, hidden):
        return nn.functional.linear(hidden, self.weight, self.bias)


def with_head(model, head_class):
    old = model.lm_head
    head = head_class(old.in_features, old.out_features)
    head.weight = old.weight
    model.lm_head = head
    return model


def test_an_lm_head_with_a_parameter_of_its_own_keeps_its_gradient(tmp_path):
    reference = with_head(tiny_model("llama", tmp_path), ScaledHead)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert "fused_linear_cross_entropy" not in report.patched
    assert "parameters of its own (scale)" in report.skipped["fused_linear_cross_entropy"], str(report)
    assert report.patched["rope"] == 2  # the other kernels are unaffected

    patched.train()
    patched(**batch()).loss.backward()
    assert patched.lm_head.scale.grad is not None and patched.lm_head.scale.grad.abs().sum() > 0
    patched.zero_grad()
    assert_same_training(patched, reference)


def test_an_lm_head_whose_forward_is_not_linear_is_left_alone(tmp_path):
    reference = with_head(tiny_model("llama", tmp_path), ClampedHead)
    patched = copy.deepcopy(reference)
    report = patch_model(patched)
    assert "ClampedHead.forward is not F.linear" in report.skipped["fused_linear_cross_entropy"]
    assert_same_training(patched, reference)


def test_an_lm_head_subclass_proven_linear_takes_the_fused_loss(tmp_path, monkeypatch):
    reference = with_head(tiny_model("llama", tmp_path), RenamedHead)
    patched = copy.deepcopy(reference)
    assert patch_model(patched).patched["fused_linear_cross_entropy"] == 1
    calls = counting(monkeypatch)
    assert_same_training(patched, reference)
    assert calls["_flce"] == 3


def test_a_head_swapped_in_after_patching_is_refused_at_the_first_step(tmp_path):
    model = tiny_model("llama", tmp_path)
    patch_model(model)
    with_head(model, ScaledHead).train()
    with pytest.raises(ValueError, match="parameters of its own"):
        model(**batch())
