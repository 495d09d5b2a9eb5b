"""The user's tools and environments, run in `rl.tool_workers` processes of their own (`tool_worker.py`).

A tool is foreign code: it may never return, exhaust memory or kill its interpreter (a segfault in a
C extension, `os._exit`). In the training process any of those would stall or end the run; here each
is the model's problem: the call's result is an error text the model reads, the process is killed (a
call past `rl.tool_timeout`) or has died, another takes its place, and the episode goes on. Counted
per trajectory as `tool_timeouts` and `tool_crashes` (also in `tool_errors`).

Nothing depends on timing: each trajectory lives in one process, chosen by the order trajectories
are opened, its calls run there in call order, and results are placed by call, not by arrival. An
environment's state lives in its process: when that process is replaced, every environment it held
is built again from its prompt row and given its earlier calls again, so a deterministic
environment is where it was. Processes start on first use and stay for the run; they die with it.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from liger_cli.data.tools import ToolError
from liger_cli.generate.tool_calls import Call, Result

START_S = 120.0
"""How long a new tool process may take to import the tools (a busy machine, a heavy tool module)."""


@dataclass
class _Opened:
    fields: dict
    worker: int
    calls: list[Call] = field(default_factory=list)
    """An environment's calls so far, to give a replacement process (plain tools keep no state)."""
    lost: str | None = None
    """Why its environment could not be rebuilt after its process died (its calls then fail)."""


class _Worker:
    """One tool process and its end of the socket."""

    def __init__(self, setup: tuple):
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "liger_cli.generate.tool_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(setup)
        self.started = False
        """Whether it has loaded the tools: a call's time limit runs from then, not from its start."""

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:
            pass  # it died: reading its reply says how

    def take(self) -> tuple | None:
        """The next reply (None for the set-up's "ready"), or ("died", how) when the process is gone."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            return ("died", self.death())
        if message == ("ready",):
            self.started = True
            return None
        return message

    def deadline(self, timeout: float) -> float:
        """When the call in hand is late: `timeout` from now, or from the process's start-up once it has."""
        return time.monotonic() + (timeout if self.started else max(START_S, timeout))

    def ask(self, message: tuple, timeout: float) -> tuple:
        """The reply to one message, or ("timeout",) (the process is then killed) or ("died", how)."""
        self.send(message)
        deadline = self.deadline(timeout)
        while True:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                return ("timeout",)
            answer = self.take()
            if answer is None:
                deadline = self.deadline(timeout)
                continue
            return answer

    def death(self) -> str:
        """How the process ended, in words."""
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "it stopped answering"
        if code < 0:
            return f"it was killed by {signal.Signals(-code).name}"
        return f"it exited with code {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()


