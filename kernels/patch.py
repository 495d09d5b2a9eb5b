"""Put our kernels into ONE Hugging Face causal-LM instance, for every family by one generic path.

Why per instance: a class-level or process-wide patch changes every model in the process, so a
reference model loaded beside a patched one (an eval, a test, a teacher) would silently run our
kernels too. Here every change is an attribute of one module object, so a patched and an unpatched
model in one process both stay exactly what they are.

Why by equivalence, not by name: a module is patched only when our replacement computes what its own
forward computes, checked numerically on probes of its own code (see `_probe.py`): RMSNorm-like
norms, SwiGLU MLPs and MoE expert gates, the attention's rotary function, and the causal-LM head with
everything between the decoder and the loss. Everything else stays as it is, and the `PatchReport`
says why.

Why only the text decoder of a model with more than one (a vision-language model: a vision tower and
a projector beside its language model): the checks that decide a run's kernels (liger's tiny twin)
train the language model on text and image tokens; a vision tower's norms and MLPs are not what they
prove, so they stay as they are, and the report says so.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .patch_loss import patch_cross_entropy, patch_fused_linear_cross_entropy
from .patch_rms_norm import patch_rms_norm
from .patch_rope import patch_rope
from .patch_swiglu import patch_swiglu_mlp

KERNELS = ("rms_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy")

_PATCHED = "_liger_kernel"  # attribute set on every patched module: the kernel's name


@dataclasses.dataclass
class PatchReport:
    """What `patch_model` replaced (kernel -> module count and classes) and what it left, and why."""

    patched: dict[str, int] = dataclasses.field(default_factory=dict)
    classes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    scope: str = ""
    """Where the per-module kernels went, when not the whole model (a vision-language model)."""

    def _add(self, kernel: str, module: nn.Module) -> None:
        self.patched[kernel] = self.patched.get(kernel, 0) + 1
        names = self.classes.setdefault(kernel, [])
        if type(module).__name__ not in names:
            names.append(type(module).__name__)

    def lines(self) -> list[str]:
        out = [f"scope: {self.scope}"] if self.scope else []
        for kernel in KERNELS:
            if kernel in self.patched:
                count = self.patched[kernel]
                line = f"{kernel}: patched {count} module{'s' if count > 1 else ''} ({', '.join(self.classes[kernel])})"
                if kernel in self.skipped:
                    line += f"; {self.skipped[kernel]}"
                out.append(line)
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
    cache: dict = {}  # probe results for this call, per class and settings
    root, scope = _language_model(causal_lm)
    if scope:
        report.scope = scope
    for kernel, on, patch_one, none_found in (
        (KERNELS[0], rms_norm, patch_rms_norm, "no RMSNorm-like module found"),
        (KERNELS[1], rope, patch_rope, "no attention module calls apply_rotary_pos_emb"),
        (KERNELS[2], swiglu, patch_swiglu_mlp, "no SwiGLU-shaped MLP found"),
    ):
        if on and root is None:
            report.skipped[kernel] = scope
        elif on:
            _patch_each(root, kernel, patch_one, report, cache, none_found)
    if cross_entropy:
        _patch_once(causal_lm, "cross_entropy", patch_cross_entropy, report)
    if fused_linear_cross_entropy:
        _patch_once(causal_lm, "fused_linear_cross_entropy", patch_fused_linear_cross_entropy, report)
    return report


def _language_model(causal_lm: nn.Module) -> tuple[nn.Module | None, str]:
    """(where the per-module kernels go, what the report says of the rest).

    A model whose config is its own text config (a causal LM) is patched throughout. One with sub-models
    (a text config inside a vision-language one) is patched in its text decoder only, as transformers'
    `get_decoder()` names it; when it names none, nowhere."""
    config = getattr(causal_lm, "config", None)
    try:
        text = config.get_text_config(decoder=True)
    except (AttributeError, ValueError, TypeError):
        text = config
    if text is None or text is config:
        return causal_lm, ""
    try:
        decoder = causal_lm.get_decoder()
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        decoder = None
    name = type(causal_lm).__name__
    if not isinstance(decoder, nn.Module) or decoder is causal_lm:
        return None, f"{name} has sub-models besides its text decoder and names no decoder (get_decoder)"
    path = next((n for n, m in causal_lm.named_modules() if m is decoder), "?")
    return decoder, (
        f"patched inside the language model ({path}, {type(decoder).__name__}) and its head only: "
        "the vision tower, the projector and the rest are left as they are; rotary embeddings (a "
        "multimodal M-RoPE's sections included) compute their cos/sin as before, rope replaces only "
        "their application where the family's apply_rotary_pos_emb is proven equal"
    )


def _patch_each(root: nn.Module, kernel: str, patch_one, report: PatchReport, cache: dict, none_found: str):
    """Run `patch_one(module, cache)` on every module; it returns True (patched), a reason string (a
    candidate we cannot prove equal), or None (not a candidate)."""
    reasons = []
    for module in root.modules():
        if getattr(module, _PATCHED, None) == kernel:
            report._add(kernel, module)
            continue
        if getattr(module, _PATCHED, None) is not None:
            continue  # one kernel per module
        outcome = patch_one(module, cache)
        if outcome is True:
            setattr(module, _PATCHED, kernel)
            report._add(kernel, module)
        elif isinstance(outcome, str) and outcome not in reasons:
            reasons.append(outcome)
    if kernel not in report.patched:
        report.skipped[kernel] = "; ".join(reasons) or none_found
    elif reasons:
        report.skipped[kernel] = "some modules left unpatched: " + "; ".join(reasons)


def _patch_once(causal_lm: nn.Module, kernel: str, patch_one, report: PatchReport) -> None:
    marks = causal_lm.__dict__.setdefault("_liger_kernels", set())  # the head takes two kernels
    if kernel in marks:
        report._add(kernel, causal_lm)
        return
    outcome = patch_one(causal_lm)
    if outcome is True:
        marks.add(kernel)
        if kernel == "fused_linear_cross_entropy":
            setattr(causal_lm, _PATCHED, kernel)  # how the launcher finds the module whose forward fuses
        report._add(kernel, causal_lm)
    else:
        report.skipped[kernel] = outcome
