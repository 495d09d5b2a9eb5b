"""fused_linear_divergence (distillation's kernel) against the plain formula written here: both models'
full logits, log_softmax and F.kl_div, exactly as TRL's GKDTrainer.generalized_jsd_loss defines the
generalized JSD (m = (1 - beta) p_s + beta p_t; beta 0 is KL(p_t || p_s), beta 1 KL(p_s || p_t)).

The PyTorch path in float64 to 1e-10 (and torch.autograd.gradcheck on its backward), in float32 and
under bf16 autocast; the Triton path under Triton's CPU interpreter (TRITON_INTERPRET=1: fp32/fp16,
tiny shapes and tiles, since each interpreted program costs milliseconds). The batch has prompt
positions and padding at -100, and the vocabulary (37) is not a multiple of the block (8).
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
from liger_kernels import fused_linear_divergence  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

distill_module = importlib.import_module("liger_kernels.fused_linear_distill")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, SEQ, HIDDEN, TEACHER_HIDDEN, VOCAB, BLOCK = 3, 7, 8, 6, 37, 8
N_LEARNED = 11  # targets that are not -100 after the shift (see `labels`)
# (loss, beta): reverse KL, and the generalized JSD at both limits and inside.
CASES = [("reverse_kl", 0.5), ("jsd", 0.0), ("jsd", 0.1), ("jsd", 0.5), ("jsd", 0.9), ("jsd", 1.0)]


def labels(seed=0):
    """[BATCH, SEQ]: a prompt and right padding at -100; after the shift 5 + 4 + 2 = 11 targets."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    out[0, :2] = -100  # labels 2..6 learned (positions 1..5 predict them)
    out[1, :2], out[1, 6:] = -100, -100  # labels 2..5
    out[2, :4], out[2, 6:] = -100, -100  # labels 4..5
    return out.to(DEVICE)


def inputs(dtype=torch.float32, seed=0, trainable=True, scale=1.0):
    """Student (hidden, weight, bias) and teacher (hidden, weight, bias): the teacher has its own
    hidden size, and its logits are spread differently from the student's."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(BATCH, SEQ, HIDDEN, generator=g) * scale
    ws = torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN**-0.5
    bs = torch.randn(VOCAB, generator=g) * 0.1
    ht = torch.randn(BATCH, SEQ, TEACHER_HIDDEN, generator=g) * scale
    wt = torch.randn(VOCAB, TEACHER_HIDDEN, generator=g) * 2 * TEACHER_HIDDEN**-0.5
    bt = torch.randn(VOCAB, generator=g) * 0.1
    hs, ws, bs, ht, wt, bt = (t.to(DEVICE, dtype) for t in (hs, ws, bs, ht, wt, bt))
    return (hs.requires_grad_(), ws.requires_grad_(trainable), bs.requires_grad_(trainable)), (ht, wt, bt)


def formula(student, teacher, targets, loss, beta, temperature):
    """float64, written independently of the kernel, TRL's formula: position t predicts labels[t + 1]."""
    (hs, ws, bs), (ht, wt, bt) = ([t.double() for t in pair] for pair in (student, teacher))
    log_ps = (F.linear(hs[:, :-1], ws, bs) / temperature).log_softmax(-1)
    log_pt = (F.linear(ht[:, :-1], wt, bt) / temperature).log_softmax(-1)
    if loss == "reverse_kl" or beta == 1.0:  # F.kl_div(input, target) = sum target (log target - input)
        div = F.kl_div(log_pt, log_ps, reduction="none", log_target=True)
    elif beta == 0.0:
        div = F.kl_div(log_ps, log_pt, reduction="none", log_target=True)
    else:
        log_m = torch.logsumexp(torch.stack([log_ps + math.log(1 - beta), log_pt + math.log(beta)]), 0)
        kl_teacher = F.kl_div(log_m, log_pt, reduction="none", log_target=True)
        kl_student = F.kl_div(log_m, log_ps, reduction="none", log_target=True)
        div = beta * kl_teacher + (1 - beta) * kl_student
    learned = targets[:, 1:] != -100
    return F.pad(div.sum(-1) * learned, (0, 1))  # the last position predicts nothing


