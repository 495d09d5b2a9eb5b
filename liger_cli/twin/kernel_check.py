"""Check our kernels on a tiny twin of the user's own architecture before training.

`patch_model` patches a module only when probes of its own code prove our replacement equal. This is
the second, independent net, on the whole model: a tiny twin of the recipe's model (same class, same
flags and multipliers, remote code included when the recipe trusts it; `liger_cli.twin.tiny`) runs one
training step unpatched and then with every requested kernel, and the loss and every gradient are
compared; where they differ, each kernel alone finds which. A kernel that changes them is switched off
for the run, and the Plan says which and why.

The same twins then generate greedily (the engine of `liger_cli.generate`, KV cache on, left-padded
prompts): a kernel is kept only if the patched twin chooses the same tokens as the unpatched one, so
what `liger generate --kernels`, the run's samples and online RL sample is what the model samples.

It runs in fp32 on the CPU in about a second once transformers is imported, whatever the real
model's size (`python bench/kernel_check.py` measures a 70B-class config).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

KERNELS = ("rms_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy")

# One fp32 step: kernels reorder sums (chunked loss, fused norms), so agreement is to ~1e-6 relative.
# A dropped multiplier, clamp or auxiliary loss is orders of magnitude above these.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


@dataclass(frozen=True)
class KernelCheck:
    """What the check found: the kernels it switched off and why, or why it could not run."""

    requested: dict[str, bool]
    switched_off: dict[str, str] = field(default_factory=dict)
    twin_report: tuple[str, ...] = ()
    not_run: str | None = None
    seconds: float = 0.0
    loss: str = ""
    """Which loss the step took when it was not the model's own (a preference objective's)."""

    @property
    def kernels(self) -> dict[str, bool]:
        """The kernels to patch into the real model: the requested ones the check did not switch off."""
        return {name: on and name not in self.switched_off for name, on in self.requested.items()}

    def lines(self) -> list[str]:
        if self.not_run:
            off = f": {', '.join(self.switched_off)} off" if self.switched_off else ""
            return [f"kernel check: not run ({self.not_run}){off}"]
        on = f" ({self.loss})" if self.loss else ""
        head = f"kernel check: one step on a tiny twin{on}, patched vs unpatched: "  # no timing: reproducible
        if not self.switched_off:
            agree = (
                "loss and every gradient agree"
                if "reward" in self.loss
                else "loss, every gradient and greedy generation agree"
            )
            return [head + agree, *self._scope_lines()]
        return (
            [head + "switched off " + ", ".join(self.switched_off)]
            + [f"  {name} off: {why}" for name, why in self.switched_off.items()]
            + self._scope_lines()
        )

    def _scope_lines(self) -> list[str]:
        """A VLM's patch scope and what its language model left alone (an M-RoPE), from the twin's report."""
        if not any(line.startswith("scope:") for line in self.twin_report):
            return []
        said = [line for line in self.twin_report if line.startswith("scope:") or ": not patched: " in line]
        return [f"  {line}" for line in said]


@dataclass
class Step:
    """The loss and the gradient of every parameter after one training step."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def train_step(model: nn.Module, batch: dict, seed: int = 0, loss_of: Callable | None = None) -> Step:
    """One forward and backward in train mode; the RNG is seeded so dropout draws the same masks.
    The loss is the model's own on `batch`, or `loss_of(model)` (an objective's, on its own batch)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss if loss_of is None else loss_of(model)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(loss.detach(), grads)


def disagreement(patched: Step, reference: Step) -> str | None:
    """Why two steps differ (the loss, a missing gradient, or the worst gradient), or None."""
    got, want = patched.loss.float(), reference.loss.float()
    if not torch.isfinite(got) or abs(got - want) > LOSS_RTOL * max(1.0, abs(want)):
        return f"the loss differs ({got.item():.6g} vs {want.item():.6g})"
    if patched.grads.keys() != reference.grads.keys():
        missing = sorted(reference.grads.keys() ^ patched.grads.keys())
        return f"gradients missing or extra for {', '.join(missing[:3])}"
    for name, want_grad in reference.grads.items():
        error = (patched.grads[name].float() - want_grad.float()).abs().max()
        scale = want_grad.float().abs().max()
        if not torch.isfinite(error) or error > GRAD_RTOL * scale + 1e-7:
            return f"the gradient of {name} differs (max error {error.item():.2e}, scale {scale.item():.2e})"
    return None


GREEDY_TOKENS = 8


def greedy_tokens(model: nn.Module, batch: dict) -> list[list[int]]:
    """Greedy continuations of the batch's rows cut to prompts of different lengths (left-padded)."""
    from liger_cli.generate.engine import Sampling, generate

    ids = batch["input_ids"]
    prompts = [ids[row, : 4 + 3 * row].tolist() for row in range(ids.shape[0])]
    found = generate(model, prompts, Sampling(GREEDY_TOKENS, temperature=0), stop_ids=[], pad_id=0)
    return [c.ids for c in found]


