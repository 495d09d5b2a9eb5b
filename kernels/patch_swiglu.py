"""Find SwiGLU MLPs by what their forward computes, and give them our kernel.

Three shapes of the same math, `down(silu(gate(x)) * up(x))`, each proven on the module's own code:
- separate projections: a module whose only Linear children are two `h -> i` and one `i -> h`;
- fused projections: one `h -> 2i` Linear (gate and up halves, either order) and one `i -> h`;
- MoE experts holding 3-D weight tensors: transformers' experts classes apply the gate through
  `_apply_gate(gate_up_out)`; ours replaces that method when the class's own one is `silu(gate) * up`.

Which child plays which role is not read from its name: every assignment is tried on a stand-in with
small random projections, in train and eval mode, at several input scales, and the module is patched
only when its class forward equals ours. So an MLP with a multiplier, a clamp, a dropout, another
activation or a residual stays as it is, with the reason in the report. The new forward still calls
the module's own projections, so LoRA-wrapped projections keep their adapters.
"""

from __future__ import annotations

import itertools
import types

import torch
from torch import nn

from . import _probe
from .swiglu import swiglu, swiglu_reference

_NAME_HINTS = ("gate", "w1", "up", "w3", "down", "w2")  # tried first, never trusted


def _linear_shape(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in, out, has_bias) of a Linear, seen through a peft adapter wrapper; None for anything else."""
    base = getattr(module, "base_layer", module)
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features, base.bias is not None
    return None


def _describe_activation(module: nn.Module) -> str | None:
    """'act_fn is GELUTanh, not SiLU' when the module names a non-SiLU activation: a clearer reason."""
    for name in ("act_fn", "activation_fn", "act"):
        act = getattr(module, name, None)
        if act is None or not callable(act):
            continue
        label = type(act).__name__ if isinstance(act, nn.Module) else getattr(act, "__name__", "")
        if isinstance(act, nn.SiLU) or "silu" in label.lower() or "swish" in label.lower():
            return None
        return f"{type(module).__name__}.{name} is {label}, not SiLU"
    return None


# Forms: (roles in call order, how the forward is rebuilt). Small probe sizes keep probes cheap.
H, I = 16, 24  # noqa: E741


def _separate(gate, up, down):
    def forward(self, x):
        return getattr(self, down)(swiglu(getattr(self, gate)(x), getattr(self, up)(x)))

    return forward, {gate: (H, I), up: (H, I), down: (I, H)}


def _fused(gate_up, down, gate_first):
    def forward(self, x):
        a, b = getattr(self, gate_up)(x).chunk(2, dim=-1)
        gate, up = (a, b) if gate_first else (b, a)
        return getattr(self, down)(swiglu(gate, up))

    return forward, {gate_up: (H, 2 * I), down: (I, H)}


def _candidate_forms(linears: dict[str, tuple[int, int, bool]]):
    """Every role assignment the shapes allow, names that hint at a role first."""
    names = sorted(linears, key=lambda n: min((i for i, h in enumerate(_NAME_HINTS) if h in n), default=9))
    if len(names) == 3:
        for gate, up, down in itertools.permutations(names):
            (gi, go, _), (ui, uo, _), (di, do, _) = linears[gate], linears[up], linears[down]
            if gi == ui == do and go == uo == di:
                yield _separate(gate, up, down)
    elif len(names) == 2:
        for gate_up, down in itertools.permutations(names):
            (gi, go, _), (di, do, _) = linears[gate_up], linears[down]
            if gi == do and go == 2 * di:
                yield _fused(gate_up, down, True)
                yield _fused(gate_up, down, False)


def _proven_form(module: nn.Module, linears: dict[str, tuple[int, int, bool]]):
    """The rebuilt forward that equals the module's class forward on probes, or None."""
    cls = type(module)
    g = _probe.generator(0)
    inputs = [(torch.randn(2, 5, H, generator=g) * scale,) for scale in _probe.SCALES]
    for forward, shapes in _candidate_forms(linears):
        children = {
            name: _probe.small_linear(i, o, linears[name][2], seed=k)
            for k, (name, (i, o)) in enumerate(shapes.items())
        }
        twin = _probe.stand_in(module, children)

        def run(fn, training, x, twin=twin):
            twin.train(training)
            return fn(twin, x)

        if _probe.agrees(lambda t, x: run(cls.forward, t, x), lambda t, x, f=forward: run(f, t, x), inputs):
            return forward
    return None


def patch_swiglu_mlp(module: nn.Module, cache: dict):
    """True (patched), a reason (an MLP-shaped module we cannot prove equal), or None (not a candidate)."""
    if hasattr(type(module), "_apply_gate") and isinstance(
        getattr(module, "gate_up_proj", None), nn.Parameter
    ):
        return _patch_experts(module, cache)
    if isinstance(module, nn.Linear) or hasattr(module, "base_layer"):
        return None
    linears = {n: s for n, c in module.named_children() if (s := _linear_shape(c)) is not None}
    shaped_like_mlp = any(True for _ in _candidate_forms(linears))
    if not shaped_like_mlp:
        if type(module).__name__.endswith("MLP") and linears:
            return f"{type(module).__name__} has no gate/up/down projections of matching shapes"
        return None
    key = ("swiglu", type(module), _probe.plain_attributes(module), tuple(sorted(linears.items())))
    if key not in cache:
        cache[key] = _proven_form(module, linears)
    forward = cache[key]
    if forward is None:
        if not any(word in type(module).__name__.lower() for word in ("mlp", "feedforward", "ffn", "expert")):
            return None  # shaped like an MLP by chance (e.g. an attention block): not worth a reason
        return _describe_activation(module) or (
            f"{type(module).__name__}.forward is not down(silu(gate(x)) * up(x)) on probes "
            "(it scales, clamps, drops out or adds something)"
        )

    def patched(self, x, *args, **kwargs):
        if args or kwargs:  # only the one-argument call was proven equal
            return type(self).forward(self, x, *args, **kwargs)
        return forward(self, x)

    module.forward = types.MethodType(patched, module)
    return True


# --- MoE experts with 3-D weights ---------------------------------------------------------------


def _ours_apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up_out.chunk(2, dim=-1)
    return swiglu(gate, up)


def _gate_is_swiglu(module: nn.Module) -> bool:
    twin = _probe.stand_in(module)
    g = _probe.generator(0)
    inputs = [(torch.randn(7, 2 * I, generator=g) * scale,) for scale in _probe.SCALES]

    def theirs(training, x):
        twin.train(training)
        return type(module)._apply_gate(twin, x)

    def reference(training, x):
        gate, up = x.chunk(2, dim=-1)
        return swiglu_reference(gate, up)

    return _probe.agrees(theirs, reference, inputs)


def _patch_experts(module: nn.Module, cache: dict):
    name = type(module).__name__
    key = ("experts", type(module), _probe.plain_attributes(module))
    if key not in cache:
        cache[key] = _gate_is_swiglu(module)
    if not cache[key]:
        return _describe_activation(module) or f"{name}._apply_gate is not silu(gate) * up on probes"
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    forward = getattr(type(module).forward, "__wrapped__", type(module).forward)
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    if implementation in (None, "eager") and "_apply_gate" not in names:
        return f"{name} runs its eager loop, which does not call _apply_gate (experts_implementation=eager)"
    module._apply_gate = types.MethodType(_ours_apply_gate, module)
    return True
