"""Will it fit? The per-rank peak memory of a training step, estimated before anything is launched.

Parameters, gradients and AdamW's two moments are counted from the model built on the meta device,
divided by N where the backend shards them (`Backend.memory_shards`); activations are measured by
one meta forward (`memory_activations.py`); the loss is what its implementation holds at its peak.
The parts are computed from `Facts` (the model, measured once) and `Settings` (what the recipe
chose), so each suggested change is re-estimated from the same facts in microseconds.

On a CPU the comparison is the training process's peak RSS over its RSS before the model is built;
on a GPU, `torch.cuda.max_memory_allocated` (the verdict adds the CUDA context, which that omits).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from liger_cli.model.quantize import four_bit_bytes, shards_weights
from liger_cli.plan.activations import Activations, measure_activations
from liger_cli.plan.backends import BACKENDS
from liger_cli.plan.decide import Plan
from liger_cli.plan.image_inputs import meta_image_batch
from liger_cli.plan.memory_objectives import kv_cache_bytes, reference, rows_per_example, teacher_bytes
from liger_cli.plan.sequence_parallel import split_limit
from liger_cli.recipe import Recipe

MiB = 2**20
OVERHEAD_BYTES = {"cpu": 0, "cuda": 1024 * MiB}
"""What a device needs beyond the tensors: on a GPU the CUDA context and cuBLAS workspaces (which the
allocator's peak leaves out); on a CPU nothing measurable (docs/memory.md: the estimate
without it is within 0.97-1.08x of the measured peak)."""
EAGER_LOSS_COPIES = 3
"""Eager loss at its peak holds [tokens, vocab] fp32 three times: the logits, their log-softmax
(saved for backward) and the gradient (measured: 3.0x at 4096 x 32000)."""


@dataclass(frozen=True)
class Facts:
    """What the model is, measured once on the meta device."""

    param_bytes: int
    trainable_bytes: int
    largest_unit_bytes: int
    """The largest FSDP unit (a wrapped layer, or the root with what no layer holds)."""
    activations: Activations | None
    """For one micro-batch of `batch` rows; None when the forward cannot run on meta (`unmeasured`)."""
    batch: int
    seq_len: int
    hidden: int
    vocab: int
    lm_head_trainable: bool
    device: str
    unmeasured: str = ""
    pictures: str = ""
    """A VLM's: what its measured batch held besides text (`image_inputs.meta_image_batch`)."""
    whole_bytes: int = 0
    """Of param_bytes, what no backend shards: QLoRA's quantization statistics (kept beside each 4-bit
    weight, not as parameters)."""


@dataclass(frozen=True)
class Settings:
    """What the recipe chose that memory depends on (and what a suggestion may change)."""

    backend: str
    zero_stage: int
    num_processes: int
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    fused_loss: bool
    rows_per_example: int = 1
    """Sequences per example: 2 for a preference pair (chosen and rejected go through one forward)."""
    reference: str | None = None
    """DPO's reference: "pass" (the adapter disabled, under no_grad) or "table" (precomputed); GRPO's
    with full fine-tuning and beta > 0: "copy" (the starting weights as each rank stores them)."""
    kv_cache_bytes: int = 0
    """GRPO: the KV cache of sampling one micro-batch's completions (freed before its forward)."""
    score_head: bool = False  # a reward model: a score head, no vocabulary logits (no loss kernel)
    teacher: int = 0  # distill: the frozen teacher's weights and its hidden states for the step
    sequence_parallel: int = 1
    """Processes each sequence is split over: each holds 1/N of its tokens' activations and loss."""
    split_mask: bool = False
    """The split builds the whole sequence's boolean mask (packing, or eager attention): S x S a row."""
    split_limit: int = 1
    """The largest split (2, 4 or 8) this run could take (`plan.sequence_parallel.split_limit`): what a
    suggestion may offer; 1 when none."""


@dataclass(frozen=True)
class Suggestion:
    change: tuple[str, ...]
    """`--set` overrides, e.g. ("distributed.activation_checkpointing=auto",)."""
    total: int


