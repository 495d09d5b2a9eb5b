"""Packing and accumulation, proved on a tiny twin of the user's own model before anything runs.

The kernel check's twin (same class, flags and code, remote code included; the recipe's adapter with
random weights; the kernels the Plan patches) is fed through the data stage's own `pack_examples` and
`collate`, and its loss is computed by the run's own rule (`liger_cli.model.objectives`):

- **packing check** (when `data.packing` is on): examples of uneven lengths packed into rows whose
  `position_ids` restart at each example (no attention mask, padding as the collator pads) against
  each example alone: every example's summed loss, and the gradients of the sum (packed sum vs the
  sum of the alone losses). A model whose attention does not follow the restarting position_ids
  lets packed examples see each other: that is an error before anything runs.
- **accumulation check**: micro-batch 4 x accumulation 1 against micro-batch 1 x accumulation 4,
  with padding and uneven label counts: the step's loss and every gradient. Processes split a step
  the same way (each rank's loss divided by the step's global count), so this is also what
  `num_processes` > 1 relies on; a run that accumulates or has several processes is refused when
  they disagree.

Dropout and router noise are switched off on the twin (packed and alone shapes would draw different
masks). fp32 on the CPU, tolerances as the kernel check's; a few milliseconds once transformers is
imported. A twin that cannot be built leaves the recipe as it is, and the line says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from liger_cli.data.encode import IGNORE_INDEX, collate, pack_examples
from liger_cli.model.objectives import causal_lm as rule
from liger_cli.twin.kernel_check import LOSS_RTOL, Step, disagreement

RUNNABLE_ATTENTION = (None, "eager", "sdpa")  # what the CPU twin can run
# (length, tokens not learned at the start) of each example: uneven lengths and label counts.
PACKING_EXAMPLES = ((7, 2), (5, 1), (6, 3), (3, 0))
PACKED_LENGTH = 12  # rows [7 | 5] and [6 | 3], the second padded by 3
ACCUMULATION_EXAMPLES = ((11, 3), (5, 1), (8, 6), (3, 0))
ACCUMULATION_HEAD = "accumulation check: micro-batch 4 x accumulation 1 vs 1 x 4 on a tiny twin"


@dataclass(frozen=True)
class Verdict:
    """One check's line for the Plan (no timing: the Plan is reproducible), and the error to stop
    with when the check found that the run would train something else than the recipe means."""

    line: str
    error: str | None = None
    seconds: float = 0.0


def check_pipeline(
    config,
    kernels: dict[str, bool],
    packing: bool,
    grad_accum: int = 1,
    processes: int = 1,
    trust_remote_code: bool = False,
    add_adapter: Callable[[nn.Module], nn.Module] | None = None,
    attn_implementation: str | None = None,
    objective=None,
) -> tuple[Verdict, Verdict]:
    """(packing verdict, accumulation verdict) for the recipe's model, kernels and attention; the
    accumulation check takes the objective's own batches and loss (the causal-LM one by default)."""
    from liger_cli.twin.tiny import TinyModelError, twin_builder, twin_session

    start = time.perf_counter()
    if attn_implementation not in RUNNABLE_ATTENTION:
        why = f"the CPU twin cannot run attention {attn_implementation}"
        return _not_run(packing, why), Verdict(f"accumulation check: not run ({why})")

    def build(attn: str | None) -> nn.Module:
        return prepared_twin(twin_builder(config, trust_remote_code, add_adapter, attn)(), kernels)

    with twin_session():
        try:
            model = build(attn_implementation)
            name, attn = _class_name(model), model.config._attn_implementation
            packed = _packing_verdict(model, build, name, attn) if packing else _not_run(False, "")
            accumulated = _accumulation_verdict(
                model, name, grad_accum, processes, objective or rule.CausalLM()
            )
        except TinyModelError as err:
            why = f"no tiny twin: {err}"
            return _not_run(packing, why), Verdict(f"accumulation check: not run ({why})")
        except Exception as err:  # the twin crashed: say so, never crash the planning
            why = f"the tiny twin failed: {type(err).__name__}: {_first_line(err)}"
            return _not_run(packing, why), Verdict(f"accumulation check: not run ({why})")
    seconds = time.perf_counter() - start
    return _timed(packed, seconds), _timed(accumulated, seconds)


