"""What a run logs: console line + metrics.jsonl + TensorBoard, written by the main process only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from liger_cli.recipe import LoggingSection


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MetricsLog:
    """Console line + metrics.jsonl + TensorBoard, written by the main process only."""

    def __init__(self, out: Path, logging: LoggingSection, enabled: bool):
        self.enabled = enabled
        self.jsonl = (out / "metrics.jsonl").open("a") if enabled and logging.jsonl else None
        self.tb = None
        if enabled and logging.tensorboard:
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