@dataclass(frozen=True)
class MemoryPlan:
    components: dict[str, int]
    """Bytes per rank, by part, in print order."""
    notes: dict[str, str]
    device_memory: int | None = None
    suggestions: tuple[Suggestion, ...] = field(default=())
    complete: bool = True
    """False when a part could not be measured: the total is then a lower bound."""

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def fits(self) -> bool | None:
        """None when unknown: no device memory, or a lower bound that fits."""
        if self.device_memory is None or (not self.complete and self.total <= self.device_memory):
            return None
        return self.total <= self.device_memory

    def to_dict(self) -> dict:
        return {
            "components": dict(self.components),
            "total_bytes": self.total,
            "device_memory_bytes": self.device_memory,
            "fits": self.fits,
            "suggestions": [{"set": list(s.change), "total_bytes": s.total} for s in self.suggestions],
        }

    def render(self) -> str:
        width = max(len(name) for name in self.components)
        lines = ["# memory per rank (estimate)"]
        lines += [  # a zero overhead (a CPU) stays in the JSON only
            f"{name:<{width}}  {size(b):>10}  {self.notes[name]}"
            for name, b in self.components.items()
            if b or name != "overhead"
        ]
        lines.append(f"{'total':<{width}}  {size(self.total):>10}  peak of a training step, per rank")
        if self.device_memory is None:
            lines.append("verdict: device memory unknown; give --device-memory (e.g. 80GB) for one")
            return "\n".join(lines)
        share = f"{100 * self.total / self.device_memory:.0f}% of {size(self.device_memory)}"
        if self.fits is None:
            lines.append(f"verdict: unknown (the lower bound is {share})")
            return "\n".join(lines)
        if self.fits:
            lines.append(f"verdict: fits ({share})")
            return "\n".join(lines)
        lines.append(f"verdict: does not fit ({share})")
        for s in self.suggestions:
            verdict = "fits" if s.total <= self.device_memory else "still too large"
            lines.append(f"  --set {' --set '.join(s.change)}  ->  {size(s.total)} ({verdict})")
        if not any(s.total <= self.device_memory for s in self.suggestions):
            lines.append("no single change fits: combine them, or take a larger device or a smaller model")
        return "\n".join(lines)


def size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", MiB)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


# --- the estimate -----------------------------------------------------------------------------------------


