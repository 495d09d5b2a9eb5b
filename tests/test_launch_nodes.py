"""`liger launch`: each machine's `liger train` command for N machines x M processes, and a Slurm batch
script that runs those same commands (run here under bash with stand-ins for scontrol, srun and liger);
every mistake is one line, exit 2, and no file. In this process (the CLI's own parsing and exit codes)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from test_generate_cli import invoke
from test_output_safety import one_line_error
from test_train import REPO

from liger_cli.recipe import load_recipe

RECIPE = REPO / "recipes" / "quickstart.yaml"
MINE = ["distributed.backend=fsdp2", "output.dir=/tmp/with space/out"]  # the user's own --set items


def commands(text: str) -> list[list[str]]:
    return [shlex.split(line) for line in text.splitlines() if line and not line.startswith("#")]


def sets(argv: list[str]) -> list[str]:
    assert argv[:3] == ["liger", "train", str(RECIPE)] and argv[3::2] == ["--set"] * len(argv[4::2]), argv
    return argv[4::2]


def test_each_machine_gets_its_command_and_its_recipe_loads_as_that_machine() -> None:
    proc = invoke("launch", str(RECIPE), "--nodes", "2", "--procs", "3", "--main-ip", "10.1.2.3", "--port", "29611",
                  *(x for s in MINE for x in ("--set", s)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = commands(proc.stdout)
    assert len(found) == 2
    for rank, argv in enumerate(found):
        assert sets(argv)[:2] == MINE  # the user's items first, then the job's
        d = load_recipe(RECIPE, sets(argv)).distributed
        assert (d.backend, d.num_machines, d.num_processes, d.machine_rank) == ("fsdp2", 2, 3, rank)
        assert (d.main_process_ip, d.main_process_port) == ("10.1.2.3", 29611)


def run_with_stand_ins(script: Path, tmp_path: Path) -> list[list[str]]:
    """The Slurm script run under bash with stand-ins: scontrol names three nodes (the third after a pause:
    a reader that stops at the first line would make it die of SIGPIPE); srun runs its command on the
    nodes --nodes and --relative name, SLURM_NODEID set; liger records its node and the argv it was given.
    Returns each recorded [node, "liger", ...]."""
    shims, capture = tmp_path / "bin", tmp_path / "argv.jsonl"
    shims.mkdir()
    (shims / "scontrol").write_text(
        "#!/bin/bash\nprintf 'node-a\\nnode-b\\n'\nsleep 0.2\nprintf 'node-c\\n'\n"
    )
    (shims / "srun").write_text(
        "#!/bin/bash\nnodes=1; first=0\n"
        'while [[ "$1" == --* ]]; do case "$1" in --nodes=*) nodes=${1#--nodes=};; '
        "--relative=*) first=${1#--relative=};; esac; shift; done\n"
        'for ((id = first; id < first + nodes; id++)); do SLURM_NODEID=$id "$@" || exit $?; done\n'
    )
    (shims / "liger").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(capture)!r}, 'a').write(json.dumps([os.environ['SLURM_NODEID'], 'liger', *sys.argv[1:]]) + '\\n')\n"
    )
    for shim in shims.iterdir():
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-c]"}
    ran = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    return [json.loads(line) for line in capture.read_text().splitlines()]


def test_the_slurm_script_runs_the_same_commands_on_each_node(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    args = ["launch", str(RECIPE), "--nodes", "2", "--procs", "4", *(x for s in MINE for x in ("--set", s))]
    proc = invoke(*args, "--slurm", "--out", str(script))
    assert proc.returncode == 0 and proc.stdout.strip() == f"wrote {script}", proc.stderr
    assert os.access(script, os.X_OK) and "#SBATCH --nodes=2" in script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    got = [argv for _, *argv in run_with_stand_ins(script, tmp_path)]
    printed = invoke(*args, "--main-ip", "node-a")
    assert printed.returncode == 0, printed.stderr
    want = commands(printed.stdout)
    assert [sorted(sets(a)) for a in got] == [sorted(sets(a)) for a in want]  # rank last in the script's


def test_mistakes_are_one_line_and_write_nothing(tmp_path: Path) -> None:
    kept = tmp_path / "kept.sh"
    kept.write_text("mine\n")
    cases = {
        "--nodes 0 --procs 1: both must be at least 1": ["--nodes", "0"],
        "--main-ip HOST: the first machine's address": ["--nodes", "2", "--set", "distributed.backend=ddp"],
        "distributed.backend is none but 2 process(es) on 2 machine(s)": ["--nodes", "2", "--procs", "2", "--slurm"],
        "exists; remove it or give another file": ["--nodes", "2", "--main-ip", "h", "--set", "distributed.backend=ddp",
                                                   "--out", str(kept)],
        "unknown key `distributed.num_nodes`": ["--set", "distributed.num_nodes=2"],
        "--vllm-serve: the recipe does not sample with vLLM": ["--vllm-serve", "--vllm-ip", "h"],
    }  # fmt: skip
    grpo = [str(REPO / "recipes" / "grpo.yaml"), "--vllm-serve", "--set", "rl.engine=vllm"]
    cases_grpo = {
        "--vllm-ip HOST: the serving machine's address": [],
        "the recipe already names a server (rl.vllm.server http://h:1)": ["--vllm-ip", "h", "--set",
                                                                            "rl.vllm.server=http://h:1"],
    }  # fmt: skip
    for expected, args in cases_grpo.items():
        line = one_line_error(invoke("launch", *grpo, *args))
        assert expected in line, (expected, line)
    for expected, args in cases.items():
        line = one_line_error(invoke("launch", str(RECIPE), *args))
        assert expected in line, (expected, line)
    assert kept.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["kept.sh"]


def test_a_serving_node_runs_vllm_and_the_trainers_are_pointed_at_it(tmp_path: Path) -> None:
    """`--vllm-serve`: printed, one more machine's `liger vllm-serve` (the run's model, data.max_seq_len,
    its adapter rank) and every training machine told its URL; in the Slurm script, the job's last node
    serves (every interface, in the background) while the others train with the same commands."""
    grpo = REPO / "recipes" / "grpo.yaml"
    mine = ["rl.engine=vllm", "distributed.backend=fsdp2"]
    args = [
        "launch",
        str(grpo),
        "--nodes",
        "2",
        "--procs",
        "2",
        "--vllm-serve",
        *(x for s in mine for x in ("--set", s)),
    ]
    printed = invoke(*args, "--main-ip", "10.1.2.3", "--vllm-ip", "10.1.2.9")
    assert printed.returncode == 0, printed.stderr
    serve, *trainers = commands(printed.stdout)
    loaded = load_recipe(grpo, mine)
    assert serve == ["liger", "vllm-serve", str(loaded.model.path.resolve()), "--host", "10.1.2.9", "--port", "8000",
                     "--dtype", "float32", "--max-model-len", str(loaded.data.max_seq_len),
                     "--max-lora-rank", str(loaded.adapter.r)]  # fmt: skip
    assert len(trainers) == 2
    for rank, argv in enumerate(trainers):
        assert argv[:3] == ["liger", "train", str(grpo)]
        r = load_recipe(grpo, argv[4::2])
        assert (r.rl.vllm.server, r.distributed.machine_rank) == ("http://10.1.2.9:8000", rank)
    # The Slurm script, with stand-ins: scontrol names three nodes; srun runs its command on the nodes
    # --nodes and --relative name (SLURM_NODEID set), in the background where the script says so.
    script = tmp_path / "job.sh"
    assert invoke(*args, "--slurm", "--out", str(script)).returncode == 0
    assert "#SBATCH --nodes=3" in script.read_text()
    got = {tuple(argv) for argv in run_with_stand_ins(script, tmp_path)}
    host = serve.index("--host") + 1
    assert ("2", *serve[:host], "0.0.0.0", *serve[host + 1 :]) in got  # the last node serves
    trained = sorted((node, load_recipe(grpo, list(argv[4::2]))) for node, *argv in got if argv[1] == "train")
    assert [node for node, _ in trained] == ["0", "1"]
    for node, r in trained:
        assert (r.rl.vllm.server, r.distributed.machine_rank, r.distributed.main_process_ip) == (
            "http://node-c:8000",
            int(node),
            "node-a",
        )
