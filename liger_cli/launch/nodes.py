"""`liger launch`: the commands that start a recipe on N machines x M processes, or a Slurm batch script.

A multi-node run is the same `liger train RECIPE` on every machine, told the job's shape and its own
rank (`distributed.num_machines`, `num_processes` per machine, `machine_rank`, and the first machine's
`main_process_ip`/`main_process_port`, where accelerate's rendezvous is); each machine's liger then
runs `accelerate launch` for its own processes (`multiprocess.py`). This module only writes those
commands down, after loading the recipe with them, so a wrong key or an impossible shape is an error
here rather than on the cluster. The Slurm script runs one task per node; each finds its rank in
`SLURM_NODEID` and the first node's name from `scontrol show hostnames`.

With `--vllm-serve` (rl.engine vllm) one more machine serves the run's policy: it runs `liger vllm-serve`
on the run's model, and every training machine is told its URL (`rl.vllm.server`); the trainers wait
for it to come up (rl.vllm.timeout) and push every update to it. In the Slurm script it is the job's
last node, started in the background and stopped when training ends.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from liger_cli.errors import UserError


@dataclass(frozen=True)
class Job:
    """The job's shape and rendezvous: `nodes` machines x `procs` processes, the first at `main_ip`."""

    nodes: int
    procs: int
    main_ip: str
    port: int | None = None
    server: str | None = None
    """The URL of the machine serving vLLM (--vllm-serve), or None."""

    def overrides(self, rank: int | str) -> list[str]:
        """The --set items that make `liger train` machine `rank` of the job."""
        found = [f"distributed.num_machines={self.nodes}", f"distributed.num_processes={self.procs}",
                 f"distributed.machine_rank={rank}", f"distributed.main_process_ip={self.main_ip}"]  # fmt: skip
        found += [f"distributed.main_process_port={self.port}"] if self.port is not None else []
        return found + ([f"rl.vllm.server={self.server}"] if self.server is not None else [])

    def command(self, recipe: Path, overrides: list[str], rank: int | str) -> list[str]:
        """Machine `rank`'s argv (`liger` first): the user's --set items, then the job's."""
        argv = ["liger", "train", str(recipe)]
        for item in [*overrides, *self.overrides(rank)]:
            argv += ["--set", item]
        return argv


def launch_command(recipe: Path, overrides: list[str], nodes: int, procs: int, main_ip: str | None,
                   port: int | None, slurm: bool, out: Path | None, vllm_serve: bool = False,
                   vllm_ip: str | None = None) -> str:  # fmt: skip
    """The text `liger launch` prints (or writes to `out`): each machine's command (and the serving
    machine's, with `vllm_serve`), or the Slurm script. Every machine's recipe is loaded first (a
    UserError names what is wrong)."""
    from liger_cli.recipe import load_recipe

    if nodes < 1 or procs < 1:
        raise UserError(f"--nodes {nodes} --procs {procs}: both must be at least 1")
    recipe = Path(recipe).expanduser().resolve()
    loaded = load_recipe(recipe, overrides)
    if main_ip is None and not slurm:
        main_ip = loaded.distributed.main_process_ip
        if main_ip is None and nodes > 1:
            raise UserError(
                "--main-ip HOST: the first machine's address, which every machine can reach (or --slurm, "
                "whose script finds it)"
            )
    if out is not None and out.exists():
        raise UserError(f"--out {out}: exists; remove it or give another file")
    serve = serve_argv(loaded, vllm_ip, slurm) if vllm_serve else None
    server = f"http://{'$VLLM_IP' if slurm else vllm_ip}:{VLLM_PORT}" if vllm_serve else None
    job = Job(nodes, procs, main_ip or "127.0.0.1", port, server)
    for rank in range(nodes):  # each machine's recipe as its liger will read it
        load_recipe(recipe, [*overrides, *job.overrides(rank)])
    if slurm:
        text = slurm_script(recipe, overrides, job, loaded.distributed.backend, serve)
    else:
        lines = [f"# {nodes} machine(s) x {procs} process(es) of {recipe.name}: run each line on its machine"]
        if serve is not None:
            lines += [f"# the machine serving vLLM ({vllm_ip}): start it first", shlex.join(serve)]
        for rank in range(nodes):
            lines += [f"# machine {rank}", shlex.join(job.command(recipe, overrides, rank))]
        text = "\n".join(lines) + "\n"
    if out is not None:
        temporary = out.with_name(f".{out.name}.tmp")
        temporary.write_text(text)
        if slurm:
            temporary.chmod(0o755)
        os.replace(temporary, out)
    return text


