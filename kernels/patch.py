"""Put our kernels into ONE Hugging Face causal-LM instance, for every supported family by one path.

Why per instance: a class-level or process-wide patch changes every model in the process, so a
reference model loaded beside a patched one (an eval, a test, a teacher) would silently run our
kernels too. Here every change is an attribute of one module object, so a patched and an unpatched
model in one process both stay exactly what they are.

Modules are recognised by structure, not by family name:
- RMSNorm: a leaf module with a 1-D `weight`, no bias and a float `variance_epsilon` / `eps`, whose own
  forward, run on a probe input with a random weight, matches `x * rsqrt(mean(x^2) + eps) * (offset + w)`
  for offset 0 (Llama) or 1 (Gemma). The probe runs on a CPU stand-in of the module, so it works
  whatever the real weights are (ones, zeros, meta, trained) and rejects look-alikes (LayerNorm).
- SwiGLU MLP: `gate_proj`, `up_proj`, `down_proj` and a SiLU `act_fn`, used by its forward. The new
  forward still calls `self.gate_proj(x)` etc., so LoRA-wrapped projections keep their adapters.
- RoPE: an attention module whose forward calls its family's module-level `apply_rotary_pos_emb`,
  when that function matches the rotate_half formula on a probe. The instance gets a copy of its
  class's forward whose globals see our function instead (shapes ours does not cover, such as Phi-3's
  partial rotary, go to the family's own function at call time).
- The causal-LM head: a module with `lm_head` and a decoder under `base_model_prefix` whose forward uses
  both and `loss_function`. Fused linear cross-entropy replaces its forward on the instance, so the
  loss runs INSIDE the causal-LM forward (where FSDP has gathered lm_head.weight), and only while
  training with labels; evaluation and generation still get logits from the original forward.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types

import torch
from torch import nn

from .cross_entropy import cross_entropy as _cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy as _flce
from .rms_norm import rms_norm as _rms_norm
from .rms_norm import rms_norm_reference
from .rope import apply_rope, rope_reference, rope_supports
from .swiglu import swiglu as _swiglu

KERNELS = ("rms_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy")

# Config attributes that change the logits between lm_head and the loss: FLCE cannot reproduce them.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")

_PATCHED = "_liger_kernel"  # attribute set on every patched module: the kernel's name


@dataclasses.dataclass
class PatchReport:
    """What `patch_model` replaced (kernel -> module count and classes) and what it left, and why."""

    patched: dict[str, int] = dataclasses.field(default_factory=dict)
    classes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def _add(self, kernel: str, module: nn.Module) -> None:
        self.patched[kernel] = self.patched.get(kernel, 0) + 1
        names = self.classes.setdefault(kernel, [])
        if type(module).__name__ not in names:
            names.append(type(module).__name__)

    def lines(self) -> list[str]:
        out = []
        for kernel in KERNELS:
            if kernel in self.patched:
                count = self.patched[kernel]
                out.append(
                    f"{kernel}: patched {count} module{'s' if count > 1 else ''} ({', '.join(self.classes[kernel])})"
                )
            elif kernel in self.skipped:
                out.append(f"{kernel}: not patched: {self.skipped[kernel]}")
            else:
                out.append(f"{kernel}: off")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def patch_model(
    model: nn.Module,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
) -> PatchReport:
    """Patch our kernels into `model` (a transformers causal LM, or a peft model around one), in place.

    Patching twice is harmless: modules already patched are counted again, not wrapped again.
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    report = PatchReport()
    if rms_norm:
        _patch_each(causal_lm, "rms_norm", _patch_rms_norm, report, "no RMSNorm-like module found")
    if rope:
        _patch_each(causal_lm, "rope", _patch_rope, report, "no attention module calls apply_rotary_pos_emb")
    if swiglu:
        _patch_each(causal_lm, "swiglu", _patch_swiglu_mlp, report, "no gate/up/down MLP found")
    if cross_entropy:
        _patch_cross_entropy(causal_lm, report)
    if fused_linear_cross_entropy:
        _patch_causal_lm_head(causal_lm, report)
    return report


def _patch_each(root: nn.Module, kernel: str, patch_one, report: PatchReport, none_found: str) -> None:
    """Run `patch_one(module)` on every module; it returns True (patched), a reason string (a
    candidate that does not fit), or None (not a candidate)."""
    reasons = []
    for module in root.modules():
        if getattr(module, _PATCHED, None) == kernel:
            report._add(kernel, module)
            continue
        outcome = patch_one(module)
        if outcome is True:
            setattr(module, _PATCHED, kernel)
            report._add(kernel, module)
        elif isinstance(outcome, str) and outcome not in reasons:
            reasons.append(outcome)
    if kernel not in report.patched:
        report.skipped[kernel] = "; ".join(reasons) or none_found
    elif reasons:
        report.skipped[kernel] = "some modules left unpatched: " + "; ".join(reasons)


# --- RMSNorm ------------------------------------------------------------------------------------