def compare_kernels(
    build: Callable[[], nn.Module], batch: dict, requested: dict[str, bool], loss_of: Callable | None = None
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """Patch a fresh build of the same model with every requested kernel and compare one step and greedy
    generation with the unpatched model; only when they differ (or the patched model crashes), patch
    fresh builds kernel by kernel to find which, then the agreeing ones together.

    Together first: when every kernel agrees (the common case) this costs two twins instead of one per
    kernel plus two, and a wrong kernel is still named by the bisection. `build()` must return the same
    model (same seeded weights) every call; a fresh build rather than a deep copy, since some models
    cannot be deep-copied. Every parameter takes a gradient, so every weight is compared. Returns
    (disagreements: kernel -> why, crashes: kernel -> error, the combined patch report's lines).
    """
    from liger_kernels import patch_model

    def fresh() -> nn.Module:
        model = build()
        for parameter in model.parameters():
            if parameter.is_floating_point():  # a 4-bit base's packed weights take no gradient
                parameter.requires_grad_(True)
        return model

    unpatched = fresh()
    reference = train_step(unpatched, batch, loss_of=loss_of)
    try:  # a reward model (one score per sequence) does not generate
        reference_tokens = (
            None if unpatched.get_output_embeddings() is None else greedy_tokens(unpatched, batch)
        )
    except Exception:  # noqa: BLE001 - a model that cannot generate with a cache: its steps are still compared
        reference_tokens = None
    model = fresh()
    try:
        report = patch_model(model, **{k: bool(requested.get(k)) for k in KERNELS})
        agree = not report.patched or (
            disagreement(train_step(model, batch, loss_of=loss_of), reference) is None
            and (reference_tokens is None or greedy_tokens(model, batch) == reference_tokens)
        )
    except Exception:  # noqa: BLE001 - which kernel crashes is found one by one below
        agree = False
    if agree:
        return {}, {}, report.lines()
    wrong: dict[str, str] = {}
    crashed: dict[str, str] = {}
    for kernel in [k for k in KERNELS if requested.get(k)]:
        model = fresh()
        try:
            report = patch_model(model, **{k: k == kernel for k in KERNELS})
            if kernel not in report.patched:
                continue  # left alone by patch_model, with its reason in the report
            why = disagreement(train_step(model, batch, loss_of=loss_of), reference)
            if (
                why is None
                and reference_tokens is not None
                and greedy_tokens(model, batch) != reference_tokens
            ):
                why = "greedy generation chooses other tokens than the unpatched model"
        except Exception as err:  # a kernel that crashes the model is off, never a crash of the run
            crashed[kernel] = (
                f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err) else ''}"
            )
            continue
        if why:
            wrong[kernel] = why
    together = {k: bool(requested.get(k)) and k not in wrong and k not in crashed for k in KERNELS}
    model = fresh()
    report = patch_model(model, **together)
    if sum(k in report.patched for k in KERNELS) > 1:
        try:
            why = disagreement(train_step(model, batch, loss_of=loss_of), reference)
        except Exception as err:
            why = f"{type(err).__name__}: {str(err).strip()[:160]}"
        if why:
            wrong.update({k: f"together with the others: {why}" for k in report.patched})
    return wrong, crashed, report.lines()


