"""The Triton paths of our kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1), against the
PyTorch reference paths and against autograd of the plain formulas in float64.

Shapes are awkward on purpose (hidden not a power of two, vocab not a multiple of the block, one row,
ignored rows) and small, since each interpreted program costs milliseconds. Tile sizes are lowered
in some tests so that the loops over row blocks and vocab blocks run more than once. bf16 arithmetic
is silently wrong in the interpreter, so bf16 is checked only on a GPU (those tests skip here).
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (also in conftest.py)

import liger_kernels._backend as backend  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from liger_kernels import apply_rope, cross_entropy, fused_linear_cross_entropy, rms_norm, swiglu  # noqa: E402
from liger_kernels.cross_entropy import cross_entropy_reference  # noqa: E402
from liger_kernels.rms_norm import rms_norm_reference  # noqa: E402
from liger_kernels.rope import rope_reference  # noqa: E402
from liger_kernels.swiglu import swiglu_reference  # noqa: E402

# The module itself: the package exports a function of the same name.
ce_module = importlib.import_module("liger_kernels.cross_entropy")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and not backend.interpreting(),
    reason="Triton needs a GPU or TRITON_INTERPRET=1 set before triton was imported",
)
gpu_only = pytest.mark.skipif(
    not CUDA, reason="bf16 arithmetic is silently wrong in Triton's CPU interpreter"
)
FLOAT_DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "triton")


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 256 elements and vocab blocks of 128, so row and vocab loops run several times."""
    monkeypatch.setattr(backend, "tile_elements", lambda: 256)
    monkeypatch.setattr(ce_module, "MAX_BLOCK_V", 128)


def leaf(*shape, dtype=torch.float32, seed=0):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.to(DEVICE).requires_grad_()


def upstream_like(t, seed=1):
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)).to(t.dtype).to(t.device)


