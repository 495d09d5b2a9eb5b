"""Packaging: our kernels install as `liger_kernels`, never as a bare `kernels` module.

Hugging Face publishes a different package whose import name is `kernels`, and transformers
switches behaviour when it detects it by that name.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python(code: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_kernels_import_under_our_own_name(tmp_path: Path) -> None:
    out = python(
        "import importlib.util, liger_kernels\n"
        "print(importlib.util.find_spec('kernels') is None, liger_kernels.__file__)",
        cwd=tmp_path,
    )
    absent, location = out.split(" ", 1)
    assert absent == "True", "a bare `kernels` module is importable: it would shadow Hugging Face's package"
    assert Path(location) == REPO / "kernels" / "__init__.py"


def test_transformers_does_not_detect_our_kernels_as_hf_kernels() -> None:
    # Run from the repository root, where a `kernels/` folder sits on sys.path[0].
    out = python(
        "from transformers.utils.import_utils import is_kernels_available\nprint(is_kernels_available())",
        cwd=REPO,
    )
    assert out == "False"


def test_python_m_liger_cli_runs_from_anywhere(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "liger_cli", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0 and "Usage: liger" in proc.stdout


def test_a_wheel_holds_every_package(tmp_path: Path) -> None:
    """A regular (not editable) install: setuptools' explicit package list includes no subpackage by
    itself, so a folder missing from it would install a liger that cannot import its stages."""
    import zipfile

    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "liger_cli").rglob("__init__.py")}
    assert folders | {"liger_kernels"} == listed
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in listed:
        init = package.replace(".", "/") + "/__init__.py"
        assert init in names, f"{init} is not in the wheel"