def check_kernels(
    config,
    requested: dict[str, bool],
    trust_remote_code: bool = False,
    add_adapter: Callable[[nn.Module], nn.Module] | None = None,
    attn_implementation: str | None = "eager",
    objective=None,
) -> KernelCheck:
    """Build the twin of `config`, compare each requested kernel on it, and say which to switch off.

    A vision-language twin's batch carries an image (`vision_batch`); where it cannot be built or fed
    one, every requested kernel is off with the reason (patch_model's probes alone never decide a VLM).

    With a preference objective the step's loss is that objective's, on preference pairs: its fused
    per-sequence log-probabilities (and the reference pass) are what the kernels must not change."""
    from liger_cli.model.vision import is_vision_language
    from liger_cli.twin.tiny import (
        TinyModelError,
        tiny_batch,
        tiny_pairs,
        tiny_unpaired,
        twin_builder,
        twin_session,
        twin_vocab,
    )
    from liger_cli.twin.vision_batch import ImageBatchError, tiny_image_batch

    start = time.perf_counter()
    if not any(requested.values()):
        return KernelCheck(requested, not_run="no kernel requested")
    # The router's auxiliary loss is part of what must not change.
    router = {"output_router_logits": True} if hasattr(config, "output_router_logits") else {}
    build = twin_builder(config, trust_remote_code, add_adapter, attn_implementation, **router)
    vision = is_vision_language(config)
    try:
        with twin_session():
            probe = build()  # what the batches are drawn for (vocabulary, padding id, image inputs)
            batch = tiny_image_batch(probe) if vision else tiny_batch(probe)
            loss_of = None
            if hasattr(objective, "twin_batch"):  # online RL: its loss on rollout rows
                rollout = objective.twin_batch(*twin_vocab(probe))
                loss_of = lambda model: objective.loss(model, rollout, objective.units(rollout))[0]  # noqa: E731
            elif getattr(objective, "unit", None) in ("pair", "completion"):
                examples = tiny_pairs(probe) if objective.unit == "pair" else tiny_unpaired(probe)
                pairs = objective.collate(examples, twin_vocab(probe)[1])
                loss_of = lambda model: step_losses(model, objective, [pairs])[0]  # noqa: E731
            wrong, crashed, report = compare_kernels(build, batch, requested, loss_of)
    except TinyModelError as err:
        return _not_run(requested, f"no tiny twin: {err}", vision, start)
    except ImageBatchError as err:
        return _not_run(requested, f"no image batch: {err}", vision, start)
    except (RuntimeError, ValueError, TypeError) as err:
        if not vision:
            raise
        why = f"the twin does not train on its image batch: {type(err).__name__}: {_first(err)}"
        return _not_run(requested, why, vision, start)
    return KernelCheck(
        requested,
        switched_off={**wrong, **crashed},
        twin_report=tuple(report),
        seconds=time.perf_counter() - start,
        loss=_loss_name(objective) if loss_of is not None else "",
    )


def _not_run(requested: dict[str, bool], why: str, vision: bool, start: float) -> KernelCheck:
    """The check could not run: a causal LM keeps its kernels as requested (patch_model's probes still
    decide each module); a VLM's language model is proven on nothing else, so its kernels stay off."""
    off = {k: f"not proven ({why})" for k, on in requested.items() if on} if vision else {}
    return KernelCheck(requested, off, not_run=why, seconds=time.perf_counter() - start)


def _first(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:160] if text else ""


def _loss_name(objective) -> str:
    if hasattr(objective, "twin_loss"):  # distill
        return f"the {objective.twin_loss} on rollouts"
    if hasattr(objective, "twin_batch"):
        return f"the grpo loss ({objective.rl.loss}) on rollouts"
    return f"the {objective.objective} loss on {objective.unit}s"


def step_losses(model: nn.Module, objective, batches: list[dict]) -> list[torch.Tensor]:
    """Each batch's loss by the objective, as `fit` takes them for one step of these micro-batches
    (the step's `begin_step` first, where the objective has one; one process, on the CPU)."""
    num_items = sum(objective.units(b) for b in batches)
    if hasattr(objective, "begin_step"):
        objective.begin_step(model, batches, torch.device("cpu"), lambda t: t)
    return [objective.loss(model, batch, num_items)[0] for batch in batches]
