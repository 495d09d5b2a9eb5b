"""fused_linear_logprob against the plain formula in float64 (full logits, log_softmax, gather, sum
over each sequence's learned positions), on the PyTorch path and on the Triton path (Triton's CPU
interpreter here, TRITON_INTERPRET=1: fp32/fp16 only, its bf16 is wrong; tiny shapes, since each
interpreted program costs milliseconds).

The batch has what preference data has: prompt positions at -100, right padding at -100, answers
of unequal length, and one sequence with no learned token at all. The upstream gradient differs
per sequence (and has both signs), as a preference loss's does.
"""

from __future__ import annotations

import importlib
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (also in conftest.py)

import liger_kernels._backend as backend  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from liger_kernels import fused_linear_logprob  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ce_module = importlib.import_module("liger_kernels.cross_entropy")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TRITON = pytest.param(
    "triton",
    marks=pytest.mark.skipif(
        not CUDA and not backend.interpreting(),
        reason="Triton needs a GPU or TRITON_INTERPRET=1 set before triton was imported",
    ),
)
BATCH, SEQ, HIDDEN, VOCAB = 4, 9, 24, 257  # vocab 257: blocks with a 1-column tail


@pytest.fixture(params=["torch", TRITON])
def kernel_backend(request, monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", request.param)
    if request.param == "triton":  # tiles of 256 elements, vocab blocks of 128: the kernel's loops run
        monkeypatch.setattr(backend, "tile_elements", lambda: 256)
        monkeypatch.setattr(ce_module, "MAX_BLOCK_V", 128)
    return request.param


def preference_labels(seed=0, vocab=VOCAB):
    """[BATCH, SEQ] labels: a prompt at -100, an answer, right padding at -100; the last sequence
    has no learned token (after the shift: only its first label, which nothing predicts, is set)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[0, :3] = -100  # prompt, then 6 answer tokens
    labels[1, :2], labels[1, 6:] = -100, -100  # prompt, 4 answer tokens, padding
    labels[2, :5], labels[2, 7:] = -100, -100  # a 2-token answer
    labels[3, 1:] = -100  # nothing learned
    return labels.to(DEVICE)


def inputs(dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN**-0.5
    tensors = [hidden, weight] + ([torch.randn(VOCAB, generator=g) * 0.1] if bias else [])
    return [t.to(DEVICE, dtype).requires_grad_() for t in tensors]


def exact_logprob(hidden, weight, labels, bias=None):
    """float64, written independently of the kernel: position t predicts labels[:, t + 1]."""
    logits = F.linear(hidden[:, :-1].double(), weight.double(), None if bias is None else bias.double())
    targets = labels[:, 1:]
    learned = targets != -100
    token = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * learned).sum(-1), learned.sum(-1)


def upstream(n=BATCH, seed=3):
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE)


def grads_of(out, wrt, grad):
    return torch.autograd.grad(out, wrt, grad)


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("block", [7, 64, None], ids=lambda b: f"block-{b}")
def test_matches_float64_formula_with_every_gradient(kernel_backend, trainable, block):
    hidden, weight, bias = inputs()
    weight.requires_grad_(trainable)
    bias.requires_grad_(trainable)
    labels = preference_labels()
    # `block` is the vocabulary block on the PyTorch path and the rows per chunk on Triton's.
    kwargs = {"vocab_block": block} if kernel_backend == "torch" else {"chunk_rows": block and block // 7}
    got, count = fused_linear_logprob(hidden, weight, labels, bias, **kwargs)
    want, want_count = exact_logprob(hidden, weight, labels, bias)
    assert got.dtype == torch.float32 and count.dtype == torch.int64
    assert count.tolist() == want_count.tolist() == [6, 4, 2, 0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert got[3].item() == 0.0

    wrt = [hidden, weight, bias] if trainable else [hidden]
    g = upstream()
    exact_wrt = [t.detach().double().requires_grad_() for t in wrt]
    exact_all = exact_wrt + ([] if trainable else [weight.detach().double(), bias.detach().double()])
    exact_grads = grads_of(
        exact_logprob(exact_all[0], exact_all[1], labels, exact_all[2])[0], exact_wrt, g.double()
    )
    for got_grad, exact in zip(grads_of(got, wrt, g), exact_grads, strict=True):
        assert got_grad.dtype == torch.float32
        torch.testing.assert_close(got_grad.double(), exact, rtol=1e-5, atol=1e-6)
    if not trainable:
        assert weight.grad is None and bias.grad is None


def test_frozen_weight_with_trainable_bias(kernel_backend):
    """Only the bias trains: its gradient is right and the weight still gets none."""
    hidden, weight, bias = inputs()
    weight.requires_grad_(False)
    labels = preference_labels()
    got, _ = fused_linear_logprob(hidden, weight, labels, bias, vocab_block=64, chunk_rows=4)
    g = upstream()
    exact = [t.detach().double().requires_grad_() for t in (hidden, bias)]
    want = exact_logprob(exact[0], weight.detach(), labels, exact[1])[0]
    got.backward(g)
    assert weight.grad is None
    for got_grad, want_grad in zip((hidden.grad, bias.grad), grads_of(want, exact, g.double()), strict=True):
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_positions_that_predict_nothing_get_exactly_zero_gradient(kernel_backend):
    hidden, weight, bias = inputs()
    labels = preference_labels()
    got, _ = fused_linear_logprob(hidden, weight, labels, bias)
    (grad,) = torch.autograd.grad(got, hidden, upstream())
    predicts = F.pad(labels[:, 1:], (0, 1), value=-100) != -100  # hidden t predicts labels[t + 1]
    assert torch.count_nonzero(grad[~predicts]) == 0
    assert (grad[predicts].abs().sum(-1) > 0).all()


def test_unshifted_labels_align_with_hidden(kernel_backend):
    hidden, weight, bias = inputs()
    labels = preference_labels()
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    a, count_a = fused_linear_logprob(hidden, weight, labels, bias)
    b, count_b = fused_linear_logprob(hidden, weight, shifted, bias, shift=False)
    torch.testing.assert_close(a, b)
    assert count_a.tolist() == count_b.tolist()


def test_flat_hidden_is_accepted():
    hidden, weight, bias = inputs()
    labels = preference_labels()
    a, _ = fused_linear_logprob(hidden, weight, labels, bias)
    b, _ = fused_linear_logprob(hidden.reshape(BATCH * SEQ, HIDDEN), weight, labels, bias)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
def test_nothing_learned_anywhere_is_zero_without_nan(kernel_backend, trainable):
    hidden, weight, bias = inputs()
    weight.requires_grad_(trainable)
    labels = torch.full((BATCH, SEQ), -100, device=DEVICE)
    labels[:, 0] = 5  # the first label is never a target
    got, count = fused_linear_logprob(hidden, weight, labels, bias)
    assert got.tolist() == [0.0] * BATCH and count.tolist() == [0] * BATCH
    wrt = [hidden, weight, bias] if trainable else [hidden, bias]
    for grad in grads_of(got, wrt, upstream()):
        assert torch.count_nonzero(grad) == 0 and not grad.isnan().any()


class MatmulLog(TorchDispatchMode):
    """Records every matmul's operand shapes and dtypes, and the largest tensor any op makes."""

    def __init__(self):
        super().__init__()
        self.matmuls, self.largest = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2], args[-1]
            self.matmuls.append((tuple(a.shape), tuple(b.shape), a.dtype))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
