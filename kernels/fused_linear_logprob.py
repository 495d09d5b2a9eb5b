"""Fused linear log-probability: each learned token's log-probability, log_softmax(h_t @ W.T + b)
[label_t] (optionally at a temperature), and each sequence's sum of them, without ever holding the
[tokens, vocab] logits. One kernel family: the per-sequence sum (`fused_linear_logprob`) is a
reduction of the per-token values (`fused_linear_token_logprob`), which online RL takes as they are.

Why: preference objectives (DPO, IPO, SimPO, ORPO: `preference.py`) need only one number per
sequence (and, for the length-normalised ones, its learned-token count), but the eager way to get
it builds [batch, seq, vocab] fp32 logits, their log_softmax and autograd's copies: at a 128k
vocabulary that is the largest tensor of the step. Here:

- Only learned rows reach the head: prompt and padding positions (label -100) are dropped before
  any matmul, so a batch that is half prompt costs half as much.
- Those rows go through FLCE's machinery (`fused_linear_cross_entropy.py`), one piece of logits at
  a time: vocabulary blocks with an online log-sum-exp on a CPU, FLCE's Triton chunks on CUDA.
  A row's log-probability is minus its cross-entropy without smoothing.
- A frozen lm_head (LoRA) gets no weight gradient at all: nothing of its size is allocated.

The upstream gradient is not one scalar as in FLCE: each sequence's loss weighs its log-probability
differently (d loss / d logp_sum[b]). How the backward copes, the memory-lean way for each case:
- Frozen head (only grad_hidden): d logp_r / d h_r does not depend on the upstream gradient, so the
  forward computes it (FLCE's one pass: 2 matmul passes, as eager) and the backward multiplies each
  row by its sequence's upstream gradient, an exact per-row scaling. It keeps [rows, H], the size of
  the gradient it returns anyway.
- Trainable head (or bias): grad_weight = sum_r g_r (softmax_r - onehot_r)^T h_r mixes rows with
  different weights, so it cannot be finished before g is known. The forward keeps only each row's
  log-sum-exp (one matmul pass); the backward recomputes the logits block by block and writes every
  gradient in one more pass (3 matmul passes): 4 in all against eager's 3, with nothing held between
  forward and backward but a float per row. (On CUDA the backward reruns FLCE's chunks, whose kernel
  recomputes the log-sum-exp from the logits it already holds: no extra matmul either.)

Conventions (as transformers' ForCausalLMLoss): hidden [B, T, H] (or [B*T, H]) and the unshifted
labels [B, T]; position t's hidden state predicts labels[:, t + 1], the last position predicts
nothing. `shift=False` takes labels already aligned with the hidden states. count[b] is the number of
learned targets of sequence b, i.e. (labels[b, 1:] != ignore_index).sum() when shifting; a sequence
with none gets logp_sum 0 and count 0.

Numerics: matmuls in the inputs' dtype (under autocast, the autocast dtype, as FLCE), everything
else in fp32; logp_sum is fp32. The per-row upstream factors are applied in fp32: to grad_hidden
after the fact, and for the recomputed gradients folded into the logits' gradient as factors in
[-1, 1] (divided by their largest magnitude, a device scalar, multiplied back in fp32), so the
low-precision gradient of the logits stays in [-1, 1] as FLCE's does: a GradScaler's large factor
never overflows fp16 there, and grad_output is never cast to a low-precision dtype.

One host synchronisation per call on CUDA: counting the learned rows (torch.nonzero), which sizes
the gathered rows; none in the loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._backend import cast_as_autocast_would, use_triton
from .cross_entropy import check_labels
from .fused_linear_cross_entropy import (
    _Blocks,
    _forward_torch,
    _forward_triton,
    _gradient_pass,
    _lse_pass,
    chunk_rows_for,
    vocab_block_for,
)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """targets[:, t] = labels[:, t + 1], and ignore_index at the last position (ForCausalLMLoss's shift)."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def fused_linear_logprob_reference(hidden, weight, labels, bias=None, ignore_index=-100, shift=True):
    """The unfused formula: full logits (in the inputs' dtype, then fp32), log_softmax, gather, sum."""
    targets = shift_labels(labels, ignore_index) if shift else labels
    logits = F.linear(hidden, weight, bias).reshape(*targets.shape, weight.shape[0]).float()
    learned = targets != ignore_index
    token_logp = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(learned, token_logp, 0.0).sum(-1), learned.sum(-1)


class _TargetLogprob(torch.autograd.Function):
    """log_softmax(h_rows @ W.T + b)[target] per row (every row learned), fp32 [rows]."""

    @staticmethod
    def forward(ctx, h_rows, weight, bias, target, chunk_rows, vocab_block, grad_enabled):
        n_rows, vocab = h_rows.shape[0], weight.shape[0]
        grads = (h_rows.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        grads = tuple(g and grad_enabled for g in grads)
        # Only grad_hidden (a frozen head): computed now, each row scaled in the backward.
        frozen = grads[0] and not (grads[1] or grads[2])
        every_row = torch.ones(n_rows, dtype=torch.bool, device=h_rows.device)
        triton = use_triton(h_rows)
        ctx.triton, ctx.frozen, ctx.grads, ctx.backward_done = triton, frozen, grads, False
        ctx.dtypes = (h_rows.dtype, weight.dtype, None if bias is None else bias.dtype)
        lse = grad_rows = None
        if n_rows == 0:  # nothing learned anywhere: no row, zero gradients
            logp = torch.zeros(0, device=h_rows.device)
        elif triton:
            ctx.chunk = chunk_rows or chunk_rows_for(n_rows, vocab, weight.dtype, weight.device)
            loss, grad_rows, _, _ = _forward_triton(
                h_rows, weight, bias, target, every_row, -100, 0.0, ctx.chunk, (frozen, False, False)
            )
            logp = loss.neg_()  # a row's log-probability is minus its cross-entropy
        else:
            ctx.block = vocab_block or vocab_block_for(n_rows, vocab, weight.device)
            if frozen:  # FLCE's one pass: online softmax, accumulating softmax @ W
                loss, grad_rows, _, _ = _forward_torch(
                    h_rows, weight, bias, target, every_row, 0.0, ctx.block, (True, False, False)
                )
                logp = loss.neg_()
            else:  # each row's log-sum-exp, kept for the backward: one matmul pass
                blocks = _Blocks(n_rows, vocab, ctx.block, h_rows.device)
                lse, target_logit, _, _ = _lse_pass(h_rows, weight, bias, target, blocks)
                logp = target_logit.sub_(lse)
        if n_rows == 0:
            inputs = (h_rows, weight, bias)
            ctx.zero_grads = [
                (t.shape, t.dtype, t.device) if g else None for t, g in zip(inputs, grads, strict=True)
            ]
        elif frozen:  # d(-logp_r)/dh_r, unscaled
            ctx.save_for_backward(grad_rows)
        elif any(grads):
            ctx.save_for_backward(h_rows, weight, bias, target, lse)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        # d logp / d logits = onehot - softmax: minus the cross-entropy's gradient the passes compute.
        row_scale = grad_logp.float().neg()
        if row_scale.numel() == 0:
            zeros = [
                None if z is None else torch.zeros(z[0], dtype=z[1], device=z[2]) for z in ctx.zero_grads
            ]
            return *zeros, None, None, None, None
        if ctx.frozen:
            if ctx.backward_done:
                raise RuntimeError(
                    "fused_linear_logprob: a second backward through the same log-probabilities is not "
                    "supported with a frozen lm_head (grad_hidden is computed in the forward and the first "
                    "backward scales it in place). Compute them again for another backward."
                )
            ctx.backward_done = True
            (grad_rows,) = ctx.saved_tensors
            if grad_rows.dtype == torch.float32:
                grad_rows = grad_rows.mul_(row_scale.unsqueeze(1)).to(hidden_dtype)
            else:  # the Triton path keeps it in the inputs' dtype: scale it in fp32 all the same
                grad_rows.copy_(grad_rows.float().mul_(row_scale.unsqueeze(1)))
            return grad_rows, None, None, None, None, None, None

        h_rows, weight, bias, target, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.grads
        n_rows, f32 = h_rows.shape[0], torch.float32
        every_row = torch.ones(n_rows, dtype=torch.bool, device=h_rows.device)
        # Factors in [-1, 1] go into the logits' gradient (possibly cast to fp16); their largest
        # magnitude is multiplied back into the results in fp32. No host synchronisation.
        top = row_scale.abs().amax()
        top = torch.where(top > 0, top, 1.0)
        unit = row_scale / top
        if ctx.triton:
            _, grad_rows, grad_weight, grad_bias = _forward_triton(
                h_rows, weight, bias, target, every_row, -100, 0.0, ctx.chunk, ctx.grads, row_scale=unit
            )
        else:
            vocab, device = weight.shape[0], h_rows.device
            grad_rows = torch.zeros(h_rows.shape, dtype=f32, device=device) if need_hidden else None
            grad_weight = torch.empty(weight.shape, dtype=f32, device=weight.device) if need_weight else None
            grad_bias = torch.empty(vocab, dtype=f32, device=weight.device) if need_bias else None
            blocks = _Blocks(n_rows, vocab, ctx.block, device)
            _gradient_pass(
                h_rows, weight, bias, target, every_row, lse, blocks, 0.0,
                grad_rows, grad_weight, grad_bias, row_scale=unit,
            )  # fmt: skip
        if grad_rows is not None:
            grad_rows = grad_rows.float().mul_(top).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(top).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(top).to(bias_dtype)
        return grad_rows, grad_weight, grad_bias, None, None, None, None


def fused_linear_token_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    shift: bool = True,
    chunk_rows: int | None = None,
    vocab_block: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, the log-probability of its target under log_softmax(logits / temperature), and
    whether it has one: (logp [B, T] fp32, 0 where nothing is learned; learned [B, T] bool).

    The family's one kernel: `fused_linear_logprob` (a preference loss's per-sequence sum) is its sum
    over positions; online RL takes it per token. hidden is [B, T, H] (or [B*T, H]), weight [V, H],
    bias [V] or None, labels [B, T] (each `ignore_index` or in [0, V)). With `shift` (the default, as
    transformers' causal-LM loss) hidden position t predicts labels[:, t + 1]; without it, labels[:, t].
    The temperature divides the logits exactly: (h @ W.T + b) / T = (h / T) @ W.T + b / T. Gradients
    flow to hidden (zero at positions that predict nothing), and to weight and bias only when they
    require grad. `vocab_block` overrides the PyTorch path's vocabulary block, `chunk_rows` the Triton
    path's rows per chunk.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, seq], got {tuple(labels.shape)}.")
    n_seq, seq_len = labels.shape
    if hidden.shape[-1] != weight.shape[1] or hidden.numel() != n_seq * seq_len * weight.shape[1]:
        raise ValueError(
            f"shapes do not fit: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}."
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be above 0, got {temperature}.")
    targets = shift_labels(labels, ignore_index) if shift else labels
    flat = targets.reshape(-1)
    check_labels(flat, weight.shape[0], ignore_index)
    learned = flat != ignore_index
    # The one host synchronisation (on CUDA): how many rows are learned. Prompt and padding rows
    # never reach the head; autograd scatters grad_hidden back (zeros elsewhere).
    rows = learned.nonzero().squeeze(1)
    h_rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    if temperature != 1.0:
        h_rows = h_rows / temperature
        bias = bias / temperature if bias is not None else None
    h_rows, weight, bias = cast_as_autocast_would(h_rows, weight, bias)  # only the learned rows are cast
    with torch.autocast(hidden.device.type, enabled=False):
        logp = _TargetLogprob.apply(
            h_rows, weight, bias, flat[rows], chunk_rows, vocab_block, torch.is_grad_enabled()
        )
    # Rows back in place (index_copy, deterministic); zeros where nothing is learned.
    dense = torch.zeros(n_seq * seq_len, dtype=logp.dtype, device=logp.device).index_copy(0, rows, logp)
    return dense.view(n_seq, seq_len), learned.view(n_seq, seq_len)


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the summed log-probability of its learned tokens and their count: the per-token
    kernel (`fused_linear_token_logprob`, same arguments) summed over positions.

    Returns (logp_sum [B] fp32, count [B] int64); count is not differentiable.
    """
    logp, learned = fused_linear_token_logprob(hidden, weight, labels, bias, **options)
    return logp.sum(1), learned.sum(1)
