"""GRPO and its variants (DAPO, Dr. GRPO, GSPO, CISPO) on per-token log-probabilities: the math, one line each.

What the loss needs from the model is each completion token's log-probability at the sampling
temperature: `fused_linear_token_logprob` computes it without building logits. What is left:

- advantages, per completion i of a group of G (one prompt's completions), rewards r:
  group: A_i = (r_i - mean_G r) / (std_G r + 1e-4), std unbiased over the G rewards;
  batch: A_i = (r_i - mean_G r) / (std_step r + 1e-4), the std over every completion of the step;
  none:  A_i = r_i - mean_G r (Dr. GRPO).
- grpo, dapo, dr_grpo, per token t of completion i: ratio rho = exp(logp - logp_old) and
  l_t = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta k3_t, where
  k3_t = exp(ref - logp) - (ref - logp) - 1 >= 0 (the KL estimator), times the importance weight w_t
  (`importance_weights`, below; 1 without a correction).
- importance weights, for a sampler that is not exactly the trainer (another engine, a lagging one):
  the token ratio r_t = p_old / p_sampler = exp(old_t - sampler_t), the sequence ratio R = exp(sum over
  the sequence's sampled tokens of (old_t - sampler_t)) (a trajectory trained per turn is one sequence),
  and a cap C:
  token_truncate:    w_t = min(r_t, C)            token_mask:    w_t = r_t if r_t <= C else 0
  sequence_truncate: w_t = min(R, C)              sequence_mask: w_t = R if R <= C else 0
- gspo (Zheng et al. 2025), the ratio of a completion: s_i = exp(sum_t m_t (logp_t - old_t) / sum_t m_t)
  (the geometric mean of its token ratios over its learned tokens m), clipped at the sequence level:
  l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), computed per token as GSPO-token
  s_it = sg[s_i] exp(logp_t - sg[logp_t]) (value s_i, gradient that of l_i); k3 and w_t per token.
- cispo (MiniMax-M1 2025): l_t = -sg[min(rho_t, 1 + eps_high)] A_i logp_t (+ beta k3_t, times w_t):
  the weight clipped above only, detached; every token keeps its gradient (TRL's cispo epsilon_high is
  the bound 1 + eps_high itself).
- aggregation over the step's completions (`loss_units` counts what the sum is divided by):
  grpo, gspo:    sum_i (sum_t l_t / |o_i|) / completions   (per-completion mean, then mean: the paper);
  dapo, cispo:   sum_i sum_t l_t / completion tokens       (one token mean over the step);
  dr_grpo:       sum_i sum_t l_t / (completions x max_new_tokens).

Each function returns sums over the rows it is given, never a mean: the caller divides by the step's
global count of units (completions, or tokens for dapo and cispo), so micro-batches and processes
add up to the same update as one batch (`tests/test_grpo.py`). `row_sum` (default: nothing) adds a
row's sums over the positions that other processes hold, where a sequence is split over several
(sequence parallelism): every per-completion quantity (gspo's ratio, grpo's and gspo's per-completion
means, dr_grpo's sums and the completions counted) is then the whole row's, on each of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOSSES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
PER_TOKEN = ("dapo", "cispo")
"""The losses whose units are completion tokens (the others': completions)."""
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4


def group_advantages(
    rewards: torch.Tensor, group: int, scale: str = "group", batch_std: torch.Tensor | None = None
) -> torch.Tensor:
    """[N x G] rewards, groups contiguous -> advantages. `batch_std` (scale "batch") is the std of every
    reward of the step, over all processes; the caller computes it."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards {scale!r}: choose one of {', '.join(SCALES)}")
    r = rewards.double().view(-1, group)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (r.std(dim=1, keepdim=True) + STD_EPS)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("scale_rewards batch needs the step's std of the rewards")
        centred = centred / (batch_std.double() + STD_EPS)
    return centred.view(-1).to(rewards.dtype)


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    loss: str = "grpo",
    row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] (0 where `mask` is False) of `loss`, and per-token indicators/values for
    metrics: `clipped` (grpo, dapo, dr_grpo: the token's clip bound is the one taken; gspo: the
    completion's, on each of its tokens; cispo: the token's weight was capped), `kl` (k3, when beta > 0)."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r}: choose one of {', '.join(LOSSES)}")
    adv = advantages.unsqueeze(1).to(logp.dtype)
    if loss == "cispo":
        ratio = torch.exp(logp.detach() - old_logp)
        per_token = -torch.clamp(ratio, max=1 + epsilon_high) * adv * logp
        indicator = ratio > 1 + epsilon_high
    else:
        if loss == "gspo":
            whole = row_sum or (lambda sums: sums)
            learned = whole(mask.to(logp.dtype).sum(1))
            log_s = whole(torch.where(mask.bool(), logp.detach() - old_logp, 0).sum(1)) / learned.clamp(min=1)
            ratio = torch.exp(log_s.unsqueeze(1) + (logp - logp.detach()))  # s_i, with logp_t's gradient
        else:
            ratio = torch.exp(logp - old_logp)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        indicator = clipped < unclipped
    stats = {"clipped": indicator.to(logp.dtype)}
    if beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs the reference log-probabilities")
        delta = ref_logp - logp
        k3 = torch.exp(delta) - delta - 1
        per_token = per_token + beta * k3
        stats["kl"] = k3.detach()
    if weights is not None:
        per_token = per_token * weights
    mask = mask.to(logp.dtype)
    return per_token * mask, {k: v * mask for k, v in stats.items()}


IMPORTANCE_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
    row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights [B, T] of `mode` (0 where `mask` is False) and where the cap changed a weight (a
    ratio above `cap`, truncated or masked). `sequence` [B] names each row's sequence (rows of one
    trajectory share it; default: each row its own); `row_sum` adds a row's sums over the processes
    holding its other positions."""
    if mode not in IMPORTANCE_MODES:
        raise ValueError(f"importance sampling {mode!r}: choose one of {', '.join(IMPORTANCE_MODES)}")
    learned = mask.bool()
    diff = torch.where(learned, old_logp - sampler_logp, 0).double()
    if mode.startswith("token"):
        ratio = torch.exp(diff)
    else:
        per_row = diff.sum(1)
        if row_sum is not None:
            per_row = row_sum(per_row)
        if sequence is not None:  # a sequence's rows: their sums added, the total on each row
            per_row = (sequence.unsqueeze(1) == sequence.unsqueeze(0)).to(per_row.dtype) @ per_row
        ratio = torch.exp(per_row).unsqueeze(1).expand_as(diff)
    over = (ratio > cap) & learned
    weights = torch.clamp(ratio, max=cap) if mode.endswith("truncate") else torch.where(over, 0.0, ratio)
    return torch.where(learned, weights, 0.0).to(old_logp.dtype), over


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    loss: str,
    max_new_tokens: int,
    row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A [B, T] per-token quantity summed as `loss` aggregates: over completions of per-completion means
    (grpo, gspo), over tokens (dapo, cispo), over tokens / max_new_tokens (dr_grpo). Divide by
    `loss_units`."""
    whole = row_sum or (lambda sums: sums)
    if loss in ("grpo", "gspo"):
        return (whole(values.sum(1)) / whole(mask.to(values.dtype).sum(1)).clamp(min=1)).sum()
    if loss in PER_TOKEN:  # each token once, wherever it is held
        return values.sum()
    if loss == "dr_grpo":
        return whole(values.sum(1)).sum() / max_new_tokens
    raise ValueError(f"loss {loss!r}: choose one of {', '.join(LOSSES)}")


def loss_units(
    mask: torch.Tensor, loss: str, row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """What the step's sum is divided by, for these rows: completions (rows with a learned token: a row
    left wholly out of the loss is not one), or completion tokens (dapo, cispo)."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r}: choose one of {', '.join(LOSSES)}")
    if loss in PER_TOKEN:
        return mask.sum()
    learned = mask.sum(1)
    return ((row_sum(learned.float()) if row_sum else learned) > 0).sum()