def as_f64(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def check(got, want, tol):
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def check_against_references(fn, reference, formula, inputs, tol, grad_tol):
    """fn(*inputs) against reference(*inputs) (same dtype) and formula(*float64 inputs), with grads."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ups = [upstream_like(o, seed=i) for i, o in enumerate(outs)]
    got_grads = torch.autograd.grad(outs, inputs, ups)

    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    refs = reference(*ref_inputs)
    refs = refs if isinstance(refs, tuple) else (refs,)
    ref_grads = torch.autograd.grad(refs, ref_inputs, ups)

    f64_inputs = as_f64(*inputs)
    exact = formula(*f64_inputs)
    exact = exact if isinstance(exact, tuple) else (exact,)
    exact_grads = torch.autograd.grad(exact, f64_inputs, [u.double() for u in ups])

    for got, ref, ex in zip(outs, refs, exact, strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        check(got, ref, tol)
        check(got, ex, tol)
    for got, ref, ex in zip(got_grads, ref_grads, exact_grads, strict=True):
        check(got, ref, grad_tol)
        check(got, ex, grad_tol)


# --- rms_norm -----------------------------------------------------------------------------------


def rms_formula(offset):
    return lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w)


@pytest.mark.parametrize("dtype,tol", FLOAT_DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(3, 5, 96), (1, 48)])
def test_rms_norm(dtype, tol, offset, shape):
    x, w = leaf(*shape, dtype=dtype), leaf(shape[-1], dtype=dtype, seed=1)
    check_against_references(
        lambda x, w: rms_norm(x, w, 1e-6, offset),
        lambda x, w: rms_norm_reference(x, w, 1e-6, offset),
        rms_formula(offset),
        (x, w),
        tol,
        tol * 20,
    )


def test_rms_norm_row_loop(small_tiles):
    # 96 columns -> 128-wide tile, 2 rows per program, 11 row blocks over 4 persistent programs.
    x, w = leaf(21, 96), leaf(96, seed=1)
    check_against_references(
        lambda x, w: rms_norm(x, w, 1e-6),
        lambda x, w: rms_norm_reference(x, w, 1e-6),
        rms_formula(0.0),
        (x, w),
        1e-5,
        1e-4,
    )


# --- rope ---------------------------------------------------------------------------------------


def rope_formula(q, k, cos, sin):
    half = q.shape[-1] // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


@pytest.mark.parametrize("dtype,tol", FLOAT_DTYPES)
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rope_gqa(dtype, tol, cos_batch):
    # q arrives as transformers makes it: a transposed view [B, H, S, D] of [B, S, H, D].
    q = leaf(2, 5, 4, 12, dtype=dtype).detach().transpose(1, 2).requires_grad_()
    k = leaf(2, 2, 5, 12, dtype=dtype, seed=1)
    cos, sin = leaf(cos_batch, 5, 12, dtype=dtype, seed=2), leaf(cos_batch, 5, 12, dtype=dtype, seed=3)
    check_against_references(apply_rope, rope_reference, rope_formula, (q, k, cos, sin), tol, tol * 20)


def test_rope_one_token_one_head():
    q, k = leaf(1, 1, 1, 6), leaf(1, 1, 1, 6, seed=1)
    cos, sin = leaf(1, 1, 6, seed=2), leaf(1, 1, 6, seed=3)
    check_against_references(apply_rope, rope_reference, rope_formula, (q, k, cos, sin), 1e-5, 1e-5)


# --- swiglu -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 33), (1, 1)])
def test_swiglu(dtype, tol, shape):
    gate, up = leaf(*shape, dtype=dtype), leaf(*shape, dtype=dtype, seed=1)
    check_against_references(
        swiglu, swiglu_reference, lambda a, b: a * torch.sigmoid(a) * b, (gate, up), tol, tol * 2
    )


def test_swiglu_many_blocks(small_tiles):
    gate, up = leaf(5, 111), leaf(5, 111, seed=1)  # 555 elements in blocks of 256
    check_against_references(
        swiglu, swiglu_reference, lambda a, b: a * torch.sigmoid(a) * b, (gate, up), 1e-6, 1e-6
    )


# --- cross_entropy ------------------------------------------------------------------------------


def labels_with_ignored(shape, vocab, seed=0):
    labels = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    labels.view(-1)[: max(1, labels.numel() // 3)] = -100
    return labels.to(DEVICE)


def ce_formula(labels, reduction, smoothing):
    def formula(logits):
        flat = logits.reshape(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, labels.view(-1), reduction="none", label_smoothing=smoothing)
        n_valid = (labels != -100).sum().clamp(min=1)
        return {"mean": loss.sum() / n_valid, "sum": loss.sum(), "none": loss.view(labels.shape)}[reduction]

    return formula


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy(small_tiles, reduction, smoothing):
    logits = leaf(3, 7, 257)  # vocab 257: two full 128-blocks and a 1-column tail
    labels = labels_with_ignored((3, 7), 257)
    check_against_references(
        lambda x: cross_entropy(x, labels, reduction=reduction, label_smoothing=smoothing),
        lambda x: cross_entropy_reference(x, labels, reduction=reduction, label_smoothing=smoothing),
        ce_formula(labels, reduction, smoothing),
        (logits,),
        1e-5,
        1e-6,
    )


def test_cross_entropy_fp16_logits():
    logits = leaf(9, 257, dtype=torch.float16)
    labels = labels_with_ignored((9,), 257)
    check_against_references(
        lambda x: cross_entropy(x, labels),
        lambda x: cross_entropy_reference(x, labels),
        ce_formula(labels, "mean", 0.0),
        (logits,),
        1e-3,
        1e-3,
    )


def test_cross_entropy_one_row_and_all_ignored():
    logits = leaf(1, 257)
    label = torch.tensor([256], device=DEVICE)
    check(cross_entropy(logits, label), F.cross_entropy(logits, label), 1e-6)
    ignored = torch.tensor([-100], device=DEVICE)
    loss = cross_entropy(logits, ignored)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.item() == 0.0 and not torch.isnan(loss)
    assert torch.count_nonzero(grad) == 0


# --- fused linear cross-entropy -----------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_rows", [4, None])
def test_flce(small_tiles, reduction, smoothing, chunk_rows):
    hidden, weight, bias = leaf(2, 9, 48), leaf(257, 48, seed=1), leaf(257, seed=2)
    labels = labels_with_ignored((2, 9), 257)

    def formula(h, w, b):
        return ce_formula(labels, reduction, smoothing)(F.linear(h, w, b))

    check_against_references(
        lambda h, w, b: fused_linear_cross_entropy(h, w, labels, b, -100, reduction, smoothing, chunk_rows),
        lambda h, w, b: cross_entropy_reference(F.linear(h, w, b), labels, -100, reduction, smoothing),
        formula,
        (hidden, weight, bias),
        1e-5,
        1e-5,
    )


def test_flce_all_ignored_is_zero():
    hidden, weight = leaf(5, 16), leaf(257, 16, seed=1)
    labels = torch.full((5,), -100, device=DEVICE)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_rows=2)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads)


# --- bf16, on a GPU only ------------------------------------------------------------------------


@gpu_only
def test_bf16_kernels_on_gpu():
    x, w = leaf(4, 96, dtype=torch.bfloat16), leaf(96, dtype=torch.bfloat16, seed=1)
    check(rms_norm(x, w), rms_norm_reference(x.float(), w.float()), 2e-2)
    gate, up = leaf(4, 96, dtype=torch.bfloat16), leaf(4, 96, dtype=torch.bfloat16, seed=1)
    check(swiglu(gate, up), swiglu_reference(gate.float(), up.float()), 2e-2)
    q, k = leaf(2, 4, 5, 16, dtype=torch.bfloat16), leaf(2, 2, 5, 16, dtype=torch.bfloat16, seed=1)
    cos, sin = leaf(1, 5, 16, dtype=torch.bfloat16, seed=2), leaf(1, 5, 16, dtype=torch.bfloat16, seed=3)
    for got, want in zip(
        apply_rope(q, k, cos, sin),
        rope_reference(q.float(), k.float(), cos.float(), sin.float()),
        strict=True,
    ):
        check(got, want, 3e-2)
    logits, labels = leaf(9, 257, dtype=torch.bfloat16), labels_with_ignored((9,), 257)
    check(cross_entropy(logits, labels), cross_entropy_reference(logits.float(), labels), 1e-2)
    hidden, weight = leaf(9, 64, dtype=torch.bfloat16), leaf(257, 64, dtype=torch.bfloat16, seed=1)
    want = cross_entropy_reference(F.linear(hidden.float(), weight.float()), labels)
    check(fused_linear_cross_entropy(hidden, weight, labels, chunk_rows=4), want, 3e-2)


# --- bf16 forward and backward of every kernel, on a GPU only ---------------------------------


def _bf16_case(kernel):
    """(inputs, our function, the PyTorch reference) in bf16, shapes with loop tails."""
    bf16 = torch.bfloat16
    labels = labels_with_ignored((9,), 257)
    if kernel == "rms_norm":
        return [leaf(4, 96, dtype=bf16), leaf(96, dtype=bf16, seed=1)], rms_norm, rms_norm_reference
    if kernel == "swiglu":
        return [leaf(4, 96, dtype=bf16), leaf(4, 96, dtype=bf16, seed=1)], swiglu, swiglu_reference
    if kernel == "rope":
        q, k = leaf(2, 4, 5, 16, dtype=bf16), leaf(2, 2, 5, 16, dtype=bf16, seed=1)
        cos, sin = leaf(1, 5, 16, dtype=bf16, seed=2), leaf(1, 5, 16, dtype=bf16, seed=3)
        return [q, k, cos, sin], apply_rope, rope_reference
    if kernel == "cross_entropy":
        return (
            [leaf(9, 257, dtype=bf16)],
            lambda x: cross_entropy(x, labels),
            lambda x: cross_entropy_reference(x, labels),
        )
    return (
        [leaf(9, 64, dtype=bf16), leaf(257, 64, dtype=bf16, seed=1)],
        lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_rows=4),
        lambda h, w: cross_entropy_reference(F.linear(h, w), labels),
    )


@gpu_only
@pytest.mark.parametrize(
    "kernel", ["rms_norm", "swiglu", "rope", "cross_entropy", "fused_linear_cross_entropy"]
)
def test_bf16_forward_and_backward_on_gpu(kernel):
    """Triton in bf16 against the PyTorch reference run in fp32 on the same bf16 values."""
    inputs, fn, reference = _bf16_case(kernel)
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ups = [upstream_like(o, seed=i) for i, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, inputs, ups)
    f32 = [t.detach().float().requires_grad_() for t in inputs]
    refs = reference(*f32)
    refs = refs if isinstance(refs, tuple) else (refs,)
    ref_grads = torch.autograd.grad(refs, f32, [u.float() for u in ups])
    for got, want in [*zip(outs, refs, strict=True), *zip(grads, ref_grads, strict=True)]:
        assert got.dtype in (torch.bfloat16, torch.float32) and torch.isfinite(got).all()
        got, want = got.double(), want.double()
        error = float((got - want).norm() / want.norm().clamp(min=1e-12))
        assert error < 1e-2, (kernel, error)  # bf16 rounds at 2^-9 on average
