"""The training recipe: named set-up steps, then one loop (`run` reads top to bottom).

Set-up, in order: backend and accelerator -> output folder checked (read-only) -> tokenizer and
data (`inputs.py`) -> model (adapter, checkpointing, kernels) -> output folder claimed (the first change on disk)
-> optimizer, schedule and `prepare` -> the objective's `prepare` (values it needs from the untrained
model, e.g. reference log-probs: `reference.py`) -> resume. Then `fit`: one
loop over optimizer steps, each taking `grad_accum` micro-batches per process (`batches.py` says
which). An online objective (GRPO) makes a step's micro-batches by sampling from the model being
trained instead (`online.py`'s Rollouts: at the step, or ahead of it with rl.max_staleness). Everything that differs between backends is
a call on the `Backend` object.

The logged loss is the true mean over the label tokens of the whole optimizer step (all micro-
batches, all ranks): each micro-batch's loss is a sum divided by the step's global token count.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from liger_cli.data.sources import local_paths
from liger_cli.data.stream import StreamBatches
from liger_cli.errors import RunFailed, UserError
from liger_cli.model import build_model, count_parameters
from liger_cli.model.objectives import Objective, objective_for
from liger_cli.model.objectives.online import Online
from liger_cli.plan import Applied, Plan, render_with
from liger_cli.recipe import Recipe
from liger_cli.run import checkpoint, output_dir, verify
from liger_cli.run.backends import Backend, backend_for
from liger_cli.run.checkpoint import save_final
from liger_cli.run.evaluate import evaluate
from liger_cli.run.fingerprint import check_same_run, fingerprint
from liger_cli.run.inputs import Data, load_data
from liger_cli.run.metrics import MemoryWatch, MetricsLog, peak_memory_mb
from liger_cli.run.output_dir import OutputDecision, claim_output
from liger_cli.run.reference import precompute_for
from liger_cli.run.sequence_parallel import SequenceParallel, attending
from liger_cli.run.trackers import check_installed

FINAL_METRICS = "final_metrics.json"


class TrainingDiverged(RunFailed):
    """The loss became NaN or infinite; the run stops and keeps its last good checkpoint."""


@dataclass
class Trainer:
    """What set-up built and the loop uses."""

    recipe: Recipe
    backend: Backend
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    data: Data
    step: int
    say: object
    fingerprint: dict
    """What the run's math depends on: written into every checkpoint, compared on resume."""
    memory: MemoryWatch
    """Started before the model is built: the peak a step adds, as the memory plan estimates it."""
    objective: Objective
    split: SequenceParallel | None = None
    """distributed.sequence_parallel: each micro-batch's sequences split over a group of processes."""
    online: bool = False
    """The objective samples its batches from the model as it trains (grpo, distill: `Online`)."""
    rollouts: object = None
    """An online run's Rollouts (liger_cli.run.online), closed by `run` however the loop ends."""
    kept: tuple | None = None
    """A resumed online run's state of its rollouts (the checkpoint's objective state)."""