class ToolPool:
    """open(fields) -> handle, run([(handle, calls)]) -> results per call, state(handle), close(handles)."""

    def __init__(self, tools, workers: int, timeout: float, memory_mb: int):
        self.tools, self.size, self.timeout, self.memory_mb = tools, workers, timeout, memory_mb
        names = [s["function"]["name"] for s in tools.schemas]
        environment = tools.sources[0] if tools.environment is not None else None
        self.setup = (list(sys.path), list(tools.sources), environment, names, memory_mb)
        self.workers: list[_Worker | None] = [None] * workers
        self.opened: dict[int, _Opened] = {}
        self.next_handle = 0

    def worker(self, k: int) -> _Worker:
        if self.workers[k] is None:
            self.workers[k] = _Worker(self.setup)
        return self.workers[k]

    def open(self, fields: dict, row: int) -> int:
        """A trajectory's tools, its environment built from its prompt row's fields; `row` (1-based) is named
        in the ToolError (exit 2) when the constructor fails: the user's code error."""
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        opened = _Opened(dict(fields), handle % self.size)
        if self.tools.environment is not None:
            answer = self.worker(opened.worker).ask(("open", handle, opened.fields), self.timeout)
            if answer[0] != "ok":
                if answer[0] != "error":
                    self._replace(opened.worker, answer)
                built = f"rl.environment: {self.tools.spec}: {self.tools.environment.__name__}(**row fields)"
                raise ToolError(
                    f"{built} raised on prompt row {row}: {answer[1]} (it is built from each row's fields other "
                    "than prompt)"
                    if answer[0] == "error"
                    else f"{built} on prompt row {row}: {self._why(answer, 'it')}"
                )
        self.opened[handle] = opened
        return handle

    def run(self, batches: list[tuple[int, list[Call]]]) -> list[list[Result]]:
        """Each trajectory's calls in order, the processes side by side; results in call order."""
        results: list[list[Result | None]] = [[None] * len(calls) for _, calls in batches]
        queues: dict[int, deque] = {}
        for b, (handle, calls) in enumerate(batches):
            for c, call in enumerate(calls):
                queues.setdefault(self.opened[handle].worker, deque()).append((b, c, handle, call))
        busy: dict[int, tuple] = {}  # worker -> (item, deadline)
        while queues or busy:
            for k in [k for k in queues if k not in busy]:
                b, c, handle, call = item = queues[k].popleft()
                if not queues[k]:
                    del queues[k]
                if self.opened[handle].lost:
                    results[b][c] = Result(call.name, f"error: {self.opened[handle].lost}", True, "crash")
                    continue
                self.worker(k).send(("call", handle, call))
                busy[k] = (item, self.workers[k].deadline(self.timeout))
            if not busy:
                continue
            left = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
            ready = set(wait([self.workers[k].conn for k in busy], left))
            for k in list(busy):
                (b, c, handle, call), deadline = busy[k]
                if self.workers[k].conn in ready:
                    answer = self.workers[k].take()
                    if answer is None:  # the set-up's "ready": the call's time starts now
                        busy[k] = (busy[k][0], self.workers[k].deadline(self.timeout))
                        continue
                elif time.monotonic() >= deadline:
                    self.workers[k].kill()
                    answer = ("timeout",)
                else:
                    continue
                del busy[k]
                if answer[0] == "result":
                    results[b][c] = answer[1]
                    if self.tools.environment is not None:
                        self.opened[handle].calls.append(call)
                    continue
                results[b][c] = self._failed(call, answer)
                self._replace(k, answer)
        return results  # type: ignore[return-value]

    def _failed(self, call: Call, answer: tuple) -> Result:
        kind = "timeout" if answer[0] == "timeout" else "crash"
        return Result(call.name, f"error: {self._why(answer, call.name)}", True, kind)

    def _why(self, answer: tuple, what: str) -> str:
        if answer[0] == "timeout":
            return f"{what} did not return within {self.timeout:g} s (rl.tool_timeout) and was stopped"
        if answer[0] == "memory":
            return (
                f"{what} ran out of memory (rl.tool_memory_mb {self.memory_mb}) and its process was replaced"
            )
        if answer[0] == "died":
            return f"{what} ended its process ({answer[1]}); the process was replaced"
        return f"{what}: {answer[-1]}"

    def _replace(self, k: int, answer: tuple) -> None:
        """A new process for worker k: every environment it held built again and given its calls again. One
        that cannot be (its constructor or a call fails this time) is lost: its later calls fail."""
        why = f"its environment was lost when its tool process was replaced ({self._why(answer, 'a call')})"
        while True:
            if self.workers[k] is not None:
                self.workers[k].kill()
                self.workers[k] = None
            if self.tools.environment is None:
                return
            for handle, opened in self.opened.items():
                if opened.worker != k or opened.lost:
                    continue
                replies = [self.worker(k).ask(("open", handle, opened.fields), self.timeout)]
                for call in opened.calls if replies[0][0] == "ok" else []:
                    replies.append(self.worker(k).ask(("call", handle, call), self.timeout))
                    if replies[-1][0] != "result":
                        break
                if replies[-1][0] not in ("ok", "result"):
                    opened.lost = why
                    if replies[-1][0] != "error":  # the process is gone: start again without this one
                        break
            else:
                return

    def state(self, handle: int):
        """A trajectory's environment instance as its process holds it now (for the reward functions)."""
        opened = self.opened[handle]
        if self.tools.environment is None or opened.lost:
            return None
        answer = self.worker(opened.worker).ask(("state", handle), self.timeout)
        if answer[0] == "state":
            return pickle.loads(answer[1])
        if answer[0] == "error":
            raise ToolError(
                f"rl.environment: {self.tools.spec}: its instance cannot be pickled ({answer[1]}): reward "
                "functions read each trajectory's environment from its tool process; keep open files, locks and "
                "sockets out of its attributes or give it __getstate__"
            )
        self._replace(opened.worker, answer)
        return None

    def close(self, handles: list[int]) -> None:
        """Forget these trajectories (their environments are dropped in their processes)."""
        for handle in handles:
            opened = self.opened.pop(handle, None)
            worker = self.workers[opened.worker] if opened else None
            if worker is not None and self.tools.environment is not None:
                worker.send(("close", handle))

    def shutdown(self) -> None:
        for k, worker in enumerate(self.workers):
            if worker is not None:
                worker.kill()
                self.workers[k] = None