def estimate(facts: Facts, s: Settings) -> tuple[dict[str, int], dict[str, str]]:
    """Bytes per rank, by part, and a short note on each."""
    backend = BACKENDS[s.backend]
    n = s.num_processes
    shards = backend.memory_shards(s.zero_stage) if n > 1 else frozenset()

    def share(nbytes: int, part: str) -> int:
        return -(-nbytes // n) if part in shards else nbytes

    sharded = facts.param_bytes - facts.whole_bytes
    parts = {"parameters": share(sharded, "parameters") + facts.whole_bytes}
    notes = {"parameters": f"1/{n} of {size(sharded)}" if "parameters" in shards else "all of them"}
    if "parameters" in shards and facts.whole_bytes:
        notes["parameters"] += f" + the 4-bit statistics, {size(facts.whole_bytes)}, on every rank"
    if s.backend == "deepspeed" and "parameters" in shards and facts.whole_bytes:
        notes["parameters"] += (
            f" (loading: all {size(facts.param_bytes)}, partitioned when the engine starts)"
        )
    if "parameters" in shards:
        parts["gathered unit"] = facts.largest_unit_bytes - share(facts.largest_unit_bytes, "parameters")
        notes["gathered unit"] = "the largest unit's other shards, during its forward and backward"
    grads = facts.trainable_bytes * backend.gradient_copies
    parts["gradients"] = share(grads, "gradients")
    notes["gradients"] = "trainable parameters only" + (
        " (x2: DDP's buckets)" if backend.gradient_copies > 1 else ""
    )
    parts["optimizer"] = share(2 * facts.trainable_bytes, "optimizer")
    notes["optimizer"] = "AdamW: two moments of the trainable parameters"
    if s.reference == "copy":  # swapped in for the reference pass: stored (sharded) like the parameters
        parts["reference copy"] = share(facts.trainable_bytes, "parameters")
        notes["reference copy"] = "the starting weights, for the KL term (rl.beta > 0, full fine-tuning)"
    if s.teacher:  # distill: per process (teacher_bytes: its layers sharded under FSDP-2 only)
        parts["teacher"], notes["teacher"] = s.teacher, "the frozen teacher's weights and final hidden states"
    mode = "every layer checkpointed" if s.checkpointing else "no checkpointing"
    rows = s.micro_batch * s.rows_per_example
    reference = {
        "pass": "; the reference pass keeps none",
        "table": "; reference log-probs precomputed before training, 8 bytes a pair",
    }.get(s.reference, "")
    pairs = f" ({s.micro_batch} pairs{reference})" if s.rows_per_example == 2 and not s.kv_cache_bytes else ""
    if s.kv_cache_bytes:
        pairs = f" ({s.micro_batch} prompts x {s.rows_per_example} completions)"
    pictures = f" ({facts.pictures})" if facts.pictures else ""
    split = s.sequence_parallel
    held = f", 1/{split} of each on this process (sequence parallel)" if split > 1 else ""
    notes["activations"] = f"{rows} x {facts.seq_len} tokens{pairs}{pictures}{held}, {mode}"
    if facts.activations is None:
        parts["activations"] = 0
        notes["activations"] = f"NOT MEASURED ({facts.unmeasured}): the total is a lower bound"
    else:  # per token, attention's whole-sequence q, k, v for heads / N included: 1/N of them
        acts = facts.activations.checkpointed() if s.checkpointing else facts.activations.total
        parts["activations"] = int(acts * rows / facts.batch / split)
    tokens = rows * -(-facts.seq_len // split)
    parts["loss"], notes["loss"] = _loss(facts, tokens, s.fused_loss, s.score_head)
    if split > 1 and s.split_mask:
        length = -(-facts.seq_len // split) * split
        parts["split mask"] = rows * length * length
        notes["split mask"] = "the whole sequence's attention mask (packing or eager), one boolean a pair"
    if s.kv_cache_bytes:  # sampling precedes the step and is freed before it: counted as an upper bound
        parts["kv cache"] = s.kv_cache_bytes
        notes["kv cache"] = (
            f"sampling {rows} sequences of up to {facts.seq_len} tokens (freed before the step)"
        )
    parts["overhead"] = OVERHEAD_BYTES.get(facts.device, OVERHEAD_BYTES["cuda"])
    notes["overhead"] = "CUDA context, workspaces" if parts["overhead"] else "none measurable on a CPU"
    return parts, notes


def _loss(facts: Facts, tokens: int, fused: bool, score_head: bool = False) -> tuple[int, str]:
    import torch
    from liger_kernels.fused_linear_cross_entropy import (
        CHUNK_BYTES,
        OTHER_DEVICE_CHUNK_BYTES,
        vocab_block_for,
    )

    if score_head:  # a reward model: fp32 scores, one per token, then one per sequence
        return tokens * 4, "score head: one score per token, no vocabulary logits"
    if not fused:
        return (
            EAGER_LOSS_COPIES * tokens * facts.vocab * 4,
            f"eager: fp32 logits {tokens} x {facts.vocab}, x3",
        )
    grad_hidden = tokens * facts.hidden * 4
    if facts.device == "cpu":
        block = tokens * vocab_block_for(tokens, facts.vocab, torch.device("cpu")) * 4
        accumulator = 0 if facts.lm_head_trainable else grad_hidden  # the frozen head's one pass
        return block + accumulator + grad_hidden, "fused: one vocabulary block of logits + grad_hidden"
    chunk = CHUNK_BYTES.get(facts.device, OTHER_DEVICE_CHUNK_BYTES)
    weight_acc = facts.vocab * facts.hidden * 4 if facts.lm_head_trainable else 0  # fp32 grad_weight
    return chunk + weight_acc + grad_hidden, "fused: one chunk of logits + grad_hidden"


def settings_of(recipe: Recipe, plan: Plan) -> Settings:
    t, dist = recipe.training, recipe.distributed
    return Settings(
        backend=plan.backend,
        zero_stage=dist.zero_stage,
        num_processes=plan.num_processes,
        micro_batch=t.micro_batch_size,
        grad_accum=t.grad_accum,
        checkpointing=plan.activation_checkpointing != "off",
        fused_loss=bool(plan.kernels.get("fused_linear_cross_entropy")),
        rows_per_example=rows_per_example(recipe),
        reference=reference(recipe),
        kv_cache_bytes=kv_cache_bytes(recipe),
        score_head=recipe.training.objective == "reward",
        teacher=teacher_bytes(recipe, plan.device),
        sequence_parallel=dist.sequence_parallel,
        split_mask=recipe.data.packing or recipe.model.attn_implementation == "eager",
        split_limit=split_limit(recipe),  # what a suggestion may offer
    )


def plan_memory(recipe: Recipe, plan: Plan, model: nn.Module, device_memory: int | None) -> MemoryPlan:
    """The memory plan of a recipe, from its Plan and its model on the meta device (kernels patched
    as the run patches them, so their activations are what they save)."""
    facts = measure_facts(recipe, plan, model)
    settings = settings_of(recipe, plan)
    parts, notes = estimate(facts, settings)
    memory = MemoryPlan(parts, notes, device_memory, complete=facts.activations is not None)
    if memory.fits is False:
        memory = replace(memory, suggestions=tuple(suggest(facts, settings, device_memory)))
    return memory


def suggest(facts: Facts, s: Settings, device_memory: int) -> list[Suggestion]:
    """Changes that would lower the peak, each re-estimated; those that fit first, cheapest first."""

    def first_fitting(options: list[tuple[tuple[str, ...], Settings]]):
        """The mildest of a graded change that fits, else its strongest."""
        return next((o for o in options if _total(facts, o[1]) <= device_memory), options[-1])

    candidates: list[tuple[tuple[str, ...], Settings]] = []
    if not s.checkpointing:
        candidates.append((("distributed.activation_checkpointing=auto",), replace(s, checkpointing=True)))
    if not s.fused_loss and not s.score_head:
        candidates.append((("kernels.fused_linear_cross_entropy=true",), replace(s, fused_loss=True)))
    halvings = [s.micro_batch >> k for k in range(1, s.micro_batch.bit_length())]
    if halvings:  # the same tokens per optimizer step
        candidates.append(first_fitting([
            ((f"training.micro_batch_size={mb}", f"training.grad_accum={s.grad_accum * s.micro_batch // mb}"),
             replace(s, micro_batch=mb, grad_accum=s.grad_accum * s.micro_batch // mb))
            for mb in halvings
        ]))  # fmt: skip
    if BACKENDS[s.backend].memory_shards(s.zero_stage):
        more = [s.num_processes * k for k in (2, 4, 8)]
        candidates.append(
            first_fitting([((f"distributed.num_processes={n}",), replace(s, num_processes=n)) for n in more])
        )
    elif s.num_processes > 1:  # nothing sharded yet: FSDP, or ZeRO-3
        candidates.append((("distributed.backend=fsdp2",), replace(s, backend="fsdp2")))
        change = ("distributed.backend=deepspeed", "distributed.zero_stage=3")
        candidates.append((change, replace(s, backend="deepspeed", zero_stage=3)))
    if s.backend == "deepspeed" and s.zero_stage != 3 and s.num_processes > 1:
        candidates.append((("distributed.zero_stage=3",), replace(s, zero_stage=3)))
    splits = [k for k in (2, 4, 8) if s.sequence_parallel < k <= s.split_limit]
    if splits:  # each sequence over k processes (more processes where k does not divide them)
        options = []
        for k in splits:
            world = -(-s.num_processes // k) * k
            more = (f"distributed.num_processes={world}",) if world != s.num_processes else ()
            options.append(((*more, f"distributed.sequence_parallel={k}"),
                            replace(s, num_processes=world, sequence_parallel=k)))  # fmt: skip
        candidates.append(first_fitting(options))
    found = [Suggestion(change, _total(facts, new)) for change, new in candidates]
    return sorted(found, key=lambda x: x.total > device_memory)  # stable: cheapest first within each


def _total(facts: Facts, s: Settings) -> int:
    return sum(estimate(facts, s)[0].values())


def measure_facts(recipe: Recipe, plan: Plan, model: nn.Module) -> Facts:
    """Sizes from the meta model; activations from one meta forward of a micro-batch (under
    fp16/bf16 mixed precision the model is cast first: it is the caller's meta model, used last)."""
    import torch

    from liger_cli.plan.wrap import resolve_wrap_classes

    params = {id(p): p for p in model.parameters()}  # a tied weight once
    four_bit = four_bit_bytes(recipe, model)
    # QLoRA's k-bit preparation (peft's) casts every fp16/bf16 parameter it does not quantize to fp32;
    # where the backend shards the 4-bit weights there is no preparation (quantize.shards_weights)
    upcast = recipe.model.quantize != "none" and not shards_weights(recipe)
    half = (torch.float16, torch.bfloat16)

    def nbytes(p) -> int:
        if id(p) in four_bit:
            return sum(four_bit[id(p)])
        return p.numel() * (4 if upcast and p.dtype in half else p.element_size())

    param_bytes = sum(nbytes(p) for p in params.values())
    trainable = sum(nbytes(p) for p in params.values() if p.requires_grad)
    classes = plan.wrap_classes
    if classes is None:
        classes = tuple(resolve_wrap_classes(model, None, env={}).classes)
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    unit_bytes = [sum(nbytes(p) for p in layer.parameters()) for layer in layers]
    root = param_bytes - sum(unit_bytes)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    batch, seq_len = recipe.training.micro_batch_size, recipe.data.max_seq_len
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)
    if low is not None:  # autocast computes in it: measure activations at its size (meta: no cost)
        model.to(low)
    activations, unmeasured, pictures = None, "", ""
    try:
        inputs, pictures = meta_image_batch(model, batch, seq_len) or ({}, "")
        activations = measure_activations(model, layers, batch, seq_len, inputs)
    except Exception as err:  # noqa: BLE001 - any model code: say what stopped it, guess nothing
        unmeasured = f"its forward cannot run on the meta device: {type(err).__name__}: {str(err)[:120]}"
    return Facts(
        param_bytes=param_bytes,
        trainable_bytes=trainable,
        largest_unit_bytes=max([root, *unit_bytes]),
        activations=activations,
        batch=batch,
        seq_len=seq_len,
        hidden=head.weight.shape[1] if head is not None else config.hidden_size,
        vocab=head.weight.shape[0] if head is not None else config.vocab_size,
        lm_head_trainable=bool(head is not None and head.weight.requires_grad),
        device=plan.device,
        unmeasured=unmeasured,
        pictures=pictures,
        whole_bytes=sum(stats for _, stats in four_bit.values()),
    )