def upstream(seed=3):
    """A different upstream gradient per position, both signs (a per-token loss's)."""
    return (torch.randn(BATCH, SEQ, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE)


def run(student, teacher, targets, loss, beta, temperature=1.0, **options):
    return fused_linear_divergence(
        student[0], student[1], teacher[0], teacher[1], targets, loss=loss, beta=beta,
        temperature=temperature, student_bias=student[2], teacher_bias=teacher[2], **options,
    )  # fmt: skip


def check_against_formula(student, teacher, loss, beta, temperature, trainable, tol, **options):
    targets = labels()
    got, learned = run(student, teacher, targets, loss, beta, temperature, **options)
    want = formula(student, teacher, targets, loss, beta, temperature)
    assert learned.sum().item() == N_LEARNED and (got[~learned] == 0).all()
    assert (want[learned] > 0).all()  # the models differ: every learned position diverges
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    wrt = list(student) if trainable else [student[0]]
    exact = [t.detach().double().requires_grad_() for t in wrt]
    exact_student = exact if trainable else [exact[0], student[1].detach(), student[2].detach()]
    g = upstream()
    want_grads = torch.autograd.grad(
        formula(exact_student, teacher, targets, loss, beta, temperature), exact, g.double()
    )
    for got_grad, want_grad in zip(torch.autograd.grad(got, wrt, g.to(got.dtype)), want_grads, strict=True):
        assert got_grad.dtype == wrt[0].dtype
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=tol, atol=tol)
    return got


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")


@pytest.fixture
def triton_backend(monkeypatch):
    """Tiles of 256 elements and 16 columns per loop step: every loop of the kernel runs several times."""
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "triton")
    monkeypatch.setattr(backend, "tile_elements", lambda: 256)
    monkeypatch.setattr(distill_module, "MAX_BLOCK_V", 16)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize(("loss", "beta"), CASES, ids=[f"{loss}-{beta}" for loss, beta in CASES])
def test_float64_matches_the_formula_with_every_gradient(torch_backend, loss, beta, trainable, temperature):
    """In float64 the PyTorch path computes in float64: agreement to rounding, values and gradients
    (hidden states always, weight and bias when the head trains), blocks of 8 over a vocabulary of 37."""
    student, teacher = inputs(torch.float64, trainable=trainable)
    got = check_against_formula(
        student, teacher, loss, beta, temperature, trainable, 1e-10, vocab_block=BLOCK
    )
    assert got.dtype == torch.float64
    if not trainable:
        assert student[1].grad is None and student[2].grad is None


