"""Evaluation: the objective's loss (and its metrics) as a mean over every unit of the eval set."""

from __future__ import annotations

import torch

from liger_cli.data.batches import even_shares, with_filler
from liger_cli.model.objectives import Objective
from liger_cli.run.inputs import data_shares
from liger_cli.run.sequence_parallel import attending


@torch.no_grad()
def evaluate(
    model,
    dataset,
    accelerator,
    objective: Objective,
    micro_batch_size: int,
    pad_id: int,
    filler=None,
    split=None,
) -> dict:
    """`eval_loss` and `eval_<metric>`: sums over the whole eval set divided by its units (each rank
    takes every world-th batch). `filler`: the run's image row for text-only batches (`Data.filler`);
    `split`: the run's sequence parallelism (each group takes every (world / N)-th batch and splits it)."""
    model.eval()
    device = accelerator.device
    names: list[str] = []
    sums: torch.Tensor | None = None  # loss, then each metric, then the unit count (float64)
    shares = even_shares(
        len(dataset), micro_batch_size, *data_shares(accelerator, split.degree if split else 1)
    )

    def batches():  # collated as they are used, never all at once
        for rows, _ in shares:
            batch = objective.collate(with_filler([dataset[k] for k in rows], filler), pad_id)
            yield split.shard(batch) if split else batch

    if hasattr(objective, "begin_step"):  # kto: z0 of the whole eval set, as a step's is of the step
        reduce = lambda t: accelerator.reduce(t, "sum")  # noqa: E731
        objective.begin_step(model, batches(), device, reduce, [real for _, real in shares])
    for (_, real), batch in zip(shares, batches(), strict=True):  # every rank runs the same forwards (FSDP)
        with attending(split, batch):
            batch = {k: v.to(device) for k, v in batch.items()}
            loss, stats = objective.loss(model, batch, torch.ones((), device=device))  # sums over its units
        names = list(stats)
        values = torch.stack(
            [loss.double(), *(v.double() for v in stats.values()), objective.units(batch).double()]
        )
        if sums is None:
            sums = torch.zeros_like(values)
        if real:
            sums += values
    sums = accelerator.reduce(sums, "sum")
    model.train()
    means = (sums[:-1] / sums[-1].clamp(min=1)).tolist()
    return dict(zip(["eval_loss", *(f"eval_{n}" for n in names)], means, strict=True))
