"""The training loop: one readable file, on `accelerate.Accelerator`.

Set-up, in order: accelerator -> output folder -> tokenizer and data -> model (adapter,
checkpointing, kernels) -> optimizer and schedule -> prepare -> resume. Then one loop over
optimizer steps; each step takes `grad_accum` micro-batches per process.

Why the batches are indexed by step rather than drawn from a DataLoader iterator: the data of
step N is a pure function of (seed, N, rank), so a resumed run sees exactly the batches an
uninterrupted run would, and every rank of a multi-process run gets its own slice of the same
global batch that a one-process run would train on.

The logged loss is the true mean over the label tokens of the whole optimizer step (all micro-
batches, all ranks): each micro-batch's loss is a sum divided by the step's global token count.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from liger_cli import checkpoint
from liger_cli.data import build_datasets, collate
from liger_cli.distributed import (
    apply_wrap_plan,
    check_sharding,
    full_state_dict,
    gather_lm_head_for_fused_loss,
    init_optimizer_state,
    make_accelerator,
    micro_batch,
)
from liger_cli.errors import UserError
from liger_cli.model import build_model, count_parameters, load_tokenizer, meta_twin
from liger_cli.plan import Plan
from liger_cli.recipe import Recipe


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run stops and keeps its last good checkpoint."""


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


