"""Cross-entropy over logits [..., vocab] with ignore_index, label smoothing and a NaN-free mean.

torch's `reduction="mean"` divides by the number of non-ignored labels and gives NaN when there are
none, which poisons a training run; here that count is clamped to 1, so an all-ignored batch has loss
0.0 and zero gradients. The count stays a tensor (no host synchronisation).

The Triton kernel streams each row once for an online log-sum-exp and, when asked, a second time to
write the gradient `(softmax - target) * scale`, where `scale` is per row. The fused linear
cross-entropy reuses it on its chunks of logits, in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _backend
from ._backend import LazyKernel, cdiv, next_power_of_2, use_triton

tl = None  # triton.language, bound by LazyKernel on the first launch

REDUCTIONS = ("mean", "sum", "none")
MAX_BLOCK_V = 4096  # columns per loop step of the Triton kernel (tests lower it to exercise the loop)


def cross_entropy_reference(logits, labels, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """PyTorch's cross-entropy in fp32, with the mean over non-ignored labels clamped to avoid NaN."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    flat = labels.reshape(-1)
    torch_reduction = "sum" if reduction == "mean" else reduction
    loss = F.cross_entropy(
        logits, flat, ignore_index=ignore_index, reduction=torch_reduction, label_smoothing=label_smoothing
    )
    if reduction == "mean":
        loss = loss / (flat != ignore_index).sum().clamp(min=1)
    elif reduction == "none":
        loss = loss.view(labels.shape)
    return loss


@LazyKernel
def _cross_entropy_kernel(
    LOGITS, LABELS, LOSS, GRAD, SCALE, n_rows, n_cols, logits_stride, grad_stride,
    ignore_index: tl.constexpr, smoothing: tl.constexpr, WRITE_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    labels = tl.load(LABELS + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = (labels != ignore_index) & row_mask
    row_ptr = LOGITS + rows.to(tl.int64)[:, None] * logits_stride

    # Pass 1: online max and sum of exponentials (and the plain sum, for label smoothing).
    running_max = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    logit_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(row_ptr + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(x - new_max[:, None]), axis=1
        )
        running_max = new_max
        if smoothing > 0.0:
            logit_sum += tl.sum(tl.where(mask, x, 0.0), axis=1)
    # Padding rows (past n_rows) get lse 0, so neither pass computes log(0) or exp(inf) on them.
    lse = tl.where(row_mask, running_max + tl.log(tl.where(row_mask, running_sum, 1.0)), 0.0)

    # A label outside [0, n_cols) never reads memory past its row: its loss is NaN (and check_labels
    # has already raised, or queued a device-side assert).
    in_range = (labels >= 0) & (labels < n_cols)
    target = tl.where(valid & in_range, labels, 0)
    target_logit = tl.load(
        LOGITS + rows.to(tl.int64) * logits_stride + target, mask=valid & in_range, other=0.0
    )
    loss = lse - target_logit.to(tl.float32)
    if smoothing > 0.0:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - logit_sum / n_cols)
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(LOSS + rows, tl.where(valid, loss, 0.0), mask=row_mask)

    if WRITE_GRAD:
        # Pass 2: d loss / d logits = (softmax - (1 - s) * onehot - s / V) * scale; zero for ignored rows.
        scale = tl.load(SCALE + rows, mask=row_mask, other=0.0).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        grad_row_ptr = GRAD + rows.to(tl.int64)[:, None] * grad_stride
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(row_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse[:, None])
            grad = tl.where(cols[None, :] == labels[:, None], grad - (1.0 - smoothing), grad)
            if smoothing > 0.0:
                grad = grad - smoothing / n_cols
            grad = tl.where(valid[:, None], grad * scale[:, None], 0.0)
            tl.store(grad_row_ptr + cols[None, :], grad.to(GRAD.dtype.element_ty), mask=mask)


def check_labels(flat_labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every label must be `ignore_index` or in [0, vocab), as torch's cross-entropy requires.

    Checked on the labels' device without waiting for it (one small reduction): on a CPU it raises a
    RuntimeError at once; on CUDA it is a device-side assert, reported at the next synchronisation,
    which is what torch's own cross-entropy does with such a label.
    """
    ok = ((flat_labels >= 0) & (flat_labels < vocab)) | (flat_labels == ignore_index)
    torch._assert_async(
        ok.all(), f"labels must be in [0, {vocab}) (the vocabulary) or {ignore_index} (ignored)"
    )


def cross_entropy_rows(logits2d, labels, ignore_index, label_smoothing, grad=None, scale=None):
    """Launch the kernel on [rows, vocab] logits: per-row losses (fp32), and the scaled gradient into
    `grad` when given (`grad` may be `logits2d` itself, to overwrite it in place)."""
    n_rows, n_cols = logits2d.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits2d.device)
    block_v = min(next_power_of_2(n_cols), MAX_BLOCK_V)
    block_m = max(1, min(next_power_of_2(n_rows), _backend.tile_elements() // block_v))
    write_grad = grad is not None
    _cross_entropy_kernel[(cdiv(n_rows, block_m),)](
        logits2d, labels, loss, grad if write_grad else loss, scale if write_grad else loss,
        n_rows, n_cols, logits2d.stride(0), grad.stride(0) if write_grad else 0,
        ignore_index=int(ignore_index), smoothing=float(label_smoothing), WRITE_GRAD=write_grad,
        BLOCK_M=block_m, BLOCK_V=block_v,
    )  # fmt: skip
    return loss


class _CrossEntropyTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index, reduction, label_smoothing):
        logits2d = logits.reshape(-1, logits.shape[-1])
        if logits2d.stride(-1) != 1:
            logits2d = logits2d.contiguous()
        flat = labels.reshape(-1).contiguous()
        check_labels(flat, logits2d.shape[1], ignore_index)
        row_loss = cross_entropy_rows(logits2d, flat, ignore_index, label_smoothing)
        n_valid = (flat != ignore_index).sum().clamp(min=1)
        ctx.save_for_backward(logits2d, flat, n_valid)
        ctx.settings = (ignore_index, reduction, label_smoothing, logits.shape, labels.shape)
        if reduction == "mean":
            return row_loss.sum() / n_valid
        if reduction == "sum":
            return row_loss.sum()
        return row_loss.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_output):
        logits2d, flat, n_valid = ctx.saved_tensors
        ignore_index, reduction, label_smoothing, logits_shape, _ = ctx.settings
        grad_output = grad_output.float()
        if reduction == "mean":
            grad_output = grad_output / n_valid
        scale = grad_output.reshape(-1).expand(flat.shape[0]).contiguous()
        grad = torch.empty_like(logits2d)
        cross_entropy_rows(logits2d, flat, ignore_index, label_smoothing, grad=grad, scale=scale)
        return grad.view(logits_shape), None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of logits [..., vocab] against integer labels [...]; the loss is fp32."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be between 0.0 and 1.0.")
    if use_triton(logits):
        return _CrossEntropyTriton.apply(logits, labels, ignore_index, reduction, float(label_smoothing))
    return cross_entropy_reference(logits, labels, ignore_index, reduction, label_smoothing)
