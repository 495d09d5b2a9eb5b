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

SFT: each token's loss is computed once, on the process holding it, and divided by the step's global
label count as without the split (`causal_lm.label_units` counts a shard's shifted targets). The
preference objectives: each process's per-row log-prob sums are added over the group with their
gradient (`sum_over_group`), so every process of the group computes the whole pairs' loss; each also
counts the pairs, so the step's count is N times theirs and the processes' losses add up to the loss
once. GRPO: a group's processes sample the same completions (the rollout's sums count each group once:
`once`), then train split, per-token values cut with the tokens and a completion's quantities added
over the group the same way (`liger_kernels.grpo`'s `row_sum`); distillation likewise, the teacher's
hidden states computed whole in the rollout and cut with the tokens. Either way a step's loss and gradients
are the unsplit ones; `check_on_twin` proves it on the run's own model and objective before the first
step. docs/distributed.md#long-sequences says what is
served and what is refused.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from liger_cli.data.encode import IGNORE_INDEX, collate, pack_examples
from liger_cli.errors import UserError

ATTENTION = "liger_sequence_parallel"  # the attention implementation a split forward runs under
_ACTIVE: list = []  # the split whose forward is running (`attending`)


class Shard(dict):
    """One process's part of a micro-batch (model inputs), with the mask over the whole sequence."""

    mask: torch.Tensor | None = None
    _ready: torch.Tensor | None = None  # the mask as the attention takes it, made once for every layer

    def mask_for(self, core: str, like: torch.Tensor) -> torch.Tensor | None:
        """sdpa takes the boolean mask as it is; eager adds its mask to the scores (0 or the lowest
        value), on the queries' device."""
        if self.mask is None or self._ready is not None:
            return self._ready
        mask = self.mask.to(like.device)
        if core == "eager":
            lowest = torch.finfo(like.dtype).min
            mask = torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(~mask, lowest)
        self._ready = mask
        return mask


@dataclass
class SequenceParallel:
    degree: int
    index: int
    """This process's place in its group: it holds positions [index * S/N, (index + 1) * S/N)."""
    group: object
    core: str = "sdpa"
    """The attention implementation each process runs over the whole sequence (the model's own)."""
    _shard: Shard | None = None
    _config: object = None  # the model's config, whose attention implementation a split forward switches

    @classmethod
    def start(cls, degree: int) -> SequenceParallel:
        """The groups of `degree` consecutive ranks (every process creates every group, in order)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        groups = [dist.new_group(list(range(g, g + degree))) for g in range(0, world, degree)]
        return cls(degree, rank % degree, groups[rank // degree])

    # --- the model ---------------------------------------------------------------------------------------

    def install(self, model) -> None:
        """Register the split attention (the Plan checked the model: `plan.sequence_parallel`) and take
        the model's own implementation to run over the whole sequence."""
        from transformers import AttentionInterface

        config = model.config.get_text_config()
        self.core = config._attn_implementation or "eager"
        if self.core not in ("eager", "sdpa"):
            raise UserError(
                f"distributed.sequence_parallel {self.degree} cannot serve attention {self.core}: set "
                "model.attn_implementation to sdpa or eager"
            )
        AttentionInterface.register(ATTENTION, _split_attention)
        self._config = config

    def check_on_twin(self, recipe, kernels: dict[str, bool]) -> str:
        """Before the first step, on a tiny twin of the run's model (its class and code, the kernels
        the run patched, the same seeded weights on every process of the group), by the run's objective:
        SFT's packed and padded micro-batches, or a micro-batch of preference pairs, give split over the
        group the loss and every gradient they give whole. A split that changes the math stops the run
        here. Returns the log's line."""
        from liger_cli.model.build import read_config
        from liger_cli.model.objectives import objective_for
        from liger_cli.plan.sequence_parallel import unsplittable
        from liger_cli.process_state import loading_alone
        from liger_cli.twin.kernel_check import disagreement
        from liger_cli.twin.pipeline_check import prepared_twin
        from liger_cli.twin.tiny import TinyModelError, twin_builder, twin_session

        m = recipe.model
        with twin_session(), loading_alone():  # built whole on each process, outside ZeRO-3's init
            try:
                config = read_config(m.path or m.config, m.trust_remote_code)
                twin = twin_builder(config, m.trust_remote_code, None, self.core)()
            except TinyModelError as err:
                return f"sequence parallel check: not run (no tiny twin: {err})"
            twin = prepared_twin(twin, kernels)
            if why := unsplittable(twin.config, self.degree):
                return f"sequence parallel check: not run (the tiny twin: {why})"
            twin_split = SequenceParallel(self.degree, self.index, self.group, self.core)
            twin_split.install(twin)
            rule = objective_for(recipe)
            batches = _twin_batches(twin, rule)
            for name, batch in batches:
                whole = _step(twin, batch, None, rule)
                split = _step(twin, twin_split.shard(batch), twin_split, rule)
                if why := disagreement(split, whole):
                    raise UserError(
                        f"distributed.sequence_parallel {self.degree}: on a tiny twin of the model, a {name} "
                        f"micro-batch split over {self.degree} processes and whole disagree ({why}): the "
                        "split would change what it learns; remove distributed.sequence_parallel"
                    )
        names = " and a ".join(name for name, _ in batches)
        return (
            f"sequence parallel check: a {names} micro-batch split over {self.degree} processes vs whole on a "
            "tiny twin: the loss and every gradient agree"
        )

    def once(self, reduce):
        """A sum over every process (`reduce`) of what each process of a group holds alike (a rollout's
        rewards and counts: its processes sample the same completions), counted once per group."""
        return lambda tensor, op="sum": (
            reduce(tensor, op) / self.degree if op == "sum" else reduce(tensor, op)
        )

    def values(self, compute, batch: dict[str, torch.Tensor], device) -> torch.Tensor:
        """`compute`'s per-position values of a whole batch ([B, S], no gradient), computed split as the
        training pass computes them: each process on its part, the parts gathered (so a rollout's
        log-probs are those its training pass starts from, bit for bit)."""
        part = self.shard(batch)
        with self.attending(part):
            found = compute({k: v.to(device) for k, v in part.items()})
        pieces = [torch.empty_like(found) for _ in range(self.degree)]
        dist.all_gather(pieces, found.contiguous(), group=self.group)
        return torch.cat(pieces, 1)[:, : batch["input_ids"].shape[1]]

    def sum_over_group(self, sums: torch.Tensor) -> torch.Tensor:
        """Per-row sums of this process's part of each row -> the whole rows' sums, on every process of
        the group, with their gradient (an all-gather, whose backward hands each part its share)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd, wait_tensor

        gathered = wait_tensor(all_gather_tensor_autograd(sums.unsqueeze(0), 0, self.group))
        return gathered.sum(0)

    @contextlib.contextmanager
    def attending(self, shard: Shard):
        """The split attention for the forwards (and recomputations in backward) inside the block."""
        self._shard, before = shard, self._config._attn_implementation
        self._config._attn_implementation = ATTENTION
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()
            self._config._attn_implementation, self._shard = before, None
            shard._ready = None  # the device copy of its mask lives as long as its forwards

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """[B, H, S/N, D] shards of q, k, v -> attention over the whole sequence on H/N heads ->
        [B, S/N, H, D], as transformers' attention functions return it."""
        if self.core == "eager":  # the family's own (softcapping, sinks, ...), beside its attention class
            core = sys.modules[type(module).__module__].eager_attention_forward
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as core
        q, k, v = (self._exchange(t) for t in (query, key, value))  # [B, H/N, S, D] each
        kwargs.pop("is_causal", None)
        out, _ = core(module, q, k, v, self._shard.mask_for(self.core, q), **kwargs)  # [B, S, H/N, D]
        return self._exchange(out), None

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """[B, A, C, D] -> [B, A/N, N*C, D]: dim 1 cut into N pieces, piece g to process g of the group,
        what comes back joined along dim 2. Positions for heads ([B, H, S/N, D] -> [B, H/N, S, D]) and
        back again ([B, S, H/N, D] -> [B, S/N, H, D])."""
        b, a, c, d = x.shape
        n = self.degree
        pieces = x.reshape(b, n, a // n, c, d).transpose(0, 1).contiguous()  # [N, B, A/N, C, D]
        got = _all_to_all(pieces, self.group)  # [N (whose piece), B, A/N, C, D]
        return got.permute(1, 2, 0, 3, 4).reshape(b, a // n, n * c, d)

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
        for key, value in batch.items():
            if key in ("input_ids", "labels", "position_ids", "attention_mask"):
                continue
            if value.dim() >= 2 and value.shape[:2] == (
                rows,
                length,
            ):  # per position (grpo's log-probs, mask)
                value = torch.cat([value, value.new_zeros(rows, pad, *value.shape[2:])], 1) if pad else value
                value = value[:, part].contiguous()
            shard[key] = value  # per row (advantages, a pair's reference row): as it is
        shard.mask = whole_mask(positions, keys, plain_causal_is_none=self.core != "eager")
        return shard


def attending(split: SequenceParallel | None, batch):
    """The split attention through the forwards (and backward's recomputations) of a block, for a run
    with or without a split."""
    return split.attending(batch) if split else contextlib.nullcontext()


def _split_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function registered with transformers: the running split's."""
    return _ACTIVE[-1].attention(module, query, key, value, attention_mask, **kwargs)


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


def _twin_batches(twin, objective) -> list[tuple[str, dict]]:
    """The twin check's micro-batches, by the objective's own collation: SFT's packed and padded ones
    (uneven lengths and label counts), preference pairs (chosen and rejected rows), or GRPO's rollout
    rows (the objective's own `twin_batch`)."""
    from liger_cli.twin.pipeline_check import (
        ACCUMULATION_EXAMPLES,
        PACKED_LENGTH,
        PACKING_EXAMPLES,
        twin_examples,
    )
    from liger_cli.twin.tiny import tiny_pairs, twin_vocab

    vocab, pad = twin_vocab(twin)
    if hasattr(objective, "twin_batch"):  # grpo: rollout rows (prompts, completions, their log-probs)
        return [("rollout", objective.twin_batch(vocab, pad))]
    if objective.unit == "pair":
        return [("preference-pair", objective.collate(tiny_pairs(twin), pad))]
    packed = pack_examples(twin_examples(PACKING_EXAMPLES, vocab), PACKED_LENGTH)
    return [
        ("packed", collate(packed, pad)),
        ("padded", collate(twin_examples(ACCUMULATION_EXAMPLES, vocab), pad)),
    ]


def _step(model, batch: dict, split: SequenceParallel | None, objective):
    """The objective's loss (divided by the batch's units, over the group when split) and every
    gradient, whole or split (then summed over the group, as the run's gradient reduction sums the
    processes' parts)."""
    from liger_cli.twin.kernel_check import Step

    model.zero_grad(set_to_none=True)
    if hasattr(objective, "split"):  # per-row sums: added over the group when split
        objective.split = split
    units = objective.units(batch).clone()
    if split is not None:
        dist.all_reduce(units, group=split.group)
    with attending(split, batch):
        loss = objective.loss(model, dict(batch), units)[0]
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    loss = loss.detach().clone()
    if split is not None:
        for tensor in (loss, *grads.values()):
            dist.all_reduce(tensor, group=split.group)
    return Step(loss, grads)


def _all_to_all(pieces: torch.Tensor, group) -> torch.Tensor:
    """Piece i of dim 0 to process i of the group; what each sends back, stacked along dim 0."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(pieces, None, None, group))
