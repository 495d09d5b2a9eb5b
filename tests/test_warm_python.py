"""tests/warm_python.py gives what subprocess.run gives: a process of its own, started warm only where that
cannot differ from a cold start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_python

WARM = "import sys; print('torch' in sys.modules)"  # a warm child starts with torch imported
FORKS = "coverage" not in sys.modules  # under scripts/coverage.sh every process starts cold, as it should


def test_a_child_is_a_process_of_its_own(tmp_path) -> None:
    code = (
        "import os, sys; print(os.getcwd(), os.environ['ACCELERATE_X'], sys.argv[1:], sys.path[0] == '');"
        "sys.stderr.write('to stderr'); sys.exit(3)"
    )
    done = warm_python.run(["-c", code, "a", "b"], cwd=tmp_path, env={**os.environ, "ACCELERATE_X": "1"})
    assert done.returncode == 3
    assert done.stdout == f"{tmp_path} 1 ['a', 'b'] True\n" and done.stderr == "to stderr"
    assert warm_python.run(["-c", WARM]).stdout == f"{FORKS}\n"  # the same environment: forked warm
    crashed = warm_python.run(["-c", "1 / 0"])
    assert crashed.returncode == 1 and crashed.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert warm_python.run(["-c", "import os; print(os.getpid() != os.getppid())"]).stdout == "True\n"


def test_a_module_and_a_script_see_the_path_python_gives_them(tmp_path) -> None:
    (tmp_path / "script.py").write_text("import sys; print(sys.argv[0], sys.path[0])")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mod.py").write_text("import sys; print(sys.argv[1], sys.path[0], sys.path[1])")
    assert warm_python.run([tmp_path / "script.py"]).stdout == f"{tmp_path / 'script.py'} {tmp_path}\n"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    done = warm_python.run(["-m", "mod", "x"], cwd=tmp_path, env=env)
    assert done.stdout == f"x {tmp_path} {tmp_path / 'lib'}\n", done.stderr


def test_a_killed_child_and_a_timeout_are_what_subprocess_reports(tmp_path) -> None:
    code = "import os, signal; print('before', flush=False); os.kill(os.getpid(), signal.SIGKILL)"
    killed = warm_python.run(["-c", code], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert killed.returncode == -signal.SIGKILL and killed.stdout == "before\n"  # unbuffered: nothing lost
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run(["-c", "import time; time.sleep(60)"], timeout=1)
    assert warm_python.run(["-c", "print(2)"]).stdout == "2\n"  # the zygote serves on after a timeout


def test_an_environment_imports_may_read_starts_cold_then_gets_its_own_zygote() -> None:
    env = {**os.environ, "HF_HOME": "/nonexistent/hf-home"}  # read by huggingface_hub as it is imported
    first, second = (warm_python.run(["-c", WARM], env=env) for _ in range(2))
    assert first.stdout == "False\n" and second.stdout == f"{FORKS}\n"
    cold = warm_python.run(["-X", "importtime", "-c", "pass"])  # an interpreter option: cold
    assert cold.returncode == 0 and "import time:" in cold.stderr


def test_a_test_stopped_while_its_command_runs_leaves_nothing_running(tmp_path) -> None:
    """pytest-timeout (or ^C) stops a test inside run(): the command and its zygote are killed, and the
    next command gets a zygote that answers it, not the old one's last line."""

    class Stopped(Exception):
        pass

    def stop(*_):
        raise Stopped

    warm_python.run(["-c", "pass"])  # the zygote is up
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.alarm(2)
        with pytest.raises(Stopped):
            warm_python.run(["-c", code])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    status = Path(f"/proc/{pid_file.read_text()}/status")
    deadline = time.monotonic() + 30  # SIGKILL is delivered when the process is next scheduled
    while status.exists() and "State:\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not status.exists() or "State:\tZ" in status.read_text()  # killed (at most not yet reaped)
    assert warm_python.run(["-c", "print('next')"]).stdout == "next\n"
