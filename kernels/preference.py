"""Preference objectives (DPO and its IPO / hinge / robust variants, SimPO, ORPO) on per-sequence numbers.

Everything a preference loss needs from the model is, per sequence, the summed log-probability of
its answer's learned tokens and their count: `fused_linear_logprob` computes both without building
logits. What is left is one short formula per objective, here, in the dtype of the log-probabilities
it is given (fp32 from the kernel; the tests pass fp64). Every function returns one loss per pair;
the caller averages over pairs.

Conventions, each chosen to match TRL (where they differ from a paper, the docstrings say so):
- Log-probabilities are sums over the answer's learned tokens; "mean" log-probabilities are
  sum / count, 0 for an answer with no learned token (count 0: truncated away), never NaN.
- DPO (sigmoid, hinge, robust) uses summed log-probabilities; IPO uses mean ones, for policy and
  reference alike (TRL averages for loss_type="ipo"); SimPO and ORPO use mean ones by definition.
- Rewards: DPO beta * (policy - reference), per answer, with the log-probabilities its loss used;
  SimPO and ORPO beta * mean log-probability (TRL's CPO and ORPO trainers). margins = chosen -
  rejected, accuracies = (chosen > rejected) as 0./1.
- An option a loss type cannot honour is a ValueError, never ignored (`check_preference_options`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

OBJECTIVES = ("dpo", "simpo", "orpo")
LOSS_TYPES = {"dpo": ("sigmoid", "ipo", "hinge", "robust"), "simpo": ("sigmoid",), "orpo": ("sigmoid",)}
# Where label smoothing (the probability that a pair's preference label is flipped) means something.
SMOOTHED = {("dpo", "sigmoid"), ("dpo", "robust"), ("simpo", "sigmoid")}


def check_preference_options(
    objective: str,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    sft_weight: float = 0.0,
    has_reference: bool | None = None,
) -> None:
    """Raise ValueError for an option the objective and loss type cannot honour (the launcher turns
    these into user errors). `has_reference`: whether reference log-probabilities are given (None:
    not checked); DPO needs them, SimPO and ORPO are reference-free and must not get any."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not one of {OBJECTIVES}.")
    if loss_type not in LOSS_TYPES[objective]:
        raise ValueError(
            f"loss_type={loss_type!r} is not a loss type of {objective}: use one of {LOSS_TYPES[objective]}."
        )
    if not (beta > 0 and math.isfinite(beta)):
        raise ValueError(f"beta={beta} must be a positive number.")
    if label_smoothing != 0.0:
        if (objective, loss_type) not in SMOOTHED:
            raise ValueError(
                f"label_smoothing={label_smoothing} cannot be honoured by {objective}"
                + (f" with loss_type={loss_type!r}" if objective == "dpo" else "")
                + ": only dpo (sigmoid, robust) and simpo smooth labels. Leave it at 0."
            )
        if not 0.0 < label_smoothing < 0.5:
            raise ValueError(
                f"label_smoothing={label_smoothing} must be in [0, 0.5): it is the probability that a "
                "preference label is flipped (0.5 would make every pair uninformative)."
            )
    if gamma != 0.0 and objective != "simpo":
        raise ValueError(f"gamma={gamma} is SimPO's target margin; {objective} has none. Leave it at 0.")
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"gamma={gamma} must be a margin >= 0.")
    if sft_weight != 0.0:
        if objective == "orpo":
            raise ValueError(
                f"sft_weight={sft_weight}: ORPO's loss already includes the chosen answer's NLL (weight 1; "
                "beta weighs the odds-ratio term). Leave sft_weight at 0."
            )
        if not (math.isfinite(sft_weight) and sft_weight > 0):
            raise ValueError(f"sft_weight={sft_weight} must be >= 0.")
    if has_reference is not None:
        if objective == "dpo" and not has_reference:
            raise ValueError("dpo needs the reference model's log-probabilities (ref_chosen, ref_rejected).")
        if objective != "dpo" and has_reference:
            raise ValueError(f"{objective} is reference-free: reference log-probabilities would be ignored.")


