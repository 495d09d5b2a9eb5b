"""Preference objectives end to end: fused_linear_logprob + preference_loss against an eager float64
reference (full logits, log_softmax, gather, then each objective written out as TRL writes it), for
every objective and loss type: the per-pair loss and every gradient (hidden, lm_head weight when it
trains, bias). Plus the checks that caught other tools: the step-0 value, signs, sums against means,
label smoothing that must change the loss, and options a loss type cannot honour.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (also in conftest.py)

import liger_kernels._backend as backend  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from liger_kernels import check_preference_options, fused_linear_logprob, preference_loss  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PAIRS, SEQ, HIDDEN, VOCAB = 3, 10, 16, 131
BETA = {"dpo": 0.5, "simpo": 2.0, "orpo": 0.25}

CASES = [
    ("dpo", "sigmoid", {}),
    ("dpo", "sigmoid", {"label_smoothing": 0.1}),
    ("dpo", "sigmoid", {"sft_weight": 0.5}),
    ("dpo", "robust", {"label_smoothing": 0.1}),
    ("dpo", "hinge", {}),
    ("dpo", "ipo", {}),
    ("simpo", "sigmoid", {"gamma": 0.5}),
    ("simpo", "sigmoid", {"gamma": 0.3, "label_smoothing": 0.1, "sft_weight": 0.2}),
    ("orpo", "sigmoid", {}),
]


def case_id(case):
    objective, loss_type, options = case
    return "-".join([objective, loss_type, *(f"{k}={v}" for k, v in options.items())])


def pair_labels(seed=0):
    """[2 * PAIRS, SEQ]: chosen answers first, then rejected; prompts and padding at -100; every
    answer a different length (so sums and means differ)."""
    labels = torch.randint(0, VOCAB, (2 * PAIRS, SEQ), generator=torch.Generator().manual_seed(seed))
    answer = [(3, 9), (4, 6), (2, 10), (3, 5), (4, 10), (2, 4)]  # [start, end) of each answer
    for row, (start, end) in enumerate(answer):
        labels[row, :start], labels[row, end:] = -100, -100
    return labels.to(DEVICE)


def model_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2 * PAIRS, SEQ, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN**-0.5
    bias = torch.randn(VOCAB, generator=g) * 0.1
    # The reference model: the same head slightly moved, its own hidden states.
    ref_hidden = hidden + 0.3 * torch.randn(hidden.shape, generator=g)
    ref_weight = weight + 0.05 * torch.randn(weight.shape, generator=g)
    return [t.to(DEVICE) for t in (hidden, weight, bias, ref_hidden, ref_weight)]


def exact_sums(hidden, weight, bias, labels):
    """float64 per-sequence summed log-probabilities and counts (hidden t predicts labels t + 1)."""
    logits = F.linear(hidden[:, :-1].double(), weight.double(), bias.double())
    targets = labels[:, 1:]
    learned = targets != -100
    token = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token * learned).sum(-1), learned.sum(-1).double()


def trl_formula(objective, loss_type, options, pc, pr, rc, rr, nc, nr):
    """Each loss as TRL's trainers write it (DPOTrainer, CPOTrainer for SimPO, ORPOTrainer), float64."""
    beta, ls = BETA[objective], options.get("label_smoothing", 0.0)
    sft = options.get("sft_weight", 0.0) * -(pc / nc)
    if objective == "dpo":
        if loss_type == "ipo":  # TRL averages the log-probabilities for ipo
            pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
        logits = (pc - pr) - (rc - rr)
        if loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        elif loss_type == "robust":
            losses = (-F.logsigmoid(beta * logits) * (1 - ls) + F.logsigmoid(-beta * logits) * ls) / (
                1 - 2 * ls
            )
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * logits)
        else:
            losses = (logits - 1 / (2 * beta)) ** 2
        return losses + sft, beta * (pc - rc), beta * (pr - rr)
    ac, ar = pc / nc, pr / nr
    if objective == "simpo":  # TRL's CPOTrainer, loss_type="simpo", simpo_gamma = gamma
        logits = (ac - ar) - options["gamma"] / beta
        losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
        return losses + sft, beta * ac, beta * ar
    log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
    return -ac - beta * F.logsigmoid(log_odds), beta * ac, beta * ar


