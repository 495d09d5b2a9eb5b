"""Start a multi-process run with `accelerate launch`, explicitly, ignoring ambient configuration.

accelerate reads `~/.cache/huggingface/accelerate/default_config.yaml` for every setting not given
on its command line; an old file there can silently change a run. We therefore always pass a
config file: the recipe's `distributed.accelerate_config` if it names one, otherwise one written
from the Plan. Each process runs `python -m liger_cli train RECIPE` and builds its backend
(DDP, FSDP, DeepSpeed) in-process from the same Plan.

On a CPU, `accelerate launch --cpu` starts ONE process and `--use_fsdp` silently gives DDP
(see docs/fsdp-facts.md#launching-on-a-cpu): we launch with the multi-GPU launcher (torchrun
underneath) and accelerate's CPU switch in the ranks' environment (`process_state.child_env`),
which gives real gloo process groups.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from liger_cli import process_state
from liger_cli.launch.rank import STATUS_ENV
from liger_cli.plan import Plan
from liger_cli.plan.backends import PRECISION_TO_ACCELERATE as MIXED_PRECISION
from liger_cli.recipe import Recipe


def accelerate_config(recipe: Recipe, plan: Plan) -> dict:
    d = recipe.distributed
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU",
        "num_processes": plan.num_processes,
        "num_machines": d.num_machines,
        "machine_rank": d.machine_rank,
        "main_process_ip": d.main_process_ip,
        "main_process_port": d.main_process_port,
        "mixed_precision": MIXED_PRECISION[plan.precision],
        "use_cpu": False,
        "rdzv_backend": "static",
        "same_network": True,
        "gpu_ids": "all",
        "dynamo_config": {},
    }


def launch_argv(
    recipe: Recipe, plan: Plan, recipe_path: Path, overrides: list[str], config_file: Path
) -> list[str]:
    """The exact command run: an argv list, never a shell string."""
    d = recipe.distributed
    argv = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(config_file),
        "--multi_gpu",
        "--num_processes", str(plan.num_processes),
        "--num_machines", str(d.num_machines),
        "--machine_rank", str(d.machine_rank),
        "--main_process_port", str(d.main_process_port),
        "--mixed_precision", MIXED_PRECISION[plan.precision],
        "--dynamo_backend", "no",
    ]  # fmt: skip
    if d.main_process_ip:
        argv += ["--main_process_ip", d.main_process_ip]
    argv += ["-m", "liger_cli", "train", str(Path(recipe_path).resolve())]
    for item in overrides:
        argv += ["--set", item]
    return argv


def launch_env(plan: Plan, status_dir: Path | None = None) -> dict[str, str]:
    """The ranks' environment: ours, without stale accelerate settings (each builds its backend)."""
    extra = {STATUS_ENV: str(status_dir)} if status_dir is not None else {}
    return process_state.child_env(cpu=plan.device == "cpu", extra=extra)


def describe_failure(status_dir: Path, num_processes: int) -> str:
    """Which ranks failed and how, from the status each rank wrote (none: it was killed)."""
    first, later = [], []
    for rank in range(num_processes):
        path = status_dir / f"rank-{rank}"
        status = path.read_text().strip() if path.is_file() else "not started"
        if status == "running":
            first.append(
                f"rank {rank} died without a report (killed by a signal, e.g. out of memory or SIGKILL)"
            )
        elif status.startswith(("error", "user error")):
            first.append(f"rank {rank} failed: {status.split(': ', 1)[-1]}")
        elif status != "ok":
            later.append(f"rank {rank} {status}")
    return "; ".join(first + later) or "no rank reported a failure (the launcher itself failed)"


def run_accelerate_launch(recipe: Recipe, plan: Plan, recipe_path: Path, overrides: list[str]) -> int:
    """Run the ranks; 0 when all finish, 2 when they stopped on a user error, 1 otherwise."""
    with tempfile.TemporaryDirectory(prefix="liger-launch-") as tmp:
        config_file = Path(tmp) / "accelerate.yaml"
        status_dir = Path(tmp) / "status"
        status_dir.mkdir()
        if recipe.distributed.accelerate_config is not None:
            config_file = recipe.distributed.accelerate_config
        else:
            config_file.write_text(yaml.safe_dump(accelerate_config(recipe, plan)))
        argv = launch_argv(recipe, plan, recipe_path, overrides, config_file)
        print(
            f"launching {plan.num_processes} processes: accelerate launch ... -m liger_cli train {recipe_path}",
            file=sys.stderr,
        )
        code = subprocess.run(argv, env=launch_env(plan, status_dir)).returncode
        if code == 0:
            return 0
        local = plan.num_processes // recipe.distributed.num_machines
        why = (
            describe_failure(status_dir, local)
            if recipe.distributed.num_machines == 1
            else "see the ranks' output above"
        )
        failed = [
            p.read_text()
            for p in status_dir.glob("rank-*")
            if not p.read_text().startswith(("ok", "stopped"))
        ]
    print(f"error: the {plan.num_processes}-process run failed (exit {code}): {why}", file=sys.stderr)
    return 2 if failed and all(s.startswith("user error") for s in failed) else 1
