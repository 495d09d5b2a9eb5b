"""Fused linear divergence (distillation): per learned position, the divergence between the student's
and the teacher's next-token distributions over the full vocabulary, computed from both models'
hidden states and heads without ever holding a [tokens, vocab] logits tensor of either.

    p_s = softmax((h_s @ W_s.T + b_s) / T),   p_t = softmax((h_t @ W_t.T + b_t) / T)

Losses (TRL's GKDTrainer.generalized_jsd_loss, trl 1.16, is the definition followed, beta included):
- reverse_kl:  KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)   (the student's own samples, scored)
- jsd(beta):   m = (1 - beta) p_s + beta p_t,  JSD = beta KL(p_t || m) + (1 - beta) KL(p_s || m)
  beta = 0 is exactly KL(p_t || p_s) (forward KL) and beta = 1 exactly KL(p_s || p_t) (reverse KL), as
  TRL special-cases them (the mixture formula itself goes to 0 at both ends). TRL's beta weighs the
  TEACHER's KL term and the teacher's share of m; "beta p_s + (1 - beta) p_t" with beta on the
  student's terms is the same family with beta -> 1 - beta, which is not what TRL's beta means.

Gradients, with respect to the student's tempered logits z (one row; the 1/T and the matmuls are
exact linear maps, applied by autograd and the blocks below). For a divergence D(p_s) written as
sum_v f_v with df/dp_s,v = a_v, the softmax's Jacobian gives dD/dz_v = p_s,v (a_v - sum_u p_s,u a_u):
- reverse KL: a_v = log p_s,v - log p_t,v + 1; the 1 cancels, so with u_v = p_s,v (log p_s,v -
  log p_t,v): dD/dz_v = u_v - p_s,v * c, c = sum_u u_u = KL(p_s || p_t).
- jsd: JSD = beta sum p_t log p_t + (1 - beta) sum p_s log p_s - sum m log m (since
  beta p_t + (1 - beta) p_s = m), so a_v = (1 - beta)(log p_s,v + 1) - (1 - beta)(log m_v + 1)
  = (1 - beta)(log p_s,v - log m_v); with u_v = (1 - beta) p_s,v (log p_s,v - log m_v):
  dJSD/dz_v = u_v - p_s,v * c, c = sum_u u_u = (1 - beta) KL(p_s || m).
- forward KL (jsd, beta = 0): D = sum p_t (log p_t - log p_s), a_v = -p_t,v / p_s,v, so
  dD/dz_v = p_s,v - p_t,v (no row constant).
The teacher is frozen: no gradient reaches it and nothing of its size is allocated.

The machinery is the family's (`fused_linear_cross_entropy.py`, `fused_linear_logprob.py`): only
learned rows reach the heads; the output is per position, so each row has its own upstream gradient.
- PyTorch (CPU): blocks of the vocabulary, all rows at once. Pass 1: each model's log-sum-exp per
  row, online (a running max and sum of exponentials, rescaled when the max grows). Pass 2: the
  logits again, the divergence per row and c. A frozen student head (LoRA) also gets its gradient
  in pass 2 without knowing c yet: grad_h = sum_v (u_v - c p_s,v) W_v = (u @ W) - c (p_s @ W), two
  accumulators of [rows, H]; the backward scales each row. A trainable head (or bias) keeps the
  log-sum-exps and c per row, and the backward walks the blocks once more (pass 3) writing grad_h,
  grad_W and grad_b, grad_W once per block.
- Triton (CUDA): chunks of rows; cuBLAS makes both chunks' logits, one kernel walks each row three
  times (both log-sum-exps online; the divergence and c; the gradient, written over the student's
  logits in place, times a per-row scale), then cuBLAS feeds grad_h and grad_W.
Numerics: matmuls in the inputs' dtype (under autocast, the autocast dtype), everything else in
fp32 (fp64 when the student is fp64, so torch.autograd.gradcheck can check the backward). Per-row
upstream factors are applied in fp32 as in fused_linear_logprob (divided by their largest magnitude
before any low-precision cast, multiplied back after). No host synchronisation in the loops; one per
call on CUDA (counting the learned rows).
"""

from __future__ import annotations

import math

import torch