def run(recipe: Recipe, plan: Plan, echo=print) -> dict:
    """Train as the recipe says. Returns the final metrics.

    Nothing on disk changes until every check has passed (recipe, paths, tokenizer, data rows, model
    config, resume compatibility): only then is the output folder claimed (`claim_output`). One
    check comes later: a resume's stored reference log-probs (`reference.py`) are read, and refused
    when they do not fit, once the objective's `prepare` asks for them, after the model is prepared.
    """
    backend = backend_for(recipe, plan)
    accelerator = backend.make_accelerator()
    say = echo if accelerator.is_main_process else (lambda *_: None)
    check_installed(recipe.logging, accelerator.is_main_process)  # exit 2 before any work
    split = (
        SequenceParallel.start(recipe.distributed.sequence_parallel)
        if recipe.distributed.sequence_parallel > 1
        else None
    )
    output = check_output(recipe)
    data = load_data(recipe, accelerator)
    run_fingerprint = fingerprint(recipe, accelerator.num_processes, plan.backend)
    if check_resume(output, data, run_fingerprint, say) == "complete":
        return {}
    objective = objective_for(recipe)  # a grpo run's reward functions are imported here
    online = isinstance(objective, Online)  # asked once: its batches are sampled from the model as it trains
    if online:
        from liger_cli.run.online import check_engine, check_prompts  # online runs: the generation stage

        check_engine(recipe)
        check_prompts(recipe, data.train, "train")
        check_prompts(recipe, data.eval, "eval")
    if hasattr(objective, "check_data"):  # a reward model's margins, before anything is built
        objective.check_data(data.train, "train")
        objective.check_data(data.eval, "eval")
    memory = MemoryWatch(accelerator.device)
    model, kernel_report = build_model(recipe, plan)
    if split:  # proved on a twin of the model before anything is written: a split that changes it stops here
        split.install(model)
        if hasattr(objective, "split"):  # per-row sums added over the group (preference, grpo)
            objective.split = split
        split_checked = split.check_on_twin(recipe, plan.kernels)
    claim_output(output, accelerator.is_main_process, accelerator.wait_for_everyone)
    record_plan(recipe, plan, Applied(kernels_patched=kernel_report), accelerator.is_main_process, say)
    describe(model, data, say)
    if split:
        say(split_checked)
    trainer = prepare(recipe, backend, model, data, say, run_fingerprint, memory, objective)
    trainer.split, trainer.online = split, online
    collate, unit = objective.collate, getattr(objective, "unit", "pair")  # unit: what the log calls them
    reference = precompute_for(
        recipe, backend, trainer.model, data, collate, run_fingerprint, say, output.resume_from, unit, split
    )
    objective.prepare(reference)  # before any weight changes
    if online:  # grpo's starting weights, before a resume loads trained ones; distill's teacher
        if note := objective.keep_reference(trainer.model, backend):
            say(note)
    if output.resume_from is not None:
        resume(trainer, output.resume_from)
    try:
        last = fit(trainer)
    finally:  # a run that stops on an error stops its tool processes and its engine's server too
        if trainer.rollouts is not None:
            trainer.rollouts.close()
    finish(trainer, last)
    return last  # the process group is destroyed by the launcher (rank.py), after every run in it


# --- set-up steps -----------------------------------------------------------------------------------------


def check_output(recipe: Recipe) -> OutputDecision:
    """What the run may do with its output folder (read-only, every rank); seed."""
    from transformers import set_seed

    out, m, d = recipe.output, recipe.model, recipe.data
    sources = local_paths(d.train) + local_paths(d.eval)
    inputs = tuple(p for p in (m.path, m.config, m.tokenizer, *sources) if p is not None)
    decision = output_dir.check_output(out.dir, out.resume, out.overwrite, inputs)
    set_seed(recipe.training.seed)
    return decision


def check_resume(output: OutputDecision, data: Data, found: dict, say) -> str | None:
    """The checkpoint must come from the same run (`fingerprint.py`) and not lie past its end;
    "complete" when it is this run's last step and the run finished (nothing to do)."""
    if output.resume_from is None:
        return None
    check_same_run(output.resume_from, found)
    step = checkpoint.read_state(output.resume_from)["step"]
    if step > data.total_steps:
        raise UserError(
            f"cannot resume {output.resume_from}: it is at step {step}, past this run's {data.total_steps} "
            "steps; raise training.max_steps (or epochs) to continue it"
        )
    if step == data.total_steps and (output.out / FINAL_METRICS).is_file():
        say(
            f"the run in {output.out} is complete ({step} of {step} steps): nothing to do; raise "
            "training.max_steps to continue it"
        )
        return "complete"
    return None


def record_plan(recipe: Recipe, plan: Plan, applied: Applied, main: bool, say) -> None:
    """The resolved recipe and `plan.txt` (main process, in the claimed folder); the Plan in the log."""
    out = recipe.output.dir
    if main:
        (out / "recipe.yaml").write_text(recipe.to_yaml())
        (out / "plan.txt").write_text(render_with(plan, applied) + "\n")
    say(render_with(plan, applied))


def describe(model, data: Data, say) -> None:
    trainable, total = count_parameters(model)
    say(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)")
    evals = len(data.eval) if data.eval is not None else 0
    train = "streamed" if data.train is None else len(data.train)
    say(f"data: {train} train / {evals} eval examples; {data.total_steps} optimizer steps")


def prepare(
    recipe: Recipe,
    backend: Backend,
    model,
    data: Data,
    say,
    found: dict,
    memory: MemoryWatch,
    objective: Objective,
) -> Trainer:
    """AdamW and the schedule; the backend wraps model and optimizer and proves it did as planned."""
    from transformers import get_scheduler

    t = recipe.training
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    # Stepped by us once per optimizer step: accelerate's prepared scheduler would step once per process.
    scheduler = get_scheduler(
        t.scheduler, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=data.total_steps
    )
    model, optimizer = backend.prepare(model, optimizer)
    say(f"sharding: {backend.check(model)}")  # no silent downgrade
    gathered = backend.gather_for_fused_loss(model)
    if gathered:
        say(f"fused loss: {gathered}")
    checkpoint.save_only_trainable_weights(backend.accelerator, model, recipe.adapter.type != "none")
    return Trainer(recipe, backend, model, optimizer, scheduler, data, 0, say, found, memory, objective)