VLLM_PORT = 8000
"""The serving machine's port (`liger launch --vllm-serve`)."""


def serve_argv(recipe, vllm_ip: str | None, slurm: bool) -> list[str]:
    """The serving machine's `liger vllm-serve` for the run (every interface under Slurm, where its address
    is the node's name; else the address the trainers are given)."""
    from liger_cli.recipe.vllm_section import vllm_server_options

    if recipe.rl is None or recipe.rl.engine != "vllm":
        raise UserError(
            "--vllm-serve: the recipe does not sample with vLLM; set rl.engine: vllm (or drop it)"
        )
    if recipe.rl.vllm.server is not None:
        raise UserError(f"--vllm-serve: the recipe already names a server (rl.vllm.server {recipe.rl.vllm.server}); "
                        "drop one of them")  # fmt: skip
    if vllm_ip is None and not slurm:
        raise UserError("--vllm-ip HOST: the serving machine's address, which the training machines can reach "
                        "(or --slurm, whose script uses the job's last node)")  # fmt: skip
    options = vllm_server_options(recipe)
    return ["liger", "vllm-serve", str(options.pop("model")), "--host", "0.0.0.0" if slurm else str(vllm_ip),
            "--port", str(VLLM_PORT), *(x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v)))]  # fmt: skip


def slurm_script(recipe: Path, overrides: list[str], job: Job, backend: str, serve: list[str] | None) -> str:
    """A batch script: one task per node; each runs its machine's `liger train` with its rank (and, with
    `serve`, the job's last node serves vLLM meanwhile)."""
    marked = Job(job.nodes, job.procs, "MAIN", job.port, job.server and "SERVER")
    argv = [shlex.quote(a) for a in marked.command(recipe, overrides, "R")]
    quoted = {"distributed.main_process_ip=MAIN": '"distributed.main_process_ip=$MAIN_IP"',
              "rl.vllm.server=SERVER": f'"rl.vllm.server={job.server}"'}  # fmt: skip
    argv = [quoted.get(a, a) for a in argv]
    at = argv.index("distributed.machine_rank=R")
    del argv[at - 1 : at + 1]  # each task adds its own rank
    lines = [" ".join(argv[:3])] + [" ".join(argv[i : i + 2]) for i in range(3, len(argv), 2)]
    command = " \\\n    ".join(lines)
    serving = (
        ""
        if serve is None
        else f"""VLLM_IP=${{NODES##*$'\\n'}}
# The last node serves vLLM in the background (the trainers wait for it); stopped when they end.
srun --nodes=1 --ntasks=1 --relative={job.nodes} {shlex.join(serve)} &
VLLM_PID=$!
trap 'kill "$VLLM_PID" 2>/dev/null || true' EXIT
"""
    )
    and_serving = "" if serve is None else ", and one more node serving vLLM"
    return f"""#!/bin/bash
# Written by `liger launch --slurm`: {recipe} on {job.nodes} nodes x {job.procs} processes ({backend}){and_serving}.
# Every node must see the same paths: this Python environment (liger on PATH), the recipe, its model
# and data, and output.dir (only the run's main process writes it, checkpoints included).
#SBATCH --job-name=liger-{recipe.stem}
#SBATCH --nodes={job.nodes + (serve is not None)}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={job.procs}
#SBATCH --exclusive
set -euo pipefail
export PYTHONUNBUFFERED=1  # each node's output as it comes, in the job's log
# The first node holds the rendezvous (accelerate's main process). No pipe into head: under pipefail
# scontrol would die of SIGPIPE when head exits first, and the job with it.
NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
MAIN_IP=${{NODES%%$'\\n'*}}
{serving}srun --nodes={job.nodes} --relative=0 --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  bash -c 'exec "$@" --set distributed.machine_rank="$SLURM_NODEID"' liger-node \\
    {command}
"""