def test_only_learned_rows_reach_the_head_in_blocks(trainable, monkeypatch):
    """Prompt and padding rows never reach a matmul; no [tokens, vocab] logits; a frozen head gets no
    tensor of the weight's size (no weight-gradient allocation at all)."""
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")
    hidden, weight = inputs(bias=False)
    weight.requires_grad_(trainable)
    labels = preference_labels()
    n_learned, block = 12, 32
    with MatmulLog() as log:
        got, _ = fused_linear_logprob(hidden, weight, labels, vocab_block=block)
        got.backward(upstream())
    # Every matmul involves the 12 learned rows (h [12, H] @ W_block.T, probs [12, block] @ W_block,
    # probs.T [block, 12] @ h) and none the 36 positions of the batch.
    assert log.matmuls and all(n_learned in a for a, _, _ in log.matmuls)
    assert not any(BATCH * SEQ in a + b for a, b, _ in log.matmuls)
    if trainable:
        assert log.largest == VOCAB * HIDDEN  # grad_weight, the floor
        assert weight.grad is not None
    else:
        assert log.largest < VOCAB * HIDDEN and log.largest < n_learned * VOCAB
        assert weight.grad is None
    assert log.largest < BATCH * SEQ * VOCAB


def test_autocast_runs_the_matmuls_in_the_autocast_dtype(monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")
    hidden, weight = inputs(bias=False)
    labels = preference_labels()
    with MatmulLog() as log, torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = fused_linear_logprob(hidden, weight, labels, vocab_block=64)
    assert log.matmuls and {dtype for *_, dtype in log.matmuls} == {torch.bfloat16}
    grads = torch.autograd.grad(got, (hidden, weight), upstream())
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]  # the master weights' dtype
    # Close to the formula on the bf16-rounded values, and not equal to the fp32 result.
    want, _ = exact_logprob(hidden.bfloat16(), weight.bfloat16(), labels)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=5e-2)
    assert not torch.equal(got, fused_linear_logprob(hidden, weight, labels, vocab_block=64)[0])


