"""User mistakes on every command: exit 2, one `error:` line naming the problem, no traceback.

`data`, `bench` and `merge` are real processes here (`liger`: the exit code and stderr a user sees); the
further cases run in this process (`liger_here`, docs/testing.md rule 6): `train`'s real process is
tests/test_recipe.py::test_real_process_exit_code_and_no_traceback's, `inspect-wrap`'s is
tests/test_cli.py::test_inspect_wrap_needs_a_model_or_recipe's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import warm_python
from test_train import liger_here

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def liger(*args: str) -> subprocess.CompletedProcess:
    """`liger ARGS` as a real process (tests/warm_python.py: forked warm)."""
    return warm_python.run(["-m", "liger_cli", *args], timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(scope="module")
def not_utf8(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("latin1") / "recipe.yaml"
    path.write_bytes("model: {path: modèle}\n".encode("latin-1"))
    return path


REAL = ("data", "bench")  # each command's real process of this file (merge's: test_merge_mistakes)


@pytest.mark.parametrize("command", ["train", "data", "bench", "inspect-wrap --recipe"])
def test_a_recipe_that_is_not_utf8_text(command: str, not_utf8: Path) -> None:
    run = liger if command in REAL else liger_here
    assert_one_line_error(run(*command.split(), str(not_utf8)), "not UTF-8")


@pytest.fixture(scope="module")
def with_nul(tmp_path_factory) -> Path:
    """Valid UTF-8, but with a NUL byte in a value (PyYAML's reader refuses it)."""
    path = tmp_path_factory.mktemp("nul") / "recipe.yaml"
    path.write_text(
        QUICKSTART.read_text().replace("dtype: float32", "dtype: float\x0032", 1), encoding="utf-8"
    )
    assert "\x00" in path.read_text()
    return path


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_recipe_with_a_control_character(command: str, with_nul: Path) -> None:
    proc = liger_here(command, str(with_nul))
    assert_one_line_error(proc, str(with_nul), "U+0000", "delete it")
    assert "line " in proc.stderr and "column " in proc.stderr


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_set_value_with_a_control_character(command: str) -> None:
    proc = liger_here(command, str(QUICKSTART), "--set", "output.dir=runs/\x01x")
    assert_one_line_error(proc, "--set output.dir=runs/\\x01x", "U+0001")


def test_load_kwargs_that_repeat_the_model_section(tmp_path: Path) -> None:
    text = QUICKSTART.read_text().replace("quickstart/", f"{REPO / 'recipes' / 'quickstart'}/")
    text = text.replace("dtype: float32}", "dtype: float32, load_kwargs: {dtype: bfloat16}}", 1)
    assert "load_kwargs" in text
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert_one_line_error(liger_here("train", str(recipe), "--dry-run"), "load_kwargs", "dtype")


def test_data_jsonl_into_a_folder(tmp_path: Path) -> None:
    assert_one_line_error(liger_here("data", str(QUICKSTART), "--jsonl", str(tmp_path)), "--jsonl", "folder")


def test_merge_mistakes(tmp_path: Path) -> None:
    assert_one_line_error(liger("merge", str(tmp_path / "no-run"), str(tmp_path / "out")), "no adapter")


def test_train_into_a_file(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    proc = liger_here("train", str(QUICKSTART), "--set", f"output.dir={tmp_path / 'a-file'}")
    assert_one_line_error(proc, "is a file")
