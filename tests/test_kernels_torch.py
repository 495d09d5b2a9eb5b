"""The PyTorch paths of our kernels (what runs on a CPU), in fp32 and bf16, and the backend choice.

References are written out here from the formulas (and torch's own cross-entropy), in float64 where
that makes the check sharper.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from liger_kernels import apply_rope, cross_entropy, fused_linear_cross_entropy, rms_norm, swiglu
from liger_kernels._backend import use_triton
from torch.utils._python_dispatch import TorchDispatchMode


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")


def grads(out, inputs, seed=1):
    """Gradients of <out, random> with respect to inputs (a fixed random upstream gradient)."""
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


def leaf(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


# --- rms_norm, rope, swiglu ---------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_formula(offset, dtype, tol):
    x, w = leaf(3, 5, 96, dtype=dtype), leaf(96, dtype=dtype, seed=1)
    y = rms_norm(x, w, eps=1e-5, offset=offset)
    assert y.dtype == dtype
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * (offset + w64)
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol)
    for got, exp in zip(grads(y, (x, w)), grads(want, (x64, w64)), strict=True):
        torch.testing.assert_close(got.double(), exp, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rope_matches_rotate_half_formula_with_gqa(dtype, tol):
    q, k = leaf(2, 4, 6, 16, dtype=dtype), leaf(2, 2, 6, 16, dtype=dtype, seed=1)
    cos, sin = leaf(1, 6, 16, dtype=dtype, seed=2), leaf(1, 6, 16, dtype=dtype, seed=3)
    q_out, k_out = apply_rope(q, k, cos, sin)

    def rotate_half(x):
        return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)

    ref = [t.detach().double().requires_grad_() for t in (q, k, cos, sin)]
    c, s = ref[2].unsqueeze(1), ref[3].unsqueeze(1)
    want = (ref[0] * c + rotate_half(ref[0]) * s, ref[1] * c + rotate_half(ref[1]) * s)
    torch.testing.assert_close(q_out.double(), want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(k_out.double(), want[1], rtol=tol, atol=tol)
    loss = (q_out * 0.3).sum() + (k_out * k_out).sum()
    want_loss = (want[0] * 0.3).sum() + (want[1] * want[1]).sum()
    for got, exp in zip(
        torch.autograd.grad(loss, (q, k, cos, sin)), torch.autograd.grad(want_loss, ref), strict=True
    ):
        torch.testing.assert_close(got.double(), exp, rtol=tol, atol=tol * 20)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_swiglu_matches_formula(dtype, tol):
    gate, up = leaf(5, 33, dtype=dtype), leaf(5, 33, dtype=dtype, seed=1)
    out = swiglu(gate, up)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    want = g64 * torch.sigmoid(g64) * u64
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    for got, exp in zip(grads(out, (gate, up)), grads(want, (g64, u64)), strict=True):
        torch.testing.assert_close(got.double(), exp, rtol=tol, atol=tol)


class SavedBytes:
    """Sums the bytes of the distinct storages autograd saves for backward while active (not parameters)."""

    def __init__(self, *exclude):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self):
        return sum(self.seen.values())


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("train_weight", [True, False])
def test_rms_norm_any_layout_matches_autograd_of_formula(offset, train_weight):
    # A transposed (non-contiguous) input with two leading dimensions, and a frozen weight (LoRA).
    base, w = leaf(96, 5, 3), leaf(96, seed=1).requires_grad_(train_weight)
    x = base.transpose(0, 2)
    assert not x.is_contiguous()
    y = rms_norm(x, w, eps=1e-5, offset=offset)
    xr, wr = (
        base.detach().clone().requires_grad_().transpose(0, 2),
        w.detach().clone().requires_grad_(train_weight),
    )
    want = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * (offset + wr)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    inputs, ref_inputs = ((x, w), (xr, wr)) if train_weight else ((x,), (xr,))
    for got, exp in zip(grads(y, inputs), grads(want, ref_inputs), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
    rms_norm(x, w, eps=1e-5, offset=offset).sum().backward()
    assert (w.grad is not None) == train_weight


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_gradcheck_float64(offset):
    x, w = leaf(2, 3, 8, dtype=torch.float64), leaf(8, dtype=torch.float64, seed=1)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5, offset), (x, w))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_low_precision_computes_in_fp32(dtype):
    x, w = leaf(4, 64, dtype=dtype), leaf(64, dtype=dtype, seed=1)
    y = rms_norm(x, w, eps=1e-6)
    gx, gw = grads(y, (x, w))
    assert (y.dtype, gx.dtype, gw.dtype) == (dtype, dtype, dtype)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * w32
    torch.testing.assert_close(y, want.to(dtype))  # one rounding of the fp32 result
    for got, exp in zip((gx, gw), grads(want, (x32, w32)), strict=True):
        torch.testing.assert_close(got, exp.to(dtype), rtol=2e-2, atol=2e-2)


def test_rms_norm_saves_its_output_and_rstd_not_its_input():
    rows, hidden = 64, 128
    x, w = leaf(rows, hidden), leaf(hidden, seed=1)
    with SavedBytes(w) as ours:
        y = rms_norm(x, w, eps=1e-6)
    # y (which the next linear keeps anyway) and one fp32 rstd per row; x, the residual stream, is free.
    assert x.untyped_storage().data_ptr() not in ours.seen
    assert y.untyped_storage().data_ptr() in ours.seen
    assert ours.total == rows * hidden * 4 + rows * 4
    with SavedBytes(w) as eager:
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert x.untyped_storage().data_ptr() in eager.seen  # the check sees eager keep x
    assert eager.total >= 2 * rows * hidden * 4  # and x * rstd


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_weight_with_a_zero_saves_input_and_stays_exact(offset):
    x, w = leaf(6, 32), leaf(32, seed=1)
    with torch.no_grad():
        w[3] = -offset  # offset + w is 0 there: y / (offset + w) cannot recover x * rstd
    with SavedBytes(w) as saved:
        y = rms_norm(x, w, eps=1e-6, offset=offset)
    assert x.untyped_storage().data_ptr() in saved.seen
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w64)
    for got, exp in zip(grads(y, (x, w)), grads(want, (x64, w64)), strict=True):
        torch.testing.assert_close(got.double(), exp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_swiglu_dtypes_and_gradcheck(dtype):
    gate, up = leaf(3, 4, 7, dtype=dtype), leaf(3, 4, 7, dtype=dtype, seed=1)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(swiglu, (gate, up))
        return
    out = swiglu(gate, up)
    g32, u32 = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
    want = F.silu(g32) * u32
    torch.testing.assert_close(out, want.to(dtype))  # computed in fp32, rounded once
    got = grads(out, (gate, up))
    assert [g.dtype for g in got] == [dtype, dtype]
    for a, b in zip(got, grads(want, (g32, u32)), strict=True):
        torch.testing.assert_close(a, b.to(dtype), rtol=2e-2, atol=2e-2)


def test_swiglu_non_contiguous_and_one_input_frozen():
    gate = leaf(33, 5).t()
    up = leaf(5, 33, seed=1).detach()
    out = swiglu(gate, up)
    g64 = gate.detach().double().requires_grad_()
    want = F.silu(g64) * up.double()
    (got,) = grads(out, (gate,))
    torch.testing.assert_close(got.double(), grads(want, (g64,))[0], rtol=1e-5, atol=1e-6)


def test_swiglu_saves_only_its_inputs():
    gate, up = leaf(64, 96), leaf(64, 96, seed=1)
    with SavedBytes() as ours:
        swiglu(gate, up)
    assert ours.total == 2 * 64 * 96 * 4  # gate and up; silu(gate) is recomputed in the backward
    with SavedBytes() as eager:
        F.silu(gate) * up
    assert eager.total == 3 * 64 * 96 * 4  # the check sees silu(gate) too


# --- cross_entropy ------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_torch(reduction, smoothing):
    logits = leaf(3, 7, 257)
    labels = torch.randint(0, 257, (3, 7), generator=torch.Generator().manual_seed(0))
    labels[0, :4] = -100
    got = cross_entropy(logits, labels, reduction=reduction, label_smoothing=smoothing)
    want = F.cross_entropy(
        logits.view(-1, 257), labels.view(-1), reduction=reduction, label_smoothing=smoothing
    ).view_as(got)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads(got, logits), grads(want, logits), strict=True):
        torch.testing.assert_close(a, b)


def test_cross_entropy_all_ignored_is_zero_not_nan():
    logits = leaf(4, 257)
    labels = torch.full((4,), -100)
    assert torch.isnan(F.cross_entropy(logits, labels))  # what we guard against
    loss = cross_entropy(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad) == 0


def test_cross_entropy_bf16_logits_give_fp32_loss_close_to_fp32():
    logits = leaf(6, 257)
    labels = torch.randint(0, 257, (6,), generator=torch.Generator().manual_seed(0))
    low = logits.detach().bfloat16().requires_grad_()
    loss = cross_entropy(low, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(low.float(), labels))
    (grad,) = torch.autograd.grad(loss, low)
    assert grad.dtype == torch.bfloat16


# --- fused linear cross-entropy -----------------------------------------------------------------


def unfused(hidden, weight, labels, bias=None, **kwargs):
    """The plain formula: full logits, then torch's cross-entropy."""
    return F.cross_entropy(
        F.linear(hidden, weight, bias).view(-1, weight.shape[0]).float(), labels.view(-1), **kwargs
    )