def _total_steps(recipe: Recipe, batches: StepBatches) -> int:
    t = recipe.training
    if t.max_steps:
        return t.max_steps
    return max(1, math.ceil((t.epochs or 1) * batches.micro_per_epoch / t.grad_accum))


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MetricsLog:
    """Console line + metrics.jsonl + TensorBoard, written by the main process only."""

    def __init__(self, out: Path, recipe: Recipe, enabled: bool):
        self.enabled = enabled
        self.jsonl = (out / "metrics.jsonl").open("a") if enabled and recipe.logging.jsonl else None
        self.tb = None
        if enabled and recipe.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float], echo) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tb:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        echo(f"step {step:>6}  " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def _micro_loss(model, batch: dict, num_items: torch.Tensor, device) -> torch.Tensor:
    """Sum of this micro-batch's token losses divided by the step's global label-token count."""
    batch = {k: v.to(device) for k, v in batch.items()}
    return model(**batch, num_items_in_batch=num_items).loss


def _label_tokens(batch: dict) -> torch.Tensor:
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
        loss = _micro_loss(model, batch, one, accelerator.device)  # a sum over tokens
        if j < len(starts):
            loss_sum += loss.double()
            tokens += _label_tokens(batch).to(accelerator.device)
    loss_sum, tokens = accelerator.reduce(torch.stack([loss_sum, tokens]), "sum")
    model.train()
    return (loss_sum / tokens.clamp(min=1)).item()


def run(recipe: Recipe, plan: Plan, echo=print) -> dict:
    """Train as the recipe says. Returns the final metrics."""
    from transformers import get_scheduler
    from transformers import set_seed as hf_set_seed

    # --- 1. processes and output folder
    accelerator = make_accelerator(recipe, plan)
    main = accelerator.is_main_process
    say = echo if main else (lambda *_: None)
    out = recipe.output.dir
    resume_from = checkpoint.prepare_output(out, recipe.output.resume, recipe.output.overwrite, main)
    accelerator.wait_for_everyone()
    hf_set_seed(recipe.training.seed)

    # --- 2. tokenizer and data (all checked before the model is built)
    tokenizer = load_tokenizer(recipe)
    train_ds, eval_ds = build_datasets(recipe.data, tokenizer, recipe.training.seed)
    t = recipe.training
    batches = StepBatches(
        len(train_ds), t.micro_batch_size, accelerator.num_processes, accelerator.process_index, t.seed
    )
    if batches.micro_per_epoch == 0:
        raise UserError(
            f"data.train has {len(train_ds)} usable examples, fewer than one global micro-batch "
            f"({t.micro_batch_size} x {accelerator.num_processes} processes): lower training.micro_batch_size"
        )
    total_steps = _total_steps(recipe, batches)

    # --- 3. model
    model = build_model(recipe, plan)
    apply_wrap_plan(accelerator, model, recipe, plan)  # FSDP units from the built model, into the Plan
    trainable, total = count_parameters(model)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / checkpoint.MARKER).touch()
        (out / "recipe.yaml").write_text(recipe.to_yaml())
        (out / "plan.txt").write_text(plan.render() + "\n")
        checkpoint.remove_stale_temporaries(out)
    say(plan.render())
    say(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)")
    say(
        f"data: {len(train_ds)} train / {len(eval_ds) if eval_ds is not None else 0} eval examples; "
        f"{total_steps} optimizer steps"
    )

    # --- 4. optimizer, schedule, accelerate
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    # Stepped by us once per optimizer step: accelerate's prepared scheduler would step once per process.
    scheduler = get_scheduler(
        t.scheduler, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=total_steps
    )
    model, optimizer = accelerator.prepare(model, optimizer)  # together: FSDP-2 swaps the optimizer's params
    say(f"sharding: {check_sharding(model, recipe, plan, accelerator.num_processes)}")  # no silent downgrade
    gathered = gather_lm_head_for_fused_loss(model, plan)
    if gathered:
        say(f"fused loss: {gathered}")
    accelerator.register_for_checkpointing(scheduler)
    _save_only_trainable_weights(accelerator, model, recipe)

    step = 0
    if resume_from is not None:
        if plan.backend == "fsdp1":
            init_optimizer_state(optimizer)  # the checkpoint reader fills only state that exists
        if accelerator.distributed_type.name == "DEEPSPEED":
            accelerator.load_state(str(resume_from))  # the engine's own sharded checkpoint; no `strict`
        else:
            if recipe.adapter.type != "none":
                _check_adapter_checkpoint(accelerator, model, resume_from)
            accelerator.load_state(str(resume_from), strict=recipe.adapter.type == "none")
        step = checkpoint.read_state(resume_from)["step"]
        say(f"resumed from {resume_from} at step {step}")

    # --- 5. the loop
    metrics_log = MetricsLog(out, recipe, main)
    pad_id = tokenizer.pad_token_id
    device = accelerator.device
    last: dict[str, float] = {}
    if eval_ds is not None and step == 0:  # the baseline that later eval losses are compared with
        last["eval_loss"] = evaluate(model, eval_ds, accelerator, t.micro_batch_size, pad_id)
        metrics_log.write(0, {"eval_loss": last["eval_loss"]}, say)
    window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
    # A progress bar on a terminal only (not in log files or pipes); the log lines print above it.
    progress = tqdm(total=total_steps, initial=step, unit="step", desc="training",
                    disable=not (main and sys.stderr.isatty()))  # fmt: skip
    log = progress.write if not progress.disable else say
    model.train()
    while step < total_steps:
        micro = [
            collate([train_ds[i] for i in batches.indices(step * t.grad_accum + a)], pad_id)
            for a in range(t.grad_accum)
        ]
        num_items = accelerator.reduce(sum(_label_tokens(b) for b in micro).to(device), "sum").clamp(min=1)
        step_loss = torch.zeros((), device=device)
        for a, batch in enumerate(micro):
            last_micro = a == len(micro) - 1
            with micro_batch(accelerator, model, last_micro) as backward:
                loss = _micro_loss(model, batch, num_items, device)
                step_loss += loss.detach()
                if last_micro:  # checked before the last backward: under DeepSpeed it also steps
                    step_loss = accelerator.reduce(step_loss, "sum")
                    if not torch.isfinite(step_loss):
                        raise TrainingDiverged(
                            f"loss is {step_loss.item()} at step {step + 1}: stopping; the last good "
                            "checkpoint is kept (lower training.lr, check the data, or use fp32)"
                        )
                backward(loss)
            window_tokens += int(batch["labels"].numel())
        # All parameters of the prepared model: accelerate then uses FSDP's own (global) norm. Under
        # DeepSpeed the engine has already clipped (gradient_clipping) and this returns its norm.
        grad_norm = (
            accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm) if t.max_grad_norm else None
        )
        optimizer.step()  # under DeepSpeed a no-op (accelerate's wrapper): the engine stepped above
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window_steps += 1
        progress.update(1)

        if step % recipe.logging.every == 0 or step == total_steps:
            elapsed = time.perf_counter() - window_start
            last = {
                "loss": step_loss.item(),
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "tokens_per_s": window_tokens * accelerator.num_processes / max(elapsed, 1e-9),
                "step_time_s": elapsed / window_steps,
                "peak_mem_mb": _peak_memory_mb(device),
            }
            metrics_log.write(step, last, log)
            progress.set_postfix(loss=f"{last['loss']:.4g}", lr=f"{last['lr']:.2e}", refresh=False)
            window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
        if eval_ds is not None and t.eval_every and step % t.eval_every == 0 and step < total_steps:
            last["eval_loss"] = evaluate(model, eval_ds, accelerator, t.micro_batch_size, pad_id)
            metrics_log.write(step, {"eval_loss": last["eval_loss"]}, log)
        if recipe.output.save_every and step % recipe.output.save_every == 0 and step < total_steps:
            saved = checkpoint.save_checkpoint(
                accelerator, out, step, {"step": step, "total_steps": total_steps}
            )
            log(f"checkpoint saved: {saved}")
    progress.close()

    # --- 6. final evaluation and outputs
    if eval_ds is not None:
        last["eval_loss"] = evaluate(model, eval_ds, accelerator, t.micro_batch_size, pad_id)
        metrics_log.write(step, {"eval_loss": last["eval_loss"]}, say)
    metrics_log.close()
    save_final(accelerator, model, tokenizer, out)
    if main:
        (out / "final_metrics.json").write_text(json.dumps(last, indent=2))
    say(f"done: final model in {out / 'final'}, metrics in {out / 'metrics.jsonl'}")
    return last  # the process group is destroyed by the launcher (launch.py), after every run in it


