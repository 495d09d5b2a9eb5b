"""`liger launch`: the commands that start a recipe on N machines x M processes, or a Slurm batch script.

A multi-node run is the same `liger train RECIPE` on every machine, told the job's shape and its own
rank (`distributed.num_machines`, `num_processes` per machine, `machine_rank`, and the first machine's
`main_process_ip`/`main_process_port`, where accelerate's rendezvous is); each machine's liger then
runs `accelerate launch` for its own processes (`multiprocess.py`). This module only writes those
commands down, after loading the recipe with them, so a wrong key or an impossible shape is an error
here rather than on the cluster. The Slurm script runs one task per node; each finds its rank in
`SLURM_NODEID` and the first node's name from `scontrol show hostnames`.
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

    def overrides(self, rank: int | str) -> list[str]:
        """The --set items that make `liger train` machine `rank` of the job."""
        found = [f"distributed.num_machines={self.nodes}", f"distributed.num_processes={self.procs}",
                 f"distributed.machine_rank={rank}", f"distributed.main_process_ip={self.main_ip}"]  # fmt: skip
        return found + ([f"distributed.main_process_port={self.port}"] if self.port is not None else [])

    def command(self, recipe: Path, overrides: list[str], rank: int | str) -> list[str]:
        """Machine `rank`'s argv (`liger` first): the user's --set items, then the job's."""
        argv = ["liger", "train", str(recipe)]
        for item in [*overrides, *self.overrides(rank)]:
            argv += ["--set", item]
        return argv


def launch_command(recipe: Path, overrides: list[str], nodes: int, procs: int, main_ip: str | None,
                   port: int | None, slurm: bool, out: Path | None) -> str:  # fmt: skip
    """The text `liger launch` prints (or writes to `out`): each machine's command, or the Slurm script.
    Every machine's recipe is loaded first (a UserError names what is wrong)."""
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
    job = Job(nodes, procs, main_ip or "127.0.0.1", port)
    for rank in range(nodes):  # each machine's recipe as its liger will read it
        load_recipe(recipe, [*overrides, *job.overrides(rank)])
    if slurm:
        text = slurm_script(recipe, overrides, job, loaded.distributed.backend)
    else:
        lines = [f"# {nodes} machine(s) x {procs} process(es) of {recipe.name}: run each line on its machine"]
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


def slurm_script(recipe: Path, overrides: list[str], job: Job, backend: str) -> str:
    """A batch script: one task per node; each runs its machine's `liger train` with its rank."""
    argv = [
        shlex.quote(a) for a in Job(job.nodes, job.procs, "MAIN", job.port).command(recipe, overrides, "R")
    ]
    argv = [
        '"distributed.main_process_ip=$MAIN_IP"' if a == "distributed.main_process_ip=MAIN" else a
        for a in argv
    ]
    at = argv.index("distributed.machine_rank=R")
    del argv[at - 1 : at + 1]  # each task adds its own rank
    lines = [" ".join(argv[:3])] + [" ".join(argv[i : i + 2]) for i in range(3, len(argv), 2)]
    command = " \\\n    ".join(lines)
    return f"""#!/bin/bash
# Written by `liger launch --slurm`: {recipe} on {job.nodes} nodes x {job.procs} processes ({backend}).
# Every node must see the same paths: this Python environment (liger on PATH), the recipe, its model
# and data, and output.dir (only the run's main process writes it, checkpoints included).
#SBATCH --job-name=liger-{recipe.stem}
#SBATCH --nodes={job.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={job.procs}
#SBATCH --exclusive
set -euo pipefail
export PYTHONUNBUFFERED=1  # each node's output as it comes, in the job's log
# The first node holds the rendezvous (accelerate's main process). No pipe into head: under pipefail
# scontrol would die of SIGPIPE when head exits first, and the job with it.
NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
MAIN_IP=${{NODES%%$'\\n'*}}
srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  bash -c 'exec "$@" --set distributed.machine_rank="$SLURM_NODEID"' liger-node \\
    {command}
"""