@pytest.mark.parametrize("vocab_block", [1, 100, None])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_flce_matches_unfused_formula(vocab_block, reduction, smoothing):
    hidden, weight, bias = leaf(2, 9, 48), leaf(257, 48, seed=1), leaf(257, seed=2)
    labels = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(0))
    labels[1, 2:6] = -100
    got = fused_linear_cross_entropy(
        hidden, weight, labels, bias, reduction=reduction, label_smoothing=smoothing, vocab_block=vocab_block
    )
    want = unfused(hidden, weight, labels, bias, reduction=reduction, label_smoothing=smoothing)
    torch.testing.assert_close(got, want)
    # A non-unit upstream gradient checks that the backward scales the saved gradients.
    for a, b in zip(
        torch.autograd.grad(got * 2.5, (hidden, weight, bias)),
        torch.autograd.grad(want * 2.5, (hidden, weight, bias)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_flce_one_row_and_all_ignored():
    hidden, weight = leaf(1, 16), leaf(257, 16, seed=1)
    label = torch.tensor([256])
    torch.testing.assert_close(
        fused_linear_cross_entropy(hidden, weight, label), unfused(hidden, weight, label)
    )
    ignored = torch.tensor([-100])
    loss = fused_linear_cross_entropy(hidden, weight, ignored)
    grad_h, grad_w = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad_h) == 0 and torch.count_nonzero(grad_w) == 0


def test_flce_frozen_weight_gets_no_gradient_and_hidden_grad_is_right():
    hidden, weight = leaf(7, 16), leaf(257, 16, seed=1).detach()
    labels = torch.randint(0, 257, (7,), generator=torch.Generator().manual_seed(0))
    loss = fused_linear_cross_entropy(hidden, weight, labels, vocab_block=100)
    loss.backward()
    assert weight.grad is None
    hidden_ref = hidden.detach().clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad(unfused(hidden_ref, weight, labels), hidden_ref)
    torch.testing.assert_close(hidden.grad, grad_ref)


def test_flce_bf16_close_to_fp32():
    hidden, weight = leaf(12, 64), leaf(257, 64, seed=1)
    labels = torch.randint(0, 257, (12,), generator=torch.Generator().manual_seed(0))
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    loss = fused_linear_cross_entropy(h16, w16, labels, vocab_block=100)
    assert loss.dtype == torch.float32
    want = unfused(hidden, weight, labels)
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=2e-2)
    got_grads = torch.autograd.grad(loss, (h16, w16))
    assert [g.dtype for g in got_grads] == [torch.bfloat16, torch.bfloat16]
    for a, b in zip(got_grads, torch.autograd.grad(want, (hidden, weight)), strict=True):
        torch.testing.assert_close(a.float(), b, rtol=5e-2, atol=5e-3)


