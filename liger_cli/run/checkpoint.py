"""Crash-safe checkpoints and the final save.

A checkpoint is written into `checkpoints/.tmp-step-N` and renamed to `checkpoints/step-N` only
once complete (with `trainer_state.json` as its last file). A save killed half-way therefore never
looks complete, and `resume: auto` always picks the newest checkpoint that is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from liger_cli.run.fingerprint import write_fingerprint
from liger_cli.run.plain_state import load_rng, load_scheduler, save_rng, save_scheduler

STATE_FILE = "trainer_state.json"
OBJECTIVE_FILE = "objective_state_{rank}.safetensors"


def checkpoints_dir(out: Path) -> Path:
    return out / "checkpoints"


def complete_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def read_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / STATE_FILE).read_text())


def save_checkpoint(
    accelerator, out: Path, step: int, state: dict, found: dict, scheduler, objective_state=None
) -> Path:
    """accelerate's save_state (weights, optimizer) into a temporary folder, the scheduler and every
    process's RNG state in plain formats (`plain_state.py`), what the run depends on (`found`, see
    fingerprint.py), this process's part of the objective's state if it has one (GRPO: the batch of
    completions the next steps reuse), the trainer state last, then an atomic rename."""
    root = checkpoints_dir(out)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    save_rng(tmp, accelerator.process_index)
    if objective_state is not None:
        tensors, meta = objective_state
        save_file(tensors, str(tmp / OBJECTIVE_FILE.format(rank=accelerator.process_index)),
                  metadata={"state": json.dumps(meta)})  # fmt: skip
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_scheduler(tmp, scheduler)
        write_fingerprint(tmp, found)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        with open(tmp / STATE_FILE) as f:
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def load_plain_state(checkpoint: Path, scheduler, rank: int) -> int:
    """The scheduler and this process's RNG state (after the backend loaded weights and optimizer);
    returns the step the checkpoint was written at (the data position)."""
    load_scheduler(checkpoint, scheduler)
    load_rng(checkpoint, rank)
    return read_state(checkpoint)["step"]


def load_objective_state(checkpoint: Path, rank: int) -> tuple[dict, dict] | None:
    """This process's part of the objective's state (tensors, metadata), if the checkpoint holds one."""
    path = checkpoint / OBJECTIVE_FILE.format(rank=rank)
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("state", "{}"))
    return load_file(str(path)), meta


def remove_stale_temporaries(out: Path) -> None:
    """Half-written saves from a killed run are never resumed from; clear them."""
    for tmp in checkpoints_dir(out).glob(".tmp-step-*"):
        shutil.rmtree(tmp, ignore_errors=True)


# --- what a checkpoint holds with an adapter ---------------------------------------------------------------


def _trainable_names(accelerator, model) -> set[str]:
    """Trainable parameter names as accelerate's state dicts name them (without DDP's `module.`)."""
    return {name for name, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}


def save_only_trainable_weights(accelerator, model, adapter: bool) -> None:
    """With an adapter, checkpoints hold only the trainable weights: the frozen base is the model folder."""
    if not adapter:
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


def check_adapter_checkpoint(accelerator, model, checkpoint_dir: Path) -> None:
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


def save_final(backend, model, tokenizer, out: Path) -> dict:
    """The adapter in peft's format (or the full model), plus the tokenizer, written by rank 0 only;
    returns the gathered state dict (whole on rank 0), which the final check compares with the files."""
    accelerator = backend.accelerator
    state_dict = backend.full_state_dict(model)  # gathers shards on every rank; rank 0 keeps it
    final = out / "final"
    if accelerator.is_main_process:
        tmp = out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        backend.model_to_save(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    accelerator.wait_for_everyone()
    return state_dict
