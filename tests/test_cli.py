"""The CLI: lazy imports, both entry points, exit codes (real processes), the dry run (in this process)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "accelerate", "triton", "datasets")


def run(*args: str, cwd: Path | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "liger_cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "import liger_cli.cli as cli\n"
        "result = CliRunner().invoke(cli.app, ['--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "for name in ('train', 'inspect-wrap', 'merge'):\n"
        "    assert name in result.output\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"heavy modules imported by --help: {proc.stdout}"


LEAVE = """
import atexit, sys, threading, time
from liger_cli.process_state import leave
atexit.register(lambda: sys.stdout.write(" atexit"))
threading.Thread(target=lambda: (time.sleep(0.3), sys.stdout.write(" thread"))).start()
sys.stdout.write("unflushed")
leave({"none": None, "3": 3}.get(sys.argv[1], sys.argv[1]))
"""


def test_leave_exits_as_python_does_without_the_teardown() -> None:
    """`liger`'s exit (process_state.leave): the thread joined, then atexit, then the buffers flushed;
    None is 0, a number its code, a text printed to stderr with code 1, as SystemExit does."""
    for code, status in (("none", 0), ("3", 3), ("a message", 1)):
        proc = subprocess.run([sys.executable, "-c", LEAVE, code], capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout) == (status, "unflushed thread atexit"), (code, proc)
        assert proc.stderr == ("a message\n" if status == 1 else ""), proc.stderr


def test_console_script_and_module_are_the_same() -> None:
    liger = shutil.which("liger", path=str(Path(sys.executable).parent))
    assert liger, "the `liger` console script is not installed next to this python"
    a = subprocess.run([liger, "--help"], capture_output=True, text=True, timeout=60)
    b = run("--help")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout


def test_subcommand_help_and_usage_errors() -> None:
    for command in ("train", "inspect-wrap", "merge"):
        proc = run(command, "--help")
        assert proc.returncode == 0, proc.stderr
    proc = run("train")  # missing argument: click's usage error
    assert proc.returncode == 2
    proc = run("no-such-command")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_inspect_wrap_needs_a_model_or_recipe() -> None:
    proc = run("inspect-wrap")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: give a MODEL")


def test_dry_run_prints_recipe_and_plan_and_creates_nothing(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from test_train import liger_here  # in this process: train's real processes are test_recipe.py's, ...

    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"example {i}"}) for i in range(8)) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{path: {tiny_model_dir}}}\n"
        f"data: {{train: {data}}}\n"
        "training: {max_steps: 2}\n"
        "distributed: {backend: fsdp2, num_processes: 2, activation_checkpointing: auto}\n"
        "output: {dir: out}\n"
    )
    monkeypatch.chdir(tmp_path)  # where `output.dir: out` would land
    proc = liger_here("train", str(recipe), "--dry-run", "--set", "training.lr=1e-4")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "# resolved recipe" in out and "lr: 0.0001" in out
    assert "# plan" in out
    assert "FSDP-2 (fsdp2)" in out
    assert "2 on 1 machine(s)" in out
    assert "LlamaDecoderLayer (from no_split_modules)" in out
    assert "reentrant (auto for fsdp2" in out
    assert "kernels patched" in out
    assert not (tmp_path / "out").exists()
