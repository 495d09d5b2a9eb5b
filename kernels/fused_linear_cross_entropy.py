"""Fused linear cross-entropy (FLCE): cross_entropy(hidden @ weight.T + bias, labels) without ever
holding the full [tokens, vocab] logits.

Why: at 4096 tokens and a 128k vocabulary the fp32 logits alone are 2 GB, and eager autograd keeps
several tensors of that size. FLCE computes the gradients during the forward, a piece of the logits
at a time, so besides the gradients it returns (grad_hidden, and grad_weight when lm_head trains)
it holds one piece of logits, sized from the call (CHUNK_BYTES per device type).

Two paths, because a CPU and a GPU want different pieces:
- PyTorch (CPU): blocks of the vocabulary, all tokens at once, so every matmul has large, efficient
  shapes (token chunks would make the BLAS repack the whole weight once per chunk, twice as slow).
  A frozen lm_head needs one pass (an online softmax, as in flash attention); a trainable one two
  (log-sum-exp first, then the gradients, grad_weight written once per block), and between them
  the first blocks' exponentials wait in grad_weight's own memory, so only the rest are recomputed.
- Triton (CUDA): chunks of tokens; our cross-entropy kernel turns each chunk's logits into their
  gradient in place, then cuBLAS feeds both weight-sized matmuls. Nothing is computed twice.

Numerics: the logits' gradients are left unscaled (softmax minus one-hot, values in [-1, 1]) when
they are cast to a low-precision dtype for the matmuls. The mean's 1/N and the upstream gradient (a
GradScaler's 65536, say) are applied in the backward as one fp32 factor, to grad_hidden and
grad_weight alike, before their cast back to the inputs' dtype. So nothing small is flushed to zero
in fp16, grad_output is never cast to fp16, and both gradients carry exactly the same scale. Labels
are checked on the device (no host synchronisation); the forward never waits on the host.
"""

from __future__ import annotations

import torch

from ._backend import cast_as_autocast_would, use_triton
from .cross_entropy import check_labels, cross_entropy_reference, cross_entropy_rows

# Bytes one chunk's working set may take (its fp32 logits, plus the low-precision logits and gradient
# when the inputs are fp16/bf16), per device type. Tuned with bench/flce_memory.py (bench/README.md):
# on a CPU 32 MiB keeps the loss within 64 MiB of the gradients it returns and is as fast as larger
# chunks; on a GPU larger chunks keep the matmuls efficient.
CHUNK_BYTES = {"cpu": 32 * 2**20, "cuda": 256 * 2**20}
OTHER_DEVICE_CHUNK_BYTES = 64 * 2**20
# Chunks are a multiple of this many rows (SIMD / tensor-core tiles), and never fewer.
ROW_MULTIPLE = {"cpu": 16, "cuda": 64}


