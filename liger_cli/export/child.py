"""llama.cpp in a process of its own, so that a crash in it (a signal, an abort) is a one-line error
naming the signal and the check it was in, not a dead `liger` with no word.

The parent's `Child` starts `python -m liger_cli.export.child` (a new interpreter, never a fork of one
that ran torch) with one end of a socket pair, sends each call as (method, args) and waits for its answer
until a deadline (`deadline`). The child holds the llama.cpp objects (`library.py`: llama_cpp and numpy,
no torch or transformers: it starts in about 0.3 s) and answers ("ok", value), or ("error", kind,
message) for liger's own errors. It shares the parent's stdout and stderr, so llama.cpp's own lines still
reach the terminal. One child serves a liger process (`shared`), started at its first call to llama.cpp
and again after one died or was stopped.

Test hook: PYTEST_LIGER_LLAMA_FAULT="METHOD:HOW" in the parent's environment (sent with each call) makes
the child, when it is asked METHOD, die of SIGSEGV (`segv`) or SIGABRT (`abort`, after a line on stderr
as ggml's aborts write), exit 3 (`exit`) or hang (`hang`), as a failing llama.cpp would. Only the tests
set it (the PYTEST_ prefix: tests/warm_python.py lets such variables differ between the commands of one
warm interpreter).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from liger_cli.errors import RunFailed, UserError

CALL_TIMEOUT_S = 600.0
"""A call's deadline, plus SECONDS_PER_GIB for each GiB of the files it reads: generous (loading,
evaluating or quantizing a file takes far less), only so that a hung llama.cpp cannot hold liger forever."""
SECONDS_PER_GIB = 120.0
FAULT = "PYTEST_LIGER_LLAMA_FAULT"
ERRORS = {"UserError": UserError, "RunFailed": RunFailed}
REPORT = "https://github.com/ggml-org/llama.cpp/issues"


def deadline(*files: Path) -> float:
    return CALL_TIMEOUT_S + SECONDS_PER_GIB * sum(f.stat().st_size for f in files if f.is_file()) / 2**30


class Child:
    """A child process holding llama.cpp; `call` runs one of its methods there."""

    def __init__(self):
        import liger_cli

        ours, theirs = socket.socketpair()
        env = dict(os.environ)  # the package this parent runs, wherever it was imported from
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(liger_cli.__file__).resolve().parents[1]), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "liger_cli.export.child", str(theirs.fileno())], pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        theirs.close()
        self.connection = Connection(ours.detach())
        self.amx = None
        """Whether its llama.cpp was built with AMX (its system info), once it has said so."""

    def call(self, what: str, seconds: float, method: str, *args):
        """`method(*args)` in the child; `what` names it in an error ("checking next tokens of X.gguf")."""
        try:
            self.connection.send((method, args, os.environ.get(FAULT, "")))
        except OSError:  # it has already died
            raise self.died(what) from None
        while True:
            if not self.connection.poll(seconds):
                self.stop()
                raise RunFailed(
                    f"llama.cpp did not answer within {seconds:.0f} s while {what}: liger stopped it and "
                    f"exported nothing; if it hangs again, report it at {REPORT}"
                )
            try:
                answer = self.connection.recv()
            except (EOFError, OSError):
                raise self.died(what) from None
            if answer[0] == "ready":
                self.amx = answer[1]
            elif answer[0] == "ok":
                return answer[1]
            elif answer[0] == "error":
                raise ERRORS[answer[1]](answer[2])
            else:
                raise RuntimeError(f"llama.cpp's process failed while {what}:\n{answer[1]}")

    def died(self, what: str) -> RunFailed:
        """The child ended without answering: by a signal (a crash, an abort) or an exit of its own."""
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.stop()
            code = self.process.returncode
        if code < 0:
            how = f"llama.cpp crashed ({signal_name(-code)}, signal {-code})"
        else:
            how = f"llama.cpp's process exited (code {code}) without an answer"
        if self.amx:
            advice = (
                "This llama.cpp was built with AMX (llama_print_system_info: AMX_INT8 = 1), whose kernels "
                "crash on virtualized Intel Xeons: bash scripts/setup.sh rebuilds it without (docs/export.md)"
            )
        else:
            advice = f"Its own error lines, if any, are above: report them at {REPORT}"
        return RunFailed(f"{how} while {what}; nothing was exported. {advice}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()

    def close(self) -> None:
        """Ends the child (it exits when its end of the pipe closes): its llama.cpp objects go with it."""
        self.connection.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.stop()


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "an unnamed signal"


_SHARED: list[Child] = []


def shared() -> Child:
    """This process's llama.cpp child: started at its first use, again after one died or was stopped."""
    if not (_SHARED and _SHARED[0].alive()):
        _SHARED[:] = [Child()]
    return _SHARED[0]


def serve(connection: Connection) -> None:
    """The child: answer calls until the parent closes its end. Exits without the interpreter's teardown
    (llama.cpp's objects go with the process)."""
    from liger_cli.export import library

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ^C is the parent's: it stops this process
    try:
        llama_cpp = library.binding()
    except UserError as err:  # the answer to the first call
        connection.send(("error", "UserError", str(err)))
        os._exit(0)
    connection.send(("ready", b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()))
    loaded: dict[int, library.Loaded] = {}
    opened = 0
    while True:
        try:
            method, args, fault = connection.recv()
        except EOFError:
            os._exit(0)
        if fault.partition(":")[0] == method:
            act(fault.partition(":")[2])
        try:
            if method == "quantize":
                value = library.quantize(*args)
            elif method == "open":
                opened += 1
                loaded[opened] = library.Loaded(*args)
                value = opened, loaded[opened].metadata
            elif method == "close":
                value = loaded.pop(args[0]).close()
            elif method == "imported":  # for the tests: what this process has imported
                value = args[0] in sys.modules
            else:
                value = getattr(loaded[args[0]], method)(*args[1:])
            connection.send(("ok", value))
        except (UserError, RunFailed) as err:
            connection.send(("error", type(err).__name__, str(err)))
        except Exception:
            import traceback

            connection.send(("bug", traceback.format_exc()))


def act(how: str) -> None:
    """The test hook's failure, as llama.cpp would fail."""
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif how == "abort":
        os.write(2, f"GGML_ABORT: {FAULT} (a test hook)\n".encode())
        os.abort()
    elif how == "exit":
        os._exit(3)
    elif how == "hang":
        signal.pause()


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
