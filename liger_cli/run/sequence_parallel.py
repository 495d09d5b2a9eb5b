"""Sequence parallelism (`distributed.sequence_parallel: N`): every sequence of a micro-batch split
across N processes, each holding 1/N of its tokens (their activations, logits and loss).

The N processes of a group (consecutive ranks, so one machine's) take the same micro-batch: the data
is sharded over world / N groups. Each process keeps its contiguous 1/N of the positions, with the
targets shifted on the whole sequence first (`shift_labels`: the last token of a shard predicts the
first of the next). Everything but attention is per token and runs on the shard as it is. Attention
(Ulysses, as DeepSpeed's sequence parallelism does it): an all-to-all trades positions for heads, so
that each process attends over the whole sequence with 1/N of the heads, then a second all-to-all
trades them back (torch's autograd-aware all_to_all_single: the backward is the reverse exchange).
The mask over the whole sequence (causal, each packed document alone, padding never a key) is built
here from the whole micro-batch, which every process of the group holds, so no collective is needed
for it; the model's own mask, built for the shard's length, is never made.

Each token's loss is computed once, on the process holding it, and divided by the step's global label
count as without the split (`causal_lm.label_units` counts a shard's shifted targets), so a step's
loss and gradients are the unsplit ones; `check_split` proves it on the run's own model before the
first step. docs/distributed.md#long-sequences says what is served and what is refused.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from liger_cli.data.encode import IGNORE_INDEX
from liger_cli.errors import UserError

ATTENTION = "liger_sequence_parallel"  # the attention implementation a split forward runs under


class Shard(dict):
    """One process's part of a micro-batch (model inputs), with the mask over the whole sequence."""

    mask: torch.Tensor | None = None


@dataclass
class SequenceParallel:
    degree: int
    index: int
    """This process's place in its group: it holds positions [index * S/N, (index + 1) * S/N)."""
    group: object
    core: str = "sdpa"
    """The attention implementation each process runs over the whole sequence (the model's own)."""
    _active: Shard | None = None
    _config: object = None  # the model's config, whose attention implementation a split forward switches

    @classmethod
    def start(cls, degree: int) -> SequenceParallel:
        """The groups of `degree` consecutive ranks (every process creates every group, in order)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        groups = [dist.new_group(list(range(g, g + degree))) for g in range(0, world, degree)]
        return cls(degree, rank % degree, groups[rank // degree])

    # --- the model ---------------------------------------------------------------------------------------

    def install(self, model) -> str:
        """Register the split attention and check that the model's attention can be split: every layer
        full causal attention (no sliding window shorter than a sequence), a text model, heads and
        key-value heads divisible by N, no attention dropout. Returns the log's line."""
        from transformers import AttentionInterface

        config = model.config.get_text_config()
        why = _unsplittable(model.config, config, self.degree)
        if why:
            raise UserError(
                f"distributed.sequence_parallel {self.degree}: {why}; remove distributed.sequence_parallel"
            )
        self.core = config._attn_implementation or "eager"
        if self.core not in ("eager", "sdpa"):
            raise UserError(
                f"distributed.sequence_parallel {self.degree} cannot serve attention {self.core}: set "
                "model.attn_implementation to sdpa or eager"
            )
        AttentionInterface.register(ATTENTION, self._attention)
        self._config = config
        return (
            f"sequence parallel: each sequence split over {self.degree} processes ({config.num_attention_heads} "
            f"heads, {self.core} over the whole sequence with {config.num_attention_heads // self.degree} "
            "heads each)"
        )

    @contextlib.contextmanager
    def attending(self, shard: Shard):
        """The split attention for the forwards (and recomputations in backward) inside the block."""
        self._active, before = shard, self._config._attn_implementation
        self._config._attn_implementation = ATTENTION
        try:
            yield
        finally:
            self._config._attn_implementation, self._active = before, None

    def _attention(self, module, query, key, value, attention_mask, **kwargs):
        """[B, H, S/N, D] shards of q, k, v -> attention over the whole sequence on H/N heads ->
        [B, S/N, H, D], as transformers' attention functions return it."""
        if self.core == "eager":  # the family's own (softcapping, sinks, ...), beside its attention class
            core = sys.modules[type(module).__module__].eager_attention_forward
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as core
        q, k, v = (self._heads_for_positions(t) for t in (query, key, value))
        mask = self._active.mask
        if mask is not None:
            mask = mask.to(q.device)
            if self.core == "eager":  # eager adds its mask to the scores
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                    ~mask, torch.finfo(q.dtype).min
                )
        kwargs.pop("is_causal", None)
        out, _ = core(module, q, k, v, mask, **kwargs)  # [B, S, H/N, D]
        return self._positions_for_heads(out), None

    def _heads_for_positions(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, S/N, D] -> [B, H/N, S, D]: head group g goes to process g, positions come back."""
        b, h, s, d = x.shape
        n = self.degree
        pieces = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # [N, B, H/N, S/N, D]
        got = _all_to_all(pieces, self.group)  # [N (whose positions), B, H/N, S/N, D]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)

    def _positions_for_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, H/N, D] -> [B, S/N, H, D]: the reverse exchange."""
        b, s, h, d = x.shape
        n = self.degree
        pieces = x.reshape(b, n, s // n, h, d).transpose(0, 1).contiguous()  # [N, B, S/N, H/N, D]
        got = _all_to_all(pieces, self.group)  # [N (whose heads), B, S/N, H/N, D]
        return got.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)

    # --- the data --------------------------------------------------------------------------------------

    def shard(self, batch: dict[str, torch.Tensor]) -> Shard:
        """This process's positions of a collated micro-batch (padded to a multiple of N), its targets
        shifted on the whole sequence, and the whole sequence's mask (`whole_mask`)."""
        ids, labels = batch["input_ids"], batch["labels"]
        rows, length = ids.shape
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length).expand(rows, length)
        keys = batch.get("attention_mask", torch.ones_like(ids)).bool()
        pad = -length % self.degree
        if pad:
            ids = torch.cat([ids, ids.new_zeros(rows, pad)], 1)
            labels = torch.cat([labels, labels.new_full((rows, pad), IGNORE_INDEX)], 1)
            positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(pad)], 1)
            keys = torch.cat([keys, keys.new_zeros(rows, pad)], 1)
        targets = torch.cat([labels[:, 1:], labels.new_full((rows, 1), IGNORE_INDEX)], 1)
        size = ids.shape[1] // self.degree
        part = slice(self.index * size, (self.index + 1) * size)
        shard = Shard(
            input_ids=ids[:, part].contiguous(),
            labels=targets[:, part].contiguous(),
            shift_labels=targets[:, part].contiguous(),
            position_ids=positions[:, part].contiguous(),
        )
        shard.mask = whole_mask(positions, keys, plain_causal_is_none=self.core != "eager")
        return shard


