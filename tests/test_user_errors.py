"""User mistakes on every command: exit 2, one `error:` line naming the problem, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def liger(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "liger_cli", *args], capture_output=True, text=True, timeout=120
    )


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


@pytest.mark.parametrize("command", ["train", "data", "bench", "inspect-wrap --recipe"])
def test_a_recipe_that_is_not_utf8_text(command: str, not_utf8: Path) -> None:
    assert_one_line_error(liger(*command.split(), str(not_utf8)), "not UTF-8")


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
    proc = liger(command, str(with_nul))
    assert_one_line_error(proc, str(with_nul), "U+0000", "delete it")
    assert "line " in proc.stderr and "column " in proc.stderr


@pytest.mark.parametrize("command", ["train", "data"])
def test_a_set_value_with_a_control_character(command: str) -> None:
    proc = liger(command, str(QUICKSTART), "--set", "output.dir=runs/\x01x")
    assert_one_line_error(proc, "--set output.dir=runs/\\x01x", "U+0001")


def test_load_kwargs_that_repeat_the_model_section(tmp_path: Path) -> None:
    text = QUICKSTART.read_text().replace("quickstart/", f"{REPO / 'recipes' / 'quickstart'}/")
    text = text.replace("dtype: float32}", "dtype: float32, load_kwargs: {dtype: bfloat16}}", 1)
    assert "load_kwargs" in text
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert_one_line_error(liger("train", str(recipe), "--dry-run"), "load_kwargs", "dtype")


def test_data_jsonl_into_a_folder(tmp_path: Path) -> None:
    assert_one_line_error(liger("data", str(QUICKSTART), "--jsonl", str(tmp_path)), "--jsonl", "folder")


def test_merge_mistakes(tmp_path: Path) -> None:
    assert_one_line_error(liger("merge", str(tmp_path / "no-run"), str(tmp_path / "out")), "no adapter")


def test_train_into_a_file(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    proc = liger("train", str(QUICKSTART), "--set", f"output.dir={tmp_path / 'a-file'}")
    assert_one_line_error(proc, "is a file")
