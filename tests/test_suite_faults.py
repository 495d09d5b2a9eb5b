"""The suite fails fast, never hangs: a worker that dies fails its test file at once, naming the test and
how the process ended; a test stuck where pytest-timeout's signal cannot reach it is ended and named;
the other files go on and the run ends with pytest's summary and a non-zero exit. Proved on a small
suite of its own run with this suite's conftest.py (its scheduler and crash handling) on two workers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

FILES = {
    "test_dies.py": (
        "import os, signal\n"
        "def test_before():\n    pass\n"
        "def test_killed():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "def test_after():\n    pass\n"
    ),
    "test_stuck.py": (
        "import signal, time\nimport pytest\n"
        "@pytest.mark.timeout(2)\n"
        "def test_stuck():\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # pytest-timeout's alarm cannot reach\n"
        "    time.sleep(600)\n"
        "def test_next():\n    pass\n"
    ),
    "test_lives.py": "def test_one():\n    pass\ndef test_two():\n    pass\n",
}


def test_a_dead_worker_and_a_stuck_test_fail_by_name_and_the_run_ends(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    env = {k: v for k, v in os.environ.items() if k != "LIGER_TEST_CRASH_DIR"} | {
        "LIGER_TEST_HANG_GRACE": "2"
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
         "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith("4 failed, 3 passed"), out[-3000:]
    assert "died while running test_dies.py::test_killed: killed by SIGSEGV" in out
    assert "Fatal Python error: Segmentation fault" in out  # its stacks, from the worker's crash file
    assert (
        "not run: worker gw" in out
        and "died while running test_dies.py::test_killed (killed by SIGSEGV)" in out
    )
    assert "died while running test_stuck.py::test_stuck: past its timeout" in out
    assert "FAILED test_dies.py::test_after" in out and "FAILED test_stuck.py::test_next" in out
    assert "test_lives.py" not in out.split("short test summary info")[1]  # the other file ran and passed
