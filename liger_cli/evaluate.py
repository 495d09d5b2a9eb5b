"""The loss as training and evaluation compute it: a sum over label tokens over a global count."""

from __future__ import annotations

import math

import torch

from liger_cli.data import collate


def micro_loss(model, batch: dict, num_items: torch.Tensor, device) -> torch.Tensor:
    """Sum of this micro-batch's token losses divided by the step's global label-token count."""
    batch = {k: v.to(device) for k, v in batch.items()}
    return model(**batch, num_items_in_batch=num_items).loss


def label_tokens(batch: dict) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


@torch.no_grad()
def evaluate(model, dataset, accelerator, micro_batch_size: int, pad_id: int) -> float:
    """Mean loss per label token over the eval set (each rank takes every world-th batch)."""
    model.eval()
    loss_sum = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    tokens = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    starts = range(0, len(dataset), micro_batch_size)
    per_rank = math.ceil(len(starts) / accelerator.num_processes)
    for i in range(per_rank):  # every rank runs the same number of forwards (FSDP needs that)
        j = i * accelerator.num_processes + accelerator.process_index
        start = starts[j] if j < len(starts) else starts[0]
        batch = collate(
            [dataset[k] for k in range(start, min(start + micro_batch_size, len(dataset)))], pad_id
        )
        one = torch.ones((), device=accelerator.device)
        loss = micro_loss(model, batch, one, accelerator.device)  # a sum over tokens
        if j < len(starts):
            loss_sum += loss.double()
            tokens += label_tokens(batch).to(accelerator.device)
    loss_sum, tokens = accelerator.reduce(torch.stack([loss_sum, tokens]), "sum")
    model.train()
    return (loss_sum / tokens.clamp(min=1)).item()
