"""A rollout's metrics (what `liger train` logs after sampling), summed over every process."""

from __future__ import annotations

import math

import torch


def rollout_stats(micro: list[dict], rows: list[dict], reduce, rl, functions: list) -> dict[str, float]:
    """A GRPO step's rollout metrics over every completion of every process (`reduce`: a sum, or a max,
    over the processes): rewards and their spread, lengths, the sampler's log-probs against the
    trainer's (`mismatch_stats`), and a multi-turn run's turns and tool calls."""
    g = rl.num_generations
    rewards = torch.cat([b["rewards"] for b in micro]).double()
    lengths = torch.tensor([r["sampled_tokens"] for r in rows], dtype=torch.float64)
    cut = torch.tensor([r["finish_reason"] == "length" for r in rows], dtype=torch.float64)
    zero_std = (rewards.view(-1, g).std(dim=1) < 1e-8).double()
    sums = {
        "reward": rewards.sum(), "reward_sq": (rewards**2).sum(), "completions": torch.tensor(float(len(rows))),
        "length": lengths.sum(), "clipped_length": cut.sum(), "zero_std_groups": zero_std.sum(),
        "groups": torch.tensor(float(zero_std.numel())),
    }  # fmt: skip
    if rl.agentic:  # per trajectory: model turns, tool calls, tool errors (timeouts and crashes among them)
        for name in ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_crashes"):
            sums[name] = torch.tensor(float(sum(r[name] for r in rows)))
    for reward in functions:
        values = [r["rewards"][reward.name] for r in rows]
        sums[f"{reward.name}_sum"] = torch.tensor(
            sum(v for v in values if v is not None), dtype=torch.float64
        )
        sums[f"{reward.name}_n"] = torch.tensor(float(sum(v is not None for v in values)))
    names = list(sums)
    total = dict(zip(names, reduce(torch.stack([sums[n] for n in names])).tolist(), strict=True))
    extremes = reduce(torch.stack([-lengths.min(), lengths.max()]), "max").tolist()
    n = total["completions"]
    mean = total["reward"] / n
    stats = {
        "reward": mean,
        "reward_std": math.sqrt(max(total["reward_sq"] / n - mean**2, 0.0) * n / max(n - 1, 1)),
        **{f"rewards/{r.name}": total[f"{r.name}_sum"] / max(total[f"{r.name}_n"], 1) for r in functions},
        "frac_zero_std_groups": total["zero_std_groups"] / total["groups"],
        "completion_length": total["length"] / n, "completion_length_min": -extremes[0],
        "completion_length_max": extremes[1], "clipped_ratio": total["clipped_length"] / n,
        **mismatch_stats(micro, reduce),
    }  # fmt: skip
    if rl.agentic:
        stats |= {"turns": total["turns"] / n, "tool/calls": total["tool_calls"] / n,
                  "tool/errors": total["tool_errors"] / n, "tool/timeouts": total["tool_timeouts"] / n,
                  "tool/crashes": total["tool_crashes"] / n}  # fmt: skip
    return stats


def mismatch_stats(micro: list[dict], reduce) -> dict[str, float]:
    """The sampler's log-probs against the trainer's over the sampled tokens of every process, with
    d = trainer's log-prob (the weights that sampled: `old_logp`) - the sampler's (`sampler_logp`) and
    r = exp(d): mean and max |d|; r's mean, min and max; `sampler/kl`, the mean of r - 1 - d (k3: an
    estimate of KL(sampler || trainer) from the sampler's own samples, >= 0)."""
    mask = torch.cat([b["completion_mask"].flatten() for b in micro]).double()
    old = torch.cat([b["old_logp"].flatten() for b in micro]).double()
    sampler = torch.cat([b["sampler_logp"].flatten() for b in micro]).double()
    diff = (old - sampler) * mask
    ratio = torch.exp(diff)
    sums = torch.stack(
        [mask.sum(), diff.abs().sum(), (ratio * mask).sum(), ((ratio - 1 - diff) * mask).sum()]
    )
    tokens, abs_diff, ratios, kl = reduce(sums).tolist()
    extremes = reduce(torch.stack([
        -torch.where(mask > 0, ratio, math.inf).min(), torch.where(mask > 0, ratio, -math.inf).max(),
        diff.abs().max(),
    ]), "max").tolist()  # fmt: skip
    tokens = max(tokens, 1.0)
    return {"sampler/abs_logp_diff": abs_diff / tokens, "sampler/ratio_mean": ratios / tokens,
            "sampler/ratio_min": -extremes[0], "sampler/ratio_max": extremes[1],
            "sampler/abs_logp_diff_max": extremes[2], "sampler/kl": kl / tokens}  # fmt: skip
