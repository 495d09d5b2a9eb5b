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


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (annotations only, never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: Path, known: set[str]) -> set[str]:
    """liger_cli modules imported by `path` at run time, at any depth (function-level imports count)."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {name for name in names if name in known}
    return found


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    # A package's __init__ importing its own submodules is how a package exposes them; it is a cycle
    # only when one of them imports the package back (then the package is half-initialised).
    state: dict[str, int] = {}

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


# The flow, first to last: a stage may import the stages before it, never one after it. The base
# (errors, process-wide state) is below every stage; the commands sit on top of all of them.
BASE = ("liger_cli", "liger_cli.errors", "liger_cli.process_state", "liger_cli.rewards")
STAGES = ("recipe", "data", "model", "generate", "twin", "plan", "launch", "run")
COMMANDS = ("liger_cli.cli", "liger_cli.__main__", "liger_cli.merge", "liger_cli.bench", "liger_cli.serve")


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
        for dep in _imports(path, set(modules)):
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
