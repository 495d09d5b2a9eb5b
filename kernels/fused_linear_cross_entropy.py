"""Fused linear cross-entropy (FLCE): cross_entropy(hidden @ weight.T + bias, labels) without ever
holding the full [tokens, vocab] logits.

Why: at 4096 tokens and a 128k vocabulary the fp32 logits alone are 2 GB, and eager autograd keeps
several tensors of that size. FLCE walks the tokens in chunks. For each chunk it computes the logits,
turns them in place into d loss / d logits, and immediately uses them for grad_hidden (d @ W) and
grad_weight (+= d.T @ h, accumulated in fp32). So the gradients are computed during the forward, the
largest temporary is one chunk of logits, and the backward only multiplies the saved gradients by
grad_output (a tensor: nothing waits on the host).

The chunk's softmax and gradient run in our Triton cross-entropy kernel on CUDA, and as in-place
PyTorch ops elsewhere; the matmuls are torch's (cuBLAS / the CPU BLAS) in both paths.
"""

from __future__ import annotations

import torch

from ._backend import use_triton
from .cross_entropy import cross_entropy_reference, cross_entropy_rows

CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk; tuned with bench/flce_memory.py


def fused_linear_cross_entropy_reference(
    hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0
):
    """The unfused formula: full logits, then our NaN-free cross-entropy."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_reference(logits, labels, ignore_index, reduction, label_smoothing)


def default_chunk_rows(n_rows: int, vocab: int) -> int:
    return max(1, min(n_rows, CHUNK_BYTES // (4 * vocab)))


def _chunk_grad_torch(logits, labels, valid, row_scale, label_smoothing):
    """In place on fp32 logits [c, V]: per-row losses (returned) and logits := d loss / d logits."""
    vocab = logits.shape[1]
    target = torch.where(valid, labels, 0).unsqueeze(1)
    target_logit = logits.gather(1, target).squeeze(1)
    logit_sum = logits.sum(1) if label_smoothing > 0 else None
    row_max = logits.amax(1, keepdim=True)
    logits.sub_(row_max).exp_()
    sum_exp = logits.sum(1, keepdim=True)
    lse = (row_max + sum_exp.log()).squeeze(1)
    loss = lse - target_logit
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - logit_sum / vocab)
    # softmax * scale, minus the (smoothed) one-hot target * scale; row_scale is 0 on ignored rows.
    logits.mul_(row_scale.unsqueeze(1) / sum_exp)
    logits.scatter_add_(1, target, (-(1.0 - label_smoothing) * row_scale).unsqueeze(1))
    if label_smoothing > 0:
        logits.sub_((label_smoothing / vocab * row_scale).unsqueeze(1))
    return torch.where(valid, loss, 0.0)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, chunk_rows):
        h2d = hidden.reshape(-1, hidden.shape[-1])
        flat = labels.reshape(-1)
        n_rows, vocab = h2d.shape[0], weight.shape[0]
        chunk_rows = chunk_rows or default_chunk_rows(n_rows, vocab)
        triton = use_triton(hidden)

        valid = flat != ignore_index
        if reduction == "mean":
            scale = 1.0 / valid.sum().clamp(min=1).float()
        else:
            scale = torch.ones((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(h2d) if hidden.requires_grad else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if weight.requires_grad
            else None
        )
        grad_bias = (
            torch.zeros(vocab, dtype=torch.float32, device=weight.device)
            if bias is not None and bias.requires_grad
            else None
        )
        weight_t = weight.t()
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n_rows, chunk_rows):
            end = min(start + chunk_rows, n_rows)
            h_chunk = h2d[start:end]
            logits = torch.addmm(bias, h_chunk, weight_t) if bias is not None else torch.mm(h_chunk, weight_t)
            logits = logits.float()
            valid_chunk = valid[start:end]
            row_scale = valid_chunk * scale
            if triton:
                row_loss = cross_entropy_rows(
                    logits,
                    flat[start:end].contiguous(),
                    ignore_index,
                    label_smoothing,
                    grad=logits,
                    scale=row_scale,
                )
            else:
                row_loss = _chunk_grad_torch(logits, flat[start:end], valid_chunk, row_scale, label_smoothing)
            loss += row_loss.sum()
            grad_logits = logits.to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                if grad_logits.dtype == torch.float32 and h_chunk.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h_chunk)
                else:  # low precision: one matmul per chunk in its dtype, accumulated across chunks in fp32
                    grad_weight += torch.mm(grad_logits.t(), h_chunk.to(weight.dtype))
            if grad_bias is not None:
                grad_bias += logits.sum(0)
            del logits, grad_logits
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.shapes = (hidden.shape, weight.dtype, None if bias is None else bias.dtype)
        return loss * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        hidden_shape, weight_dtype, bias_dtype = ctx.shapes
        # In place on the saved gradients: they are used once and are as large as the weight.
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_output.to(grad_hidden.dtype)).view(hidden_shape)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_output).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_output).to(bias_dtype)
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, labels), chunked over tokens; the loss is fp32.

    hidden is [..., H], weight [V, H], labels [...]. `reduction` is "mean" (over non-ignored labels;
    0.0 when all are ignored) or "sum". `chunk_rows` overrides the tokens per chunk.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: fused_linear_cross_entropy supports 'mean' and 'sum'.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be between 0.0 and 1.0.")
    if hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"shapes do not fit: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}."
        )
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # Do what autocast would do to the matmuls, once, outside the Function (whose own matmuls use
        # out= buffers, which autocast does not allow); the casts stay differentiable.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(device_type, enabled=False):
        return _FusedLinearCrossEntropy.apply(
            hidden, weight, labels, bias, ignore_index, reduction, float(label_smoothing), chunk_rows
        )
