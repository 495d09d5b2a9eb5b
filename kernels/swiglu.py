"""SwiGLU: silu(gate) * up, the activation of Llama-style gate/up/down MLPs.

Both paths recompute silu in the backward instead of saving it, so only the two inputs are kept for
autograd: eager autograd of the formula also keeps silu(gate), one more [tokens, intermediate] tensor per
MLP. The Triton path also fuses the activation and the product into one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _backend
from ._backend import LazyKernel, cdiv, use_triton

tl = None  # triton.language, bound by LazyKernel on the first launch


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch formula: the CPU path, and what the Triton path is tested against."""
    return F.silu(gate) * up


@LazyKernel
def _swiglu_forward(A, B, C, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    c = a * tl.sigmoid(a) * b
    tl.store(C + offs, c.to(C.dtype.element_ty), mask=mask)


@LazyKernel
def _swiglu_backward(DC, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dc = tl.load(DC + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    da = dc * b * sig * (1.0 + a * (1.0 - sig))
    tl.store(DA + offs, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dc * silu).to(DB.dtype.element_ty), mask=mask)


class _SwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        a, b = gate.contiguous(), up.contiguous()
        c = torch.empty_like(a)
        n = a.numel()
        block = min(_backend.tile_elements(), 1 << max(0, (n - 1).bit_length()))
        _swiglu_forward[(cdiv(n, block),)](a, b, c, n, BLOCK=block)
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        block = min(_backend.tile_elements(), 1 << max(0, (n - 1).bit_length()))
        _swiglu_backward[(cdiv(n, block),)](dc.contiguous(), a, b, da, db, n, BLOCK=block)
        return da, db


class _SwiGLUTorch(torch.autograd.Function):
    """The PyTorch path: computed in fp32 (or fp64) like the Triton path, saving only gate and up."""

    @staticmethod
    def forward(ctx, gate, up):
        compute = torch.promote_types(gate.dtype, torch.float32)
        ctx.save_for_backward(gate, up)
        return F.silu(gate.to(compute)).mul_(up.to(compute)).to(gate.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dc):
        gate, up = ctx.saved_tensors
        compute = torch.promote_types(gate.dtype, torch.float32)
        a, dcf = gate.to(compute), dc.to(compute)
        sig = torch.sigmoid(a)
        d_gate = d_up = None
        if ctx.needs_input_grad[1]:
            d_up = (a * sig).mul_(dcf).to(up.dtype)
        if ctx.needs_input_grad[0]:
            # d silu(a) / da = sig * (1 + a * (1 - sig)), built in place on one buffer
            d_gate = torch.rsub(sig, 1.0).mul_(a).add_(1.0).mul_(sig).mul_(dcf).mul_(up.to(compute))
            d_gate = d_gate.to(gate.dtype)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise (inputs of different shapes or dtypes take the PyTorch path)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return swiglu_reference(gate, up)
    if use_triton(gate):
        return _SwiGLUTriton.apply(gate, up)
    return _SwiGLUTorch.apply(gate, up)
