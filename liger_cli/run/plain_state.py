"""The scheduler and random-number state of a checkpoint, as JSON and safetensors: never pickled.

accelerate pickles both (`scheduler.bin` / `custom_checkpoint_0.pkl`, `random_states_N.pkl`), and a
pickle from elsewhere can run code when loaded. liger writes them itself in plain formats, deletes
accelerate's pickled random states from the checkpoint, and reads only its own files; the optimizer
state that accelerate writes is loaded with `torch.load(weights_only=True)` (`backends/base.py`).
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

SCHEDULER_FILE = "scheduler.json"


def _rng_files(folder: Path, rank: int) -> tuple[Path, Path]:
    return folder / f"rng-{rank}.safetensors", folder / f"rng-{rank}.json"


def save_rng(folder: Path, rank: int) -> None:
    """This process's torch (CPU and CUDA), Python and NumPy generator states."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors |= {f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": [version, list(state), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]}
    tensor_file, json_file = _rng_files(folder, rank)
    save_file(tensors, tensor_file)
    json_file.write_text(json.dumps(plain))
    for pickled in folder.glob(f"random_states_{rank}.pkl"):  # accelerate's pickled copy: never read
        pickled.unlink()


def load_rng(folder: Path, rank: int) -> None:
    tensor_file, json_file = _rng_files(folder, rank)
    tensors = load_file(tensor_file)
    plain = json.loads(json_file.read_text())
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_scheduler(folder: Path, scheduler) -> None:
    """A LambdaLR's state (transformers' schedules) is numbers and lists; its lambdas are code, not state."""
    folder.joinpath(SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))


def load_scheduler(folder: Path, scheduler) -> None:
    scheduler.load_state_dict(json.loads(folder.joinpath(SCHEDULER_FILE).read_text()))


class _MetadataOnly(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's `.metadata` and refuses every other global."""

    def find_class(self, module: str, name: str):
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (
                module == "pathlib"
                and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
            )
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed-checkpoint index")
        return super().find_class(module, name)


def check_distributed_checkpoint_index(folder: Path) -> None:
    """FSDP's sharded checkpoints (torch.distributed.checkpoint) keep their index in a pickled
    `.metadata` file that torch loads with plain `pickle.load`: read each one with an unpickler that
    allows only the index's own classes first, so a planted pickle is refused before torch loads it."""
    for index in folder.rglob(".metadata"):
        with index.open("rb") as f:
            _MetadataOnly(f).load()
