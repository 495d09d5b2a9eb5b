"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * (offset + weight), in fp32, returned in x's dtype.

`offset=1.0` is Gemma's form (weights stored around zero). Both paths save one [rows, hidden] tensor
and one fp32 `rstd` per row for the backward, which recomputes the normalised input from them: eager
autograd of the formula also keeps `x * rstd` whenever the weight is trained, and an fp32 copy of a
bf16/fp16 input. The backward then needs no second reduction pass over the forward.
"""

from __future__ import annotations

import torch

from ._backend import LazyKernel, cdiv, program_cap, rows_per_program, use_triton

tl = None  # triton.language, bound by LazyKernel on the first launch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0):
    """The plain PyTorch formula: the CPU path, and what the Triton path is tested against."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())
    return y.to(x.dtype)


@LazyKernel
def _rms_norm_forward(
    X,
    W,
    Y,
    RSTD,
    n_rows,
    n_cols,
    eps: tl.constexpr,
    offset: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@LazyKernel
def _rms_norm_backward(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    n_rows,
    n_cols,
    offset: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # A persistent program: loops over row blocks and keeps one fp32 partial sum of dweight.
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_M
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(pid * BLOCK_M, n_rows, step):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        dy_w = dy * w[None, :]
        mean_dot = tl.sum(dy_w * x_hat, axis=1) / n_cols
        dx = (dy_w - x_hat * mean_dot[:, None]) * rstd[:, None]
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_mask)


def _blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    block_n = 1 << max(0, (n_cols - 1).bit_length())
    return rows_per_program(n_rows, block_n), block_n


class _RMSNormTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1]).contiguous()
        n_rows, n_cols = x2d.shape
        y = torch.empty_like(x2d)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_m, block_n = _blocks(n_rows, n_cols)
        _rms_norm_forward[(cdiv(n_rows, block_m),)](
            x2d, weight.contiguous(), y, rstd, n_rows, n_cols, eps, offset, BLOCK_M=block_m, BLOCK_N=block_n
        )
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.offset = offset
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2d.shape
        dy2d = dy.reshape(-1, n_cols).contiguous()
        dx = torch.empty_like(x2d)
        block_m, block_n = _blocks(n_rows, n_cols)
        n_programs = min(cdiv(n_rows, block_m), program_cap(x2d))
        dw_partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=x2d.device)
        _rms_norm_backward[(n_programs,)](
            dy2d, x2d, weight.contiguous(), rstd, dx, dw_partial, n_rows, n_cols, ctx.offset,
            BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
        return dx.view(dy.shape), dw_partial.sum(0).to(weight.dtype), None, None


class _RMSNormTorch(torch.autograd.Function):
    """The PyTorch path: the formula, with a backward written out so autograd keeps one tensor and rstd.

    In fp32/fp64 the saved tensor is the OUTPUT y, and the backward recovers x * rstd as y / (offset + w).
    The next layer keeps y anyway (a LoRA or trainable linear saves its input), so the norm adds only
    rstd, and its input, the residual stream, is freed after the residual add instead of living until
    the backward: one [rows, hidden] tensor less per norm. A weight with a zero (or subnormal) entry
    cannot be divided by, and a bf16/fp16 y is too coarse to divide, so those save x instead.
    A caller that modifies y in place then gets autograd's "modified by an inplace operation" error.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for gradcheck
        xf = x.to(compute)
        scale = weight.to(compute) + offset
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        y = (xf * rstd).mul_(scale).to(x.dtype)
        # A host read of a [hidden] vector: cheap on the CPU, where this path runs.
        ctx.from_output = x.dtype == compute and bool((scale.abs() >= torch.finfo(compute).tiny).all())
        ctx.save_for_backward(y if ctx.from_output else x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        saved, weight, rstd = ctx.saved_tensors
        compute = rstd.dtype
        scale = weight.to(compute) + ctx.offset
        xf = saved / scale / rstd if ctx.from_output else saved.to(compute)  # recomputed, never saved
        dyf = dy.to(compute)
        dx = dw = None
        if ctx.needs_input_grad[1]:  # a frozen weight (LoRA) skips this [rows, hidden] product
            dw = (dyf * (xf * rstd)).reshape(-1, xf.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            # dx = dy*w*rstd - x * rstd^3 * mean(dy*w*x), rounded in the order autograd of the formula
            # rounds it, so training matches the unpatched model closely even through Adam's division.
            dy_w = dyf * scale
            d_rstd = (dy_w * xf).sum(-1, keepdim=True).mul_(-0.5).mul_(rstd.pow(3))
            dx = dy_w.mul_(rstd).add_(d_rstd.div_(xf.shape[-1]).mul_(2.0).mul(xf)).to(dy.dtype)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """RMS-normalise the last dimension of `x` and scale by `offset + weight`."""
    if use_triton(x):
        return _RMSNormTriton.apply(x, weight, float(eps), float(offset))
    return _RMSNormTorch.apply(x, weight, float(eps), float(offset))
