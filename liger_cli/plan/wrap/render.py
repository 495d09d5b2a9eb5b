"""The text `inspect-wrap` prints for a WrapReport (the JSON form is `WrapReport.to_json`)."""

from __future__ import annotations

import io
import re
from dataclasses import asdict

from liger_cli.plan.backends import display_name
from liger_cli.plan.wrap.report import ROOT, Unit, WrapReport, ceil_div, format_size
from liger_cli.plan.wrap.resolve import ENV_KEY


def render_report(report: WrapReport) -> str:
    """A plain-text report: the units table, what the root keeps, where the embeddings land, warnings."""
    from rich.console import Console
    from rich.table import Table

    backend = display_name(report.backend)
    source = {
        "recipe": "the recipe or --wrap-classes",
        "env": ENV_KEY,
        "no_split_modules": "the model's _no_split_modules",
        "none": "nothing named anywhere",
    }.get(report.wrap_source, report.wrap_source)
    lines = [
        f"Model {report.model_type} ({report.dtype}), {backend} over {report.num_processes} process(es); "
        f"wrap classes: {', '.join(report.wrap_classes) or '[]'} (from {source})",
    ]
    if report.added_vision:
        lines.append(
            f"Added for a vision-language model (blocks or tower _no_split_modules leaves out): "
            f"{', '.join(report.added_vision)}"
        )
    if report.kept_whole:
        lines.append(
            f"Not wrapped, since a unit of theirs would split a shared weight: {', '.join(report.kept_whole)}"
        )
    if report.dropped_no_split:
        lines.append(
            f"_no_split_modules names this model does not contain (dropped): {', '.join(report.dropped_no_split)}"
        )
    table = Table(title="FSDP units", title_justify="left", box=None, pad_edge=False)
    for header in ("unit", "class", "count", "params each", "trainable each", "size each", "per rank each"):
        table.add_column(header, justify="left" if header in ("unit", "class") else "right")
    root_row = Unit(
        ROOT,
        "(everything else)",
        report.root_params,
        report.root_trainable_params,
        report.root_bytes,
        ceil_div(report.root_bytes, report.num_processes),
        "root",
    )
    for unit, count in [*_collapse(report.units), (root_row, 1)]:
        table.add_row(
            unit.path,
            unit.cls,
            str(count),
            f"{unit.params:,}",
            f"{unit.trainable_params:,}",
            format_size(unit.bytes),
            format_size(unit.bytes_per_rank),
        )
    buffer = io.StringIO()
    Console(file=buffer, width=140, no_color=True, highlight=False, force_terminal=False).print(table)
    lines.append(buffer.getvalue().rstrip())
    lines += [
        f"Root unit keeps: {', '.join(report.root_modules) or 'no parameters'}",
        f"lm_head: {report.lm_head_unit}; embed_tokens: {report.embed_unit}; "
        f"final norm: {report.final_norm_unit}; tied embeddings: {'yes' if report.tied_embeddings else 'no'}",
        f"Total: {report.total_params:,} parameters ({report.trainable_params:,} trainable), "
        f"{format_size(report.total_bytes)}. Per rank: {format_size(report.bytes_per_rank)} sharded, peak about "
        f"{format_size(report.peak_bytes_per_rank)} with the root and the largest unit gathered (parameters only).",
    ]
    if report.parts:
        lines.append("Parts (what trains): " + "; ".join(
            f"{p.name} {p.path}: {p.params:,} parameters, {p.trainable_params:,} trainable" for p in report.parts
        ))  # fmt: skip
    mixed = [unit.path for unit, _ in _collapse([u for u in report.units if u.path in report.mixed_units])]
    mixed += [ROOT] if ROOT in report.mixed_units else []
    lines.append(
        f"Units mixing frozen and trainable parameters: {', '.join(mixed)}"
        if mixed
        else "No unit mixes frozen and trainable parameters."
    )
    if report.warnings:
        lines.append(f"Warnings ({len(report.warnings)}):")
        lines += [f"  {w.code}: {w.message}" for w in report.warnings]
    else:
        lines.append("No warnings.")
    return "\n".join(lines) + "\n"


def _collapse(units: list[Unit]) -> list[tuple[Unit, int]]:
    """Fold identical units that differ only in one index (model.layers.0 .. 31) into one row."""
    rows: dict[tuple, list] = {}  # key -> [unit, indices, template]
    for unit in units:
        match = re.search(r"\.(\d+)(?=\.|$)", unit.path)
        template = unit.path[: match.start(1)] + "{}" + unit.path[match.end(1) :] if match else unit.path
        key = (template, unit.cls, unit.params, unit.trainable_params, unit.bytes, unit.reason)
        row = rows.setdefault(key, [unit, [], template])
        if match:
            row[1].append(int(match[1]))
    collapsed = []
    for unit, indices, template in rows.values():
        if len(indices) > 1:
            contiguous = indices == list(range(indices[0], indices[0] + len(indices)))
            span = (
                f"{{{indices[0]}..{indices[-1]}}}" if contiguous else "{" + ",".join(map(str, indices)) + "}"
            )
            unit = Unit(**{**asdict(unit), "path": template.format(span)})
        collapsed.append((unit, max(len(indices), 1)))
    return collapsed
