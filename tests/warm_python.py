"""`python ARGS` for the tests, forked from a warm interpreter instead of started cold.

Every `liger` process a test starts spent about 7 CPU s importing torch, transformers and datasets
before doing anything (8 s of a 1-step quickstart run's 10); the suite starts dozens. Here one
interpreter per test worker and environment (the zygote) imports them once, and each command is a fork
of it: a real process of its own (its own pid, environment, folder, stdout and stderr files, exit code
or signal; an uncaught exception is its traceback and exit 1; it exits through Python's own exit),
which starts with those libraries imported, as it would have imported them first thing. The zygote
imports nothing of liger, peft, bitsandbytes or DeepSpeed, so what `liger` decides before importing
them (which to hide, DeepSpeed's accelerator) it still decides in the child.

A fork is used only where it cannot differ from a cold start:
- the child's environment differs from its zygote's only in variables nothing reads while PRELOAD is
  imported (RUNTIME_ENV; PYTHONPATH and PYTHONUNBUFFERED are applied in the child as Python's start
  applies them); any other difference (a cache folder, a thread count, a hash seed) is another
  zygote's, started on that environment's second command (its first starts cold);
- under `coverage` (scripts/coverage.sh) every process starts cold, measured as it always was.
Tests about a process's own start (what a command imports, what it prints first) start their processes
with subprocess directly.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ("torch", "torch.distributed.tensor", "torch._dynamo", "transformers", "transformers.modeling_utils",
           "datasets")  # fmt: skip
RUNTIME_ENV = ("ACCELERATE_", "FSDP_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR", "PYTHONPATH", "PYTHONUNBUFFERED",
               "PYTEST_")  # fmt: skip
"""Variables (or prefixes) nothing in PRELOAD reads while it is imported: children of one zygote may differ in them."""

ZYGOTE = """
import json, os, sys
for name in json.loads(sys.argv[1]):
    __import__(name)
print("ready", flush=True)


def serve():
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request  # the child leaves the loop and runs the command below
        print(json.dumps({"pid": pid}), flush=True)
        print(json.dumps({"code": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
    raise SystemExit(0)


request = serve()
os.setpgid(0, 0)  # the command and whatever it starts: one group, killed together on a timeout
sys.stdin.close()
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
if os.environ.get("PYTHONUNBUFFERED"):  # as Python's start makes them: no buffer between a print and the file
    import io
    sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True, errors="backslashreplace")
argv = request["argv"]
extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if argv[0] == "-m":  # sys.path[0] as `python -m` sets it: the folder it starts in
    sys.argv, sys.path[0] = argv[1:], os.getcwd()
elif argv[0] == "-c":  # as `python -c` sets it: ""
    sys.argv = ["-c", *argv[2:]]
else:  # as `python SCRIPT` sets it: the script's folder
    sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
sys.path[1:1] = [os.path.abspath(p) for p in extra]  # PYTHONPATH: right after sys.path[0], as at a start
del request, serve, fd, path, extra
import runpy
if argv[0] == "-m":
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
elif argv[0] == "-c":
    exec(compile(argv[1], "<string>", "exec"))
else:
    runpy.run_path(argv[0], run_name="__main__")
"""

_zygotes: dict[str, subprocess.Popen] = {}
_seen: set[str] = set()
MAX_ZYGOTES = 3  # per worker (each holds ~0.5 GB): further environments start cold


def _import_env(env: dict[str, str]) -> str:
    """The part of an environment that imports may read: what two children must share to share a zygote."""
    return json.dumps({k: v for k, v in sorted(env.items()) if not k.startswith(RUNTIME_ENV)})


def _zygote(env: dict[str, str]) -> subprocess.Popen | None:
    """The zygote for `env`: started with this worker's own environment's first command, or another
    environment's second (a one-off environment is cheaper started cold); None: start this one cold."""
    key = _import_env(env)
    if key not in _zygotes:
        if key != _import_env(dict(os.environ)) and key not in _seen or len(_zygotes) >= MAX_ZYGOTES:
            _seen.add(key)
            return None
        zygote = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, json.dumps(PRELOAD)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env, cwd=tempfile.gettempdir(),
        )  # fmt: skip
        zygote.unread = b""
        if _line(zygote, timeout=600) != "ready":
            raise RuntimeError("the warm interpreter did not start")
        _zygotes[key] = zygote
    return _zygotes[key]


def _line(zygote: subprocess.Popen, timeout: float | None) -> str | None:
    """The zygote's next line, or None when none came within `timeout` seconds (read from the pipe's
    descriptor itself: a buffered reader could hold a line that `select` then never sees)."""
    while b"\n" not in zygote.unread:
        if not select.select([zygote.stdout], [], [], timeout)[0]:
            return None
        chunk = os.read(zygote.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError("the warm interpreter ended")
        zygote.unread += chunk
    line, zygote.unread = zygote.unread.split(b"\n", 1)
    return line.decode()


@atexit.register
def _stop() -> None:
    for zygote in _zygotes.values():
        zygote.stdin.close()
        zygote.wait(timeout=60)
    _zygotes.clear()


def run(
    args: list[str | Path], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:  # fmt: skip
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout)`, forked warm where that cannot differ (see the module's docstring). `args` starts
    with -m MODULE, -c CODE or a script. A timeout kills the command's process group and raises
    subprocess.TimeoutExpired, as subprocess.run does."""
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    argv = [sys.executable, *args]
    zygote = (
        None
        if "coverage" in sys.modules or args[0].startswith("-") and args[0] not in ("-m", "-c")
        else _zygote(env)
    )
    if zygote is None:
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        request = {"argv": args, "env": env, "cwd": str(Path(cwd or os.getcwd()).resolve()),
                   "stdout": str(out), "stderr": str(err)}  # fmt: skip
        zygote.stdin.write((json.dumps(request) + "\n").encode())
        zygote.stdin.flush()
        pid = json.loads(_line(zygote, None))["pid"]
        try:
            done = _line(zygote, timeout)
        except BaseException:  # the test itself stopped (its own timeout, ^C): no child or zygote outlives it
            os.killpg(pid, signal.SIGKILL)
            zygote.kill()
            _zygotes.pop(_import_env(env))
            raise
        if done is None:
            os.killpg(pid, signal.SIGKILL)
            _line(zygote, None)
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(argv, json.loads(done)["code"], out.read_text(), err.read_text())