def test_no_host_synchronisation_in_the_loops(monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")
    hidden, weight, bias = inputs()
    labels = preference_labels()

    def refuse(*args, **kwargs):
        raise AssertionError("host synchronisation in the log-prob hot path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got, _ = fused_linear_logprob(hidden, weight, labels, bias, vocab_block=64)
    got.backward(upstream())
    monkeypatch.undo()
    torch.testing.assert_close(got.double(), exact_logprob(hidden, weight, labels, bias)[0])


def test_frozen_head_second_backward_raises_a_clear_error():
    hidden, weight = inputs(bias=False)
    weight.requires_grad_(False)
    got, _ = fused_linear_logprob(hidden, weight, preference_labels())
    got.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        got.sum().backward()


def test_no_grad_evaluation_computes_no_gradient(monkeypatch):
    """Under torch.no_grad (a reference model's pass) only the log-sum-exp pass runs."""
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")
    hidden, weight, bias = inputs()
    with MatmulLog() as log, torch.no_grad():
        got, _ = fused_linear_logprob(hidden, weight, preference_labels(), bias, vocab_block=64)
    assert not got.requires_grad
    assert len(log.matmuls) == math.ceil(VOCAB / 64)  # one matmul per block, nothing else


def test_bad_arguments_raise():
    hidden, weight, bias = inputs()
    labels = preference_labels()
    with pytest.raises(ValueError, match=r"labels must be \[batch, seq\]"):
        fused_linear_logprob(hidden, weight, labels.view(-1))
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_linear_logprob(hidden[:, :-1], weight, labels)
    with pytest.raises(ValueError, match="bias"):
        fused_linear_logprob(hidden, weight, labels, bias[:-1])
    bad = labels.clone()
    bad[0, 5] = VOCAB
    if DEVICE == "cpu":  # on CUDA a device-side assert (as FLCE's test checks in a process of its own)
        with pytest.raises(RuntimeError, match=rf"labels must be in \[0, {VOCAB}\)"):
            fused_linear_logprob(hidden, weight, bad)


# --- fp16 / bf16 numerics, as tests/test_flce_numerics.py checks FLCE --------------------------


def scale_and_error(got, want):
    """The least-squares scale of got against want (a wrong factor moves it) and the relative error
    norm (flushed or imprecise values move it)."""
    got, want = got.double().flatten(), want.double().flatten()
    return float(got @ want / (want @ want)), float((got - want).norm() / want.norm())


def low_precision_case(dtype, trainable, grad_scale):
    """fp16/bf16 inputs, the float64 formula on the same values; upstream gradients as a DPO loss
    gives them (beta * sigmoid / pairs: ~1e-3), times a GradScaler-like factor, both signs."""
    low = inputs(dtype, bias=False)
    low[1].requires_grad_(trainable)
    labels = preference_labels()
    g = torch.tensor([1e-3, -2.5e-3, 7e-4, 1e-3], device=DEVICE) * grad_scale
    exact = [t.detach().double().requires_grad_() for t in low]
    want, _ = exact_logprob(*exact, labels)
    wrt = [0, 1] if trainable else [0]
    want_grads = torch.autograd.grad(want, [exact[i] for i in wrt], g.double())
    return low, labels, g, want, want_grads, wrt


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("grad_scale", [1.0, 65536.0], ids=["plain", "gradscaler"])
def test_fp16_gradients_keep_their_precision(kernel_backend, trainable, grad_scale):
    low, labels, g, want, want_grads, wrt = low_precision_case(torch.float16, trainable, grad_scale)
    got, _ = fused_linear_logprob(*low, labels, vocab_block=64, chunk_rows=4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)
    got_grads = torch.autograd.grad(got, [low[i] for i in wrt], g)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert got_grad.dtype == torch.float16 and torch.isfinite(got_grad).all()
        scale, error = scale_and_error(got_grad, want_grad)
        # fp16 rounds at 2^-11 relative: a flushed (1e-3 * 1/V is below fp16's normal range) or
        # mis-scaled gradient is far outside these.
        assert abs(scale - 1) < 1e-3 and error < 2e-3, (scale, error)


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
def test_bf16_gradients_are_close_to_the_formula(trainable, monkeypatch):
    if not CUDA:
        monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")  # the interpreter's bf16 is wrong
    low, labels, g, want, want_grads, wrt = low_precision_case(torch.bfloat16, trainable, 1.0)
    got, _ = fused_linear_logprob(*low, labels, vocab_block=64, chunk_rows=4)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=2e-2)
    got_grads = torch.autograd.grad(got, [low[i] for i in wrt], g)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert got_grad.dtype == torch.bfloat16 and torch.isfinite(got_grad).all()
        scale, error = scale_and_error(got_grad, want_grad)
        assert abs(scale - 1) < 5e-3 and error < 2e-2, (scale, error)  # bf16 rounds at 2^-9 on average


def test_fp16_large_upstream_gradient_does_not_overflow(kernel_backend):
    """A GradScaler's scale grows (x2 every 2000 clean steps): an upstream gradient of 1.3e5 must not
    overflow the fp16 gradient of the logits (fp16 ends at 65504) when the results themselves fit."""
    low = [t.detach().mul(0.01).requires_grad_() for t in inputs(torch.float16, bias=False)]
    labels = preference_labels()
    g = torch.tensor([131072.0, -65536.0, 98304.0, 1.0], device=DEVICE)
    got, _ = fused_linear_logprob(*low, labels, vocab_block=64, chunk_rows=4)
    got_grads = torch.autograd.grad(got, low, g)
    exact = [t.detach().double().requires_grad_() for t in low]
    want_grads = torch.autograd.grad(exact_logprob(*exact, labels)[0], exact, g.double())
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert torch.isfinite(got_grad).all()
        scale, error = scale_and_error(got_grad, want_grad)
        assert abs(scale - 1) < 1e-3 and error < 2e-3, (scale, error)
