"""The FSDP wrap plan: which module classes become FSDP units, and what that does to memory and correctness.

| module | what it does |
|---|---|
| resolve.py | decides the wrap classes (the one place, for `train` and `inspect-wrap`) |
| units.py | replays accelerate's auto-wrap policy on a (meta) model: the units and their sizes |
| rules.py | the warnings: plans known to fail or to cost more than they must |
| report.py, render.py | the report as data (and JSON) and as text |
"""

from liger_cli.plan.wrap.render import render_report
from liger_cli.plan.wrap.report import ROOT, Unit, WrapReport, WrapWarning
from liger_cli.plan.wrap.resolve import (
    ENV_KEY,
    WrapResolution,
    model_classes,
    resolve_wrap_classes,
    split_names,
)
from liger_cli.plan.wrap.rules import ambient_accelerate_config
from liger_cli.plan.wrap.units import plan_units

__all__ = [
    "ENV_KEY",
    "ROOT",
    "Unit",
    "WrapReport",
    "WrapResolution",
    "WrapWarning",
    "ambient_accelerate_config",
    "model_classes",
    "plan_units",
    "render_report",
    "resolve_wrap_classes",
    "split_names",
]
