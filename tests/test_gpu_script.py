"""`bash bench/gpu.sh` without a GPU: one line saying so, exit 0, nothing installed or written; and its
rehearsal, `--dry-run`, which says what a GPU run would run (the vLLM step against TRL's use_vllm last)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


def _dry_run(tmp_path: Path, *extra: str) -> list[str]:
    """`bench/gpu_report.py --dry-run`'s lines, run here (no GPU needed); it writes nothing."""
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu_report.py"),
            "--dry-run",
            "--out",
            str(tmp_path / "out"),
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "LIGER_VLLM_PYTHON"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "out").exists()
    return done.stdout.splitlines()


def test_dry_run_lists_the_vllm_step_against_trl_last(tmp_path):
    lines = _dry_run(tmp_path)
    titles = [line.split(",")[0].split(" (")[0] for line in lines if line.startswith("- ")]
    assert titles == ["- GPU tests", "- kernel sweep", "- training A/B", "- sequence parallelism", "- TRL check",
                      "- TRL install", "- GRPO step: vLLM engine vs TRL use_vllm", "- sampling ahead on vLLM"]  # fmt: skip
    ahead = lines[-1].split()
    assert ahead[1:5] == ["bench/async_rl.py", "--engine", "vllm", "--recipes"]
    step = lines[-3].split()
    assert step[1:3] == ["bench/grpo_vs_trl.py", "--vllm"] and "--trl-vllm" in step
    assert step[step.index("--model-config") + 1] == "recipes/bench/llama-3.2-1b.json"
    trl_python = step[step.index("--trl-python") + 1]
    assert trl_python.endswith(".venv-vllm/bin/python")  # no LIGER_VLLM_PYTHON here
    install = lines[next(i for i, line in enumerate(lines) if line.startswith("- TRL install")) + 1].split()
    assert install[0] == trl_python  # TRL goes where vLLM is
    assert "trl==1.16.0" in install and install[install.index("-c") + 1] == "constraints-vllm.txt"


def test_dry_run_says_which_steps_zero_timeouts_leave_out(tmp_path):
    lines = [line for line in _dry_run(tmp_path, "--timeouts", "0,0,0,540") if line.startswith("- ")]
    assert [line.endswith("LEFT OUT: --timeouts gives it 0 s") for line in lines] == [True] * 4 + [
        False
    ] * 3 + [True]
    assert lines[-2].endswith("limit 540 s:")  # sampling ahead: only when a fifth limit is given
    lines = [line for line in _dry_run(tmp_path, "--timeouts", "0,0,0,300,240") if line.startswith("- ")]
    assert lines[-1].endswith("limit 240 s:")


def test_gpu_script_dry_run_without_a_gpu_says_what_it_would_run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("dirname"), bin_dir / "dirname")
    env = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path),
        "LIGER_GPU_OUT": str(tmp_path / "out"),
        "LIGER_PYTHON": sys.executable,
    }
    done = subprocess.run(
        [shutil.which("bash"), str(REPO / "bench" / "gpu.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"bench/gpu.sh --dry-run: no set-up (LIGER_PYTHON={sys.executable})"
    assert (
        "--trl-vllm" in done.stdout.splitlines()[-3] and "bench/async_rl.py" in done.stdout.splitlines()[-1]
    )
    assert not (tmp_path / "out").exists()
