"""The recipe's `logging` section: how often, and where the metrics go (metrics.jsonl, TensorBoard and the
experiment trackers of `report_to`: liger_cli/run/trackers.py, docs/trackers.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from liger_cli.recipe.base import _Section

TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")
"""The experiment trackers `logging.report_to` may name (liger_cli/run/trackers.py)."""


class LoggingSection(_Section):
    """Where the metrics go and how often."""

    every: int = Field(10, ge=1)
    """Log the metrics every N steps."""
    report_to: list[Literal["tensorboard", "trackio", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"]
    )
    """The experiment trackers that get every metric of metrics.jsonl, the recipe, the Plan and tables of
    rollouts or eval samples; their connection comes from their own environment variables (docs/trackers.md)."""
    project: str | None = None
    """The trackers' project (MLflow: experiment); default: the output folder's name."""
    run_name: str | None = None
    """The run's name in the trackers; default: the output folder's name."""
    table_rows: int = Field(32, ge=0)
    """At most this many rows of rollouts (grpo, distill, agents) or eval samples per step go to the
    trackers as a table (0: none); every row stays in rollouts.jsonl or samples.jsonl."""
    tensorboard: bool = True
    """Older recipes' switch: false leaves tensorboard out whatever report_to says."""
    jsonl: bool = True
    """Write the metrics to OUT/metrics.jsonl."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_name(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def trackers(self) -> list[str]:
        """report_to as the run follows it: each name once, tensorboard only while `tensorboard` is true."""
        names = [n for n in TRACKERS if n in self.report_to]
        return names if self.tensorboard else [n for n in names if n != "tensorboard"]