def ours(objective, loss_type, options, hidden, weight, bias, ref_hidden, ref_weight, labels, **kernel):
    logp, count = fused_linear_logprob(hidden, weight, labels, bias, **kernel)
    ref = (None, None)
    if objective == "dpo":
        with torch.no_grad():
            ref_logp, _ = fused_linear_logprob(ref_hidden, ref_weight, labels, bias, **kernel)
        ref = (ref_logp[:PAIRS], ref_logp[PAIRS:])
    return preference_loss(
        objective, logp[:PAIRS], logp[PAIRS:], count[:PAIRS], count[PAIRS:], *ref,
        beta=BETA[objective], loss_type=loss_type, **options,
    )  # fmt: skip


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable-head", "frozen-head"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loss_and_every_gradient_match_float64(case, trainable, monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")
    objective, loss_type, options = case
    hidden, weight, bias, ref_hidden, ref_weight = model_inputs()
    labels = pair_labels()
    wrt = [hidden, weight, bias] if trainable else [hidden]
    for t in wrt:
        t.requires_grad_()
    loss, metrics = ours(
        objective, loss_type, options, hidden, weight, bias, ref_hidden, ref_weight, labels, vocab_block=32
    )
    got_grads = torch.autograd.grad(loss.mean(), wrt)
    if not trainable:
        assert weight.grad is None and bias.grad is None

    exact = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    logp, count = exact_sums(*exact, labels)
    ref_logp, _ = exact_sums(ref_hidden, ref_weight, bias, labels)
    halves = [logp[:PAIRS], logp[PAIRS:], ref_logp[:PAIRS], ref_logp[PAIRS:], count[:PAIRS], count[PAIRS:]]
    want, want_chosen_reward, want_rejected_reward = trl_formula(objective, loss_type, options, *halves)
    want_grads = torch.autograd.grad(want.mean(), exact[: len(wrt)])

    assert loss.shape == (PAIRS,) and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["rewards/chosen"].double(), want_chosen_reward, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        metrics["rewards/rejected"].double(), want_rejected_reward, rtol=1e-5, atol=1e-6
    )
    for got, exact_grad in zip(got_grads, want_grads, strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got.double(), exact_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(
    not CUDA and not backend.interpreting(), reason="Triton needs a GPU or TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("case", [CASES[1], CASES[7], CASES[8]], ids=case_id)
def test_triton_path_matches_float64(case, monkeypatch):
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "triton")
    objective, loss_type, options = case
    hidden, weight, bias, ref_hidden, ref_weight = model_inputs()
    labels = pair_labels()
    wrt = [t.requires_grad_() for t in (hidden, weight, bias)]
    loss, _ = ours(
        objective, loss_type, options, hidden, weight, bias, ref_hidden, ref_weight, labels, chunk_rows=8
    )
    got_grads = torch.autograd.grad(loss.mean(), wrt)
    exact = [t.detach().double().requires_grad_() for t in wrt]
    logp, count = exact_sums(*exact, labels)
    ref_logp, _ = exact_sums(ref_hidden, ref_weight, bias, labels)
    halves = [logp[:PAIRS], logp[PAIRS:], ref_logp[:PAIRS], ref_logp[PAIRS:], count[:PAIRS], count[PAIRS:]]
    want, _, _ = trl_formula(objective, loss_type, options, *halves)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    for got, exact_grad in zip(got_grads, torch.autograd.grad(want.mean(), exact), strict=True):
        torch.testing.assert_close(got.double(), exact_grad, rtol=1e-4, atol=1e-6)


def test_step_zero_dpo_is_exactly_ln2_with_zero_rewards():
    """Policy == reference (the first step): h = 0 exactly, so the loss is ln 2 and every reward 0."""
    hidden, weight, bias, *_ = model_inputs()
    labels = pair_labels()
    logp, count = fused_linear_logprob(hidden.requires_grad_(), weight, labels, bias)
    with torch.no_grad():
        ref, _ = fused_linear_logprob(hidden, weight, labels, bias)
    loss, metrics = preference_loss(
        "dpo", logp[:PAIRS], logp[PAIRS:], count[:PAIRS], count[PAIRS:], ref[:PAIRS], ref[PAIRS:], beta=0.1
    )
    assert torch.equal(loss, torch.full_like(loss, math.log(2)))
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert torch.count_nonzero(metrics[key]) == 0, key


def per_pair(*values):
    return [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values]


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_signs_preferring_the_chosen_answer_lowers_the_loss(objective):
    """The policy likes the chosen answer more (and the rejected less) than the reference does: the
    loss is lower than at the neutral point, rewards say so, and descent raises chosen, lowers rejected."""
    counts = torch.tensor([5.0, 5.0], dtype=torch.float64)
    pc, pr = per_pair([-6.0, -4.0], [-9.0, -11.0])
    rc, rr = torch.tensor([-8.0, -6.0], dtype=torch.float64), torch.tensor([-8.0, -9.0], dtype=torch.float64)
    ref = (rc, rr) if objective == "dpo" else (None, None)
    loss, metrics = preference_loss(objective, pc, pr, counts, counts, *ref, beta=0.5)
    grad_c, grad_r = torch.autograd.grad(loss.sum(), (pc, pr))
    assert (grad_c < 0).all() and (grad_r > 0).all()
    assert (metrics["rewards/margins"] > 0).all() and (metrics["rewards/accuracies"] == 1).all()
    swapped, _ = preference_loss(objective, pr, pc, counts, counts, *ref[::-1], beta=0.5)
    assert (loss < swapped).all()
    if objective == "dpo":
        assert (loss < math.log(2)).all()
        assert (metrics["rewards/chosen"] > 0).all() and (metrics["rewards/rejected"] < 0).all()


@pytest.mark.parametrize("objective,loss_type", [("dpo", "sigmoid"), ("dpo", "robust"), ("simpo", "sigmoid")])
def test_label_smoothing_changes_the_loss(objective, loss_type):
    counts = torch.tensor([4.0, 7.0], dtype=torch.float64)
    pc, pr = per_pair([-6.0, -14.0], [-9.0, -10.0])
    ref = per_pair([-7.0, -13.0], [-8.0, -12.0]) if objective == "dpo" else (None, None)
    kwargs = dict(beta=0.5, loss_type=loss_type)
    plain, _ = preference_loss(objective, pc, pr, counts, counts, *ref, **kwargs)
    smoothed, _ = preference_loss(objective, pc, pr, counts, counts, *ref, label_smoothing=0.2, **kwargs)
    assert (smoothed - plain).abs().min() > 1e-3
    z = 0.5 * ((pc - pr) - (ref[0] - ref[1])) if objective == "dpo" else 0.5 * (pc / counts - pr / counts)
    if loss_type == "robust":
        want = (0.8 * -F.logsigmoid(z) + 0.2 * F.logsigmoid(-z)) / 0.6
    else:
        want = 0.8 * -F.logsigmoid(z) - 0.2 * F.logsigmoid(-z)
    torch.testing.assert_close(smoothed, want)


def test_ipo_uses_mean_log_probs_and_sigmoid_uses_sums():
    nc, nr = torch.tensor([2.0]), torch.tensor([8.0])
    pc, pr, rc, rr = torch.tensor([-4.0]), torch.tensor([-20.0]), torch.tensor([-5.0]), torch.tensor([-18.0])
    ipo, metrics = preference_loss("dpo", pc, pr, nc, nr, rc, rr, beta=0.5, loss_type="ipo")
    h_mean = (-2.0 - -2.5) - (-2.5 - -2.25)
    torch.testing.assert_close(ipo, torch.tensor([(h_mean - 1.0) ** 2]))
    torch.testing.assert_close(metrics["rewards/chosen"], torch.tensor([0.5 * (-2.0 - -2.5)]))
    sigmoid, _ = preference_loss("dpo", pc, pr, nc, nr, rc, rr, beta=0.5)
    torch.testing.assert_close(sigmoid, -F.logsigmoid(torch.tensor([0.5 * ((-4.0 + 20.0) - (-5.0 + 18.0))])))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_an_empty_answer_gives_no_nan(case, monkeypatch):
    """An answer truncated away (count 0, log-prob 0): finite loss and gradients, for every objective."""
    monkeypatch.setenv("LIGER_KERNEL_BACKEND", "torch")
    objective, loss_type, options = case
    hidden, weight, bias, ref_hidden, ref_weight = model_inputs()
    labels = pair_labels()
    labels[PAIRS + 1, :] = -100  # pair 1's rejected answer is empty
    labels[0, :] = -100  # pair 0's chosen answer is empty
    weight.requires_grad_()
    loss, metrics = ours(
        objective, loss_type, options, hidden.requires_grad_(), weight, bias, ref_hidden, ref_weight, labels
    )
    grads = torch.autograd.grad(loss.mean(), (hidden, weight))
    assert torch.isfinite(loss).all() and all(torch.isfinite(g).all() for g in grads)
    assert all(torch.isfinite(m).all() for m in metrics.values())


def test_orpo_is_finite_when_the_model_is_nearly_certain():
    nc = torch.tensor([3.0])
    pc, pr = per_pair([-3e-7], [-3.0])
    loss, _ = preference_loss("orpo", pc, pr, nc, nc, beta=0.1)
    grads = torch.autograd.grad(loss.sum(), (pc, pr))
    assert torch.isfinite(loss).all() and all(torch.isfinite(g).all() for g in grads)


def test_metrics_are_detached_per_pair_numbers():
    counts = torch.tensor([4.0, 7.0])
    pc, pr = torch.tensor([-6.0, -14.0], requires_grad=True), torch.tensor([-9.0, -10.0], requires_grad=True)
    _, metrics = preference_loss("orpo", pc, pr, counts, counts, beta=0.1)
    expected = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
    expected |= {"logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"}
    assert set(metrics) == expected
    assert all(not m.requires_grad and m.shape == (2,) for m in metrics.values())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(objective="kto"), "objective='kto'"),
        (
            dict(objective="dpo", loss_type="ipo", label_smoothing=0.1),
            "cannot be honoured by dpo with loss_type='ipo'",
        ),
        (dict(objective="dpo", loss_type="hinge", label_smoothing=0.1), "cannot be honoured"),
        (dict(objective="orpo", label_smoothing=0.1), "cannot be honoured by orpo"),
        (dict(objective="dpo", label_smoothing=0.5), r"must be in \[0, 0.5\)"),
        (dict(objective="dpo", loss_type="robust", label_smoothing=-0.1), r"must be in \[0, 0.5\)"),
        (dict(objective="simpo", loss_type="ipo"), "not a loss type of simpo"),
        (dict(objective="dpo", loss_type="exo"), "not a loss type of dpo"),
        (dict(objective="dpo", beta=0.0), "beta=0.0 must be a positive number"),
        (dict(objective="dpo", gamma=0.5), "SimPO's target margin"),
        (dict(objective="simpo", gamma=-1.0), "margin >= 0"),
        (dict(objective="orpo", sft_weight=0.5), "already includes the chosen answer's NLL"),
        (dict(objective="dpo", sft_weight=-1.0), "must be >= 0"),
        (dict(objective="dpo", has_reference=False), "needs the reference"),
        (dict(objective="simpo", has_reference=True), "reference-free"),
    ],
)
def test_options_a_loss_cannot_honour_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_preference_options(**kwargs)


def test_preference_loss_checks_its_options():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="cannot be honoured"):
        preference_loss("dpo", x, x, x, x, x, x, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="reference-free"):
        preference_loss("orpo", x, x, x, x, x, x)
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss("dpo", x, x, x, x)
