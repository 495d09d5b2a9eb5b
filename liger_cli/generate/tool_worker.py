"""One tool process: `python -m liger_cli.generate.tool_worker FD`, started by `tool_pool.ToolPool`.

It loads the user's tools (or environment class) itself and runs the calls it is sent, one at a time,
on the socket it is given; the user's code never runs in the training process. Its address space is
capped at `rl.tool_memory_mb` (RLIMIT_AS), so a tool that allocates without bound gets a MemoryError
here, which ends this process (the pool starts another). It dies with its parent (PR_SET_PDEATHSIG),
so a tool stuck in a call never outlives the run. Imports nothing heavy: it starts in a few
hundredths of a second.

Messages (pickled tuples): first the set-up (sys.path, tool specs, environment spec, method names,
memory cap) -> ("ready",) | ("error", text); then ("open", handle, fields) -> ("ok",) | ("error", text); ("call", handle,
Call) -> ("result", Result) | ("memory",); ("state", handle) -> ("state", pickle bytes) | ("error",
text); ("close", handle) -> nothing.
"""

from __future__ import annotations

import pickle
import sys


def _die_with_parent() -> None:
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the socket's end still stops an idle process
        pass


def _cap_memory(megabytes: int) -> None:
    import resource

    limit = megabytes << 20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def serve(conn) -> None:
    from liger_cli.generate.tool_calls import run_one
    from liger_cli.user_code import load_object, said

    path, specs, environment, names, memory_mb = conn.recv()
    sys.path[:] = path
    _cap_memory(memory_mb)
    try:
        if environment is None:
            functions = {getattr(f, "__name__", s.rpartition(":")[2]): f for s, f in
                         ((s, load_object(s, "rl.tools")) for s in specs)}  # fmt: skip
            cls = None
        else:
            functions, cls = {}, load_object(environment, "rl.environment", kind="class")
    except Exception as err:  # noqa: BLE001 - loaded in the run's process, it fails here: say why
        conn.send(("error", said(err)))
        return
    conn.send(("ready",))
    tools: dict[int, dict] = {}
    instances: dict[int, object] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind, handle = message[0], message[1]
        if kind == "open":  # an environment's instance (plain tools are shared: no open)
            try:
                instance = cls(**message[2])
            except Exception as err:  # noqa: BLE001 - the user's constructor: its error goes back to the run
                conn.send(("error", said(err)))
                continue
            instances[handle] = instance
            tools[handle] = {name: getattr(instance, name) for name in names}
            conn.send(("ok",))
        elif kind == "call":
            try:
                result = run_one(message[2], tools.get(handle, functions))
            except MemoryError:
                conn.send(("memory",))
                return
            conn.send(("result", result))
        elif kind == "state":
            try:
                conn.send(("state", pickle.dumps(instances.get(handle))))
            except Exception as err:  # noqa: BLE001 - an instance pickle cannot write
                conn.send(("error", said(err)))
        elif kind == "close":
            tools.pop(handle, None)
            instances.pop(handle, None)


def main() -> None:
    import socket
    from multiprocessing.connection import Connection

    _die_with_parent()
    sock = socket.socket(fileno=int(sys.argv[1]))
    serve(Connection(sock.detach()))


if __name__ == "__main__":
    main()
