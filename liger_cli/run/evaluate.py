"""Evaluation: the objective's loss (and its metrics) as a mean over every unit of the eval set."""

from __future__ import annotations

import math

import torch

from liger_cli.model.objectives import Objective


@torch.no_grad()
def evaluate(model, dataset, accelerator, objective: Objective, micro_batch_size: int, pad_id: int) -> dict:
    """`eval_loss` and `eval_<metric>`: sums over the whole eval set divided by its units (each rank
    takes every world-th batch)."""
    model.eval()
    device = accelerator.device
    names: list[str] = []
    sums: torch.Tensor | None = None  # loss, then each metric, then the unit count (float64)
    starts = range(0, len(dataset), micro_batch_size)
    per_rank = math.ceil(len(starts) / accelerator.num_processes)
    for i in range(per_rank):  # every rank runs the same number of forwards (FSDP needs that)
        j = i * accelerator.num_processes + accelerator.process_index
        start = starts[j] if j < len(starts) else starts[0]
        examples = [dataset[k] for k in range(start, min(start + micro_batch_size, len(dataset)))]
        batch = {k: v.to(device) for k, v in objective.collate(examples, pad_id).items()}
        loss, stats = objective.loss(model, batch, torch.ones((), device=device))  # sums over its units
        names = list(stats)
        values = torch.stack(
            [loss.double(), *(v.double() for v in stats.values()), objective.units(batch).double()]
        )
        if sums is None:
            sums = torch.zeros_like(values)
        if j < len(starts):
            sums += values
    sums = accelerator.reduce(sums, "sum")
    model.train()
    means = (sums[:-1] / sums[-1].clamp(min=1)).tolist()
    return dict(zip(["eval_loss", *(f"eval_{n}" for n in names)], means, strict=True))
