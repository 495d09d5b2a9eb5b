"""GRPO proved piece by piece: the advantages and the surrogate against hand-written formulas (GSPO's
and CISPO's losses and gradients too), the loss normalisation against accumulation (8 completions in
one micro-batch = 2 x 4 = 4 x 2, for every `rl.loss`), the fused per-token log-probs against plain
logits, the reward-function contract, and the recipe's refusals."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from liger_cli.errors import UserError
from liger_cli.model.objectives.grpo import Grpo
from liger_cli.model.objectives.online import token_logprobs
from liger_cli.model.objectives.rewards import RewardError, load_rewards, score
from liger_cli.recipe.rl_section import RLSection


def rl(**over) -> RLSection:
    return RLSection(rewards=[{"function": "liger_cli.rewards:exact_match"}], **over)


# --- the math --------------------------------------------------------------------------------------------------


def test_advantages_for_each_scaling():
    from liger_kernels.grpo import group_advantages

    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    g1, g2 = [1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]
    std = lambda xs: math.sqrt(sum((x - sum(xs) / 4) ** 2 for x in xs) / 3)  # noqa: E731 - unbiased
    want = [(x - 0.5) / (std(g1) + 1e-4) for x in g1] + [(x - 2.75) / (std(g2) + 1e-4) for x in g2]
    assert group_advantages(r, 4, "group").tolist() == pytest.approx(want, rel=1e-6)
    assert group_advantages(r, 4, "none").tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]
    )
    batch = group_advantages(r, 4, "batch", torch.tensor(2.0))
    assert batch.tolist() == pytest.approx(
        [a / 2.0001 for a in [0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]]
    )


def test_the_surrogate_and_the_kl_term():
    from liger_kernels.grpo import grpo_token_loss

    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]])
    old = torch.tensor([[-1.5, -2.0], [-0.2, -0.1]])
    ref = torch.tensor([[-1.2, -1.0], [-0.5, -0.3]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = grpo_token_loss(logp, old, adv, mask, 0.2, 0.28, beta=0.1, ref_logp=ref)
    for b in range(2):
        for t in range(2):
            rho = math.exp(logp[b, t] - old[b, t])
            a = adv[b].item()
            surrogate = -min(rho * a, min(max(rho, 0.8), 1.28) * a)
            d = (ref[b, t] - logp[b, t]).item()
            want = (surrogate + 0.1 * (math.exp(d) - d - 1)) * mask[b, t].item()
            assert loss[b, t].item() == pytest.approx(want, abs=1e-6)
    # Clipped where the bound is taken: rho = e^0.5 > 1.28 with A > 0; rho = e^-0.3 < 0.8 with A < 0.
    assert stats["clipped"].tolist() == [[1.0, 0.0], [1.0, 0.0]]


def test_aggregations_divide_as_their_papers_say():
    from liger_kernels.grpo import LOSSES, aggregate, loss_units

    values = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    want = {
        "grpo": (2.0 + 2.0) / 2,  # per-completion means (2, 2), mean over the 2 completions
        "gspo": (2.0 + 2.0) / 2,  # as grpo: its loss is per completion
        "dapo": 6.0 / 3,  # one mean over the 3 completion tokens
        "cispo": 6.0 / 3,  # as dapo: its loss is per token
        "dr_grpo": 6.0 / (2 * 3),  # token sum / (completions x max_new_tokens)
    }
    assert set(want) == set(LOSSES)
    for loss, value in want.items():
        got = aggregate(values, mask, loss, 3) / loss_units(mask, loss)
        assert got.item() == pytest.approx(value), loss
    with pytest.raises(ValueError, match="choose one of grpo, dapo, dr_grpo, gspo, cispo"):
        loss_units(mask, "ppo")


# A hand-made batch for GSPO and CISPO: three completions, the third with two learned tokens out of four
# (an environment id inside, and padding), ratios on both sides of the clip ranges.
HAND_LOGP = [[-1.0, -2.0, -0.5, -1.5], [-0.3, -0.2, -0.9, -1.1], [-2.0, -0.7, -0.4, -3.0]]
HAND_OLD = [[-1.2, -1.9, -0.9, -1.4], [-0.4, -0.1, -1.3, -1.0], [-2.1, -0.7, -0.1, -3.0]]
HAND_REF = [[-1.1, -2.2, -0.6, -1.3], [-0.2, -0.3, -1.0, -1.2], [-1.8, -0.9, -0.5, -2.5]]
HAND_MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 1, 0]]
HAND_ADV = [1.5, -0.8, 2.0]
HAND_W = [[1.0, 0.9, 1.1, 1.0], [0.8, 1.0, 1.2, 1.0], [1.3, 1.0, 0.7, 1.0]]


def hand_batch(weights: bool):
    t = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    logp = t(HAND_LOGP).requires_grad_(True)
    mask = torch.tensor(HAND_MASK, dtype=torch.bool)
    return logp, t(HAND_OLD), t(HAND_REF), t(HAND_ADV), mask, (t(HAND_W) if weights else None)


def kernel_loss(loss: str, eps_low: float, eps_high: float, beta: float, weights: bool):
    """liger's loss for the step (the sum divided by the step's units, as the objective divides it), its
    gradient with respect to the log-probs, and the clip fraction."""
    from liger_kernels.grpo import aggregate, grpo_token_loss, loss_units

    logp, old, ref, adv, mask, w = hand_batch(weights)
    per_token, stats = grpo_token_loss(logp, old, adv, mask, eps_low, eps_high, beta, ref, w, loss=loss)
    units = loss_units(mask, loss)
    value = aggregate(per_token, mask, loss, 4) / units
    value.backward()
    return value.item(), logp.grad, (aggregate(stats["clipped"], mask, loss, 4) / units).item()


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_gspo_is_the_sequence_objective_and_its_gradient(beta):
    """GSPO's loss and gradient equal the sequence-level objective's, written directly: one ratio per
    completion, s_i = exp(mean of its learned tokens' log-ratios), clipped, its loss l_i = -min(s_i A_i,
    clip(s_i) A_i) (+ beta times the completion's mean k3), mean over completions. With the paper's clip
    range (3e-4, 4e-4) the first completion's ratio is clipped, the others' are not."""
    eps_low, eps_high = 3e-4, 4e-4
    logp, old, ref, adv, mask, _ = hand_batch(False)
    m = mask.double()
    s = torch.exp(((logp - old) * m).sum(1) / m.sum(1))
    l_seq = -torch.minimum(s * adv, torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    want = (l_seq + beta * (k3 * m).sum(1) / m.sum(1)).sum() / 3
    want.backward()
    got, grad, clip_fraction = kernel_loss("gspo", eps_low, eps_high, beta, weights=False)
    assert got == pytest.approx(want.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-12)
    # The ratios: e^0.1 (A > 0: clipped at 1 + 4e-4), e^(0.4/3) (A < 0) and e^-0.1 (A > 0): taken unclipped.
    assert s.detach().tolist() == pytest.approx([math.exp(0.1), math.exp(0.4 / 3), math.exp(-0.1)])
    assert clip_fraction == pytest.approx(1 / 3)
    # A clipped completion teaches nothing but its KL term: no surrogate gradient on its tokens.
    if beta == 0:
        assert grad[0].abs().max() == 0 and grad[1, :3].abs().min() > 0 and grad[2, [0, 2]].abs().min() > 0


def test_gspo_with_weights_and_a_wide_clip_by_hand():
    """Truncated importance sampling weighs each token's term: d loss / d logp_t = w_t (-A_i s_i + beta
    (1 - exp(ref_t - logp_t))) / (|o_i| completions), where the surrogate keeps its gradient (s_i inside
    the clip range, or the unclipped term is the smaller); the value is sum_t w_t (l_i + beta k3_t) / |o_i|."""
    eps_low, eps_high, beta = 0.2, 0.08, 0.05
    got, grad, clip_fraction = kernel_loss("gspo", eps_low, eps_high, beta, weights=True)
    want, want_grad = 0.0, [[0.0] * 4 for _ in range(3)]
    for i in range(3):
        tokens = [t for t in range(4) if HAND_MASK[i][t]]
        s = math.exp(sum(HAND_LOGP[i][t] - HAND_OLD[i][t] for t in tokens) / len(tokens))
        a = HAND_ADV[i]
        clipped = min(max(s, 1 - eps_low), 1 + eps_high)
        l_i = -min(s * a, clipped * a)
        live = 1 - eps_low <= s <= 1 + eps_high or s * a < clipped * a
        for t in tokens:
            w, d = HAND_W[i][t], HAND_REF[i][t] - HAND_LOGP[i][t]
            want += w * (l_i + beta * (math.exp(d) - d - 1)) / len(tokens) / 3
            want_grad[i][t] = w * ((-a * s if live else 0.0) + beta * (1 - math.exp(d))) / len(tokens) / 3
    assert got == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # e^0.1 > 1.08 with A > 0: clipped; e^(0.4/3) > 1.08 with A < 0: the unclipped term taken; e^-0.1 inside.
    assert clip_fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize("weights", [False, True])
def test_cispo_by_hand(weights):
    """CISPO: l_t = -min(rho_t, 1 + eps_high) A_i logp_t (+ beta k3_t), times w_t, the weight detached:
    d l_t / d logp_t = -min(rho_t, 1 + eps_high) A_i (+ beta (1 - exp(ref_t - logp_t))), times w_t; one
    mean over the step's completion tokens. A token whose weight is capped keeps its gradient (no token is
    dropped, unlike the clipped surrogate), and there is no lower clip."""
    eps_high, beta = 0.25, 0.1
    got, grad, clip_fraction = kernel_loss("cispo", 0.2, eps_high, beta, weights)
    tokens = [(i, t) for i in range(3) for t in range(4) if HAND_MASK[i][t]]
    want, want_grad, capped = 0.0, [[0.0] * 4 for _ in range(3)], 0
    for i, t in tokens:
        logp, a = HAND_LOGP[i][t], HAND_ADV[i]
        rho = math.exp(logp - HAND_OLD[i][t])
        weight = min(rho, 1 + eps_high)
        capped += rho > 1 + eps_high
        w = HAND_W[i][t] if weights else 1.0
        d = HAND_REF[i][t] - logp
        want += w * (-weight * a * logp + beta * (math.exp(d) - d - 1)) / len(tokens)
        want_grad[i][t] = w * (-weight * a + beta * (1 - math.exp(d))) / len(tokens)
    assert got == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert capped == 2 and clip_fraction == pytest.approx(2 / len(tokens))  # e^0.4 twice; e^0.2 is not capped
    assert (
        math.exp(HAND_LOGP[2][2] - HAND_OLD[2][2]) < 1 - 0.2
    )  # e^-0.3: below any lower clip, and kept as is
    assert all(grad[i, t] != 0 for i, t in tokens)


# --- the objective's loss through a real model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, config)


def rollout_batch(n: int = 8, seed: int = 0) -> dict:
    """n prompt + completion rows of different lengths, as a rollout makes them."""
    return Grpo(rl(), [], 0, True).twin_batch(800, 0, rows=n, seed=seed)


def rows(batch: dict, index: list[int]) -> dict:
    return {k: v[index] for k, v in batch.items()}


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
@pytest.mark.parametrize("iteration", [0, 1])
def test_accumulation_and_processes_add_up_to_one_batch(policy, loss, iteration):
    """The same 8 completions as 1 x 8, 2 x 4 and 4 x 2 micro-batches (a process is a micro-batch
    whose units are summed over ranks): the same loss and the same gradient, within fp32 rounding."""
    objective = Grpo(rl(loss=loss, max_new_tokens=8, importance_sampling_cap=2.0, beta=0.0), [], 0, True)
    objective._iteration = iteration  # 0: on-policy (old = current); 1: a later update, old from the batch
    batch = rollout_batch()

    def step(splits):
        policy.zero_grad(set_to_none=True)
        parts = [rows(batch, s) for s in splits]
        num_items = sum(objective.units(p) for p in parts)
        total = 0.0
        for p in parts:
            value, _ = objective.loss(policy, p, num_items)
            value.backward()
            total += value.item()
        return total, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    one, grads = step([list(range(8))])
    for splits in ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]):
        total, split_grads = step(splits)
        assert total == pytest.approx(one, abs=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(split_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_are_their_formulas(mode):
    """Each mode's weight, written here token by token: r = exp(old - sampler) per token, R = exp of the
    sum over the sequence's sampled tokens (rows 1 and 2 are one trajectory: one sequence), cap C = 1.5;
    truncate: min(ratio, C); mask: the ratio, or 0 above C; 0 off the mask."""
    import math

    from liger_kernels.grpo import importance_weights

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2
    sampler = old + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.4
    sampler[0] -= 0.5  # a sequence the trainer finds far likelier than the sampler (over the cap)...
    sampler[3] += 0.5  # ...and one it finds less likely (under it)
    mask = torch.rand(4, 6, generator=g) > 0.3
    sequence = torch.tensor([0, 1, 1, 2])
    cap = 1.5
    weights, capped = importance_weights(old, sampler, mask, mode, cap, sequence=sequence)
    for b in range(4):
        rows = [r for r in range(4) if sequence[r] == sequence[b]]
        log_r_seq = sum(old[r, t] - sampler[r, t] for r in rows for t in range(6) if mask[r, t])
        for t in range(6):
            ratio = math.exp(old[b, t] - sampler[b, t]) if mode.startswith("token") else math.exp(log_r_seq)
            want = min(ratio, cap) if mode.endswith("truncate") else (ratio if ratio <= cap else 0.0)
            assert weights[b, t].item() == pytest.approx(want if mask[b, t] else 0.0, rel=1e-12, abs=1e-12)
            assert bool(capped[b, t]) == bool(mask[b, t] and ratio > cap)
    assert capped.any() and (~capped & mask).any()  # both sides of the cap are exercised


def test_importance_sampling_keys_resolve_and_refuse():
    """A cap alone is today's token_truncate; a mode alone gets the cap 2.0; none with a cap is refused."""
    from pydantic import ValidationError

    assert (rl().importance_sampling, rl().importance_sampling_cap) == ("none", None)
    capped = rl(importance_sampling_cap=3.0)
    assert (capped.importance_sampling, capped.importance_sampling_cap) == ("token_truncate", 3.0)
    masked = rl(importance_sampling="sequence_mask")
    assert (masked.importance_sampling, masked.importance_sampling_cap) == ("sequence_mask", 2.0)
    with pytest.raises(ValidationError, match="remove the cap, or choose a mode"):
        rl(importance_sampling="none", importance_sampling_cap=2.0)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate", "sequence_mask"])