@pytest.mark.parametrize(("loss", "beta"), [("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0)])
def test_gradcheck(torch_backend, loss, beta):
    """torch.autograd.gradcheck: the backward's Jacobian against finite differences of the forward."""
    student, teacher = inputs(torch.float64, scale=0.5)
    targets = labels()

    def divergence(hs, ws, bs):
        return run((hs, ws, bs), teacher, targets, loss, beta, 0.8, vocab_block=BLOCK)[0]

    assert torch.autograd.gradcheck(divergence, student, eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block-8", "one-block"])
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize(("loss", "beta"), [("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.0)])
def test_float32_matches_the_formula(torch_backend, loss, beta, trainable, block):
    student, teacher = inputs(trainable=trainable)
    got = check_against_formula(student, teacher, loss, beta, 0.7, trainable, 2e-5, vocab_block=block)
    assert got.dtype == torch.float32


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize(("loss", "beta"), [("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0)])
def test_triton_matches_the_formula(triton_backend, loss, beta, trainable):
    """Chunks of 4 rows (11 rows: the last chunk has 3), columns in loop steps of 16 (37: a tail of 5)."""
    student, teacher = inputs(trainable=trainable)
    check_against_formula(student, teacher, loss, beta, 0.7, trainable, 2e-5, chunk_rows=4)


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_fp16_gradients_keep_their_precision(kernel_backend, monkeypatch):
    """fp16 inputs against the float64 formula on the same fp16 values; upstream gradients of a mean
    over tokens (~1e-2) times a GradScaler's 65536: nothing flushed, overflowed or mis-scaled."""
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", kernel_backend)
    monkeypatch.setattr(backend, "tile_elements", lambda: 256)
    student, teacher = inputs(torch.float16)
    targets = labels()
    got, _ = run(student, teacher, targets, "jsd", 0.5, vocab_block=BLOCK, chunk_rows=4)
    want = formula(student, teacher, targets, "jsd", 0.5, 1.0)
    torch.testing.assert_close(got.double(), want, rtol=5e-3, atol=2e-3)
    g = upstream() * 1e-2 * 65536
    exact = [t.detach().double().requires_grad_() for t in student]
    want_grads = torch.autograd.grad(formula(exact, teacher, targets, "jsd", 0.5, 1.0), exact, g.double())
    for got_grad, want_grad in zip(torch.autograd.grad(got, student, g), want_grads, strict=True):
        assert got_grad.dtype == torch.float16 and torch.isfinite(got_grad).all()
        got_grad, want_grad = got_grad.double().flatten(), want_grad.flatten()
        scale = float(got_grad @ want_grad / (want_grad @ want_grad))  # a wrong factor moves it
        error = float((got_grad - want_grad).norm() / want_grad.norm())  # flushed values move it
        assert abs(scale - 1) < 5e-3 and error < 1e-2, (scale, error)


@pytest.mark.parametrize(("loss", "beta"), [("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.0)])
def test_a_student_equal_to_its_teacher_diverges_nowhere(torch_backend, loss, beta):
    student, _ = inputs()
    teacher = tuple(t.detach() for t in student)
    got, _ = run(student, teacher, labels(), loss, beta, vocab_block=BLOCK)
    assert got.abs().max().item() < 1e-6
    for grad in torch.autograd.grad(got, student, upstream()):
        assert grad.abs().max().item() < 1e-6


class MatmulLog(TorchDispatchMode):
    """Records every matmul's operand shapes and dtypes, and the shape of every tensor an op allocates
    (views of its inputs, such as the teacher's detached weight, allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.matmuls, self.largest, self.shapes = [], 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2], args[-1]
            self.matmuls.append((tuple(a.shape), tuple(b.shape), a.dtype))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
def test_no_logits_and_nothing_of_the_teachers_size(torch_backend, trainable):
    """Only learned rows reach a matmul; no tensor of [rows, vocab] logits; nothing of the teacher's
    weight's size; a frozen student head gets nothing of its weight's size either. Matmuls per block:
    frozen 6 (both models' logits in two passes, u @ W and p_s @ W), trainable 8 (both logits in two
    passes forward; both logits, grad_hidden and grad_weight backward)."""
    student, teacher = inputs(trainable=trainable)
    n_blocks = math.ceil(VOCAB / BLOCK)
    with MatmulLog() as log:
        got, _ = run(student, teacher, labels(), "jsd", 0.5, vocab_block=BLOCK)
        got.backward(upstream())
    assert log.matmuls and all(N_LEARNED in a + b for a, b, _ in log.matmuls)
    assert len(log.matmuls) == 8 * n_blocks if trainable else 6 * n_blocks
    assert log.largest < N_LEARNED * VOCAB and log.largest < BATCH * SEQ * VOCAB
    assert log.largest == (VOCAB * HIDDEN if trainable else BATCH * SEQ * HIDDEN)  # grad_weight, grad_hidden
    assert (VOCAB, TEACHER_HIDDEN) not in log.shapes and (TEACHER_HIDDEN, VOCAB) not in log.shapes
    assert ((VOCAB, HIDDEN) in log.shapes) == trainable
    assert all(t.grad is None for t in teacher)
    assert (student[1].grad is not None) == trainable


def test_no_grad_evaluation_makes_two_logit_passes(torch_backend):
    student, teacher = inputs()
    with MatmulLog() as log, torch.no_grad():
        got, _ = run(student, teacher, labels(), "reverse_kl", 0.5, vocab_block=BLOCK)
    assert not got.requires_grad
    assert len(log.matmuls) == 4 * math.ceil(VOCAB / BLOCK)  # each model's logits, twice


def test_no_host_synchronisation_in_the_loops(torch_backend, monkeypatch):
    student, teacher = inputs()
    targets = labels()

    def refuse(*args, **kwargs):
        raise AssertionError("host synchronisation in the divergence's hot path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got, _ = run(student, teacher, targets, "jsd", 0.5, vocab_block=BLOCK)
    got.backward(upstream())
    monkeypatch.undo()
    # float32 against the float64 formula: float32's tolerance, as test_float32_matches_the_formula (float64's
    # default 1e-7 held on AMD EPYC by luck; a Xeon with AMX computes it 1.7e-7 away)
    want = formula(student, teacher, targets, "jsd", 0.5, 1.0)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


def test_autocast_runs_the_matmuls_in_the_autocast_dtype(torch_backend):
    student, teacher = inputs()
    targets = labels()
    with MatmulLog() as log, torch.autocast(DEVICE, dtype=torch.bfloat16):
        got, _ = run(student, teacher, targets, "reverse_kl", 0.5, vocab_block=BLOCK)
    assert log.matmuls and {dtype for *_, dtype in log.matmuls} == {torch.bfloat16}
    assert got.dtype == torch.float32
    grads = torch.autograd.grad(got, student, upstream())
    assert [g.dtype for g in grads] == [torch.float32] * 3  # the master weights' dtype
    # Close to the formula on the bf16-rounded values, and not equal to the fp32 result.
    rounded = [tuple(t.bfloat16() for t in pair) for pair in (student, teacher)]
    torch.testing.assert_close(
        got.double(), formula(*rounded, targets, "reverse_kl", 0.5, 1.0), rtol=2e-2, atol=2e-2
    )
    assert not torch.equal(got, run(student, teacher, targets, "reverse_kl", 0.5, vocab_block=BLOCK)[0])


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
def test_nothing_learned_anywhere_is_zero_without_nan(torch_backend, trainable):
    student, teacher = inputs(trainable=trainable)
    targets = torch.full((BATCH, SEQ), -100, device=DEVICE)
    got, learned = run(student, teacher, targets, "jsd", 0.5)
    assert got.tolist() == [[0.0] * SEQ] * BATCH and not learned.any()
    wrt = list(student) if trainable else [student[0]]
    for grad in torch.autograd.grad(got, wrt, upstream()):
        assert torch.count_nonzero(grad) == 0 and not grad.isnan().any()


def test_frozen_head_second_backward_raises_a_clear_error(torch_backend):
    student, teacher = inputs(trainable=False)
    got, _ = run(student, teacher, labels(), "reverse_kl", 0.5)
    got.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        got.sum().backward()


def test_bad_arguments_raise_one_clear_error():
    (hs, ws, bs), (ht, wt, bt) = inputs()
    targets = labels()
    with pytest.raises(ValueError, match=r"loss='kl' is not one of \('reverse_kl', 'jsd'\)"):
        fused_linear_divergence(hs, ws, ht, wt, targets, loss="kl")
    with pytest.raises(ValueError, match=r"beta=1.5 must be between 0.0 and 1.0"):
        fused_linear_divergence(hs, ws, ht, wt, targets, loss="jsd", beta=1.5)
    with pytest.raises(ValueError, match="temperature must be above 0"):
        fused_linear_divergence(hs, ws, ht, wt, targets, temperature=0.0)
    with pytest.raises(ValueError, match=r"labels must be \[batch, seq\]"):
        fused_linear_divergence(hs, ws, ht, wt, targets.view(-1))
    with pytest.raises(ValueError, match="shapes do not fit: teacher_hidden"):
        fused_linear_divergence(hs, ws, ht[:, :-1], wt, targets)
    with pytest.raises(ValueError, match="student_bias"):
        fused_linear_divergence(hs, ws, ht, wt, targets, student_bias=bs[:-1])
    with pytest.raises(ValueError, match=r"vocabulary \(37\) and the teacher's \(36\) differ"):
        fused_linear_divergence(hs, ws, ht, wt[:-1], targets)
    with pytest.raises(ValueError, match="teacher_hidden is torch.float32 but teacher_weight torch.bfloat16"):
        fused_linear_divergence(hs, ws, ht, wt.bfloat16(), targets)


def test_the_reference_the_benchmark_measures_is_this_formula():
    """bench/distill_kernel.py's baseline (`fused_linear_divergence_reference`, shipped beside the kernel)
    computes the divergence written here, for every loss and beta, in float64."""
    every = torch.zeros(BATCH, SEQ, dtype=torch.long, device=DEVICE)  # every position learned
    (hs, ws, bs), (ht, wt, bt) = (
        [t.detach().double() for t in pair] for pair in inputs(torch.float64, scale=2.0)
    )
    for loss, beta in CASES:
        want = formula((hs, ws, bs), (ht, wt, bt), every, loss, beta, 0.7)[:, :-1].reshape(-1)
        student, teacher = hs[:, :-1].reshape(-1, HIDDEN), ht[:, :-1].reshape(-1, TEACHER_HIDDEN)
        got = distill_module.fused_linear_divergence_reference(
            student, ws, teacher, wt, loss, beta, 0.7, bs, bt
        )
        assert got.dtype == torch.float32  # its logits in fp32, as the bench's unfused baseline computes them
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=f"{loss} beta {beta}")