def whole_mask(
    positions: torch.Tensor, keys: torch.Tensor, plain_causal_is_none: bool
) -> torch.Tensor | None:
    """[B, 1, S, S] boolean: query i sees key j when j <= i, both in the same packed document (a new one
    starts where position_ids restart at 0) and j is not padding. None when that is plain causal and
    `plain_causal_is_none` (sdpa is then causal by itself; eager needs every mask)."""
    starts = positions == 0
    starts[:, 0] = True
    packed = bool(starts[:, 1:].any())
    left_padding = bool((~keys[:, :-1] & keys[:, 1:]).any())  # a padding key before a real one
    if not (packed or left_padding) and plain_causal_is_none:
        return None
    length = positions.shape[1]
    document = starts.cumsum(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = document[:, :, None] == document[:, None, :]
    return (causal & same & keys[:, None, :])[:, None]


def _all_to_all(pieces: torch.Tensor, group) -> torch.Tensor:
    """Piece i of dim 0 to process i of the group; what each sends back, stacked along dim 0."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(pieces, None, None, group))


def _unsplittable(config, text, degree: int) -> str | None:
    """Why this model's attention cannot be split over `degree` processes, or None."""
    if config is not text:
        return "a vision-language model is not split (its image tokens attend as the family decides)"
    heads, kv = (
        text.num_attention_heads,
        getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
    )
    if heads % degree or kv % degree:
        return f"its {heads} attention heads and {kv} key-value heads must both be divisible by {degree}"
    window = getattr(text, "sliding_window", None)
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or (window and getattr(text, "use_sliding_window", True)):
        return "its layers use sliding-window or chunked attention, which the split's mask does not reproduce"
    if getattr(text, "attention_dropout", 0.0):
        return "attention dropout draws a different mask on each split"
    return None