from . import _backend
from ._backend import LazyKernel, cast_as_autocast_would, cdiv, next_power_of_2, use_triton
from .fused_linear_cross_entropy import (
    _add_matmul,
    _blocks,
    _logits_into,
    _view,
    chunk_rows_for,
    vocab_block_for,
)
from .fused_linear_logprob import shift_labels

tl = None  # triton.language, bound by LazyKernel on the first launch

LOSSES = ("reverse_kl", "jsd")
REVERSE, FORWARD, JSD = 0, 1, 2  # the kernels' modes: jsd at beta 1 is REVERSE, at beta 0 FORWARD
MAX_BLOCK_V = 4096  # columns per loop step of the Triton kernel (tests lower it to exercise the loop)
BLOCK_BUFFERS = 4  # [rows, block] buffers a PyTorch block holds at once (jsd's most)


def _mode(loss: str, beta: float) -> int:
    if loss == "reverse_kl" or beta == 1.0:
        return REVERSE
    return FORWARD if beta == 0.0 else JSD


def fused_linear_divergence_reference(
    student_hidden, student_weight, teacher_hidden, teacher_weight, loss="reverse_kl", beta=0.5,
    temperature=1.0, student_bias=None, teacher_bias=None,
):  # fmt: skip
    """The unfused formula on [N, H] rows: both models' full fp32 logits, log_softmax, the divergence."""
    zs = torch.nn.functional.linear(student_hidden, student_weight, student_bias).float() / temperature
    zt = torch.nn.functional.linear(teacher_hidden, teacher_weight, teacher_bias).float() / temperature
    log_ps, log_pt = zs.log_softmax(-1), zt.log_softmax(-1)
    mode = _mode(loss, beta)
    if mode == REVERSE:
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    if mode == FORWARD:
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
    return (beta * log_pt.exp() * (log_pt - log_m) + (1 - beta) * log_ps.exp() * (log_ps - log_m)).sum(-1)


# --- PyTorch path: blocks of the vocabulary ------------------------------------------------------


class _Work:
    """The block buffers, allocated once per call and reused by every block (fresh ones per block
    would cost page faults: the allocator hands large blocks back to the system)."""

    def __init__(self, n_rows, block, dtype, device):
        self.n_rows = n_rows
        self.buffers = [torch.empty(n_rows * block, dtype=dtype, device=device) for _ in range(BLOCK_BUFFERS)]

    def get(self, i, cols):
        return _view(self.buffers[i], self.n_rows, cols)


def _both_logits(heads, work, v0, v1):
    """Both models' logits for the vocabulary block [v0, v1), in the work buffers 0 and 1."""
    (hs, ws, bs), (ht, wt, bt) = heads
    zs = _logits_into(work.get(0, v1 - v0), hs, ws[v0:v1], None if bs is None else bs[v0:v1])
    zt = _logits_into(work.get(1, v1 - v0), ht, wt[v0:v1], None if bt is None else bt[v0:v1])
    return zs, zt


def _lse_pass(heads, bounds, work):
    """Pass 1: each row's log-sum-exp of the student's and the teacher's logits, online."""
    n_rows, device, dtype = heads[0][0].shape[0], work.buffers[0].device, work.buffers[0].dtype
    state = [
        [torch.full((n_rows,), float("-inf"), dtype=dtype, device=device), torch.zeros(n_rows, dtype=dtype, device=device)]
        for _ in range(2)
    ]  # fmt: skip
    for v0, v1 in bounds:
        for z, running in zip(_both_logits(heads, work, v0, v1), state, strict=True):
            running_max, sum_exp = running
            new_max = torch.maximum(running_max, z.amax(1))
            sum_exp.mul_(torch.exp(running_max - new_max)).add_(z.sub_(new_max.unsqueeze(1)).exp_().sum(1))
            running[0] = new_max
    return [(running_max + sum_exp.log()).unsqueeze(1) for running_max, sum_exp in state]


