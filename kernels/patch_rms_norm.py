"""Find RMSNorm modules by what their forward computes, and give them our kernel.

A candidate is a leaf module with a 1-D `weight`, no bias and a float `variance_epsilon` / `eps`. It
is patched when its class forward, run on a stand-in with a random weight, equals
`x * rsqrt(mean(x^2) + eps) * (offset + w)` for offset 0 (Llama) or 1 (Gemma) at several input scales
(so a different epsilon or an extra scale shows). Extra forward arguments (a gated norm's `gate`) go
to the module's own forward: only the one-argument call was proven equal.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from . import _probe
from .rms_norm import rms_norm, rms_norm_reference


def _eps_attribute(module: nn.Module) -> str | None:
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(module, name, None), float):
            return name
    return None


def _offset(module: nn.Module, eps: float) -> float | None:
    """0.0 or 1.0 when the module's class forward is RMSNorm with that weight offset, else None."""
    size = 24
    g = _probe.generator(0)
    weight = torch.randn(size, generator=g)
    twin = _probe.stand_in(module)
    twin.weight = nn.Parameter(weight, requires_grad=False)
    inputs = [(torch.randn(3, size, generator=g) * scale,) for scale in _probe.SCALES]

    def theirs(training, x):
        twin.train(training)
        return type(module).forward(twin, x)

    for offset in (0.0, 1.0):
        if _probe.agrees(theirs, lambda training, x, o=offset: rms_norm_reference(x, weight, eps, o), inputs):
            return offset
    return None


def patch_rms_norm(module: nn.Module, cache: dict):
    """True (patched), a reason (a candidate whose forward is not RMSNorm), or None (not a candidate)."""
    weight = getattr(module, "weight", None)
    eps_name = _eps_attribute(module)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps_name is None:
        return None
    if getattr(module, "bias", None) is not None or len(module._modules) > 0:
        return None
    eps = getattr(module, eps_name)
    key = ("rms_norm", type(module), _probe.plain_attributes(module))
    if key not in cache:
        cache[key] = _offset(module, eps)
    offset = cache[key]
    if offset is None:
        return f"{type(module).__name__} has a weight and eps but its forward is not RMSNorm"

    def forward(self, hidden_states, *args, **kwargs):
        if args or kwargs:  # e.g. a gated norm's gate: only the plain call was proven equal
            return type(self).forward(self, hidden_states, *args, **kwargs)
        return rms_norm(hidden_states, self.weight, getattr(self, eps_name), offset)

    module.forward = types.MethodType(forward, module)
    return True
