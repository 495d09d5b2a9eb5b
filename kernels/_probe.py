"""Probes: run a module's own code on small random inputs and compare it with our replacement.

Why: a name or a shape says nothing about what a forward computes (a multiplier, a clamp, a dropout,
a gate). A module is patched only when its own forward and our replacement give the same numbers on
probes, so what we cannot prove equal stays as it is.

The probe never runs the real module: it runs the class's code on a *stand-in*, a fresh instance of
the same class with the same plain attributes (eps, multipliers, config) and small random weights on
the CPU. So the real weights' size, device, dtype or values (meta, sharded, ones) do not matter, and
a 70B model is probed as cheaply as a tiny one.
"""

from __future__ import annotations

import torch
from torch import nn

# Inputs are drawn at several magnitudes: a clamp or a saturating branch that a unit-scale probe
# never reaches shows at 100x, an epsilon that unit scale hides shows at 1e-3.
SCALES = (1.0, 1e-3, 100.0)


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def stand_in(module: nn.Module, children: dict[str, nn.Module] | None = None) -> nn.Module:
    """A fresh instance of `module`'s class with its plain attributes and the given children only.

    Parameters and buffers are not copied (the caller sets small ones); children not named in
    `children` are kept only when they hold no parameters or buffers (activations, dropouts).
    """
    cls = type(module)
    twin = cls.__new__(cls)
    twin.__dict__.update(module.__dict__)
    nn.Module.__init__(twin)  # fresh parameter, buffer, module and hook dicts
    twin.training = module.training
    for name, child in module._modules.items():
        if child is not None and not any(True for _ in child.parameters()) and not list(child.buffers()):
            twin._modules[name] = child
    for name, child in (children or {}).items():
        twin._modules[name] = child
    return twin


def small_linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    """A CPU fp32 Linear with random weights of scale 1/sqrt(fan_in) (and a random bias)."""
    g = generator(seed)
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta")  # no draw from the global RNG
    layer.weight = nn.Parameter(torch.randn(out_features, in_features, generator=g) / in_features**0.5)
    if bias:
        layer.bias = nn.Parameter(torch.randn(out_features, generator=g))
    return layer


def same(a, b, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Whether two probe outputs agree: same type, shape and values (NaNs never agree)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    a, b = a.detach().float(), b.detach().float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    return torch.allclose(a, b, rtol=rtol, atol=atol * max(1.0, b.abs().max().item()))


def agrees(theirs, ours, inputs: list[tuple], modes=(True, False)) -> bool:
    """Whether `theirs(*args)` equals `ours(*args)` for every probe input, in train and eval mode.

    `theirs` and `ours` take `(training, *args)`; an exception in `theirs` means "cannot prove equal".
    The global RNG is restored afterwards (a dropout in train mode draws from it): patching must not
    change what the user's run draws next.
    """
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for training in modes:
                for args in inputs:
                    if not same(theirs(training, *args), ours(training, *args)):
                        return False
    except Exception:
        return False
    return True


def plain_attributes(module: nn.Module) -> tuple:
    """A hashable summary of the module's plain attributes: what its forward may depend on besides
    weights (eps, multipliers, flags). Keys a cache that lives for one `patch_model` call only (it holds
    object ids, which are unique only while those objects live)."""
    items = []
    for key, value in sorted(module.__dict__.items()):
        if key.startswith("_"):
            continue
        if isinstance(value, (bool, int, float, str, type(None))):
            items.append((key, value))
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            items.append((key, tuple(value)))
        else:
            items.append((key, id(value)))  # a config or a callable: per object
    return tuple(items)