def _block_terms(zs, zt, lse_s, lse_t, mode, beta, work):
    """One block's elementwise work, in place in the work buffers. Returns (divergence part [rows],
    c part [rows] or None, u, p_s or None): the gradient w.r.t. the tempered student logits is
    u - c * p_s (u itself, p_s - p_t, for FORWARD, where c is None)."""
    cols = zs.shape[1]
    log_ps, log_pt = zs.sub_(lse_s), zt.sub_(lse_t)
    if mode == REVERSE:
        u = log_pt.neg_().add_(log_ps)  # log p_s - log p_t
        ps = log_ps.exp_()
        u.mul_(ps)  # p_s (log p_s - log p_t)
        part = u.sum(1)
        return part, part, u, ps
    if mode == FORWARD:
        diff = torch.sub(log_pt, log_ps, out=work.get(2, cols))  # log p_t - log p_s
        pt = log_pt.exp_()
        part = diff.mul_(pt).sum(1)  # p_t (log p_t - log p_s)
        return part, None, log_ps.exp_().sub_(pt), None  # p_s - p_t
    # JSD: log m = logaddexp(log(1 - beta) + log p_s, log(beta) + log p_t)
    log_m = torch.add(log_ps, math.log1p(-beta), out=work.get(2, cols))
    other = torch.add(log_pt, math.log(beta), out=work.get(3, cols))
    torch.logaddexp(log_m, other, out=log_m)
    pt = torch.exp(log_pt, out=other)
    teacher_part = log_pt.sub_(log_m).mul_(pt).sum(1)  # sum p_t (log p_t - log m)
    ps = torch.exp(log_ps, out=other)
    u = log_ps.sub_(log_m).mul_(ps).mul_(1.0 - beta)  # (1 - beta) p_s (log p_s - log m)
    c_part = u.sum(1)
    return c_part + beta * teacher_part, c_part, u, ps


def _divergence_pass(heads, lse, mode, beta, bounds, work, frozen):
    """Pass 2: each row's divergence and c; with `frozen`, the unscaled gradient of the student's
    (tempered) hidden rows, grad_h = u @ W - c (p_s @ W), accumulated before c is known."""
    hs, ws = heads[0][0], heads[0][1]
    n_rows, dtype, device = hs.shape[0], work.buffers[0].dtype, hs.device
    div = torch.zeros(n_rows, dtype=dtype, device=device)
    c = torch.zeros(n_rows, dtype=dtype, device=device) if mode != FORWARD else None
    u_w = torch.zeros(hs.shape, dtype=dtype, device=device) if frozen else None
    ps_w = torch.zeros(hs.shape, dtype=dtype, device=device) if frozen and c is not None else None
    for v0, v1 in bounds:
        zs, zt = _both_logits(heads, work, v0, v1)
        part, c_part, u, ps = _block_terms(zs, zt, *lse, mode, beta, work)
        div += part
        if c is not None:
            c += c_part
        if frozen:
            _add_matmul(u_w, u, ws[v0:v1])
            if ps_w is not None:
                _add_matmul(ps_w, ps, ws[v0:v1])
    grad_rows = None
    if frozen:
        grad_rows = u_w if ps_w is None else u_w.sub_(ps_w.mul_(c.unsqueeze(1)))
    return div, c, grad_rows


def _gradient_pass(heads, lse, c, mode, beta, bounds, work, unit, grad_hidden, grad_weight, grad_bias):
    """Pass 3 (the backward, trainable head): each block's gradient w.r.t. the tempered student
    logits, (u - c p_s) times each row's `unit` factor, into grad_hidden (+=), grad_weight and
    grad_bias (written once per block)."""
    hs, ws = heads[0][0], heads[0][1]
    for v0, v1 in bounds:
        zs, zt = _both_logits(heads, work, v0, v1)
        _, _, g, ps = _block_terms(zs, zt, *lse, mode, beta, work)
        if ps is not None:
            g.sub_(ps.mul_(c.unsqueeze(1)))
        g.mul_(unit.unsqueeze(1))
        w = ws[v0:v1]
        if grad_hidden is not None:
            _add_matmul(grad_hidden, g, w)
        if grad_bias is not None:
            torch.sum(g, 0, out=grad_bias[v0:v1])
        if grad_weight is not None:
            if w.dtype == grad_weight.dtype:
                torch.mm(g.t(), hs, out=grad_weight[v0:v1])
            else:  # the matmul in the weight's dtype
                grad_weight[v0:v1] = torch.mm(g.t().to(w.dtype), hs)


