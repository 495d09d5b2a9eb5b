"""The code's shape, checked: stages that import down the flow only, no import cycles, small modules, no
backend names in the training loop."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "liger_cli"
MAX_LINES = 400
SPLIT_ELSEWHERE: set[str] = set()  # none: every module fits


def _modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """liger_cli modules imported by `path`, at any depth: function-level imports count, and so do those
    under `if TYPE_CHECKING:` (never executed, but a reader, a type checker and import-graph tools
    all follow them). Relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        found |= {imported for imported in names if imported in known}
    return found


def test_no_import_cycles() -> None:
    """No module imports, through any chain, one that imports it back; `TYPE_CHECKING` imports included
    (a helper that needs a caller's type takes the pieces it uses instead)."""
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join([*stack, name, dep])}"
            if dep not in state:
                visit(dep, [*stack, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_cycle_check_sees_type_checking_and_relative_imports(tmp_path) -> None:
    """The graph the cycle check walks holds the imports a reader follows, not only those that run."""
    helper = tmp_path / "helper.py"
    helper.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from liger_cli.run.train import Trainer\n"
        "def f():\n    from . import checkpoint\n"
    )
    known = {"liger_cli.run", "liger_cli.run.train", "liger_cli.run.checkpoint"}
    assert _imports("liger_cli.run.helper", helper, known) == known


# The flow, first to last: a stage may import the stages before it, never one after it. The base
# (errors, process-wide state) is below every stage; the commands sit on top of all of them.
BASE = (
    "liger_cli",
    "liger_cli.errors",
    "liger_cli.process_state",
    "liger_cli.rewards",
    "liger_cli.user_code",
)
STAGES = ("recipe", "data", "model", "generate", "twin", "plan", "launch", "run")
COMMANDS = (
    "liger_cli.cli",
    "liger_cli.__main__",
    "liger_cli.merge",
    "liger_cli.bench",
    "liger_cli.serve",
    "liger_cli.export",
)


def _level(module: str) -> int:
    if module in BASE:
        return 0
    if module.startswith(COMMANDS):
        return len(STAGES) + 1
    stage = module.split(".")[1]
    assert stage in STAGES, f"{module} belongs to no stage: put it in one of {STAGES}"
    return STAGES.index(stage) + 1


def test_imports_point_down_the_flow_only() -> None:
    modules = _modules()
    for name, path in modules.items():
        for dep in _imports(name, path, set(modules)):
            if dep.startswith(name + ".") or dep == name:
                continue
            assert _level(dep) <= _level(name), f"{name} imports {dep}, a later stage of the flow"


def test_the_flow_is_visible_at_the_top_level() -> None:
    """A few modules at the top (the CLI and what every stage shares); each stage a package that
    opens with what it does and what it may import."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top
    for stage in STAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / stage / "__init__.py").read_text()))
        assert doc and "import" in doc, (
            f"liger_cli/{stage}/__init__.py must say its job and what it may import"
        )


def test_kernels_import_nothing_of_liger_cli() -> None:
    for path in (PACKAGE.parent / "kernels").rglob("*.py"):
        assert "liger_cli" not in path.read_text(), f"{path.name} imports liger_cli: kernels/ is a leaf"


def test_modules_are_small_and_none_shadows_the_standard_library() -> None:
    import sys

    for name, path in _modules().items():
        if path.name not in SPLIT_ELSEWHERE:
            lines = len(path.read_text().splitlines())
            assert lines <= MAX_LINES, f"{name} has {lines} lines"
        assert path.stem not in sys.stdlib_module_names or path.stem == "__init__", name


def test_training_loop_and_launch_name_no_backend() -> None:
    """Backend differences live in liger_cli/run/backends/: the loop asks its Backend object."""
    for module in (
        "run/train.py",
        "run/evaluate.py",
        "launch/start.py",
        "run/checkpoint.py",
        "model/build.py",
    ):
        text = (PACKAGE / module).read_text()
        for name in ('"fsdp1"', '"fsdp2"', '"deepspeed"', '"ddp"', "distributed_type", "DEEPSPEED"):
            assert name not in text, f"{module} names {name}"


def test_process_wide_state_is_edited_in_one_module() -> None:
    markers = ("_shared_state", "ACCELERATE_USE_", "DS_ACCELERATOR", "__compatible_ops__", "_flat_param")
    for name, path in _modules().items():
        if name == "liger_cli.process_state":
            continue
        text = path.read_text()
        assert not [m for m in markers if m in text], f"{name} touches process-wide state"