def fused_linear_cross_entropy_reference(
    hidden, weight, labels, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0
):
    """The unfused formula: full logits, then our NaN-free cross-entropy."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_reference(logits, labels, ignore_index, reduction, label_smoothing)


def chunk_rows_for(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per chunk: as many as the device's budget (CHUNK_BYTES) allows for this vocabulary and dtype."""
    element = torch.empty((), dtype=dtype).element_size()
    row_bytes = vocab * (4 if element >= 4 else 4 + 2 * element)
    budget = CHUNK_BYTES.get(device.type, OTHER_DEVICE_CHUNK_BYTES)
    multiple = ROW_MULTIPLE.get(device.type, 16)
    rows = max(multiple, budget // row_bytes // multiple * multiple)
    return max(1, min(n_rows, rows))


def vocab_block_for(n_rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary entries per block of the PyTorch path: [n_rows, block] fp32 logits fit CHUNK_BYTES."""
    budget = CHUNK_BYTES.get(device.type, OTHER_DEVICE_CHUNK_BYTES)
    return max(1, min(vocab, max(256, budget // (4 * max(1, n_rows)) // 256 * 256)))


def _add_matmul(out, a, b):
    """out (fp32) += a (fp32) @ b, the matmul in b's dtype."""
    if b.dtype == torch.float32:
        out.addmm_(a, b)
    else:
        out += torch.mm(a.to(b.dtype), b)


def _blocks(vocab: int, block: int) -> list[tuple[int, int]]:
    return [(v0, min(v0 + block, vocab)) for v0 in range(0, vocab, block)]


def _logits_into(out, h2d, w, bias):
    """out (fp32, [rows, block]) = h2d @ w.T + bias, the matmul in w's dtype."""
    if w.dtype == torch.float32:
        if bias is None:
            return torch.mm(h2d, w.t(), out=out)
        return torch.addmm(bias, h2d, w.t(), out=out)
    return out.copy_(torch.mm(h2d, w.t()) if bias is None else torch.addmm(bias, h2d, w.t()))


def _view(buffer, rows, cols):
    """buffer's first rows * cols elements as a [rows, cols] matrix (None if it is too small)."""
    return buffer[: rows * cols].view(rows, cols) if rows * cols <= buffer.numel() else None


class _Slots:
    """Where the first blocks' logits wait between the two passes: in grad_weight's own memory.

    grad_weight ([V, H] fp32) must be returned anyway and is written only in the second pass, so
    until then it holds H/rows of the logits for free (all of them when rows <= H): those blocks
    are not recomputed. The slots sit at the end of the buffer, in block order, so writing block k's
    gradient (rows [v0, v1) of grad_weight, from the start) never reaches a slot not yet consumed;
    only block k's own slot may overlap its gradient, which then goes through a temporary.
    """

    def __init__(self, grad_weight, n_rows, bounds):
        flat = grad_weight.view(-1)
        sizes = [n_rows * (v1 - v0) for v0, v1 in bounds]
        kept = 0  # the first blocks whose logits fit together
        while kept < len(sizes) and sum(sizes[: kept + 1]) <= flat.numel():
            kept += 1
        offset = flat.numel() - sum(sizes[:kept])
        self.views, self.ranges = [], []
        for (v0, v1), size in zip(bounds[:kept], sizes, strict=False):
            self.views.append(flat[offset : offset + size].view(n_rows, v1 - v0))
            self.ranges.append((offset, offset + size))
            offset += size
        self.row_len = grad_weight.shape[1]

    def overlaps_own(self, k, v0, v1):
        """Does block k's gradient (rows v0:v1 of grad_weight) overlap block k's own slot?"""
        if k >= len(self.ranges):
            return False
        start, end = self.ranges[k]
        return v0 * self.row_len < end and start < v1 * self.row_len


class _Blocks:
    """One call's vocabulary blocks (PyTorch path) and the buffer each block's logits are written to:
    the first blocks' in grad_weight's memory (`_Slots`, when grad_weight is given), every other
    block's in one work buffer, reused (a fresh 32 MiB each time would cost as many page faults: the
    allocator hands blocks this large back to the system when freed)."""

    def __init__(self, n_rows, vocab, block, device, grad_weight=None):
        self.n_rows = n_rows
        self.bounds = _blocks(vocab, block)
        self.slots = _Slots(grad_weight, n_rows, self.bounds) if grad_weight is not None else None
        self.n_kept = len(self.slots.views) if self.slots is not None else 0
        self.slot_max = []  # per stored block: each row's running max when its exponentials were taken
        self.work = torch.empty(n_rows * min(block, vocab), dtype=torch.float32, device=device)

    def buffer(self, k, v0, v1):
        return self.slots.views[k] if k < self.n_kept else _view(self.work, self.n_rows, v1 - v0)

    def overlaps_own(self, k, v0, v1):
        return self.slots is not None and self.slots.overlaps_own(k, v0, v1)


def _where_target(target, v0, v1):
    """Which rows' target lies in the block [v0, v1), and its column there (clamped for the others)."""
    in_block = (target >= v0) & (target < v1)
    return in_block, (target - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1)


def _lse_pass(h2d, weight, bias, target, blocks, label_smoothing=0.0, acc=None):
    """First pass over the vocabulary blocks: each row's log-sum-exp (online, as in flash attention:
    a running max and sum of exponentials, rescaled whenever the max grows), its target's logit and,
    for label smoothing, the sum of its logits. With `acc` ([rows, H] fp32) it also accumulates
    exp(logits - max) @ W under the same rescaling (softmax @ W once divided by the sum). The blocks
    kept in slots keep exp(logits - max), and their max goes to `blocks.slot_max`.

    Returns (lse, target_logit, logit_sum or None, sum_exp), fp32 per row.
    """
    n_rows, device = h2d.shape[0], h2d.device
    running_max = torch.full((n_rows,), float("-inf"), device=device)
    sum_exp = torch.zeros(n_rows, device=device)
    target_logit = torch.zeros(n_rows, device=device)
    logit_sum = torch.zeros(n_rows, device=device) if label_smoothing > 0 else None
    for k, (v0, v1) in enumerate(blocks.bounds):
        w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
        logits = _logits_into(blocks.buffer(k, v0, v1), h2d, w, b)
        in_block, column = _where_target(target, v0, v1)
        target_logit += torch.where(in_block, logits.gather(1, column).squeeze(1), 0.0)
        if logit_sum is not None:
            logit_sum += logits.sum(1)
        new_max = torch.maximum(running_max, logits.amax(1))
        rescale = torch.exp(running_max - new_max)
        logits.sub_(new_max.unsqueeze(1)).exp_()  # exp(logits - max): what a slot keeps
        sum_exp.mul_(rescale).add_(logits.sum(1))
        if acc is not None:
            acc.mul_(rescale.unsqueeze(1))
            _add_matmul(acc, logits, w)
        if k < blocks.n_kept:
            blocks.slot_max.append(new_max)
        running_max = new_max
        del logits
    return running_max + sum_exp.log(), target_logit, logit_sum, sum_exp


def _gradient_pass(
    h2d, weight, bias, target, valid, lse, blocks, label_smoothing, grad_hidden, grad_weight, grad_bias,
    row_scale=None,
):  # fmt: skip
    """Second pass: each block's d loss / d logits = softmax - (1 - s) * onehot - s / V (zero for rows
    not `valid`), times `row_scale` per row when given, into grad_hidden (+=), grad_weight and grad_bias
    (written once per block). Blocks kept in slots turn their stored exp(logits - max) into softmax;
    the others recompute their logits from `lse` (each row's final log-sum-exp)."""
    f32 = torch.float32
    # An ignored row's log-sum-exp is +inf, so its probabilities, hence its gradient, come out 0.
    lse = torch.where(valid, lse, float("inf")).unsqueeze(1)
    smooth = (
        torch.where(valid, label_smoothing / weight.shape[0], 0.0).unsqueeze(1)
        if label_smoothing > 0
        else None
    )
    for k, (v0, v1) in enumerate(blocks.bounds):
        w, b = weight[v0:v1], None if bias is None else bias[v0:v1]
        if k < blocks.n_kept:  # softmax = exp(logits - max) * exp(max - lse)
            probs = blocks.slots.views[k].mul_(torch.exp(blocks.slot_max[k].unsqueeze(1) - lse))
        else:
            probs = _logits_into(blocks.buffer(k, v0, v1), h2d, w, b).sub_(lse).exp_()
        in_block, column = _where_target(target, v0, v1)
        probs.scatter_add_(1, column, torch.where(in_block & valid, label_smoothing - 1.0, 0.0).unsqueeze(1))
        if smooth is not None:
            probs.sub_(smooth)
        if row_scale is not None:
            probs.mul_(row_scale.unsqueeze(1))
        if grad_hidden is not None:
            _add_matmul(grad_hidden, probs, w)
        if grad_bias is not None:
            torch.sum(probs, 0, out=grad_bias[v0:v1])
        if grad_weight is not None:
            if w.dtype != f32:  # the matmul in the weight's dtype
                grad_weight[v0:v1] = torch.mm(probs.t().to(w.dtype), h2d)
            elif not blocks.overlaps_own(k, v0, v1):
                torch.mm(probs.t(), h2d, out=grad_weight[v0:v1])
            else:  # the result would overwrite its own slot: through `work` (free: probs is in the slot)
                tmp = _view(blocks.work, v1 - v0, h2d.shape[1])
                grad_weight[v0:v1] = torch.mm(probs.t(), h2d, out=tmp) if tmp is not None else probs.t() @ h2d
        del probs


def _forward_torch(h2d, weight, bias, target, valid, label_smoothing, block, grads):
    """The PyTorch path, over blocks of the vocabulary (every matmul keeps all the tokens, so the CPU
    BLAS runs large, efficient shapes). Returns per-row losses and the unscaled gradients.

    When only grad_hidden is needed (a frozen lm_head) one pass suffices: like flash attention, it
    keeps a running max and sum of exponentials per row and accumulates exp(logits - max) @ W,
    rescaled whenever the max grows. Otherwise a first pass finds each row's log-sum-exp and a second
    writes each block's gradients, grad_weight once per block. Between the passes, exp(logits - max)
    of the first blocks waits in grad_weight's memory (`_Slots`), so only the others are recomputed:
    3 + (1 - H/rows) matmul passes over the weight instead of 4, with no memory beyond the floor.
    """
    need_hidden, need_weight, need_bias = grads
    n_rows, vocab = h2d.shape[0], weight.shape[0]
    device, f32 = h2d.device, torch.float32
    one_pass = need_hidden and not (need_weight or need_bias)
    grad_weight = torch.empty(weight.shape, dtype=f32, device=weight.device) if need_weight else None
    blocks = _Blocks(n_rows, vocab, block, device, grad_weight)
    acc = torch.zeros(h2d.shape, dtype=f32, device=device) if one_pass else None
    lse, target_logit, logit_sum, sum_exp = _lse_pass(h2d, weight, bias, target, blocks, label_smoothing, acc)
    loss = lse - target_logit
    if logit_sum is not None:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - logit_sum / vocab)
    loss = torch.where(valid, loss, 0.0)
    if not any(grads):
        return loss, None, None, None

    if one_pass:  # softmax @ W minus the (smoothed) one-hot target @ W
        grad_hidden = acc.div_(sum_exp.unsqueeze(1))
        for r0 in range(0, n_rows, 1024):  # W[target] a piece at a time: no [rows, hidden] temporary
            grad_hidden[r0 : r0 + 1024].sub_(
                weight[target[r0 : r0 + 1024]].float(), alpha=1.0 - label_smoothing
            )
        if label_smoothing > 0:
            grad_hidden.sub_(weight.sum(0, dtype=f32) * (label_smoothing / vocab))
        return loss, grad_hidden.mul_(valid.unsqueeze(1)), None, None

    grad_hidden = torch.zeros(h2d.shape, dtype=f32, device=device) if need_hidden else None
    grad_bias = torch.empty(vocab, dtype=f32, device=weight.device) if need_bias else None
    _gradient_pass(
        h2d, weight, bias, target, valid, lse, blocks, label_smoothing, grad_hidden, grad_weight, grad_bias
    )
    return loss, grad_hidden, grad_weight, grad_bias


def _forward_triton(
    h2d, weight, bias, flat, valid, ignore_index, label_smoothing, chunk_rows, grads, row_scale=None
):
    """The Triton path, over chunks of tokens: each chunk's logits become their gradient in place
    (our cross-entropy kernel, which also zeroes ignored rows), then feed both weight-sized matmuls.
    On a GPU large row chunks keep cuBLAS efficient and nothing is computed twice. `row_scale` (fp32,
    per row) multiplies each row's gradient of the logits; without it every valid row counts once."""
    need_hidden, need_weight, need_bias = grads
    n_rows, vocab = h2d.shape[0], weight.shape[0]
    scale = valid.to(torch.float32) if row_scale is None else row_scale
    write_grad = any(grads)
    grad_hidden = torch.empty_like(h2d) if need_hidden else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    )
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_bias else None
    low_precision = weight.dtype != torch.float32
    weight_t = weight.t()
    losses = []
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        h_chunk = h2d[start:end]
        logits = torch.addmm(bias, h_chunk, weight_t) if bias is not None else torch.mm(h_chunk, weight_t)
        logits = logits.float()  # a copy only in low precision; the low-precision logits are freed
        losses.append(
            cross_entropy_rows(
                logits, flat[start:end].contiguous(), ignore_index, label_smoothing,
                grad=logits if write_grad else None, scale=scale[start:end],
            )
        )  # fmt: skip
        if not write_grad:  # evaluation: the per-row losses only
            continue
        grad_logits = logits.to(weight.dtype) if low_precision else logits
        if grad_hidden is not None:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            if low_precision:  # one matmul per chunk in its dtype, accumulated across chunks in fp32
                grad_weight += torch.mm(grad_logits.t(), h_chunk)
            else:
                grad_weight.addmm_(grad_logits.t(), h_chunk)
        if grad_bias is not None:
            grad_bias += logits.sum(0)
        del logits, grad_logits
    return torch.cat(losses), grad_hidden, grad_weight, grad_bias


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        bias,
        ignore_index,
        reduction,
        smoothing,
        chunk_rows,
        vocab_block,
        grad_enabled,
    ):
        h2d = hidden.reshape(-1, hidden.shape[-1])
        flat = labels.reshape(-1)
        n_rows, vocab = h2d.shape[0], weight.shape[0]
        check_labels(flat, vocab, ignore_index)
        valid = flat != ignore_index
        n_valid = valid.sum() if reduction == "mean" else torch.ones((), dtype=torch.long, device=flat.device)
        # Under torch.no_grad (evaluation) no gradient is computed, whatever requires_grad says.
        grads = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        grads = tuple(g and grad_enabled for g in grads)
        if use_triton(hidden):
            chunk_rows = chunk_rows or chunk_rows_for(n_rows, vocab, weight.dtype, weight.device)
            loss, grad_hidden, grad_weight, grad_bias = _forward_triton(
                h2d, weight, bias, flat, valid, ignore_index, smoothing, chunk_rows, grads
            )
        else:
            block = vocab_block or vocab_block_for(n_rows, vocab, weight.device)
            target = torch.where(valid, flat, 0)
            loss, grad_hidden, grad_weight, grad_bias = _forward_torch(
                h2d, weight, bias, target, valid, smoothing, block, grads
            )
        # The gradients are unscaled; the backward multiplies them by grad_output / N.
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, n_valid)
        ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.backward_done = False
        return loss.sum() / n_valid.clamp(min=1)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.backward_done:
            raise RuntimeError(
                "fused_linear_cross_entropy: a second backward through the same loss is not supported "
                "(its gradients are computed in the forward and the first backward scales them in place, "
                "to use no extra memory). Compute the loss again for another backward."
            )
        ctx.backward_done = True
        grad_hidden, grad_weight, grad_bias, n_valid = ctx.saved_tensors
        hidden_shape, hidden_dtype, weight_dtype, bias_dtype = ctx.shapes
        # One fp32 factor for every gradient: grad_output is never cast to a low-precision dtype.
        scale = grad_output.float() / n_valid.clamp(min=1)
        # In place on the saved gradients: they are used once and are as large as the weight.
        if grad_hidden is not None:
            if grad_hidden.dtype == torch.float32:
                grad_hidden = grad_hidden.mul_(scale).to(hidden_dtype)
            else:  # the Triton path keeps it in the inputs' dtype: scale it in fp32 all the same
                grad_hidden.copy_(grad_hidden.float().mul_(scale))
            grad_hidden = grad_hidden.view(hidden_shape)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(scale).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(scale).to(bias_dtype)
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_rows: int | None = None,
    vocab_block: int | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, labels), chunked over tokens; the loss is fp32.

    hidden is [..., H], weight [V, H], labels [...] (each `ignore_index` or in [0, V)). `reduction`
    is "mean" (over non-ignored labels; 0.0 when all are ignored) or "sum". `chunk_rows` overrides
    the tokens per chunk of the Triton path, `vocab_block` the vocabulary block of the PyTorch path. One backward per loss: a second one (retain_graph=True) raises.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: fused_linear_cross_entropy supports 'mean' and 'sum'.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be between 0.0 and 1.0.")
    if hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"shapes do not fit: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}."
        )
    hidden, weight, bias = cast_as_autocast_would(hidden, weight, bias)
    options = (
        ignore_index,
        reduction,
        float(label_smoothing),
        chunk_rows,
        vocab_block,
        torch.is_grad_enabled(),
    )
    with torch.autocast(hidden.device.type, enabled=False):
        return _FusedLinearCrossEntropy.apply(hidden, weight, labels, bias, *options)
