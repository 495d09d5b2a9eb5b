"""The bench's results: each run summarised from its metrics, the two compared, shown as a table and a chart."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

VARIANTS = ("kernels_on", "kernels_off")
# Relative tolerance on the first-step loss: fp32 paths agree to rounding; half precision rounds the
# logits differently in the fused and the unfused loss.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}
NOISE = 0.02  # step-time and memory ratios within 2% of 1.0 are called "the same"


@dataclass
class RunResult:
    """One variant's measured steps, as read back from its metrics.jsonl."""

    variant: str
    kernels: list[str]
    first_step_loss: float
    step_time_s: float
    tokens_per_s: float
    peak_mem_mb: float
    measured_steps: int
    wall_s: float


@dataclass
class Comparison:
    ratios: dict[str, float]
    loss_rel_diff: float
    loss_rtol: float
    losses_agree: bool
    verdict: str

    @property
    def exit_code(self) -> int:
        return 0 if self.losses_agree else 1


def read_metrics(path: Path, warmup: int) -> tuple[float, list[dict]]:
    """(first-step loss, the per-step records after the warm-up) from a run's metrics.jsonl."""
    if not path.is_file():
        raise RuntimeError(f"the run wrote no {path}")
    steps = [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
    first = next((r for r in steps if r["step"] == 1), None)
    measured = [r for r in steps if r["step"] > warmup]
    if first is None or not measured:
        raise RuntimeError(f"{path} has no step-1 record or no step after the {warmup} warm-up step(s)")
    return first["loss"], measured


def summarize(
    variant: str, kernels: list[str], metrics: Path, warmup: int, baseline_mb: float, wall_s: float
):
    """Mean step time, tokens/s over the measured steps, and peak memory (minus the CPU baseline)."""
    first_loss, measured = read_metrics(metrics, warmup)
    seconds = sum(r["step_time_s"] for r in measured)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in measured)
    return RunResult(
        variant=variant,
        kernels=kernels,
        first_step_loss=first_loss,
        step_time_s=seconds / len(measured),
        tokens_per_s=tokens / seconds,
        peak_mem_mb=max(r["peak_mem_mb"] for r in measured) - baseline_mb,
        measured_steps=len(measured),
        wall_s=wall_s,
    )


def compare(on: RunResult, off: RunResult, precision: str) -> Comparison:
    """Ratios kernels-on / kernels-off, the first-step loss check, and a one-line verdict."""
    ratios = {
        "step_time": on.step_time_s / off.step_time_s,
        "tokens_per_s": on.tokens_per_s / off.tokens_per_s,
        "peak_mem": on.peak_mem_mb / off.peak_mem_mb if off.peak_mem_mb > 0 else float("nan"),
    }
    rel_diff = abs(on.first_step_loss - off.first_step_loss) / max(abs(off.first_step_loss), 1e-12)
    rtol = LOSS_RTOL.get(precision, LOSS_RTOL["bf16"])
    agree = rel_diff <= rtol
    if not agree:
        verdict = (
            f"CORRECTNESS FAILURE: the first-step losses differ (kernels on {on.first_step_loss:.6g}, off "
            f"{off.first_step_loss:.6g}, relative difference {rel_diff:.2e} > {rtol:.0e}); do not trust these "
            "kernels on this recipe, and report it with bench.json"
        )
    else:
        verdict = _verdict(ratios["step_time"], ratios["peak_mem"])
    return Comparison(ratios, rel_diff, rtol, agree, verdict)


def _verdict(time_ratio: float, mem_ratio: float) -> str:
    def change(ratio: float, what: str) -> str:
        if abs(ratio - 1) <= NOISE:
            return f"the same {what} (within {NOISE:.0%})"
        return f"{abs(1 - ratio):.0%} {'less' if ratio < 1 else 'more'} {what}"

    speed = change(time_ratio, "step time")
    memory = change(mem_ratio, "peak memory")
    faster, slower = time_ratio < 1 - NOISE, time_ratio > 1 + NOISE
    smaller, larger = mem_ratio < 1 - NOISE, mem_ratio > 1 + NOISE
    if not slower and not larger and (faster or smaller):
        advice = "keep the kernels on"
    elif slower and smaller:
        advice = "keep them on if memory limits your batch or sequence length, otherwise turn them off"
    elif larger and faster:
        advice = "keep them on unless memory is tight"
    elif slower or larger:
        advice = "turn the kernels off for this recipe"
    else:
        advice = "the kernels make no measurable difference here"
    return f"kernels on: {speed}, {memory}: {advice}"


def render_table(on: RunResult, off: RunResult, comparison: Comparison, report: dict) -> str:
    rows = [
        (
            "step time (s, mean)",
            f"{on.step_time_s:.3f}",
            f"{off.step_time_s:.3f}",
            comparison.ratios["step_time"],
        ),
        ("tokens/s", f"{on.tokens_per_s:.1f}", f"{off.tokens_per_s:.1f}", comparison.ratios["tokens_per_s"]),
        (
            "peak memory (MiB)",
            f"{on.peak_mem_mb:.0f}",
            f"{off.peak_mem_mb:.0f}",
            comparison.ratios["peak_mem"],
        ),
        ("first-step loss", f"{on.first_step_loss:.6f}", f"{off.first_step_loss:.6f}", None),
    ]
    header = ("", "kernels on", "kernels off", "on / off")
    lines = [f"{header[0]:<20} {header[1]:>12} {header[2]:>12} {header[3]:>9}"]
    for name, a, b, ratio in rows:
        shown = f"{ratio:.3f}x" if ratio is not None else f"{comparison.loss_rel_diff:.1e}"
        lines.append(f"{name:<20} {a:>12} {b:>12} {shown:>9}")
    load = report["load_average"]
    lines.append(
        f"(device {report['device']}: {report['device_name']}, load average {load['before']} -> {load['after']}; "
        f"memory: {report['memory']}; loss column: relative difference, tolerance {comparison.loss_rtol:.0e})"
    )
    return "\n".join(lines)


def write_chart(report: dict, path: Path) -> Path | None:
    """Three bar pairs (step time, tokens/s, peak memory), each titled with its on/off ratio; None
    when matplotlib (an optional extra, `liger-cli[bench]`) is not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    panels = [
        ("step_time_s", "step time (s)", "step_time"),
        ("tokens_per_s", "tokens/s", "tokens_per_s"),
        ("peak_mem_mb", "peak memory (MiB)", "peak_mem"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, (key, label, ratio) in zip(axes, panels, strict=True):
        values = [runs[v][key] for v in VARIANTS]
        ax.bar(["kernels on", "kernels off"], values, color=["tab:orange", "tab:gray"])
        ax.set_title(f"{label}\non/off = {report['ratios'][ratio]:.3f}x", fontsize=10)
    fig.suptitle(
        f"liger bench {Path(report['recipe']).name} ({report['device']}, {report['num_processes']} "
        f"process(es), {report['precision']}, {report['steps']} steps)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