def _eps_attribute(module: nn.Module) -> str | None:
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(module, name, None), float):
            return name
    return None


_RMS_NORM_FORMS: dict[tuple[type, float], float | None] = {}


def _rms_norm_offset(module: nn.Module, eps: float) -> float | None:
    """0.0 or 1.0 when the module's class forward computes RMSNorm with that weight offset, else None.

    Found by a probe: the class forward runs on a CPU stand-in (the module's attributes, a random fp32
    weight), so the real weights' values, device or dtype do not matter. Cached per (class, eps).
    """
    key = (type(module), eps)
    if key not in _RMS_NORM_FORMS:
        size = 24
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(3, size, generator=generator)
        weight = torch.randn(size, generator=generator)
        stand_in = type(module).__new__(type(module))
        stand_in.__dict__.update(module.__dict__)
        nn.Module.__init__(stand_in)  # fresh parameter, buffer, module and hook dicts
        stand_in.weight = nn.Parameter(weight, requires_grad=False)
        _RMS_NORM_FORMS[key] = None
        try:
            with torch.no_grad():
                out = type(module).forward(stand_in, x)
        except Exception:
            return None
        if isinstance(out, torch.Tensor) and out.shape == x.shape:
            for offset in (0.0, 1.0):
                if torch.allclose(
                    out.float(), rms_norm_reference(x, weight, eps, offset), rtol=1e-5, atol=1e-6
                ):
                    _RMS_NORM_FORMS[key] = offset
    return _RMS_NORM_FORMS[key]


def _patch_rms_norm(module: nn.Module):
    weight = getattr(module, "weight", None)
    eps_name = _eps_attribute(module)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps_name is None:
        return None
    if getattr(module, "bias", None) is not None or len(module._modules) > 0:
        return None
    offset = _rms_norm_offset(module, getattr(module, eps_name))
    if offset is None:
        return f"{type(module).__name__} has a weight and eps but its forward is not RMSNorm"

    def forward(self, hidden_states):
        return _rms_norm(hidden_states, self.weight, getattr(self, eps_name), offset)

    module.forward = types.MethodType(forward, module)
    return True


# --- SwiGLU MLP ---------------------------------------------------------------------------------


def _is_silu(act: object) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is nn.functional.silu


def _patch_swiglu_mlp(module: nn.Module):
    names = getattr(type(module).forward, "__code__", types.SimpleNamespace(co_names=())).co_names
    has_projections = all(
        isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj")
    )
    if not has_projections:
        if type(module).__name__.endswith("MLP"):
            return f"{type(module).__name__} has no separate gate_proj/up_proj/down_proj"
        return None
    if not all(n in names for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return f"{type(module).__name__}.forward does not use gate_proj/up_proj/down_proj/act_fn"
    act = getattr(module, "act_fn", None)
    if not _is_silu(act):
        return f"{type(module).__name__}.act_fn is {type(act).__name__}, not SiLU"

    def forward(self, x):
        return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x)))

    module.forward = types.MethodType(forward, module)
    return True


# --- RoPE ---------------------------------------------------------------------------------------