def resume(trainer: Trainer, checkpoint_dir: Path) -> None:
    """Weights and optimizer the backend's way, then scheduler and RNG state (plain files); the data
    position is the step number. A file that needs more than plain tensor data to load is refused."""
    try:
        trainer.backend.load_state(trainer.model, trainer.optimizer, checkpoint_dir)
    except pickle.UnpicklingError as err:
        raise UserError(
            f"cannot resume {checkpoint_dir}: a file in it is not plain tensor data ({str(err).splitlines()[0]}); "
            "it was changed or not written by liger"
        ) from None
    rank = trainer.backend.accelerator.process_index
    trainer.step = checkpoint.load_plain_state(checkpoint_dir, trainer.scheduler, rank)
    trainer.kept = checkpoint.load_objective_state(
        checkpoint_dir, rank
    )  # grpo's completions for the next steps
    if isinstance(trainer.data.batches, StreamBatches):  # the stream continues where the step left it
        position = checkpoint.read_state(checkpoint_dir).get("stream")
        if position is None:
            raise UserError(f"cannot resume {checkpoint_dir}: it holds no stream position (data.streaming)")
        trainer.data.batches.seek(position, trainer.step * trainer.recipe.training.grad_accum)
    trainer.say(f"resumed from {checkpoint_dir} at step {trainer.step}")


def finish(trainer: Trainer, last: dict[str, float]) -> None:
    """The final model (gathered by the backend, written by rank 0) and the final metrics."""
    recipe, backend, model, data = trainer.recipe, trainer.backend, trainer.model, trainer.data
    out, accelerator = recipe.output.dir, backend.accelerator
    state_dict = save_final(backend, model, data.tokenizer, out)
    verify.check_final(recipe, backend, model, data, trainer.objective.collate, trainer.say, state_dict)
    peak = trainer.memory.peak_mb
    trainer.say(f"memory: peak {peak:.0f} MiB over the process's memory before the model was built "
                "(what `liger train --dry-run` estimates)")  # fmt: skip
    if accelerator.is_main_process:
        final = {**last, "peak_mem_growth_mb": peak}
        (out / FINAL_METRICS).write_text(json.dumps(final, indent=2))  # last: it marks the run complete
    trainer.say(f"done: final model in {out / 'final'}, metrics in {out / 'metrics.jsonl'}")


# --- the loop ---------------------------------------------------------------------------------------------