def test_flce_under_autocast_follows_the_autocast_dtype():
    hidden, weight = leaf(12, 64), leaf(257, 64, seed=1)
    labels = torch.randint(0, 257, (12,), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, labels, vocab_block=100)
    grads_ = torch.autograd.grad(loss, (hidden, weight))
    assert [g.dtype for g in grads_] == [torch.float32, torch.float32]  # the master weights' dtype
    want = unfused(hidden, weight, labels)
    torch.testing.assert_close(loss, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads_, torch.autograd.grad(want, (hidden, weight)), strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces while active."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_flce_never_materialises_full_logits():
    tokens, vocab, hidden_size, block = 64, 1000, 4, 100
    hidden, weight = leaf(tokens, hidden_size), leaf(vocab, hidden_size, seed=1)
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    for trainable in (True, False):  # two passes, or one (frozen lm_head)
        weight.requires_grad_(trainable)
        with LargestTensor() as mode:
            fused_linear_cross_entropy(hidden, weight, labels, vocab_block=block).backward()
        assert mode.largest == tokens * block  # one block of logits (grad_weight is 4000)
    weight.requires_grad_()
    with LargestTensor() as eager:
        unfused(hidden, weight, labels).backward()
    assert eager.largest == tokens * vocab  # the check itself can see a full logits tensor


def test_flce_does_no_host_synchronisation(monkeypatch):
    hidden, weight = leaf(10, 16), leaf(257, 16, seed=1)
    labels = torch.randint(0, 257, (10,), generator=torch.Generator().manual_seed(0))
    labels[:3] = -100

    def refuse(*args, **kwargs):
        raise AssertionError("host synchronisation in the FLCE hot path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    loss = fused_linear_cross_entropy(hidden, weight, labels, vocab_block=100)
    loss.backward()
    monkeypatch.undo()
    torch.testing.assert_close(loss, unfused(hidden, weight, labels))


def test_flce_rejects_bad_arguments():
    hidden, weight, labels = leaf(4, 16), leaf(257, 16), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="shapes"):
        fused_linear_cross_entropy(hidden, weight, labels[:3])


# --- backend choice -----------------------------------------------------------------------------


def test_backend_env_var(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")
    assert use_triton(cpu) is False
    monkeypatch.delenv("LIGER_KERNEL_BACKEND")
    assert use_triton(cpu) is False  # CPU tensors default to PyTorch
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LIGER_KERNEL_BACKEND"):
        use_triton(cpu)
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton(cpu)


def test_importing_liger_kernels_does_not_import_triton():
    env = {k: v for k, v in os.environ.items() if k != "LIGER_KERNEL_BACKEND"}
    code = "import sys, liger_kernels; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


@pytest.mark.parametrize(
    "tokens,hidden_size,block",
    [(40, 16, 50), (40, 16, 7), (12, 16, 50), (16, 16, 300), (3, 64, 64)],
    ids=["some-blocks-kept", "uneven-blocks", "all-kept", "rows-equal-hidden", "one-block"],
)
def test_flce_trainable_head_keeps_logits_in_grad_weight_exactly(tokens, hidden_size, block):
    # The two-pass path keeps the first blocks' exponentials in grad_weight's memory between the
    # passes (all of them when tokens <= hidden): every split must give the unfused gradients.
    vocab = 300
    hidden, weight, bias = leaf(tokens, hidden_size), leaf(vocab, hidden_size, seed=1), leaf(vocab, seed=2)
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    labels[::5] = -100
    got = fused_linear_cross_entropy(hidden, weight, labels, bias, label_smoothing=0.1, vocab_block=block)
    want = unfused(hidden, weight, labels, bias, label_smoothing=0.1)
    torch.testing.assert_close(got, want)
    for a, b in zip(
        torch.autograd.grad(got, (hidden, weight, bias)),
        torch.autograd.grad(want, (hidden, weight, bias)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
