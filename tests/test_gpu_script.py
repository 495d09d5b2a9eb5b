"""`bash bench/gpu.sh` without a GPU: one line saying so, exit 0, nothing installed or written."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run_without_gpu(tmp_path: Path, fake_nvidia_smi: bool) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("dirname"), bin_dir / "dirname")
    if fake_nvidia_smi:  # a driver that finds no device exits non-zero, as nvidia-smi does
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "LIGER_GPU_OUT": str(tmp_path / "out")}
    return subprocess.run(
        [shutil.which("bash"), str(REPO / "bench" / "gpu.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@pytest.mark.parametrize("fake_nvidia_smi", [False, True], ids=["no-nvidia-smi", "nvidia-smi-finds-none"])
def test_gpu_script_without_a_gpu_says_so_and_exits_0(tmp_path, fake_nvidia_smi):
    done = _run_without_gpu(tmp_path, fake_nvidia_smi)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "bench/gpu.sh: no CUDA GPU here (nvidia-smi finds none): nothing to run."
    ]
    assert done.stderr == ""
    assert not (tmp_path / "out").exists()