def mean_logprob(logp_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Per-token mean: sum / count, 0 where count is 0."""
    return logp_sum / count.to(logp_sum.dtype).clamp(min=1)


def _smoothed_logsigmoid_loss(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-log sigmoid(z) when the label is right, with probability label_smoothing it is flipped (cDPO)."""
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DPO per pair, on h = (pc - rc) - (pr - rr), the margin of the policy's log-ratios over the
    reference's (pass mean log-probabilities for ipo, sums otherwise; `preference_loss` does):

    sigmoid: -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)   (DPO; cDPO with ls > 0)
    robust:  ((1 - ls)(-log sigmoid(beta h)) + ls log sigmoid(-beta h)) / (1 - 2 ls)   (rDPO, TRL's
             formula: an unbiased estimate of the clean-label loss under flip rate ls)
    hinge:   relu(1 - beta h)   (SLiC)
    ipo:     (h - 1 / (2 beta))^2   (IPO's eq. 17, beta as its tau)
    """
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    z = beta * h
    if loss_type == "sigmoid":
        return _smoothed_logsigmoid_loss(z, label_smoothing)
    if loss_type == "robust":
        ls = label_smoothing
        return ((1.0 - ls) * -F.logsigmoid(z) + ls * F.logsigmoid(-z)) / (1.0 - 2.0 * ls)
    if loss_type == "hinge":
        return torch.relu(1.0 - z)
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES['dpo']}.")


def simpo_loss(
    mean_chosen: torch.Tensor,
    mean_rejected: torch.Tensor,
    beta: float,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """SimPO per pair: -log sigmoid(beta (mean_c - mean_r) - gamma), label smoothing as in DPO.

    gamma is the target margin in reward units, as in the SimPO paper (its gamma) and TRL's CPO
    trainer (`simpo_gamma`); the SimPO repository's `gamma_beta_ratio` r is gamma = beta * r.
    """
    return _smoothed_logsigmoid_loss(beta * (mean_chosen - mean_rejected) - gamma, label_smoothing)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler's switch at -ln 2)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(
    mean_chosen: torch.Tensor,
    mean_rejected: torch.Tensor,
    beta: float,
    chosen_count: torch.Tensor | None = None,
    rejected_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO per pair: -mean_c - beta * log sigmoid(log_odds), with
    log_odds = (mean_c - mean_r) - (log(1 - exp(mean_c)) - log(1 - exp(mean_r))).

    The NLL term is the chosen answer's per-token mean, per pair (the paper's L_SFT; TRL averages
    over all chosen tokens of the batch instead). beta is the paper's lambda. A pair with an answer
    that has no learned token (counts given and 0) gets no odds-ratio term: its mean log-probability
    0 would make the odds infinite. Returns (loss, log_odds).
    """
    nonempty = None
    if chosen_count is not None and rejected_count is not None:
        nonempty = (chosen_count > 0) & (rejected_count > 0)
        # Placeholders where an answer is empty, so that neither branch makes an inf (or a NaN gradient).
        mean_chosen_safe = torch.where(nonempty, mean_chosen, -1.0)
        mean_rejected_safe = torch.where(nonempty, mean_rejected, -1.0)
    else:
        mean_chosen_safe, mean_rejected_safe = mean_chosen, mean_rejected
    log_odds = (mean_chosen_safe - mean_rejected_safe) - (
        _log1mexp(mean_chosen_safe) - _log1mexp(mean_rejected_safe)
    )
    odds_term = -F.logsigmoid(log_odds)
    if nonempty is not None:
        odds_term = torch.where(nonempty, odds_term, 0.0)
        log_odds = torch.where(nonempty, log_odds, 0.0)
    return -mean_chosen + beta * odds_term, log_odds


def preference_loss(
    objective: str,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_count: torch.Tensor,
    rejected_count: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    sft_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One loss per pair from per-sequence numbers, and per-pair metrics (detached).

    policy_* and ref_* are summed log-probabilities of the answers' learned tokens ([pairs]; the
    reference's without grad), *_count their learned-token counts (`fused_linear_logprob`'s two
    outputs, split into chosen and rejected). `sft_weight` (dpo, simpo) adds sft_weight times the
    chosen answer's per-token mean NLL. Metrics: rewards/{chosen,rejected,margins,accuracies},
    logps/{chosen,rejected} (sums), and nll_loss (orpo, or sft_weight > 0), log_odds_ratio
    (log sigmoid(log_odds)) and log_odds_chosen (log_odds) for orpo.
    """
    check_preference_options(
        objective, loss_type, beta, label_smoothing, gamma, sft_weight, ref_chosen is not None
    )
    if (ref_chosen is None) != (ref_rejected is None):
        raise ValueError("give both ref_chosen and ref_rejected, or neither.")
    mean_chosen = mean_logprob(policy_chosen, chosen_count)
    mean_rejected = mean_logprob(policy_rejected, rejected_count)
    metrics = {}
    if objective == "dpo":
        if loss_type == "ipo":  # IPO on per-token means, the reference's too (TRL's convention)
            used = (
                mean_chosen, mean_rejected,
                mean_logprob(ref_chosen, chosen_count), mean_logprob(ref_rejected, rejected_count),
            )  # fmt: skip
        else:
            used = (policy_chosen, policy_rejected, ref_chosen, ref_rejected)
        loss = dpo_loss(*used, beta, loss_type, label_smoothing)
        chosen_reward, rejected_reward = beta * (used[0] - used[2]), beta * (used[1] - used[3])
    elif objective == "simpo":
        loss = simpo_loss(mean_chosen, mean_rejected, beta, gamma, label_smoothing)
        chosen_reward, rejected_reward = beta * mean_chosen, beta * mean_rejected
    else:
        loss, log_odds = orpo_loss(mean_chosen, mean_rejected, beta, chosen_count, rejected_count)
        chosen_reward, rejected_reward = beta * mean_chosen, beta * mean_rejected
        metrics["nll_loss"] = -mean_chosen.detach()
        metrics["log_odds_ratio"] = F.logsigmoid(log_odds).detach()
        metrics["log_odds_chosen"] = log_odds.detach()
    if sft_weight > 0:
        loss = loss + sft_weight * -mean_chosen
        metrics["nll_loss"] = -mean_chosen.detach()
    chosen_reward, rejected_reward = chosen_reward.detach(), rejected_reward.detach()
    metrics.update(
        {
            "rewards/chosen": chosen_reward,
            "rewards/rejected": rejected_reward,
            "rewards/margins": chosen_reward - rejected_reward,
            "rewards/accuracies": (chosen_reward > rejected_reward).to(chosen_reward.dtype),
            "logps/chosen": policy_chosen.detach(),
            "logps/rejected": policy_rejected.detach(),
        }
    )
    return loss, metrics
