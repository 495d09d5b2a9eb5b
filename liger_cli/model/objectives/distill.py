"""On-policy distillation: an online objective. Each step's prompts are sampled by the student as it
trains (the rl section's sampling keys, through the run's sampler: the generation engine on the model
as its backend wraps it, keyed by (seed, step, prompt row, completion) as GRPO's rollouts are), and the
loss on every sampled token is the divergence between the student's and a frozen teacher's
next-token distributions over the whole vocabulary (`distill.loss`: reverse KL, or TRL GKD's
generalized JSD with `distill.beta`), at `distill.temperature`.

Neither model's [tokens, vocab] logits exist on the fused path: the teacher's forward (no gradient,
eval mode, right after sampling) hands its lm_head's input to a swapped loss_function, which keeps it
(the teacher's final hidden states, [B, T, Ht]); the student's own forward hands its lm_head's input to
`liger_kernels.fused_linear_divergence` with the teacher's hidden states and head, inside the
causal-LM module's forward (where a backend has gathered the head). Without our fused loss patched
into the student, the student's logits arrive and the teacher's are made from its hidden states and
head: the same numbers, the logits held (as every objective does with its kernels off).

The loss is the sum of the divergence over completion tokens divided by the step's global count of
completion tokens, like every objective, so neither accumulation nor processes change it. The
teacher is loaded once (`keep_reference`, on the prepared model's device, in the run's precision or
with 4-bit linear layers), frozen, with our fused-loss interception patched in (the only kernel it
gets: it changes no number); its tokenizer is checked against the student's before anything loads
weights (`liger_cli.model.teacher`).
"""

from __future__ import annotations

import json
import math
import time

import torch
from torch import nn

from liger_cli.data.encode import IGNORE_INDEX, collate
from liger_cli.model.objectives.online import Online, aligned, shifted, token_logprobs
from liger_cli.model.objectives.preference import find_causal_lm, kept_flags, loss_function_swapped
from liger_cli.model.objectives.rollout_stats import mismatch_stats

# What each forward takes from a batch (shift_labels: a sequence-parallel shard's targets)
NAMES = ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels")