def test_each_importance_mode_adds_up_over_micro_batches(policy, mode):
    """A sequence mode's ratio is per sequence: cut into micro-batches, the loss and gradient stay one
    batch's (token_truncate is in the test above, with every loss)."""
    objective = Grpo(rl(max_new_tokens=8, importance_sampling=mode, importance_sampling_cap=1.2), [], 0, True)
    objective._iteration = 1
    batch = rollout_batch()
    batch["sampler_logp"] = batch["old_logp"] + 0.3 * torch.randn(
        batch["old_logp"].shape, generator=torch.Generator().manual_seed(1)
    )

    def step(splits):
        policy.zero_grad(set_to_none=True)
        parts = [rows(batch, s) for s in splits]
        num_items = sum(objective.units(p) for p in parts)
        total, capped = 0.0, 0.0
        for p in parts:
            value, metrics = objective.loss(policy, p, num_items)
            value.backward()
            total, capped = total + value.item(), capped + metrics["sampler/capped"].item()
        return total, capped, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    one, capped, grads = step([list(range(8))])
    assert 0 < capped < 1  # the cap changed some weights, not all
    total, split_capped, split_grads = step([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert total == pytest.approx(one, abs=1e-6) and split_capped == pytest.approx(capped, abs=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("loss", "clip"), [("gspo", {"epsilon": 3e-4, "epsilon_high": 4e-4}),
                                            ("cispo", {"epsilon_high": 4.0})])  # fmt: skip
def test_the_twin_proves_the_fused_kernel_on_gspo_and_cispo(loss, clip):
    """The twin's kernel check runs the run's own loss (with a KL term and capped weights): fused and plain
    agree, so the kernel stays in, and the Plan names the loss it was proven on."""
    from transformers import AutoConfig

    from liger_cli.twin.kernel_check import check_kernels

    objective = Grpo(rl(loss=loss, beta=0.1, importance_sampling_cap=2.0, **clip), [], 0, True)
    requested = {"rms_norm": False, "rope": False, "swiglu": False, "cross_entropy": False,
                 "fused_linear_cross_entropy": True}  # fmt: skip
    check = check_kernels(AutoConfig.for_model("llama"), requested, objective=objective)
    assert check.switched_off == {} and check.loss == f"the grpo loss ({loss}) on rollouts"


def test_fused_token_logprobs_equal_the_plain_ones(tiny_model_dir):
    """With our fused loss patched in, per-token log-probs (at a temperature) and their gradients equal
    those taken from the model's own logits."""
    from liger_kernels import patch_model
    from transformers import AutoModelForCausalLM

    batch = rollout_batch(4)
    found = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        if fused:
            report = patch_model(model, rms_norm=False, rope=False, swiglu=False, cross_entropy=False,
                                 fused_linear_cross_entropy=True)  # fmt: skip
            assert "fused_linear_cross_entropy" in report.patched
        model.train()
        logp, mask = token_logprobs(model, batch, temperature=0.7)
        (logp * batch["advantages"][:, None]).sum().backward()
        found.append(
            (
                logp.detach(),
                mask,
                model.lm_head.weight.grad.clone(),
                model.model.embed_tokens.weight.grad.clone(),
            )
        )
    (plain_logp, plain_mask, *plain_grads), (fused_logp, fused_mask, *fused_grads) = found
    assert torch.equal(plain_mask, fused_mask) and torch.equal(plain_mask, batch["completion_mask"])
    torch.testing.assert_close(fused_logp, plain_logp, atol=2e-5, rtol=0)
    for got, want in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # The temperature is the sampler's: log_softmax(logits / 0.7) at the completion tokens.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * plain_mask
    torch.testing.assert_close(plain_logp, want, atol=2e-5, rtol=0)


# --- reward functions ------------------------------------------------------------------------------------------


def spec(function: str, weight: float = 1.0):
    return SimpleNamespace(function=function, weight=weight)


def test_rewards_are_called_with_the_fields_and_weighted(tmp_path):
    file = tmp_path / "rewards.py"
    file.write_text(
        "def short(completions, **kw):\n    return [1.0 if len(c) < 4 else 0.0 for c in completions]\n"
        "def maybe(completions, task, **kw):\n    return [None if t == 'skip' else 2.0 for t in task]\n"
    )
    rewards = load_rewards(
        [spec("liger_cli.rewards:exact_match"), spec(f"{file}:short", 0.5), spec(f"{file}:maybe")]
    )
    assert [r.name for r in rewards] == ["exact_match", "short", "maybe"]
    totals, per = score(rewards, ["12", "twelve", "12 "], ["p"] * 3, [[1], [2], [3]],
                        {"answer": ["12", "12", "13"], "task": ["a", "skip", "a"]}, [1, 1, 2], timeout=60)  # fmt: skip
    assert per == {"exact_match": [1.0, 0.0, 0.0], "short": [1.0, 0.0, 1.0], "maybe": [2.0, None, 2.0]}
    assert totals == [1.0 + 0.5 + 2.0, 0.0, 0.5 + 2.0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("    raise KeyError('answer')", "reward bad (FILE:bad) raised on prompt row 8: KeyError: 'answer'"),
        ("    return [1.0]", "reward bad (FILE:bad) returned 1 values for 2 completions"),
        ("    return [1.0, float('nan')]", "returned nan for prompt row 8: return a finite float or None"),
        ("    return [1.0, 'yes']", "returned 'yes' for prompt row 8: return a float or None"),
        ("    return 1.0", "returned float, not a list of 2 numbers"),
    ],
)
def test_a_reward_function_that_breaks_the_contract_is_named(tmp_path, body, message):
    file = tmp_path / "r.py"
    file.write_text(
        "def bad(completions, **kw):\n    if len(completions) == 1 and completions[0] == 'ok':\n        return [1.0]\n"
        + body
        + "\n"  # fmt: skip
    )
    rewards = load_rewards([spec(f"{file}:bad")])
    with pytest.raises(RewardError) as err:
        score(rewards, ["ok", "no"], ["p", "q"], [[1], [2]], {}, [3, 8], timeout=60)
    assert message.replace("FILE", str(file)) in str(err.value)
    assert isinstance(err.value, UserError)


def test_a_reward_function_that_hangs_is_named_with_its_row(tmp_path):
    """A function that never returns on row 8's completion: the run's error names it and the row, after
    rl.reward_timeout, instead of a silent stall (the stuck thread is a daemon: it ends with the process)."""
    file = tmp_path / "r.py"
    file.write_text(
        "import threading\n"
        "def stuck(completions, **kw):\n"
        "    if 'no' in completions:\n        threading.Event().wait()\n"
        "    return [1.0] * len(completions)\n"
    )
    rewards = load_rewards([spec(f"{file}:stuck")])
    with pytest.raises(RewardError) as err:
        score(rewards, ["ok", "no"], ["p", "q"], [[1], [2]], {}, [3, 8], timeout=0.5)
    assert str(err.value) == (
        f"reward stuck ({file}:stuck) did not return within 0.5 s (rl.reward_timeout) on prompt row 8: make it "
        "return (or raise) sooner, or raise rl.reward_timeout"
    )


def test_reward_functions_that_do_not_load_are_named(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    cases = {
        f"{tmp_path / 'missing.py'}:f": "no such file",
        f"{broken}:f": "importing",
        "liger_cli.rewards:nothing": "liger_cli.rewards has no function nothing",
        "no_such_package.mod:f": "cannot import no_such_package.mod",
    }
    for function, message in cases.items():
        with pytest.raises(RewardError, match=message):
            load_rewards([spec(function)])


# --- the recipe ------------------------------------------------------------------------------------------------


def test_the_recipe_refuses_what_grpo_cannot_do(tmp_path, tiny_model_dir):
    from liger_cli.recipe.load import validate_recipe

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "answer": "x"}\n')
    base = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train": str(prompts), "format": "prompt", "max_seq_len": 64},
        "training": {"objective": "grpo", "max_steps": 1},
        "rl": {"max_new_tokens": 8, "rewards": [{"function": "rewards.py:f"}]},
    }
    runs = {name: tmp_path / name for name in ("bad", "sft", "unfinished")}  # rl.rewards model folders
    for name, text in {"bad": "training: [unclosed\n", "sft": "training: {objective: sft}\n",
                       "unfinished": "training: {objective: reward}\n"}.items():  # fmt: skip
        runs[name].mkdir()
        (runs[name] / "recipe.yaml").write_text(text)
    recipe = validate_recipe(base, tmp_path)
    assert recipe.rl.epsilon_high == recipe.rl.epsilon == 0.2
    assert recipe.rl.rewards[0].function == f"{tmp_path / 'rewards.py'}:f"  # anchored at the recipe
    for loss, clip in (("gspo", {"epsilon": 3e-4, "epsilon_high": 4e-4}), ("cispo", {"epsilon_high": 4.0})):
        found = validate_recipe({**base, "rl": {**base["rl"], "loss": loss, **clip}}, tmp_path).rl
        assert (found.loss, found.epsilon_high) == (loss, clip["epsilon_high"])
    cases = [
        ({"training": {"max_steps": 1}}, "data.format prompt goes with training.objective grpo"),
        ({"data": {"train": str(prompts), "format": "chat"}}, "set data.format: prompt"),
        ({"rl": None}, "needs an rl section"),
        ({"rl": {"rewards": []}}, "rl.rewards"),
        ({"rl": {"rewards": [{"function": "nocolon"}]}}, "write file.py:function"),
        ({"rl": {"max_new_tokens": 64, "rewards": [{"function": "m:f"}]}}, "leaves no room for the prompt"),
        (
            {"rl": {"loss": "ppo", "rewards": [{"function": "m:f"}]}},
            "rl.loss.*'grpo', 'dapo', 'dr_grpo', 'gspo' or 'cispo'",
        ),
        (
            {"rl": {"loss": "cispo", "epsilon": 0.1, "rewards": [{"function": "m:f"}]}},
            "cispo has none.*remove rl.epsilon",
        ),
        ({"rl": {**base["rl"], "tools": ["t.py:f"], "environment": "e.py:E"}}, "rl.tools and rl.environment: give one"),
        ({"rl": {**base["rl"], "max_turns": 2}}, "rl.max_turns applies to runs with rl.tools or rl.environment"),
        ({"rl": {"rewards": [{"function": "m:f", "model": str(tmp_path)}]}}, "gives one of function .* or model"),
        ({"rl": {"rewards": [{"model": str(tmp_path)}]}}, "not a liger run folder"),
        ({"rl": {"rewards": [{"model": str(runs["bad"])}]}}, r"is not a liger run's recipe \(ParserError\)"),
        ({"rl": {"rewards": [{"model": str(runs["sft"])}]}}, "a sft run, not a reward model"),
        ({"rl": {"rewards": [{"model": str(runs["unfinished"] / "final")}]}}, "no final model in .*has not finished"),
        ({"preference": {"beta": 0.2}}, "the preference section applies to dpo, simpo and orpo"),
        ({"reward": {"center_coefficient": 0.01}}, "the reward section applies to training.objective reward"),
        ({"kto": {"beta": 0.2}}, "the kto section applies to training.objective kto"),
        ({"data": {**base["data"], "packing": True}}, "data.packing and data.streaming do not apply to prompts"),
        ({"training": {**base["training"], "eval_samples": 2}}, "evaluates greedy completions of every eval prompt"),
    ]  # fmt: skip
    for over, message in cases:
        data = {**base, **over}
        if data.get("rl") is None:
            data.pop("rl")
        with pytest.raises(UserError, match=message):
            validate_recipe(data, tmp_path)


def test_full_fine_tuning_swaps_the_starting_weights_in_for_the_reference(tiny_model_dir):
    """beta > 0 without an adapter: the reference pass computes with the weights the run started from
    (kept before any step), and the trained weights are back, bit for bit, after it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    objective = Grpo(rl(beta=0.1, max_new_tokens=8), [], 0, adapter=False)
    stored = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731 - one process
    objective.keep_reference(model, SimpleNamespace(stored_trainable=stored))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # "training"
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    batch = Grpo(rl(beta=0.1, max_new_tokens=8), [], 0, True).twin_batch(model.config.vocab_size, 0)
    with torch.no_grad():
        want = token_logprobs(start, batch, 1.0)[0]
        with objective._reference_weights(model):
            got = token_logprobs(model, batch, 1.0)[0]
        moved = token_logprobs(model, batch, 1.0)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (moved - want).abs().max() > 1e-3  # the trained weights compute something else
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    with_adapter = Grpo(rl(beta=0.1, max_new_tokens=8), [], 0, adapter=True)
    with_adapter.keep_reference(model, SimpleNamespace(stored_trainable=stored))
    assert with_adapter._reference is None  # an adapter's reference is the adapter switched off: no copy