@functools.cache
def _family_rope_matches(family_rope) -> bool:
    """Whether a family's apply_rotary_pos_emb(q, k, cos, sin) is the rotate_half formula (a probe)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=generator)
    k = torch.randn(2, 2, 5, 8, generator=generator)
    cos = torch.randn(2, 5, 8, generator=generator)
    sin = torch.randn(2, 5, 8, generator=generator)
    try:
        got = family_rope(q, k, cos, sin)
    except Exception:
        return False
    want = rope_reference(q, k, cos, sin)
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want, strict=True))


@functools.cache
def _forward_with_our_rope(cls: type):
    """A copy of `cls.forward` that sees our RoPE in place of its module's apply_rotary_pos_emb.

    Only the copy's globals differ: the class, its module and every other instance are untouched.
    """
    original = cls.forward
    family_rope = original.__globals__["apply_rotary_pos_emb"]

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if args or kwargs or not rope_supports(q, k, cos, sin):
            return family_rope(q, k, cos, sin, *args, **kwargs)
        return apply_rope(q, k, cos, sin)

    namespace = dict(original.__globals__, apply_rotary_pos_emb=apply_rotary_pos_emb)
    forward = types.FunctionType(
        original.__code__, namespace, original.__name__, original.__defaults__, original.__closure__
    )
    forward.__kwdefaults__ = original.__kwdefaults__
    forward.__qualname__ = original.__qualname__
    return forward


def _patch_rope(module: nn.Module):
    forward = type(module).forward
    code = getattr(forward, "__code__", None)
    if code is None or "apply_rotary_pos_emb" not in code.co_names:
        return None
    family_rope = forward.__globals__.get("apply_rotary_pos_emb")
    if family_rope is None or not _family_rope_matches(family_rope):
        family = sys.modules.get(type(module).__module__, None)
        return f"{getattr(family, '__name__', '?')}.apply_rotary_pos_emb is not the rotate_half formula"
    module.forward = types.MethodType(_forward_with_our_rope(type(module)), module)
    return True


# --- the loss: cross-entropy and fused linear cross-entropy -------------------------------------


def _shifted_labels(labels, shift_labels, ignore_index):
    """transformers' ForCausalLMLoss shift: token t predicts label t+1; the last position is ignored."""
    if shift_labels is not None:
        return shift_labels
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _divide_by_items(loss, num_items_in_batch):
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def causal_lm_cross_entropy(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' ForCausalLMLoss with our cross-entropy kernel (same signature, same numbers)."""
    targets = _shifted_labels(labels, shift_labels, ignore_index).reshape(-1).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _cross_entropy(logits.reshape(-1, vocab_size), targets, ignore_index, reduction)
    return _divide_by_items(loss, num_items_in_batch)


def _patch_cross_entropy(causal_lm: nn.Module, report: PatchReport) -> None:
    if not hasattr(type(causal_lm), "loss_function"):
        report.skipped["cross_entropy"] = f"{type(causal_lm).__name__} has no loss_function to replace"
        return
    causal_lm.loss_function = causal_lm_cross_entropy  # an instance attribute (transformers' setter)
    report._add("cross_entropy", causal_lm)


def _flce_refusal(causal_lm: nn.Module) -> str | None:
    """Why fused linear cross-entropy cannot reproduce this model's loss exactly, or None."""
    name = type(causal_lm).__name__
    decoder = getattr(causal_lm, getattr(causal_lm, "base_model_prefix", ""), None)
    lm_head = getattr(causal_lm, "lm_head", None)
    forward = getattr(inspect.unwrap(type(causal_lm).forward), "__code__", None)  # under its decorators
    if lm_head is None or not isinstance(decoder, nn.Module) or decoder is causal_lm or forward is None:
        return f"{name} is not a causal LM with a decoder and an lm_head"
    if not {"lm_head", "loss_function"} <= set(forward.co_names):
        return f"{name}.forward does not compute its loss from lm_head and loss_function"
    config = getattr(causal_lm, "config", None)
    for attribute in LOGIT_TRANSFORMS:
        if getattr(config, attribute, None) is not None or attribute in forward.co_names:
            value = getattr(config, attribute, None)
            return (
                f"{name} transforms its logits ({attribute}={value}), which the fused loss does not reproduce"
            )
    return _lm_head_refusal(lm_head)


def _lm_head_refusal(lm_head: nn.Module) -> str | None:
    # A plain Linear, or one whose class FSDP-2's fully_shard swapped for a subclass (FSDPLinear).
    if isinstance(lm_head, nn.Linear) and not hasattr(lm_head, "base_layer"):
        return None
    if hasattr(lm_head, "base_layer"):
        return (
            f"lm_head carries an adapter ({type(lm_head).__module__}.{type(lm_head).__name__}); the fused loss "
            "reads lm_head.weight directly and would train without the adapter's gradient"
        )
    return f"lm_head is a {type(lm_head).__name__}, not a plain nn.Linear"


def _patch_causal_lm_head(causal_lm: nn.Module, report: PatchReport) -> None:
    if getattr(causal_lm, _PATCHED, None) == "fused_linear_cross_entropy":
        report._add("fused_linear_cross_entropy", causal_lm)
        return
    refusal = _flce_refusal(causal_lm)
    if refusal:
        report.skipped["fused_linear_cross_entropy"] = refusal
        return

    def forward(self, *args, labels=None, logits_to_keep=0, **kwargs):
        fused = not args and self.training and labels is not None and isinstance(logits_to_keep, int)
        if not fused or logits_to_keep != 0:
            # The class's own forward (not a captured bound method, so copy.deepcopy stays correct).
            return type(self).forward(self, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
        return _fused_causal_lm_forward(self, labels, **kwargs)

    causal_lm.forward = types.MethodType(forward, causal_lm)
    causal_lm._liger_kernel = "fused_linear_cross_entropy"
    report._add("fused_linear_cross_entropy", causal_lm)


def _fused_causal_lm_forward(
    causal_lm, labels, num_items_in_batch=None, shift_labels=None, ignore_index=-100, **decoder_kwargs
):
    """Decoder, then the fused loss on lm_head's weight; runs inside the causal-LM module's forward."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    lm_head = causal_lm.lm_head
    refusal = _lm_head_refusal(lm_head)  # an adapter added after patching must not be silently dropped
    if refusal:
        raise ValueError(f"fused linear cross-entropy: {refusal}. Patch without fused_linear_cross_entropy.")
    decoder = getattr(causal_lm, causal_lm.base_model_prefix)
    outputs = decoder(**decoder_kwargs)
    hidden = outputs.last_hidden_state
    targets = _shifted_labels(labels, shift_labels, ignore_index).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _flce(hidden, lm_head.weight, targets, lm_head.bias, ignore_index, reduction)
    return CausalLMOutputWithPast(
        loss=_divide_by_items(loss, num_items_in_batch),
        logits=None,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