class Distill(Online):
    unit = "completion token"

    def __init__(self, recipe):
        super().__init__(recipe.rl)
        self.recipe, self.settings = recipe, recipe.distill
        self.teacher: nn.Module | None = None
        self._head: tuple | None = None  # the teacher's lm_head weight and bias (or a twin's stand-in)

    @property
    def twin_loss(self) -> str:  # how the twin's checks name this loss in the Plan
        return f"distill loss ({self.settings.loss})"

    # --- what the loop asks -------------------------------------------------------------------------

    def keep_reference(self, model: nn.Module, backend) -> str:
        """Called once on the prepared model before its first step: the teacher is loaded here, on the
        model's device, and sharded as the backend shards a frozen model (`backend.shard_frozen`: FSDP-2
        its decoder layers; the others keep it whole). Returns the log's line on it."""
        from liger_cli.model.teacher import load_teacher

        self.teacher = load_teacher(self.recipe, next(model.parameters()).device)
        how = backend.shard_frozen(self.teacher)
        head = find_causal_lm(self.teacher).lm_head
        self._head = (head.weight, head.bias)
        held = sum(_local(p).numel() for p in self.teacher.parameters())
        whole = sum(p.numel() for p in self.teacher.parameters())
        return f"distill: the teacher holds {held:,} of its {whole:,} parameters on this process ({how})"

    def rollout(self, step: int, examples: list[list[dict]], model, sample, reduce) -> list[dict]:
        """The step's micro-batches: G completions of each prompt sampled by the student, then the
        teacher's final hidden states on them (no gradient)."""
        start = time.perf_counter()
        micro, rows = [], []
        for prompts in examples:
            prompts, trajectories = self.group(step, prompts, sample)
            micro.append(self._batch(trajectories, sample.tokenizer.pad_token_id))
            rows += [
                {"step": step + 1} | self.rollout_row(p, t, sample.text(t))
                for p, t in zip(prompts, trajectories, strict=True)
            ]
        sampled = time.perf_counter()
        for batch in micro:
            batch["teacher_hidden"] = self._teacher_hidden(batch)
        self.step_stats = _length_stats(rows, reduce)
        if self.rl.engine == "vllm":  # another engine: each update proved by scoring its samples (docs/rl.md)
            self.step_stats |= self._mismatch(model, micro, rows, reduce)
        self.step_stats |= {"time/sampling_s": sampled - start, "time/rollout_s": time.perf_counter() - start}
        self.samples = rows
        return micro

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["completion_mask"].sum()

    def _mismatch(self, model: nn.Module, micro: list[dict], rows: list[dict], reduce) -> dict[str, float]:
        """The student's log-probs of its sampled tokens (no dropout, no gradient, at the sampling
        temperature) against the sampler's: GRPO's `sampler/*` figures, which prove each update reached
        the engine. One more forward per micro-batch, taken only when another engine samples."""
        device = next(p for p in model.parameters()).device
        done = 0
        with torch.no_grad(), kept_flags(model):
            model.eval()
            for batch in micro:
                mine = rows[done : done + len(batch["input_ids"])]
                done += len(mine)
                inputs = {k: batch[k].to(device) for k in NAMES if k in batch}
                batch["old_logp"] = token_logprobs(model, inputs, self.rl.temperature)[0].cpu()
                batch["sampler_logp"] = aligned(
                    [r["sampler_logprobs"] for r in mine], [len(r["prompt_ids"]) for r in mine], batch
                )
        return mismatch_stats(micro, reduce)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor):
        """The divergence summed over completion tokens / the step's completion tokens; `kl`, the mean
        KL(student || teacher) at distill.temperature, the same way (the loss itself with reverse_kl)."""
        divergence, learned, kl = self.divergences(model, batch)
        divide = num_items.to(divergence.device, divergence.dtype)
        return (divergence * learned).sum() / divide, {"kl": (kl * learned).sum() / divide}

    def checkpoint_state(self) -> None:  # a step's completions are a function of seed, step and weights
        return None

    def evaluate(self, model: nn.Module, sampler, dataset) -> dict[str, float]:
        """`eval_kl`: the mean KL(student || teacher) per token of the student's greedy completion of every
        eval prompt; `eval_exact_match` too when every eval row has an `answer` (the share of completions
        equal to it, stripped, as liger_cli.rewards:exact_match scores)."""
        prompts, real = sampler.eval_prompts(dataset)
        trajectories = sampler.trajectories(prompts, [f"eval:{p['row']}" for p in prompts], greedy=True)
        per_row, tokens = [], []
        rows = self.recipe.training.micro_batch_size * self.rl.num_generations  # a training micro-batch's
        with torch.no_grad(), kept_flags(model):
            model.eval()
            for i in range(0, len(trajectories), rows):
                batch = self._batch(trajectories[i : i + rows], sampler.tokenizer.pad_token_id)
                batch["teacher_hidden"] = self._teacher_hidden(batch)
                _, learned, kl = self.divergences(model, batch)
                per_row.append((kl * learned).sum(1).double().cpu())
                tokens.append(learned.sum(1).double().cpu())
        keep = torch.tensor(real, dtype=torch.float64)
        sums = [(torch.cat(per_row) * keep).sum(), (torch.cat(tokens) * keep).sum()]
        answers = [json.loads(p["fields"]).get("answer") for p in prompts]
        graded = all(a is not None for a in answers)
        if graded:
            right = [
                float(sampler.text(t).strip() == str(a).strip())
                for t, a in zip(trajectories, answers, strict=True)
            ]
            sums += [(torch.tensor(right, dtype=torch.float64) * keep).sum(), keep.sum()]
        total = sampler.reduce(torch.stack([torch.as_tensor(s, dtype=torch.float64) for s in sums])).tolist()
        found = {"eval_kl": total[0] / max(total[1], 1.0)}
        if graded:
            found["eval_exact_match"] = total[2] / max(total[3], 1.0)
        return found

    def twin_batch(self, vocab: int, pad_id: int, rows: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
        """Rollout rows as `rollout` makes them (prompts and completions of different lengths), with random
        ids below `vocab` and a random stand-in for the teacher (hidden states of width 8 and a head), for
        the twin's checks: its kernels and accumulation are proved on this objective's loss."""
        g = torch.Generator().manual_seed(seed)
        features = []
        for prompt, completion in self.random_rows(vocab, rows, g):
            features.append({"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion,
                             "position_ids": list(range(len(prompt) + len(completion)))})  # fmt: skip
        batch = collate(features, pad_id)
        batch["completion_mask"] = shifted(batch["labels"]) != IGNORE_INDEX
        batch["teacher_hidden"] = torch.randn(*batch["input_ids"].shape, 8, generator=g)
        self._head = (torch.randn(vocab, 8, generator=g), None)
        return batch

    # --- the two forwards ---------------------------------------------------------------------------

    def divergences(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per position t, the divergence of the student's distribution of token t + 1 from the teacher's,
        whether t + 1 is a completion token, and KL(student || teacher) (each [B, T], fp32), through the
        student's own forward with its loss_function swapped for the call."""
        device = next(p for p in model.parameters()).device
        inputs = {k: batch[k].to(device) for k in NAMES if k in batch}
        weight, bias = self._head
        function = divergence_loss(batch["teacher_hidden"].to(device), weight, bias, self.settings)
        causal_lm = find_causal_lm(model)
        with loss_function_swapped(causal_lm, function):
            output = model(**inputs)
        stacked = output.loss
        if stacked is None or stacked.dim() != 3 or stacked.shape != (3, *batch["input_ids"].shape):
            raise RuntimeError(
                f"{type(causal_lm).__name__}.forward changed what its loss_function returned: distill needs "
                "the per-token divergences untouched"
            )
        return stacked[0], stacked[1], stacked[2]

    def _teacher_hidden(self, batch: dict) -> torch.Tensor:
        """The teacher's final hidden states (its lm_head's input) on the batch: no gradient, eval mode."""
        found: list[torch.Tensor] = []

        def keep(logits, labels, *args, **kwargs):
            from liger_kernels.patch_loss import DeferredLogits

            if not isinstance(logits, DeferredLogits):
                raise RuntimeError(
                    "the teacher's forward did not defer its logits (fused loss not patched in)"
                )
            found.append(logits.hidden)
            return logits.hidden.new_zeros(())

        keep.liger_logprobs = True  # it takes lm_head's input itself, in eval mode too
        device = self._head[0].device
        with torch.no_grad(), loss_function_swapped(find_causal_lm(self.teacher), keep):
            self.teacher(**{k: batch[k].to(device) for k in NAMES if k in batch})
        return found[0]

    def _batch(self, trajectories: list, pad_id: int) -> dict[str, torch.Tensor]:
        """Prompt then completion per trajectory; the completion's ids are learned."""
        features = []
        for t in trajectories:
            segment = t.segments[0]
            features.append({"input_ids": segment.prompt_ids + segment.ids,
                             "labels": [IGNORE_INDEX] * len(segment.prompt_ids) + segment.ids,
                             "position_ids": list(range(len(segment.prompt_ids) + len(segment.ids)))})  # fmt: skip
        batch = collate(features, pad_id)
        batch["completion_mask"] = shifted(batch["labels"]) != IGNORE_INDEX
        return batch


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter (a sharded DTensor's local shard, else the tensor)."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def divergence_loss(teacher_hidden: torch.Tensor, weight: torch.Tensor, bias, settings):
    """A loss_function for the student's forward: per position, the divergence from the teacher, whether
    the next token is learned, and KL(student || teacher), stacked as [3, B, T] (fp32). Given lm_head's
    deferred input (our fused loss patched in) it never builds logits (`fused_linear_divergence`);
    given the student's logits, it makes the teacher's and computes the same formula on them."""
    from liger_kernels import fused_linear_divergence
    from liger_kernels.fused_linear_logprob import shift_labels as shift
    from liger_kernels.patch_loss import DeferredLogits

    loss, beta, temperature = settings.loss, settings.beta, settings.temperature
    reverse = loss == "reverse_kl" or beta == 1.0

    def loss_function(
        logits,
        labels,
        vocab_size=None,
        num_items_in_batch=None,
        ignore_index=-100,
        shift_labels=None,
        **kwargs,
    ):
        targets = shift_labels if shift_labels is not None else shift(labels, ignore_index)
        if isinstance(logits, DeferredLogits):
            head = logits.lm_head
            args = (logits.hidden, head.weight, teacher_hidden, weight, targets.to(logits.hidden.device))
            options = {"temperature": temperature, "student_bias": head.bias, "teacher_bias": bias,
                       "ignore_index": ignore_index, "shift": False}  # fmt: skip
            divergence, learned = fused_linear_divergence(*args, loss=loss, beta=beta, **options)
            if reverse:
                kl = divergence.detach()
            else:
                with torch.no_grad():
                    kl = fused_linear_divergence(*args, loss="reverse_kl", **options)[0]
        else:
            learned = targets.to(logits.device) != ignore_index
            teacher_logits = nn.functional.linear(teacher_hidden, weight, bias)
            divergence = plain_divergence(logits, teacher_logits, loss, beta, temperature) * learned
            kl = divergence.detach() if reverse else plain_divergence(
                logits.detach(), teacher_logits, "reverse_kl", beta, temperature
            ) * learned  # fmt: skip
        return torch.stack([divergence.float(), learned.float(), kl.float()])

    loss_function.liger_logprobs = True  # not a loss over labels: wanted in eval mode too
    return loss_function


def plain_divergence(
    student_logits, teacher_logits, loss: str, beta: float, temperature: float
) -> torch.Tensor:
    """The divergence per position from both models' logits ([..., V] -> [...], fp32): what
    fused_linear_divergence computes without the logits (TRL GKD's generalized JSD; beta 0 is forward
    KL, beta 1 and reverse_kl are KL(student || teacher))."""
    log_ps = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_pt = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if loss == "reverse_kl" or beta == 1.0:
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    if beta == 0.0:
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
    return (beta * log_pt.exp() * (log_pt - log_m) + (1 - beta) * log_ps.exp() * (log_ps - log_m)).sum(-1)


def _length_stats(rows: list[dict], reduce) -> dict[str, float]:
    """Completion lengths (mean, min, max) and the share cut at max_new_tokens, over every process."""
    lengths = torch.tensor([len(r["completion_ids"]) for r in rows], dtype=torch.float64)
    cut = torch.tensor([r["finish_reason"] == "length" for r in rows], dtype=torch.float64)
    n, total, clipped = reduce(
        torch.stack([torch.tensor(float(len(rows))), lengths.sum(), cut.sum()])
    ).tolist()
    low, high = reduce(torch.stack([-lengths.min(), lengths.max()]), "max").tolist()
    return {"completion_length": total / n, "completion_length_min": -low, "completion_length_max": high,
            "clipped_ratio": clipped / n}  # fmt: skip
