"""GRPO (and DAPO, Dr. GRPO, GSPO, CISPO): an online objective. Its batches are made during the run:
each step's prompts are sampled G times from the model being trained, scored by the recipe's reward
functions, and turned into advantages; then the loss is `rl.loss`'s, in `liger_kernels.grpo`.

`rollout` makes a step's micro-batches (every prompt's G completions in the same micro-batch, so a
group's statistics are local), through `sample`, the run's way of calling the generation engine on the
model as its backend wraps it. Sampling is keyed by (seed, step, prompt row, completion), so the
completions do not depend on how prompts are spread over processes. At the same time it takes, with
no gradient, the trainer's log-probs of the sampled tokens at the sampling temperature (`old`: the
weights that sampled) and, with beta > 0, the reference's, and compares the trainer's with the
sampler's: the mismatch figures are logged every step, before any cap.

The reference is the model before training. With an adapter it is the adapter switched off (no copy).
With full fine-tuning it is a copy of the starting weights as this process stores them (its shard
under FSDP and ZeRO-3: 1/world of the trainable weights), taken before a resume loads trained ones,
and swapped into the model for the reference pass: the same forward, kernels and sharding as the
policy's, no second wrapped model.

`loss` takes each completion token's log-prob at the same temperature through the model's own
forward (fused with our kernel patched in: never the [tokens, vocab] logits), then sums the per-token
loss as `rl.loss` aggregates and divides by the step's global units (completions; completion tokens
for dapo and cispo), like every objective, so micro-batches and processes add up to one batch's update.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass

import torch
from torch import nn

from liger_cli.data.encode import IGNORE_INDEX, collate
from liger_cli.model.objectives.online import Online, aligned, shifted, token_logprobs
from liger_cli.model.objectives.preference import kept_flags, reference_mode
from liger_cli.model.objectives.rewards import Reward, score
from liger_cli.model.objectives.rollout_stats import rollout_stats


@dataclass
class Sampled:
    """A step's completions as sampled and scored, before the trainer's part of the rollout (`Grpo.finish`)."""

    data_step: int
    version: int
    """The policy version that was asked to sample them (each row says which did: `policy_version`)."""
    micro: list[dict]
    rows: list[dict]
    sampling_s: float
    tools_s: float


class Grpo(Online):
    def __init__(self, rl, rewards: list[Reward], seed: int, adapter: bool):
        from liger_kernels.grpo import PER_TOKEN

        super().__init__(rl)
        self.rewards, self.seed, self.adapter = rewards, seed, adapter
        self.unit = "completion token" if rl.loss in PER_TOKEN else "completion"
        self._cached: tuple[int, list] | None = None
        self._iteration = 0
        """Which of its num_iterations optimizer steps the current batch of completions serves."""
        self._on_policy = True
        """The current batch was sampled by the weights being trained, and this is its first update."""
        self._reference: list[torch.Tensor] | None = None
        """Full fine-tuning with beta > 0: the starting weights as this process stores them."""
        self._stored = None
        self.split = None
        """The run's sequence parallelism (`liger_cli.run.sequence_parallel`, set by the run), or None: the
        rollout's log-probs are then computed split as training computes them (`split.values`), and a
        completion's sums are added over its group (`split.sum_over_group`) before the loss."""

    # --- what the loop asks -------------------------------------------------------------------------

    def data_step(self, step: int) -> int:
        """Which step's prompts serve optimizer step `step` (each batch serves num_iterations steps)."""
        return step // self.rl.num_iterations

    def rollout(self, step: int, examples: list[list[dict]], model, sample, reduce) -> list[dict]:
        """The step's micro-batches: new completions on the first of num_iterations steps, else the
        same ones again (their old log-probs from the weights that sampled them)."""
        data_step = self.data_step(step)
        self._iteration = step - data_step * self.rl.num_iterations
        if self._cached is not None and self._cached[0] == data_step:
            self.samples = []  # written when they were sampled
            self._on_policy = False
            return self._cached[1]
        return self.finish(step, self.sample_batch(data_step, examples, sample), model, reduce)

    def sample_batch(self, data_step: int, examples: list[list[dict]], sample) -> Sampled:
        """A step's micro-batches sampled and scored: no gradient and no other process (the part that
        rl.max_staleness runs in the background, `liger_cli.run.pipeline`)."""
        start, tools_before = time.perf_counter(), getattr(sample, "tools_s", 0.0)
        micro, rows = [], []
        for prompts in examples:
            batch, found = self._sample(data_step, prompts, sample)
            micro.append(batch)
            rows += found
        tools = getattr(sample, "tools_s", 0.0) - tools_before
        return Sampled(data_step, sample.version, micro, rows, time.perf_counter() - start - tools, tools)

    def finish(self, step: int, sampled: Sampled, model, reduce, weights=None) -> list[dict]:
        """The rest of a rollout, every process together: stale rows dropped (rl.max_staleness), advantages,
        the trainer's log-probs under the weights that sampled (`weights`: a context that puts them in the
        model, when they are not the model's own now), the step's figures and rows."""
        start, micro, rows = time.perf_counter(), sampled.micro, sampled.rows
        dropped = self._drop_stale(step, micro, rows) if self.rl.max_staleness else None
        self._advantages(micro, reduce)
        with weights if weights is not None else contextlib.nullcontext():
            for batch in micro:
                self._trainer_logps(model, batch)
        self.step_stats = rollout_stats(micro, rows, reduce, self.rl, self.rewards)
        # This process's seconds: sampling and scoring, then the whole rollout (with the no-grad log-probs).
        self.step_stats |= {
            "time/sampling_s": sampled.sampling_s,
            "time/rollout_s": sampled.sampling_s + sampled.tools_s + time.perf_counter() - start,
        }
        if self.rl.agentic:
            self.step_stats["time/tools_s"] = sampled.tools_s
        if dropped is not None:
            self.step_stats["rollout/stale_dropped"] = float(reduce(torch.tensor([float(dropped)]))[0])
        self.samples = self._rows(step, micro, rows)
        self._cached = (sampled.data_step, micro)
        self._on_policy = self._iteration == 0 and sampled.version == step
        return micro

    def _drop_stale(self, step: int, micro: list[dict], rows: list[dict]) -> int:
        """Rows sampled more than rl.max_staleness versions before `step` leave the loss with their whole
        group (their labels masked: every shape stays); how many rows left."""
        oldest, g, dropped, first = step - self.rl.max_staleness, self.rl.num_generations, 0, 0
        for batch in micro:
            n = batch["rewards"].numel()
            versions = [rows[first + i]["policy_version"] for i in range(n)]
            stale = {i // g for i, v in enumerate(versions) if v is None or v < oldest}
            for group in stale:
                segments = (batch["trajectory"] // g) == group
                batch["labels"][segments] = IGNORE_INDEX
                batch["completion_mask"][segments] = False
                for i in range(group * g, group * g + g):
                    rows[first + i]["stale_dropped"] = True
                dropped += g
            first += n
        return dropped

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from liger_kernels.grpo import loss_units

        return loss_units(batch["completion_mask"], self.rl.loss, self._row_sum)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor):
        from liger_kernels.grpo import aggregate, grpo_token_loss, importance_weights

        rl = self.rl
        logp, mask = token_logprobs(model, batch, rl.temperature)
        # The first update on a batch sampled by these weights is on-policy: the old log-probs are the
        # current ones, exactly. Later iterations and older samples (rl.max_staleness) use the sampling weights'.
        old = logp.detach() if self._on_policy else batch["old_logp"]
        weights = capped = None
        if rl.importance_sampling != "none":  # the sampler's distribution against the trainer's (docs/rl.md)
            weights, capped = importance_weights(
                batch["old_logp"], batch["sampler_logp"], mask, rl.importance_sampling,
                rl.importance_sampling_cap, self._row_sum, batch.get("trajectory"),
            )  # fmt: skip
        per_token, stats = grpo_token_loss(
            logp, old, batch["advantages"], mask, rl.epsilon, rl.epsilon_high, rl.beta,
            batch.get("ref_logp"), weights, rl.loss, self._row_sum,
        )  # fmt: skip
        divide = num_items.to(per_token.device, per_token.dtype)
        total = lambda values: aggregate(values, mask, rl.loss, rl.max_new_tokens, self._row_sum) / divide  # noqa: E731
        metrics = {"clip_fraction": total(stats["clipped"])}
        if "kl" in stats:
            metrics["kl"] = total(stats["kl"])
        if capped is not None:  # the share of sampled tokens whose weight the cap changed
            metrics["sampler/capped"] = total(capped.to(per_token.dtype))
        return total(per_token), metrics

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """This process's batch of completions and its figures, which the remaining num_iterations
        steps reuse: a run resumed between them trains on the same completions (tensors, metadata)."""
        if self._cached is None:
            return None
        data_step, micro = self._cached
        tensors = {f"{i}/{name}": t.contiguous() for i, b in enumerate(micro) for name, t in b.items()}
        return tensors, {"data_step": data_step, "micro_batches": len(micro), "step_stats": self.step_stats}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        micro: list[dict] = [{} for _ in range(meta["micro_batches"])]
        for key, value in tensors.items():
            i, _, name = key.partition("/")
            micro[int(i)][name] = value
        self._cached, self.step_stats = (meta["data_step"], micro), meta["step_stats"]
        self._on_policy = False

    def keep_reference(self, model: nn.Module, backend) -> None:
        """Called once on the prepared model before any weight changes (and before a resume loads
        trained ones): full fine-tuning with beta > 0 keeps a copy of this process's stored trainable
        weights, reached the backend's way (`backend.stored_trainable(model)`)."""
        if self.rl.beta > 0 and not self.adapter:
            self._stored = stored = backend.stored_trainable
            with torch.no_grad():
                self._reference = [t.detach().clone() for t in stored(model)]

    @property
    def _row_sum(self):
        return self.split.sum_over_group if self.split else None

    def twin_batch(self, vocab: int, pad_id: int, rows: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
        """Rollout rows as `rollout` makes them, with random ids below `vocab` (prompts and completions of
        different lengths, some with environment ids inside, advantages, old, sampler and reference log-probs),
        for the twin's checks: its kernels and accumulation are proved on this objective's loss, tool tokens
        left out of it on every path."""
        g = torch.Generator().manual_seed(seed)
        features = []
        for prompt, completion in self.random_rows(vocab, rows, g):
            learned = list(completion)
            if len(learned) >= 5:  # an environment turn inside the completion: its ids are not learned
                learned[2:4] = [IGNORE_INDEX] * 2
            features.append({"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + learned,
                             "position_ids": list(range(len(prompt) + len(completion)))})  # fmt: skip
        batch = collate(features, pad_id)
        batch["completion_mask"] = shifted(batch["labels"]) != IGNORE_INDEX
        batch["advantages"] = torch.randn(rows, generator=g)
        batch["old_logp"] = -torch.rand(batch["input_ids"].shape, generator=g)
        batch["sampler_logp"] = batch["old_logp"] - 0.01
        batch["trajectory"] = torch.arange(rows)
        if self.rl.beta > 0:
            batch["ref_logp"] = batch["old_logp"] - 0.05
        return batch

    # --- a rollout, step by step --------------------------------------------------------------------

    def _sample(self, data_step: int, prompts: list[dict], sample) -> tuple[dict, list[dict]]:
        """G trajectories of each prompt, scored; the micro-batch of their samples (one row per trajectory,
        or per model turn where the template is not append-only): prompt, then sampled ids learned and
        environment ids not (`completion_mask`), each row knowing its trajectory."""
        rows, trajectories = self.group(data_step, prompts, sample)
        totals, per_function = self.score(trajectories, rows, sample.text)
        found = [
            self.rollout_row(rows[i], t, sample.text(t))
            | {"rewards": {n: v[i] for n, v in per_function.items()}, "reward": totals[i],
               "sampled_tokens": sum(sum(s.mask) for s in t.segments)}
            | ({"turn_versions": t.versions} if self.rl.agentic else {})
            | ({"segments": [vars(s) for s in t.segments]} if len(t.segments) > 1 else {})
            for i, t in enumerate(trajectories)
        ]  # fmt: skip
        features, owners, segments = [], [], []
        for i, t in enumerate(trajectories):
            left_out = self.rl.mask_truncated and t.finish_reason != "stop"  # cut by a limit: not learned
            for seg in t.segments:
                learned = [
                    tok if m and not left_out else IGNORE_INDEX
                    for tok, m in zip(seg.ids, seg.mask, strict=True)
                ]
                features.append({"input_ids": seg.prompt_ids + seg.ids,
                                 "labels": [IGNORE_INDEX] * len(seg.prompt_ids) + learned,
                                 "position_ids": list(range(len(seg.prompt_ids) + len(seg.ids)))})  # fmt: skip
                owners.append(i)
                segments.append(seg)
        batch = collate(features, sample.tokenizer.pad_token_id)
        batch["completion_mask"] = shifted(batch["labels"]) != IGNORE_INDEX
        batch["sampler_logp"] = aligned(
            [s.logprobs for s in segments], [len(s.prompt_ids) for s in segments], batch
        )
        batch["rewards"] = torch.tensor(totals, dtype=torch.float32)
        batch["trajectory"] = torch.tensor(owners, dtype=torch.long)
        return batch, found

    def score(self, trajectories: list, prompts: list[dict], text) -> tuple[list[float], dict[str, list]]:
        """Each trajectory's reward and each function's values; `prompts` are their prompt rows. Reward
        functions get the completions (`text(trajectory)`: the last model turn's text) and, in a multi-turn
        run, `messages` (and `environment` with rl.environment)."""
        fields_of = [json.loads(p["fields"]) for p in prompts]
        names = sorted({k for f in fields_of for k in f})
        fields = {name: [f.get(name) for f in fields_of] for name in names}
        extra = {}
        if self.rl.agentic:
            extra["messages"] = [t.messages for t in trajectories]
            if self.rl.environment:
                extra["environment"] = [t.environment for t in trajectories]
        ids = [[i for s in t.segments for i in s.ids] for t in trajectories]
        return score(self.rewards, [text(t) for t in trajectories], [json.loads(p["prompt"]) for p in prompts],
                     ids, fields, [p["row"] + 1 for p in prompts], extra, timeout=self.rl.reward_timeout)  # fmt: skip

    def _advantages(self, micro: list[dict], reduce) -> None:
        from liger_kernels.grpo import group_advantages

        batch_std = None
        if self.rl.scale_rewards == "batch":  # the std of every reward of the step, over all processes
            rewards = torch.cat([b["rewards"] for b in micro]).double()
            sums = reduce(
                torch.stack([rewards.sum(), (rewards**2).sum(), torch.tensor(float(rewards.numel()))])
            )
            n = sums[2]
            mean = sums[0] / n
            batch_std = torch.sqrt(torch.clamp((sums[1] - n * mean**2) / torch.clamp(n - 1, min=1), min=0))
        for batch in micro:  # per trajectory, then on each of its rows
            batch["trajectory_advantages"] = group_advantages(
                batch["rewards"], self.rl.num_generations, self.rl.scale_rewards, batch_std
            )
            batch["advantages"] = batch["trajectory_advantages"][batch["trajectory"]]

    def _trainer_logps(self, model: nn.Module, batch: dict) -> None:
        """The trainer's log-probs of the sampled tokens under the weights that sampled them (no dropout,
        no gradient) and, with beta > 0, the reference's (the adapter switched off)."""
        device = next(p for p in model.parameters()).device

        def logps(rows: dict) -> torch.Tensor:  # split as training splits them, under sequence parallelism
            if self.split:
                return self.split.values(
                    lambda part: token_logprobs(model, part, self.rl.temperature)[0], rows, device
                )
            return token_logprobs(model, {k: v.to(device) for k, v in rows.items()}, self.rl.temperature)[0]

        with torch.no_grad(), kept_flags(model):
            model.eval()
            batch["old_logp"] = logps(batch).cpu()
            if self.rl.beta > 0:
                with self._reference_weights(model):
                    batch["ref_logp"] = logps(batch).cpu()

    @contextlib.contextmanager
    def _reference_weights(self, model: nn.Module):
        """The model computing as the reference: the adapter switched off, or the starting weights
        swapped in (and the trained ones back after, bit for bit)."""
        if self.adapter:
            with reference_mode(model):
                yield
            return
        if self._reference is None:
            raise RuntimeError("grpo with beta > 0 and full fine-tuning: keep_reference was not called")
        with torch.no_grad():
            stored = self._stored(model)
        swap_in_place(stored, self._reference)
        try:
            yield
        finally:
            with torch.no_grad():
                stored = self._stored(model)  # resharded again: the next forward gathers the trained ones
            swap_in_place(stored, self._reference)

    def _rows(self, step: int, micro: list[dict], rows: list[dict]) -> list[dict]:
        """rollouts.jsonl's rows, one per trajectory: `completion_ids` every id after the prompt (sampled and
        environment), `completion_mask` 1 where sampled, `sampler_logprobs` 0 where not; `segments` (each
        sample's ids) when the trajectory was trained per turn."""
        advantages = torch.cat([b["trajectory_advantages"] for b in micro]).tolist()
        return [
            {"step": step + 1, **{k: v for k, v in r.items() if k != "sampled_tokens"}, "advantage": a}
            for r, a in zip(rows, advantages, strict=True)
        ]


@torch.no_grad()
def swap_in_place(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Exchange the values of each pair in place (the storage stays where the backend put it; one
    tensor's worth of scratch at a time)."""
    for x, y in zip(a, b, strict=True):
        scratch = x.detach().clone()
        x.copy_(y)
        y.copy_(scratch)
