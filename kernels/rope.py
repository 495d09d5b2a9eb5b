"""Rotary position embedding with transformers' `rotate_half` convention.

out = x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1) over the two halves of
head_dim. q and k may have different head counts (GQA); cos and sin are [batch or 1, seq, head_dim].
The Triton path rotates q and k of one token in one program; the backward is the same rotation with
the sign of sin flipped, so it reuses the kernel.
"""

from __future__ import annotations

import torch

from ._backend import LazyKernel, next_power_of_2, use_triton

tl = None  # triton.language, bound by LazyKernel on the first launch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(q, k, cos, sin):
    """transformers' `apply_rotary_pos_emb` (unsqueeze_dim=1): the CPU path and the test reference."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@LazyKernel
def _rope_kernel(
    X, OUT, COS, SIN, seq_len, n_heads, half,
    x_sb, x_sh, x_ss, o_sb, o_sh, o_ss, c_sb, c_ss,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per (batch, position): all heads of that token, both halves of head_dim.
    token = tl.program_id(0)
    b = token // seq_len
    s = token % seq_len
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < half
    mask = (heads < n_heads)[:, None] & dim_mask[None, :]
    c_base = b.to(tl.int64) * c_sb + s * c_ss
    cos1 = tl.load(COS + c_base + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(COS + c_base + half + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(SIN + c_base + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(SIN + c_base + half + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    x_ptr = X + b.to(tl.int64) * x_sb + s * x_ss + heads[:, None] * x_sh + dims[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # The transpose of the rotation: d1 = g1*cos1 + g2*sin2, d2 = g2*cos2 - g1*sin1.
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    o_ptr = OUT + b.to(tl.int64) * o_sb + s * o_ss + heads[:, None] * o_sh + dims[None, :]
    tl.store(o_ptr, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(o_ptr + half, y2.to(OUT.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """Launch the kernel on x [B, H, S, D]; cos/sin are [B or 1, S, D] with a unit last stride."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, n_heads, seq_len, head_dim = x.shape
    out = torch.empty(batch, n_heads, seq_len, head_dim, dtype=x.dtype, device=x.device)
    cos_batch_stride = 0 if cos.shape[0] == 1 else cos.stride(0)
    half = head_dim // 2
    _rope_kernel[(batch * seq_len,)](
        x, out, cos, sin, seq_len, n_heads, half,
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cos_batch_stride, cos.stride(1),
        BACKWARD=backward, BLOCK_H=next_power_of_2(n_heads), BLOCK_D=next_power_of_2(half),
    )  # fmt: skip
    return out


class _RoPETriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(q, k, cos, sin)
        return _rotate(q, cos, sin, backward=False), _rotate(k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, cos, sin = ctx.saved_tensors
        dq = _rotate(dq_out, cos, sin, backward=True) if dq_out is not None else None
        dk = _rotate(dk_out, cos, sin, backward=True) if dk_out is not None else None
        dcos = dsin = None
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            # cos and sin come from the rotary module under no_grad in every supported family; when
            # they do need a gradient it is a plain reduction, done in PyTorch.
            dcos, dsin = _cos_sin_grads(q, k, dq_out, dk_out, cos)
        return dq, dk, dcos, dsin


def _cos_sin_grads(q, k, dq_out, dk_out, cos):
    dcos = torch.zeros(q.shape[0], *cos.shape[1:], dtype=torch.float32, device=q.device)
    dsin = torch.zeros_like(dcos)
    for x, g in ((q, dq_out), (k, dk_out)):
        if g is not None:
            dcos += (g.float() * x.float()).sum(1)
            dsin += (g.float() * _rotate_half(x.float())).sum(1)
    if cos.shape[0] == 1:
        dcos, dsin = dcos.sum(0, keepdim=True), dsin.sum(0, keepdim=True)
    return dcos.to(cos.dtype), dsin.to(cos.dtype)


def rope_supports(q, k, cos, sin) -> bool:
    """Whether (q, k, cos, sin) have the shapes `apply_rope` handles: 4-D q/k, full-width 3-D cos/sin."""
    return (
        q.dim() == 4
        and k.dim() == 4
        and cos.dim() == 3
        and cos.shape == sin.shape
        and cos.shape[-1] == q.shape[-1] == k.shape[-1]
        and q.shape[-1] % 2 == 0
        and cos.shape[0] in (1, q.shape[0])
        and cos.shape[1] == q.shape[2] == k.shape[2]
        and q.shape[0] == k.shape[0]
    )


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [B, Hq, S, D] and k [B, Hk, S, D] by cos/sin [B or 1, S, D]; returns (q_out, k_out)."""
    if not rope_supports(q, k, cos, sin) or not use_triton(q):
        return rope_reference(q, k, cos, sin)
    return _RoPETriton.apply(q, k, cos, sin)
