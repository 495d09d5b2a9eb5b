"""What a run logs: console line + metrics.jsonl + the experiment trackers (TensorBoard, trackio, W&B,
MLflow: `trackers.py`), written by the main process only."""

from __future__ import annotations

import atexit
import json
from pathlib import Path

import torch

from liger_cli.recipe import Recipe


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MemoryWatch:
    """The peak memory of a training step over what the process held before the model was built:
    what the memory plan (`liger train --dry-run`) estimates. Each step's peak is taken from a
    high-water mark reset when the step begins, so loading weights and writing checkpoints between
    steps do not count. CUDA: the allocator's peak; CPU: the peak RSS (Linux's VmHWM, reset through
    /proc/self/clear_refs)."""

    def __init__(self, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        self.start = torch.cuda.memory_allocated(device) if cuda else _status_kib("VmRSS") * 1024
        self.peak_mb = 0.0
        """The largest step peak so far, MiB over `start`."""

    def step_begins(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        except OSError:
            pass  # not Linux, or not allowed: the peak then includes earlier ones

    def step_ends(self) -> None:
        if self.device.type == "cuda":
            high = torch.cuda.max_memory_allocated(self.device)
        else:
            high = _status_kib("VmHWM") * 1024
        self.peak_mb = max(self.peak_mb, (high - self.start) / 2**20)


def _status_kib(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux: the best there is


class MetricsLog:
    """Console line + metrics.jsonl + the trackers of `logging.report_to` (TensorBoard among them:
    `trackers.py`), written by the main process only."""

    def __init__(self, out: Path, recipe: Recipe, enabled: bool):
        self.enabled = enabled
        self.jsonl = (out / "metrics.jsonl").open("a") if enabled and recipe.logging.jsonl else None
        self.trackers = None
        if enabled and recipe.logging.trackers:
            from liger_cli.run.trackers import Trackers

            self.trackers = Trackers(out, recipe)
            atexit.register(self._ended_early)  # a run that stops on an error still ends its tracker runs

    def write(self, step: int, metrics: dict[str, float], echo) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.trackers:
            self.trackers.log(step, metrics)
        echo(f"step {step:>6}  " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))

    def close(self, summary: dict[str, float] | None = None) -> None:
        """`summary`: the final metrics (the trackers' summary); None: the run stopped before its end."""
        if self.jsonl:
            self.jsonl.close()
            self.jsonl = None
        if self.trackers:
            atexit.unregister(self._ended_early)
            self.trackers.finish(summary)
            self.trackers = None

    def _ended_early(self) -> None:
        self.close(None)
