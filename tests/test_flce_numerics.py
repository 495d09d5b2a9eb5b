"""Numerics of the fused linear cross-entropy in low precision, on both paths (PyTorch, and Triton
under TRITON_INTERPRET=1 on a CPU: fp32/fp16 only, since the interpreter's bf16 is wrong).

Each gradient is compared with autograd of the plain formula in float64 by two numbers that catch a
0.1% error: the least-squares scale of got against want (a wrong 1/N or upstream factor moves it),
and the relative error norm (values flushed to zero, or lost precision, move it).
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (also in conftest.py)

import liger_kernels._backend as backend  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from liger_kernels import cross_entropy, fused_linear_cross_entropy  # noqa: E402

BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() and not backend.interpreting(),
            reason="Triton needs a GPU or TRITON_INTERPRET=1 set before triton was imported",
        ),
    ),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 256 tokens over a 2000-entry vocabulary: the mean's 1/N times a probability (~1/V) is ~2e-6, below
# fp16's smallest normal number; grad_output = 1.001 is not a bf16 number (it would round to 1.0).
TOKENS, HIDDEN, VOCAB = 256, 64, 2000


@pytest.fixture(params=BACKENDS)
def kernel_backend(request, monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", request.param)
    return request.param


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN**-0.5
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels[:20] = -100
    low = [t.to(DEVICE, dtype).requires_grad_() for t in (hidden, weight)]
    exact = [t.to(DEVICE, dtype).double().requires_grad_() for t in (hidden, weight)]  # same values
    return low, exact, labels.to(DEVICE)


def exact_grads(exact, labels, grad_output):
    hidden, weight = exact
    loss = F.cross_entropy(hidden @ weight.t(), labels)
    return loss, torch.autograd.grad(loss * grad_output, (hidden, weight))


def scale_and_error(got, want):
    got, want = got.double().flatten(), want.double().flatten()
    scale = float(got @ want / (want @ want))
    error = float((got - want).norm() / want.norm())
    return scale, error


def check_grads(got_grads, want_grads, tol):
    for got, want in zip(got_grads, want_grads, strict=True):
        assert torch.isfinite(got).all()
        scale, error = scale_and_error(got, want)
        assert abs(scale - 1) < tol and error < 2 * tol, (scale, error)


def run(low, labels, grad_output, **kwargs):
    loss = fused_linear_cross_entropy(*low, labels, **kwargs)
    wrt = [t for t in low if t.requires_grad]
    grads = torch.autograd.grad(loss, wrt, torch.tensor(grad_output, device=DEVICE))
    return loss, grads


@pytest.mark.parametrize("trainable", [True, False])
def test_fp16_gradients_keep_their_precision(kernel_backend, trainable):
    low, exact, labels = inputs(torch.float16)
    low[1].requires_grad_(trainable)
    loss, got = run(low, labels, 1.0, chunk_rows=64, vocab_block=512)
    want_loss, want = exact_grads(exact, labels, 1.0)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-4, atol=0)
    # fp16 rounds at 2^-11 relative: a flushed or mis-scaled gradient is far outside 5e-4.
    check_grads(got if trainable else got[:1], want if trainable else want[:1], 5e-4)


def test_fp16_gradscaler_scale_does_not_overflow(kernel_backend):
    low, exact, labels = inputs(torch.float16)
    _, got = run(low, labels, 65536.0, chunk_rows=64, vocab_block=512)  # GradScaler's initial scale
    _, want = exact_grads(exact, labels, 65536.0)
    check_grads(got, want, 5e-4)


def test_bf16_gradients_share_one_fp32_scale():
    low, exact, labels = inputs(torch.bfloat16)
    _, got = run(low, labels, 1.001, vocab_block=512)
    _, want = exact_grads(exact, labels, 1.001)
    # bf16 rounds at 2^-8, but the least-squares scale over 16k values averages that out: a factor of
    # 1.001 rounded to bf16's 1.0 on one gradient and not the other is a 1e-3 difference.
    scales = [scale_and_error(g, w)[0] for g, w in zip(got, want, strict=True)]
    assert all(abs(s - 1) < 1e-3 for s in scales) and abs(scales[0] - scales[1]) < 2e-4, scales


def test_second_backward_raises_a_clear_error(kernel_backend):
    low, exact, labels = inputs(torch.float32)
    loss = fused_linear_cross_entropy(*low, labels, chunk_rows=64, vocab_block=512)
    loss.backward(retain_graph=True)
    _, want = exact_grads(exact, labels, 1.0)
    check_grads([low[0].grad, low[1].grad], want, 1e-5)
    with pytest.raises(RuntimeError, match="second backward through the same loss is not supported"):
        loss.backward()


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -5])
def test_labels_outside_the_vocabulary_raise(kernel_backend, bad):
    if DEVICE == "cuda":  # a device-side assert ends the CUDA context: check it in a process of its own
        code = (
            "import torch; from liger_kernels import fused_linear_cross_entropy as f\n"
            f"labels = torch.zeros(8, dtype=torch.long, device='cuda'); labels[3] = {bad}\n"
            "h, w = torch.randn(8, 16, device='cuda'), torch.randn(100, 16, device='cuda')\n"
            "f(h, w, labels); torch.cuda.synchronize()"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and "assert" in done.stderr.lower(), done.stderr[-2000:]
        return
    low, _, labels = inputs(torch.float32)
    labels[7] = bad
    with pytest.raises(RuntimeError, match=rf"labels must be in \[0, {VOCAB}\)"):
        fused_linear_cross_entropy(*low, labels, chunk_rows=64)
    logits = torch.randn(TOKENS, VOCAB, device=DEVICE, requires_grad=True)
    with pytest.raises((RuntimeError, IndexError)):
        cross_entropy(logits, labels)


def test_labels_check_does_not_synchronise(monkeypatch):
    """The label check is a device-side assert (torch._assert_async), not a host round trip."""
    low, _, labels = inputs(torch.float32)
    calls = []
    real = torch._assert_async
    monkeypatch.setattr(torch, "_assert_async", lambda *a: calls.append(a) or real(*a))
    fused_linear_cross_entropy(*low, labels)
    assert len(calls) == 1 and isinstance(calls[0][0], torch.Tensor)