# --- packing -------------------------------------------------------------------------------------------------
def _packing_verdict(model: nn.Module, build: Callable, name: str, attn: str) -> Verdict:
    why = packing_disagreement(model)
    if why is None:
        return Verdict(
            f"packing check: packed rows vs each example alone on a tiny twin ({attn}): "
            "every example's loss and every gradient agree"
        )
    fix = "set data.packing: false"
    for other in ("sdpa", "eager"):  # is the attention implementation the cause?
        try:
            agrees = other != attn and packing_disagreement(build(other)) is None
        except Exception:  # not buildable with that implementation: not the fix
            agrees = False
        if agrees:
            fix = f"set model.attn_implementation: {other} (packing agrees with it on this model), or {fix}"
            break
    return Verdict(
        f"packing check: packed rows vs each example alone on a tiny twin ({attn}): {why}",
        error=f"data.packing: true would change what {name} learns: on a tiny twin ({attn}), packed "
        f"rows and each example alone disagree ({why}): packed examples see each other, because the "
        f"model's attention does not follow the position_ids that restart at each example; {fix}",
    )


def packing_disagreement(model: nn.Module) -> str | None:
    """Why packed rows and each example alone differ (an example's loss, or a gradient), or None."""
    from liger_cli.twin.tiny import twin_vocab

    vocab, pad = twin_vocab(model)
    examples = twin_examples(PACKING_EXAMPLES, vocab)
    rows = pack_examples(examples, PACKED_LENGTH)
    packed = collate(rows, pad)
    spans = []  # (row, start, end) of each example, from where its position_ids restart
    for r, row in enumerate(rows):
        starts = [t for t, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
        spans += [(r, a, b) for a, b in zip(starts, starts[1:], strict=False)]
    assert len(spans) == len(examples) and "attention_mask" not in packed, "packing changed its layout"

    alone, alone_sums = _accumulate(model, [collate([e], pad) for e in examples])
    together, _ = _accumulate(model, [packed])
    with torch.no_grad():
        for i, (r, a, b) in enumerate(spans):
            labels = torch.full_like(packed["labels"], IGNORE_INDEX)
            labels[r, a:b] = packed["labels"][r, a:b]
            got, want = _summed(model, {**packed, "labels": labels}), alone_sums[i]
            if not torch.isfinite(got) or abs(got - want) > LOSS_RTOL * max(1.0, abs(want)):
                return (
                    f"example {i + 1} of {len(examples)} has a summed loss of {got.item():.6g} packed "
                    f"and {want.item():.6g} alone"
                )
    return disagreement(together, alone)


# --- accumulation --------------------------------------------------------------------------------------------
def _accumulation_verdict(model: nn.Module, name: str, grad_accum: int, processes: int, objective) -> Verdict:
    why = accumulation_disagreement(model, objective)
    if why is None:
        what = {
            "label token": "uneven label counts",
            "pair": f"{getattr(objective, 'objective', '')} loss on pairs",
            "completion": f"{getattr(objective, 'objective', '')} loss on labelled completions",
        }.get(objective.unit, f"{getattr(objective, 'twin_loss', 'grpo loss')} on {objective.unit}s")
        return Verdict(f"{ACCUMULATION_HEAD} (padding, {what}): loss and every gradient agree")
    if grad_accum == 1 and processes == 1:
        return Verdict(
            f"{ACCUMULATION_HEAD}: {why}; not used by this run (one micro-batch per step, one process)"
        )
    return Verdict(
        f"{ACCUMULATION_HEAD}: {why}",
        error=f"training.grad_accum: {grad_accum} on {processes} process(es) would change what {name} "
        f"learns: on a tiny twin, micro-batch 4 x accumulation 1 and micro-batch 1 x accumulation 4 "
        f"disagree ({why}), so the step's loss is not the mean over its {objective.unit}s (the loss does not "
        "divide by num_items_in_batch, or adds a term per micro-batch such as a router loss); set "
        "training.grad_accum: 1 and distributed.num_processes: 1 with a larger training.micro_batch_size",
    )


def accumulation_disagreement(model: nn.Module, objective=None) -> str | None:
    """Why one micro-batch of 4 and four micro-batches of 1 differ (the units, the loss, a gradient),
    by the objective's own collation, unit count and loss."""
    from liger_cli.twin.tiny import tiny_pairs, tiny_unpaired, twin_vocab

    objective = objective or rule.CausalLM()
    vocab, pad = twin_vocab(model)
    if hasattr(objective, "twin_batch"):  # an online objective: rollout rows, four of them
        whole = objective.twin_batch(vocab, pad)
        micro = [{k: v[i : i + 1] for k, v in whole.items()} for i in range(whole["input_ids"].shape[0])]
    else:
        pairs = objective.unit == "pair"
        examples = tiny_pairs(model) if pairs else twin_examples(ACCUMULATION_EXAMPLES, vocab)
        if objective.unit == "completion":  # kto: labelled completions with their KL sequences
            examples = tiny_unpaired(model)
        whole, micro = objective.collate(examples, pad), [objective.collate([e], pad) for e in examples]
    num_items = objective.units(whole)
    if int(num_items) != int(sum(objective.units(b) for b in micro)):
        return f"the {objective.unit}s counted differ between one micro-batch of 4 and four of 1"
    one, _ = _accumulate(model, [whole], num_items, objective)
    four, _ = _accumulate(model, micro, num_items, objective)
    return disagreement(four, one)


# --- the twin and its steps ----------------------------------------------------------------------------------
def twin_examples(spec, vocab: int, seed: int = 0) -> list[dict]:
    """Examples as the data stage makes them: ids, labels (-100 on an unlearned start), position_ids."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for length, unlearned in spec:
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        labels = [IGNORE_INDEX] * unlearned + ids[unlearned:]
        examples.append({"input_ids": ids, "labels": labels, "position_ids": list(range(length))})
    return examples


def prepared_twin(model: nn.Module, kernels: dict[str, bool]) -> nn.Module:
    """The twin as the run trains it (kernels patched, train mode), every weight taking a gradient,
    without randomness: dropout and router jitter off, on the modules and in the config."""
    if any(kernels.values()):
        from liger_kernels import patch_model

        patch_model(model, **kernels)
    for parameter in model.parameters():
        if parameter.is_floating_point():  # a 4-bit base's packed weights take no gradient
            parameter.requires_grad_(True)
    configs = [model.config, *(getattr(model.config, k) for k in getattr(model.config, "sub_configs", {}))]
    for owner in [*model.modules(), *(c for c in configs if c is not None)]:
        if isinstance(owner, nn.Dropout):
            owner.p = 0.0
        for key, value in list(vars(owner).items()):
            if ("dropout" in key or "jitter" in key) and isinstance(value, float):
                setattr(owner, key, 0.0)
    return model.train()


def _summed(model: nn.Module, batch: dict) -> torch.Tensor:
    """The batch's token losses summed, by the run's rule: its mean (divided by its own label count)
    times that count, whatever the model does with num_items_in_batch."""
    units = rule.label_units(batch)
    return rule.causal_lm_loss(model, batch, units) * units


def _accumulate(
    model: nn.Module, batches: list[dict], num_items=None, objective=None
) -> tuple[Step, list[torch.Tensor]]:
    """Forward and backward of each batch, gradients accumulated: (the step, each batch's loss).
    Each loss is the objective's (divided by `num_items`), or with None the causal-LM sum (`_summed`)."""
    model.zero_grad(set_to_none=True)
    losses = []
    if num_items is not None and hasattr(objective, "begin_step"):  # what the whole step decides (kto)
        objective.begin_step(model, batches, torch.device("cpu"), lambda t: t)
    for batch in batches:
        loss = (
            _summed(model, batch)
            if num_items is None
            else (objective or rule.CausalLM()).loss(model, batch, num_items)[0]
        )
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(torch.stack(losses).sum(), grads), losses


def _class_name(model: nn.Module) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__


def _not_run(packing: bool, why: str) -> Verdict:
    if not packing:
        return Verdict("packing check: not run (packing off)")
    return Verdict(f"packing check: not run ({why}); packing stays on, not proven on this model")


def _timed(verdict: Verdict, seconds: float) -> Verdict:
    return Verdict(verdict.line, verdict.error, seconds)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:160]
