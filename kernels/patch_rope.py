"""Give attention modules our RoPE kernel where their family's rotary function is the one we compute.

An attention module is a candidate when its forward calls its module's `apply_rotary_pos_emb`; one that
calls another rotary function (a multimodal M-RoPE that splits the head into sections) is left alone,
named in the report. The forward may be decorated (functools.wraps): the code read is the innermost
function's, below every decorator. The module-level function that code really calls (plain, or turned
into a callable module by the `kernels` hub decorator) is probed against the rotate_half formula; when
it matches, the instance gets a copy of its class's forward, decorators included, whose globals see our
function instead. Calls our kernel does not cover (extra arguments, partial rotary, other shapes) go to
the family's own function at call time, so only the call that was proven equal ever runs our kernel.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
from torch import nn

from . import _probe
from .rope import apply_rope, rope_reference, rope_supports


@functools.cache
def _family_rope_matches(family_rope) -> bool:
    """Whether a family's apply_rotary_pos_emb(q, k, cos, sin) is the rotate_half formula (a probe)."""
    g = _probe.generator(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k = torch.randn(2, 2, 5, 8, generator=g)
    cos = torch.randn(2, 5, 8, generator=g)
    sin = torch.randn(2, 5, 8, generator=g)
    try:
        got = family_rope(q, k, cos, sin)
    except Exception:
        return False
    want = rope_reference(q, k, cos, sin)
    return (
        isinstance(got, tuple)
        and len(got) == 2
        and all(_probe.same(a, b) for a, b in zip(got, want, strict=True))
    )


def _layers(forward) -> list:
    """`forward` and the functions it wraps, outermost first (a decorator that used functools.wraps).

    Why: transformers decorates attention forwards (transformers 5.24 wraps every one in
    `deprecate_kwarg`), so the code that calls apply_rotary_pos_emb is the innermost layer's.
    """
    layers = [forward]
    while hasattr(layers[-1], "__wrapped__") and len(layers) < 16:
        layers.append(layers[-1].__wrapped__)
    return layers


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _copy(function, namespace: dict | None = None, inner=None, new_inner=None):
    """A copy of a plain function with another globals dict, and the closure cell that holds `inner`
    (the function a decorator wrapped) holding `new_inner` instead."""
    closure = function.__closure__
    if inner is not None:
        closure = tuple(types.CellType(new_inner) if _holds(cell, inner) else cell for cell in closure or ())
    copy = types.FunctionType(
        function.__code__,
        function.__globals__ if namespace is None else namespace,
        function.__name__,
        function.__defaults__,
        closure,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    copy.__qualname__ = function.__qualname__
    if inner is not None:
        copy.__wrapped__ = new_inner
    return copy


@functools.cache
def _forward_with_our_rope(forward):
    """A copy of `forward` (a class's, with its decorators) that calls our RoPE in place of its module's
    apply_rotary_pos_emb, or a reason it cannot be copied.

    The innermost function is copied with other globals; each decorator layer around it is copied with
    the closure cell that holds the function it wraps pointing at the copy, so the decorators still run
    (a renamed keyword still arrives). The class, its module and every other instance are untouched.
    """
    layers = _layers(forward)
    innermost = layers[-1]
    if not isinstance(innermost, types.FunctionType):
        return f"its forward is {type(innermost).__name__}, not a function we can copy"
    family_rope = innermost.__globals__["apply_rotary_pos_emb"]

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if args or kwargs or not rope_supports(q, k, cos, sin):
            return family_rope(q, k, cos, sin, *args, **kwargs)
        return apply_rope(q, k, cos, sin)

    copy = _copy(innermost, dict(innermost.__globals__, apply_rotary_pos_emb=apply_rotary_pos_emb))
    for wrapper, inner in zip(reversed(layers[:-1]), reversed(layers[1:]), strict=True):
        if not (
            isinstance(wrapper, types.FunctionType)
            and any(_holds(c, inner) for c in wrapper.__closure__ or ())
        ):
            return f"its forward is wrapped by {getattr(wrapper, '__qualname__', wrapper)!r}, which we cannot copy"
        copy = _copy(wrapper, inner=inner, new_inner=copy)
    return copy


def _other_rotary(function) -> str | None:
    """The module-level rotary function a forward calls instead of apply_rotary_pos_emb (a multimodal
    M-RoPE such as Qwen2-VL's `apply_multimodal_rotary_pos_emb`), or None: named in the report."""
    for name in function.__code__.co_names:
        lowered = name.lower()
        if ("rotary" in lowered or "rope" in lowered) and callable(function.__globals__.get(name)):
            return name
    return None


def patch_rope(module: nn.Module, cache: dict):
    """True (patched), a reason (its rotary function is another formula), or None (not a candidate)."""
    forward = type(module).forward
    innermost = _layers(forward)[-1]
    code = getattr(innermost, "__code__", None)
    if code is None:
        return None
    if "apply_rotary_pos_emb" not in code.co_names:
        other = _other_rotary(innermost)
        if other is None:
            return None
        return f"{type(module).__name__} calls {other}, which we do not compute: left as it is"
    family_rope = innermost.__globals__.get("apply_rotary_pos_emb")
    if family_rope is None or not _family_rope_matches(family_rope):
        family = sys.modules.get(type(module).__module__, None)
        return f"{getattr(family, '__name__', '?')}.apply_rotary_pos_emb is not the rotate_half formula"
    ours = _forward_with_our_rope(forward)
    if isinstance(ours, str):
        return f"{type(module).__name__}: {ours}"
    module.forward = types.MethodType(ours, module)
    return True