def _trainable_names(accelerator, model) -> set[str]:
    """Trainable parameter names as accelerate's state dicts name them (without DDP's `module.`)."""
    return {name for name, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}


def _save_only_trainable_weights(accelerator, model, recipe: Recipe) -> None:
    """With an adapter, checkpoints hold only the trainable weights: the frozen base is the model folder."""
    if recipe.adapter.type == "none":
        return
    trainable = _trainable_names(accelerator, model)

    def keep_trainable(models, weights, output_dir):
        for i, state in enumerate(weights):
            weights[i] = {k: v for k, v in state.items() if k in trainable}
            if weights[i].keys() != trainable:  # never write a checkpoint that resumes without the adapter
                raise RuntimeError(
                    f"checkpoint would hold {len(weights[i])} of {len(trainable)} trainable weights"
                )

    accelerator.register_save_state_pre_hook(keep_trainable)


def _check_adapter_checkpoint(accelerator, model, checkpoint_dir: Path) -> None:
    """Loading is not strict with an adapter (the frozen base is not in the checkpoint), so check the
    checkpoint holds exactly the trainable weights: a silent partial load would train from scratch."""
    weights = checkpoint_dir / "model.safetensors"
    if not weights.is_file():  # FSDP and DeepSpeed write their own sharded formats, loaded strictly
        return
    from safetensors import safe_open

    with safe_open(weights, "pt") as f:
        keys = set(f.keys())
    trainable = _trainable_names(accelerator, model)
    if keys != trainable:
        raise RuntimeError(
            f"checkpoint {checkpoint_dir} holds {len(keys)} weights but the model trains {len(trainable)} "
            f"(e.g. missing {sorted(trainable - keys)[:2]}): it was written by another recipe or backend"
        )


def save_final(accelerator, model, tokenizer, out: Path) -> None:
    """The adapter in peft's format (or the full model), plus the tokenizer, written by rank 0 only."""
    state_dict = full_state_dict(accelerator, model)  # gathers shards on every rank; rank 0 keeps it
    final = out / "final"
    if accelerator.is_main_process:
        tmp = out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        inner = accelerator.unwrap_model(model)
        if hasattr(inner, "peft_config") and accelerator.distributed_type.name == "FSDP":
            inner = meta_twin(inner)  # peft cannot name the adapter's weights through FSDP's wrappers
        inner.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    accelerator.wait_for_everyone()