def _compute_dtype(hidden):
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _vocab_block(n_rows, vocab, device):
    """FLCE's block for BLOCK_BUFFERS times the rows: the block's buffers together fit its budget."""
    return vocab_block_for(BLOCK_BUFFERS * n_rows, vocab, device)


# --- Triton path: chunks of rows ------------------------------------------------------------------


@LazyKernel
def _divergence_kernel(
    S, T, LOSS, SCALE, n_rows, n_cols, s_stride, t_stride, beta, log_1mb, log_b,
    MODE: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    s_ptr = S + rows.to(tl.int64)[:, None] * s_stride
    t_ptr = T + rows.to(tl.int64)[:, None] * t_stride

    # Pass 1: both log-sum-exps, online.
    max_s = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    max_t = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    sum_s = tl.zeros([BLOCK_M], dtype=tl.float32)
    sum_t = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        xs = tl.load(s_ptr + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        xt = tl.load(t_ptr + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        new_s = tl.maximum(max_s, tl.max(xs, axis=1))
        new_t = tl.maximum(max_t, tl.max(xt, axis=1))
        sum_s = sum_s * tl.exp(max_s - new_s) + tl.sum(tl.exp(xs - new_s[:, None]), axis=1)
        sum_t = sum_t * tl.exp(max_t - new_t) + tl.sum(tl.exp(xt - new_t[:, None]), axis=1)
        max_s, max_t = new_s, new_t
    # Padding rows (past n_rows) get lse 0: no log(0) or exp(inf) on them.
    lse_s = tl.where(row_mask, max_s + tl.log(tl.where(row_mask, sum_s, 1.0)), 0.0)
    lse_t = tl.where(row_mask, max_t + tl.log(tl.where(row_mask, sum_t, 1.0)), 0.0)

    # Pass 2: the divergence, and c = sum of u (the gradient's row constant).
    div = tl.zeros([BLOCK_M], dtype=tl.float32)
    c = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        log_ps = tl.load(s_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32) - lse_s[:, None]
        log_pt = tl.load(t_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32) - lse_t[:, None]
        if MODE == 0:  # reverse KL: u = p_s (log p_s - log p_t)
            u = tl.exp(log_ps) * (log_ps - log_pt)
            c += tl.sum(tl.where(mask, u, 0.0), axis=1)
        elif MODE == 1:  # forward KL: p_t (log p_t - log p_s)
            div += tl.sum(tl.where(mask, tl.exp(log_pt) * (log_pt - log_ps), 0.0), axis=1)
        else:  # JSD: m = (1 - beta) p_s + beta p_t, in log space
            a = log_ps + log_1mb
            b = log_pt + log_b
            top = tl.maximum(a, b)
            log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
            u = (1.0 - beta) * tl.exp(log_ps) * (log_ps - log_m)
            c += tl.sum(tl.where(mask, u, 0.0), axis=1)
            div += tl.sum(tl.where(mask, beta * tl.exp(log_pt) * (log_pt - log_m), 0.0), axis=1)
    div += c  # c is 0 for forward KL; the student's term for the others
    tl.store(LOSS + rows, div, mask=row_mask)

    if WRITE_GRAD:
        # Pass 3: d div / d z_s = (u - c p_s) (p_s - p_t for forward KL), times the row's scale,
        # over the student's logits in place (each element is read before it is written).
        scale = tl.load(SCALE + rows, mask=row_mask, other=0.0).to(tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            log_ps = tl.load(s_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32) - lse_s[:, None]
            log_pt = tl.load(t_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32) - lse_t[:, None]
            ps = tl.exp(log_ps)
            if MODE == 0:
                grad = ps * (log_ps - log_pt - c[:, None])
            elif MODE == 1:
                grad = ps - tl.exp(log_pt)
            else:
                a = log_ps + log_1mb
                b = log_pt + log_b
                top = tl.maximum(a, b)
                log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
                grad = (1.0 - beta) * ps * (log_ps - log_m) - c[:, None] * ps
            grad = grad * scale[:, None]
            tl.store(s_ptr + cols[None, :], grad.to(S.dtype.element_ty), mask=mask)


def _divergence_rows(zs, zt, mode, beta, scale=None):
    """Launch the kernel on [rows, vocab] fp32 logits of both models: per-row divergences (fp32), and
    with `scale` (fp32 per row) the scaled gradient written over `zs` in place."""
    n_rows, n_cols = zs.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=zs.device)
    block_v = min(next_power_of_2(n_cols), MAX_BLOCK_V)
    block_m = max(1, min(next_power_of_2(n_rows), _backend.tile_elements() // block_v))
    write_grad = scale is not None
    # log(1 - beta) and log(beta): JSD's mixture weights in log space (0 < beta < 1 there; unused otherwise).
    log_1mb, log_b = (math.log1p(-beta), math.log(beta)) if mode == JSD else (0.0, 0.0)
    _divergence_kernel[(cdiv(n_rows, block_m),)](
        zs, zt, loss, scale if write_grad else loss, n_rows, n_cols, zs.stride(0), zt.stride(0),
        float(beta), log_1mb, log_b, MODE=mode, WRITE_GRAD=write_grad, BLOCK_M=block_m, BLOCK_V=block_v,
    )  # fmt: skip
    return loss


def _forward_triton(heads, mode, beta, chunk_rows, grads, row_scale=None):
    """Chunks of rows: both chunks' logits by cuBLAS, the divergence (and the gradient, in place) by
    our kernel, then the student's gradient matmuls. `row_scale` multiplies each row's gradient;
    without it every row counts once."""
    (hs, ws, bs), (ht, wt, bt) = heads
    need_hidden, need_weight, need_bias = grads
    n_rows, vocab = hs.shape[0], ws.shape[0]
    write_grad = any(grads)
    scale = torch.ones(n_rows, dtype=torch.float32, device=hs.device) if row_scale is None else row_scale
    grad_hidden = torch.empty_like(hs) if need_hidden else None
    grad_weight = torch.zeros(ws.shape, dtype=torch.float32, device=ws.device) if need_weight else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=ws.device) if need_bias else None
    low_precision = ws.dtype != torch.float32
    losses = []
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        h_chunk = hs[start:end]
        zs = (torch.addmm(bs, h_chunk, ws.t()) if bs is not None else torch.mm(h_chunk, ws.t())).float()
        zt = ht[start:end] @ wt.t()
        zt = (zt if bt is None else zt.add_(bt)).float()
        losses.append(_divergence_rows(zs, zt, mode, beta, scale[start:end] if write_grad else None))
        del zt
        if not write_grad:
            continue
        grad_logits = zs.to(ws.dtype) if low_precision else zs
        if grad_hidden is not None:
            torch.mm(grad_logits, ws, out=grad_hidden[start:end])
        if grad_weight is not None:
            if low_precision:
                grad_weight += torch.mm(grad_logits.t(), h_chunk)
            else:
                grad_weight.addmm_(grad_logits.t(), h_chunk)
        if grad_bias is not None:
            grad_bias += zs.sum(0)
        del zs, grad_logits
    return torch.cat(losses), grad_hidden, grad_weight, grad_bias


def _chunk_rows(n_rows, vocab, dtype, device):
    """FLCE's rows per chunk for twice the vocabulary: both models' logits fit its budget together."""
    return chunk_rows_for(n_rows, 2 * vocab, dtype, device)


# --- the autograd Function ------------------------------------------------------------------------


class _Divergence(torch.autograd.Function):
    """Per row, D(p_s || p_t) from the student's rows and head (differentiable) and the teacher's
    (frozen); every row learned. fp32 [rows] (fp64 for an fp64 student on the PyTorch path)."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, mode, beta, chunk_rows, vocab_block, grad_enabled):
        n_rows, vocab = hs.shape[0], ws.shape[0]
        grads = (hs.requires_grad, ws.requires_grad, bs is not None and bs.requires_grad)
        grads = tuple(g and grad_enabled for g in grads)
        frozen = grads[0] and not (grads[1] or grads[2])  # only grad_hidden: done in the forward
        heads = ((hs, ws, bs), (ht, wt, bt))
        triton = use_triton(hs)
        ctx.triton, ctx.frozen, ctx.grads, ctx.mode, ctx.beta = triton, frozen, grads, mode, beta
        ctx.dtypes = (hs.dtype, ws.dtype, None if bs is None else bs.dtype)
        ctx.backward_done = False
        lse = c = grad_rows = None
        if n_rows == 0:
            div = torch.zeros(0, dtype=_compute_dtype(hs), device=hs.device)
        elif triton:
            ctx.chunk = chunk_rows or _chunk_rows(n_rows, vocab, ws.dtype, ws.device)
            div, grad_rows, _, _ = _forward_triton(heads, mode, beta, ctx.chunk, (frozen, False, False))
        else:
            ctx.block = vocab_block or _vocab_block(n_rows, vocab, hs.device)
            bounds = _blocks(vocab, ctx.block)
            work = _Work(n_rows, min(ctx.block, vocab), _compute_dtype(hs), hs.device)
            lse = _lse_pass(heads, bounds, work)
            div, c, grad_rows = _divergence_pass(heads, lse, mode, beta, bounds, work, frozen)
        if n_rows == 0:
            inputs = (hs, ws, bs)
            ctx.zero_grads = [
                (t.shape, t.dtype, t.device) if g else None for t, g in zip(inputs, grads, strict=True)
            ]
        elif frozen:
            ctx.save_for_backward(grad_rows)
        elif any(grads):
            ctx.save_for_backward(hs, ws, bs, ht, wt, bt, *(lse or (None, None)), c)
        return div

    @staticmethod
    def backward(ctx, grad_div):
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        row_scale = grad_div.to(torch.float64 if grad_div.dtype == torch.float64 else torch.float32)
        nothing = (None,) * 8  # teacher tensors and options get no gradient
        if row_scale.numel() == 0:
            zeros = [
                None if z is None else torch.zeros(z[0], dtype=z[1], device=z[2]) for z in ctx.zero_grads
            ]
            return *zeros, *nothing
        if ctx.frozen:
            if ctx.backward_done:
                raise RuntimeError(
                    "fused_linear_divergence: a second backward through the same divergences is not "
                    "supported with a frozen student head (grad_hidden is computed in the forward and the "
                    "first backward scales it in place). Compute them again for another backward."
                )
            ctx.backward_done = True
            (grad_rows,) = ctx.saved_tensors
            if grad_rows.dtype == row_scale.dtype:
                grad_rows = grad_rows.mul_(row_scale.unsqueeze(1)).to(hidden_dtype)
            else:  # the Triton path keeps it in the inputs' dtype: scale it in fp32 all the same
                grad_rows.copy_(grad_rows.float().mul_(row_scale.unsqueeze(1)))
            return grad_rows, None, None, *nothing

        hs, ws, bs, ht, wt, bt, lse_s, lse_t, c = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.grads
        # Factors in [-1, 1] go into the logits' gradient (possibly cast to fp16); their largest
        # magnitude is multiplied back into the results in fp32. No host synchronisation.
        top = row_scale.abs().amax()
        top = torch.where(top > 0, top, 1.0)
        unit = row_scale / top
        heads = ((hs, ws, bs), (ht, wt, bt))
        if ctx.triton:
            _, grad_rows, grad_weight, grad_bias = _forward_triton(
                heads, ctx.mode, ctx.beta, ctx.chunk, ctx.grads, row_scale=unit
            )
        else:
            n_rows, vocab, device, acc = hs.shape[0], ws.shape[0], hs.device, _compute_dtype(hs)
            grad_rows = torch.zeros(hs.shape, dtype=acc, device=device) if need_hidden else None
            grad_weight = torch.empty(ws.shape, dtype=acc, device=ws.device) if need_weight else None
            grad_bias = torch.empty(vocab, dtype=acc, device=ws.device) if need_bias else None
            work = _Work(n_rows, min(ctx.block, vocab), acc, device)
            _gradient_pass(
                heads, (lse_s, lse_t), c, ctx.mode, ctx.beta, _blocks(vocab, ctx.block), work, unit,
                grad_rows, grad_weight, grad_bias,
            )  # fmt: skip
        if grad_rows is not None:
            grad_rows = grad_rows.to(top.dtype).mul_(top).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(top).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(top).to(bias_dtype)
        return grad_rows, grad_weight, grad_bias, *nothing


def _check_pair(name, hidden, weight, bias):
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(
            f"{name}_hidden is {hidden.dtype} but {name}_weight {weight.dtype}"
            + ("" if bias is None else f" and {name}_bias {bias.dtype}")
            + ": give them one dtype, or run under torch.autocast."
        )


def fused_linear_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor,
    loss: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = True,
    chunk_rows: int | None = None,
    vocab_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, the divergence between the student's and the teacher's next-token distributions
    over the full vocabulary at `temperature`, and whether the position is learned:
    (divergence [B, T] fp32, 0 where nothing is learned; learned [B, T] bool).

    `loss` is "reverse_kl" (KL(p_s || p_t)) or "jsd" (TRL GKD's generalized JSD: m = (1 - beta) p_s
    + beta p_t, beta KL(p_t || m) + (1 - beta) KL(p_s || m); beta 0 is KL(p_t || p_s), beta 1
    KL(p_s || p_t)); `beta` is used by "jsd" only. Hidden states are [B, T, H] (or [B*T, H]) for the
    student and [B, T, Ht] for the teacher; weights [V, H] and [V, Ht] (one vocabulary), biases [V] or
    None. `labels` [B, T] select the learned positions as in fused_linear_token_logprob (shift: hidden
    position t predicts labels[:, t + 1]; only whether a label is `ignore_index` matters). Gradients
    reach the student's hidden states (zero where nothing is learned) and its weight and bias when
    they require grad; the teacher's inputs are detached. `vocab_block` overrides the PyTorch path's
    vocabulary block, `chunk_rows` the Triton path's rows per chunk.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not one of {LOSSES}.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must be between 0.0 and 1.0 (TRL GKD's convention).")
    if not temperature > 0:
        raise ValueError(f"temperature must be above 0, got {temperature}.")
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, seq], got {tuple(labels.shape)}.")
    n_seq, seq_len = labels.shape
    for name, hidden, weight, bias in (
        ("student", student_hidden, student_weight, student_bias),
        ("teacher", teacher_hidden, teacher_weight, teacher_bias),
    ):
        if hidden.shape[-1] != weight.shape[1] or hidden.numel() != n_seq * seq_len * weight.shape[1]:
            raise ValueError(
                f"shapes do not fit: {name}_hidden {tuple(hidden.shape)}, {name}_weight "
                f"{tuple(weight.shape)}, labels {tuple(labels.shape)}."
            )
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(
                f"{name}_bias {tuple(bias.shape)} does not fit {name}_weight {tuple(weight.shape)}."
            )
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"the student's vocabulary ({student_weight.shape[0]}) and the teacher's "
            f"({teacher_weight.shape[0]}) differ: distillation needs one tokenizer's vocabulary."
        )
    targets = shift_labels(labels, ignore_index) if shift else labels
    learned = targets.reshape(-1) != ignore_index
    # The one host synchronisation (on CUDA): how many rows are learned; only those reach the heads.
    rows = learned.nonzero().squeeze(1)
    hs = student_hidden.reshape(-1, student_hidden.shape[-1]).index_select(0, rows)
    with torch.no_grad():
        ht = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]).index_select(0, rows)
    wt, bt = teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach()
    bs = student_bias
    if temperature != 1.0:  # (h @ W.T + b) / T = (h / T) @ W.T + b / T, exactly
        hs, ht = hs / temperature, ht / temperature
        bs = bs / temperature if bs is not None else None
        bt = bt / temperature if bt is not None else None
    hs, ws, bs = cast_as_autocast_would(hs, student_weight, bs)
    ht, wt, bt = cast_as_autocast_would(ht, wt, bt)
    _check_pair("student", hs, ws, bs)
    _check_pair("teacher", ht, wt, bt)
    with torch.autocast(hs.device.type, enabled=False):
        div = _Divergence.apply(
            hs, ws, bs, ht, wt, bt, _mode(loss, beta), float(beta), chunk_rows, vocab_block,
            torch.is_grad_enabled(),
        )  # fmt: skip
    dense = torch.zeros(n_seq * seq_len, dtype=div.dtype, device=div.device).index_copy(0, rows, div)
    return dense.view(n_seq, seq_len), learned.view(n_seq, seq_len)
