"""Which examples each rank trains on at each step: a pure function of (seed, step, rank).

Why the batches are indexed by step rather than drawn from a DataLoader iterator: a resumed run
sees exactly the batches an uninterrupted run would, and every rank of a multi-process run gets its
own slice of the same global batch that a one-process run would train on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from liger_cli.recipe import TrainingSection


@dataclass
class StepBatches:
    """Global batch order: epoch e is a seeded permutation; micro-batch g of the run is a slice of it."""

    size: int
    micro_batch_size: int
    world: int
    rank: int
    seed: int

    @property
    def micro_per_epoch(self) -> int:
        """Micro-batches per rank per epoch (the incomplete global tail is dropped, so ranks stay in step)."""
        return self.size // (self.micro_batch_size * self.world)

    def indices(self, g: int) -> list[int]:
        epoch, k = divmod(g, self.micro_per_epoch)
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))
        start = (k * self.world + self.rank) * self.micro_batch_size
        return order[start : start + self.micro_batch_size].tolist()


def total_steps(training: TrainingSection, batches: StepBatches) -> int:
    if training.max_steps:
        return training.max_steps
    return max(1, math.ceil((training.epochs or 1) * batches.micro_per_epoch / training.grad_accum))


def even_shares(size: int, micro_batch_size: int, world: int, rank: int) -> list[tuple[range, bool]]:
    """This rank's micro-batches of a pass over `size` examples in order (evaluation, precomputing):
    batch j goes to rank j % world, so a batch holds the same examples whatever the world size. Every
    rank gets as many batches (FSDP and ZeRO-3 forwards are collective); a rank's padding batches
    repeat the first one and are marked False: run them, drop what they give."""
    starts = range(0, size, micro_batch_size)
    shares = []
    for i in range(math.ceil(len(starts) / world)):
        j = i * world + rank
        start = starts[j] if j < len(starts) else 0
        shares.append((range(start, min(start + micro_batch_size, size)), j < len(starts)))
    return shares


def image_filler(dataset) -> dict | None:
    """The first image row of `dataset` with every label ignored (None when it has none), for `with_filler`."""
    from liger_cli.data.encode import IGNORE_INDEX
    from liger_cli.data.images import IMAGE_STARTS

    if dataset is None or IMAGE_STARTS not in dataset.column_names:
        return None
    found = next((i for i, starts in enumerate(dataset[IMAGE_STARTS]) if starts), None)
    if found is None:
        return None
    row = dict(dataset[found])
    return row | {"labels": [IGNORE_INDEX] * len(row["labels"])}


def with_filler(examples: list[dict], filler: dict | None) -> list[dict]:
    """A micro-batch of text rows in a multi-process run of image data gets `filler`, an image row with
    nothing to learn, so that every rank runs the vision tower in every forward: a sharded tower's
    gathers (FSDP, ZeRO-3) must run on all ranks or none, and DDP waits for a trainable projector's
    gradient from each rank. It adds no label token, so the loss and gradients are unchanged."""
    from liger_cli.data.images import IMAGES_COLUMN

    if filler is None or any(ex.get(IMAGES_COLUMN) for ex in examples):
        return examples
    return [*examples, filler]
