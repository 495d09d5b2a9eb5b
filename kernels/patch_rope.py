"""Give attention modules our RoPE kernel where their family's rotary function is the one we compute.

An attention module is a candidate when its forward calls its module's `apply_rotary_pos_emb`. That
function is probed against the rotate_half formula; when it matches, the instance gets a copy of its
class's forward whose globals see our function instead. Calls our kernel does not cover (extra
arguments, partial rotary, other shapes) go to the family's own function at call time, so only the
call that was proven equal ever runs our kernel.
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


def patch_rope(module: nn.Module, cache: dict):
    """True (patched), a reason (its rotary function is another formula), or None (not a candidate)."""
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