def fit(trainer: Trainer) -> dict[str, float]:
    """Optimizer steps until the end, with logging, evaluation and checkpoints; the last metrics."""
    recipe, backend, model, data = trainer.recipe, trainer.backend, trainer.model, trainer.data
    accelerator, t, out, say = backend.accelerator, recipe.training, recipe.output.dir, trainer.say
    main, device, pad_id = accelerator.is_main_process, accelerator.device, data.tokenizer.pad_token_id
    metrics_log = MetricsLog(out, recipe, main)
    objective = trainer.objective
    step = trainer.step
    last: dict[str, float] = {}
    samples = rollouts = None
    if t.eval_samples:
        from liger_cli.run.samples import Samples

        samples = Samples.of_run(recipe, data.eval, data.tokenizer, model)
    if online := trainer.online:  # the generation stage is imported by the runs that sample
        from liger_cli.run.online import Rollouts, evaluate_rewards

        rollouts = trainer.rollouts = Rollouts(trainer, trainer.kept)

    def run_eval(at: int, echo) -> None:
        if online:  # an objective's own evaluation (distill: eval_kl), else by reward (grpo)
            rollouts.drain()  # the engine free of background sampling
            sampler, own = rollouts.sampler, getattr(objective, "evaluate", None)
            found = own(model, sampler, data.eval) if own else evaluate_rewards(objective, sampler, data.eval)
        else:
            found = evaluate(model, data.eval, accelerator, objective, t.micro_batch_size, pad_id, data.filler,
                             trainer.split)  # fmt: skip
        if samples is not None:
            found |= samples.write(backend, model, at, echo)
        last.update(found)
        metrics_log.write(at, found, echo)

    if data.eval is not None and step == 0:  # the baseline that later eval losses are compared with
        run_eval(0, say)
    window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
    # A progress bar on a terminal only (not in log files or pipes); the log lines print above it.
    progress = tqdm(total=data.total_steps, initial=step, unit="step", desc="training",
                    disable=not (main and sys.stderr.isatty()))  # fmt: skip
    log = progress.write if not progress.disable else say
    model.train()
    while step < data.total_steps:
        trainer.memory.step_begins()
        if online:  # the step's prompts, each sampled rl.num_generations times and scored
            micro = rollouts.batch(step)
        else:
            micro = [
                objective.collate(data.examples(step * t.grad_accum + a), pad_id) for a in range(t.grad_accum)
            ]
        if trainer.split:  # this process's positions of each micro-batch (units and loss count its part)
            micro = [trainer.split.shard(b) for b in micro]
        num_items = accelerator.reduce(sum(objective.units(b) for b in micro).to(device), "sum").clamp(min=1)
        if hasattr(objective, "begin_step"):  # kto: what the step's whole global batch decides (z0)
            objective.begin_step(model, micro, device, lambda t: accelerator.reduce(t, "sum"))
        step_sums = None  # the step's loss, then each of the objective's metrics (means over its units)
        for a, batch in enumerate(micro):
            last_micro = a == len(micro) - 1
            with backend.micro_batch(model, last_micro) as backward, attending(trainer.split, batch):
                loss, stats = objective.loss(model, {k: v.to(device) for k, v in batch.items()}, num_items)
                sums = torch.stack([loss.detach(), *(v.detach() for v in stats.values())])
                step_sums = sums if step_sums is None else step_sums + sums
                if last_micro:  # checked before the last backward: under DeepSpeed it also steps
                    step_sums = accelerator.reduce(step_sums, "sum")
                    if not torch.isfinite(step_sums[0]):
                        raise TrainingDiverged(
                            f"loss is {step_sums[0].item()} at step {step + 1}: stopping; the last good "
                            "checkpoint is kept (lower training.lr, check the data, or use fp32)"
                        )
                backward(loss)
            window_tokens += int(batch["input_ids"].numel())
        # All parameters of the prepared model: accelerate then uses FSDP's own (global) norm. Under
        # DeepSpeed the engine has already clipped (gradient_clipping) and this returns its norm.
        grad_norm = (
            accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm) if t.max_grad_norm else None
        )
        trainer.optimizer.step()  # under DeepSpeed a no-op (accelerate's wrapper): the engine stepped above
        trainer.scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.memory.step_ends()
        step += 1
        if online:  # the engine checked against the trainer, then given the new weights
            rollouts.step_done(step)
        window_steps += 1
        progress.update(1)
        if step == 1 and (
            note := objective.start_note(dict(zip(["loss", *stats], step_sums.tolist(), strict=True)))
        ):
            log(note)  # a fresh run's first step, where an objective knows what it must see

        if step % recipe.logging.every == 0 or step == data.total_steps:
            elapsed = time.perf_counter() - window_start
            values = step_sums.tolist()
            last = {
                "loss": values[0],
                **dict(zip(stats, values[1:], strict=True)),
                "lr": trainer.scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "tokens_per_s": window_tokens * accelerator.num_processes / max(elapsed, 1e-9),
                "step_time_s": elapsed / window_steps,
                "peak_mem_mb": peak_memory_mb(device),
                **(objective.step_stats if online else {}),
            }
            metrics_log.write(step, last, log)
            if online and objective.samples:
                shown = objective.samples[0]
                scored = f" reward {shown['reward']:.3g}" if "reward" in shown else ""  # grpo's
                log(f"sample: {shown['completion'][:80]!r}{scored}")
            progress.set_postfix(loss=f"{last['loss']:.4g}", lr=f"{last['lr']:.2e}", refresh=False)
            window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
        if data.eval is not None and t.eval_every and step % t.eval_every == 0 and step < data.total_steps:
            run_eval(step, log)
        every = recipe.output.save_every
        if (every and step % every == 0) or step == data.total_steps:  # the last step too: a run can continue
            state = {"step": step, "total_steps": data.total_steps, **data.position()}
            found, scheduler = trainer.fingerprint, trainer.scheduler
            kept = rollouts.checkpoint_state() if online else None
            saved = checkpoint.save_checkpoint(accelerator, out, step, state, found, scheduler, kept)
            log(f"checkpoint saved: {saved}")
    progress.close()
    if isinstance(data.batches, StreamBatches):
        data.batches.close()  # the reading thread ends with the loop
    if data.eval is not None:  # the final evaluation
        run_eval(step, say)
    metrics_log.close({**last, "peak_mem_growth_mb": trainer.memory.peak_mb})  # final_metrics.json's
    return last
