"""Distributed training with 2 real processes on gloo, a tiny Llama saved to disk, kernels on.

Every backend must train the same model a 1-process run trains: per-step losses equal the
1-process run with the same global batch (fp32, within 1e-5), and the saved outputs load. The
cases of DDP, FSDP-1 and FSDP-2 are this file's part of the suite's ONE 2-process launch
(tests/conftest.py `two_process_launch`, tests/dist_driver.py), since each launch costs 10-20 s of
imports; every multi-process call has a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_python
import yaml
from safetensors.torch import load_file
from test_kto import write_unpaired
from test_preference_train import write_pairs

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "dist_driver.py"
QUICK_TRAIN = REPO / "recipes" / "quickstart" / "data" / "train.jsonl"
STEPS = 4
CASES = {  # name -> (adapter type, activation checkpointing)
    "lora": ("lora", "off"),
    "full": ("none", "off"),
    "lora-ac": ("lora", "auto"),
    "full-ac": ("none", "auto"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **extra)
    return env


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    return make_assets(tmp_path_factory.mktemp("dist-assets"))


def make_assets(root: Path) -> dict[str, Path]:
    """The tiny Llama (and its tied twin), instruction rows and preference pairs, under `root`."""
    from conftest import save_tiny_model

    root.mkdir(parents=True, exist_ok=True)
    data = root / "train.jsonl"
    data.write_text("".join(QUICK_TRAIN.read_text().splitlines(keepends=True)[:64]))
    return {
        "root": root,
        "data": data,
        "model": save_tiny_model(root / "llama"),
        "tied": save_tiny_model(root / "llama-tied", tie_word_embeddings=True),
        "pairs": write_pairs(root / "pairs.jsonl", n=40),
        "unpaired": write_unpaired(root / "unpaired.jsonl", n_pairs=20),
    }


def dpo(assets: dict) -> dict:
    """The overrides that make a recipe a DPO run on preference pairs (LoRA: the reference is the
    adapter disabled, a second forward in every micro-batch)."""
    return {"data__train": str(assets["pairs"]), "data__format": "preference", "data__max_seq_len": 24,
            "training__objective": "dpo"}  # fmt: skip


def dpo_full(assets: dict) -> dict:
    """DPO with full fine-tuning: the reference log-probs precomputed before step 1. An eval split of 6
    pairs (3 micro-batches of 2) and 34 train pairs (17): the second rank pads its share of each."""
    return {**dpo(assets), "adapter__type": "none", "data__eval_fraction": 0.15}


# How a step is split changes the micro-batch size too (so padding and each micro-batch's label count
# differ): micro-batch 4 x accumulation 1 (the reference), 1 x 4, and (DDP, 2 processes) 1 x 2.
ACCUMULATION = {"mb4-acc1": (4, 1), "mb1-acc4": (1, 4)}
DDP_ACCUMULATION = {"ddp-mb1-acc2": (1, 2)}


def split_step(name: str) -> dict:
    micro, accum = {**ACCUMULATION, **DDP_ACCUMULATION}[name]
    return {"training__micro_batch_size": micro, "training__grad_accum": accum}


def kto_full(assets: dict) -> dict:
    """KTO with full fine-tuning on 40 labelled completions (34 train, 6 eval): the reference table of each
    completion and its mismatched one, and z0 from the step's completions on both ranks (all-reduced),
    pushed above 0 (desirable completions weighted up, a high learning rate) so that it counts."""
    return {"data__train": str(assets["unpaired"]), "data__format": "unpaired", "data__max_seq_len": 24,
            "training__objective": "kto", "adapter__type": "none", "data__eval_fraction": 0.15,
            "training__lr": 2e-2, "training__warmup_steps": 0, "kto__beta": 1.0,
            "kto__undesirable_weight": 0.2}  # fmt: skip


def reward(assets: dict) -> dict:
    """A reward model on the preference pairs: its LoRA adapter beside the score head, trained in full."""
    return {**dpo(assets), "training__objective": "reward"}


def preference_cases(assets: dict) -> dict[str, dict]:
    """Every preference objective in the 2-process comparison: DPO with LoRA and full, SimPO with LoRA
    (no reference), ORPO full (no reference, its NLL term), KTO full (its z0 over the step)."""
    return {
        "dpo": dpo(assets),
        "dpo-full": dpo_full(assets),
        "simpo": {**dpo(assets), "training__objective": "simpo"},
        "orpo-full": {**dpo_full(assets), "training__objective": "orpo"},
        "kto-full": kto_full(assets),
    }


def write_recipe(
    assets: dict, out: Path, backend: str = "none", adapter: str = "lora", ac: str = "off", **over
) -> Path:
    """One recipe; the 1-process reference takes the same global batch (2 x 2 x 2 = 1 x 2 x 4)."""
    world = 1 if backend == "none" else 2
    recipe = {
        "model": {"path": str(assets[over.pop("model", "model")])},
        "adapter": {"type": adapter, "r": 4, "alpha": 8},
        "data": {"train": str(assets["data"]), "format": "instruction", "max_seq_len": 48},
        "training": {
            "max_steps": STEPS,
            "micro_batch_size": 2,
            "grad_accum": 4 // world,
            "lr": 5e-3,
            "warmup_steps": 1,
            "seed": 3,
        },  # fmt: skip
        "output": {"dir": str(out)},
        "logging": {"every": 1, "tensorboard": False},
        "distributed": {"backend": backend, "num_processes": world, "activation_checkpointing": ac},
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        recipe.setdefault(section, {})[name] = value
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def losses(out: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in r]


def run_driver(spec: dict, folder: Path, nproc: int, timeout: int = 240) -> subprocess.CompletedProcess:
    spec_file = folder / "spec.json"
    spec_file.write_text(json.dumps(spec))
    argv = [sys.executable, str(DRIVER), str(spec_file)]
    if nproc > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), *argv[1:]]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=folder)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_here(spec: dict) -> None:
    """The 1-process driver's cases in THIS process (tests/dist_driver.py, no 8 s of imports): each trains
    through `liger_cli.run.train.run` as in a fresh process, then the process's state is put back
    (test_train.restored_process_state); the twin checks are shared between the cases only."""
    import dist_driver
    from check_memo import twin_checks_memoized
    from test_train import restored_process_state

    with restored_process_state(), twin_checks_memoized():
        dist_driver.run_spec(spec)


@pytest.fixture(scope="module")
def references(assets) -> dict[str, Path]:
    """1-process runs of the same recipes: LoRA, full fine-tuning, and full on the tied model."""
    root = assets["root"] / "ref"
    root.mkdir()
    preference = preference_cases(assets)
    outs = {
        name: root / name for name in ("lora", "full", "tied", "stream", "reward", *preference, *ACCUMULATION)
    }
    cases = [
        write_recipe(assets, outs["lora"]),
        write_recipe(assets, outs["full"], adapter="none"),
        write_recipe(assets, outs["tied"], adapter="none", model="tied"),
        write_recipe(assets, outs["stream"], data__streaming=True),
        write_recipe(assets, outs["reward"], **reward(assets)),
        *(write_recipe(assets, outs[name], **over) for name, over in preference.items()),
        *(write_recipe(assets, outs[name], **split_step(name)) for name in ACCUMULATION),
    ]
    run_here({"cases": [{"recipe": str(c)} for c in cases]})
    return outs


def assert_same_reward_run(out: Path, ref: Path) -> None:
    """A reward run: the same per-step losses and the same saved adapter, its score head included."""
    assert losses(out) == pytest.approx(losses(ref), abs=1e-5, rel=0) and len(losses(ref)) == STEPS
    got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (out, ref))
    assert got.keys() == want.keys() and any(".score." in k for k in want), want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=2e-5, rtol=1e-4, msg=key)


def assert_same_run(out: Path, ref: Path) -> None:
    got, want = losses(out), losses(ref)
    assert len(got) == STEPS and len(want) == STEPS
    assert got == pytest.approx(want, abs=1e-5, rel=0), (got, want)
    if (ref / "final" / "adapter_model.safetensors").is_file():
        from peft import PeftModel

        from liger_cli.model import model_class, read_config

        config = json.loads((out / "final" / "adapter_config.json").read_text())
        source = config["base_model_name_or_path"]
        base = model_class(read_config(source)).from_pretrained(source)  # a causal LM, or a VLM
        loaded = PeftModel.from_pretrained(base, out / "final")  # the saved adapter loads in peft
        assert any("lora_A" in name for name, _ in loaded.named_parameters())
        got_w, want_w = (load_file(p / "final" / "adapter_model.safetensors") for p in (out, ref))
    else:
        got_w, want_w = (load_file(p / "final" / "model.safetensors") for p in (out, ref))
    assert got_w.keys() == want_w.keys() and got_w
    for key in want_w:
        torch.testing.assert_close(got_w[key], want_w[key], atol=2e-5, rtol=1e-4, msg=key)


BACKENDS = ["ddp", "fsdp1", "fsdp2"]  # deepspeed: proven in tests/test_deepspeed.py (its own shared launch)


def backend_cases(assets: dict, folder: Path, backend: str) -> tuple[list[dict], dict[str, Path], Path]:
    """One backend's cases: LoRA and full fine-tuning, with and without activation checkpointing; the
    preference objectives; streaming; a resume of the LoRA case; (FSDP) the tied model. Returns the
    driver cases, the outputs compared with the 1-process references, and the resumed output."""
    cases, outs = [], {}
    for name, (adapter, ac) in CASES.items():
        outs[name] = folder / name
        env = {}
        if backend == "fsdp1" and name == "lora-ac":
            env = {"FSDP_TRANSFORMER_CLS_TO_WRAP": ""}  # accelerate alone would look for a class ""
        if backend == "fsdp2" and name == "lora-ac":
            env = {"FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer,"}
        save = {"output__save_every": 2} if name == "lora" else {}
        if name == "lora":  # rank 0 alone opens the trackers: one run each (test below)
            tracked = TRACKED if backend == "ddp" else ["trackio"]
            save |= {"logging__report_to": tracked, "logging__project": tracked_project(folder)}
        cases.append(
            {"recipe": str(write_recipe(assets, outs[name], backend, adapter, ac, **save)), "env": env}
        )
    # Preference pairs: the loss per pair, the reference pass (LoRA) or the reference log-probs
    # precomputed by both ranks (full), or no reference (SimPO, ORPO); metrics over all ranks.
    for name, over in preference_cases(assets).items():
        outs[name] = folder / name
        cases.append({"recipe": str(write_recipe(assets, outs[name], backend, **over))})
    # A reward model (no lm_head: its score head's gradients reduced like the adapter's).
    outs["reward"] = folder / "reward"
    cases.append({"recipe": str(write_recipe(assets, outs["reward"], backend, **reward(assets)))})
    # data.streaming: each rank takes its slice of every global micro-batch of the stream, so the
    # steps see the examples one process sees.
    outs["stream"] = folder / "stream"
    cases.append({"recipe": str(write_recipe(assets, outs["stream"], backend, data__streaming=True))})
    # Resume the LoRA case's step-2 checkpoint under the same backend and process count.
    resumed = folder / "resumed"
    resume = {"output__resume": str(outs["lora"] / "checkpoints" / "step-2")}
    cases.append({"recipe": str(write_recipe(assets, resumed, backend, "lora", **resume))})
    if backend.startswith("fsdp"):
        outs["tied"] = folder / "tied"
        cases.append({"recipe": str(write_recipe(assets, outs["tied"], backend, "none", model="tied"))})
    if backend == "ddp":  # compared with the 1-process micro-batch 4 x accumulation 1 run
        for name in DDP_ACCUMULATION:
            cases.append({"recipe": str(write_recipe(assets, folder / name, backend, **split_step(name)))})
    return cases, outs, resumed


TRACKED = ["trackio", "wandb", "mlflow"]


def tracked_project(folder: Path) -> str:
    """A LoRA case's tracker project: its backend and the session's launch folder name it (the stores are the
    session's)."""
    return f"{folder.name}-lora-{folder.parents[1].name}"


def launch_part(root: Path) -> tuple[list[dict], dict]:
    """This file's cases of the shared 2-process launch (tests/conftest.py `two_process_launch`): every
    backend's cases, then FSDP-1's field failure. Per backend: its outputs, its resumed run, its recipes
    (rank 0 wrote each one's output beside it) and its folder."""
    assets = make_assets(root / "assets")
    cases, runs = [], {}
    for backend in BACKENDS:
        folder = root / backend
        folder.mkdir()
        backend_part, outs, resumed = backend_cases(assets, folder, backend)
        cases += backend_part
        runs[backend] = {"outs": outs, "resumed": resumed, "recipes": [Path(c["recipe"]) for c in backend_part],
                         "folder": folder}  # fmt: skip
    ff1 = write_recipe(assets, root / "fsdp1" / "ff1", "fsdp1", "none")
    cases.append({"check": "field_failure_1", "recipe": str(ff1)})
    return cases, runs


@pytest.fixture(scope="module")
def backend_runs(two_process_launch) -> dict[str, dict]:
    """Every backend's runs in the shared launch, with what rank 0 printed for each backend's cases."""
    runs = two_process_launch["test_distributed"]
    for run in runs.values():
        run["stdout"] = "".join(recipe.with_suffix(".stdout").read_text() for recipe in run["recipes"])
    return runs


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_make_one_tracker_run(backend: str, backend_runs) -> None:
    """Each backend's LoRA case reports to trackers (DDP: trackio, W&B and MLflow; FSDP-1, FSDP-2: trackio):
    exactly one run in each, holding every value of its metrics.jsonl (both ranks' steps, reduced) at its
    step, once (tests/test_trackers.py)."""
    from test_trackers import assert_one_run_each

    run = backend_runs[backend]
    out = run["outs"]["lora"]
    tracked = TRACKED if backend == "ddp" else ["trackio"]
    assert_one_run_each(out, tracked_project(run["folder"]), tracked)
    assert set(json.loads((out / "trackers.json").read_text())) == {*tracked, "logged"}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_train_the_one_process_model(backend: str, assets, references, backend_runs) -> None:
    """LoRA and full fine-tuning, with and without activation checkpointing, preference objectives, a
    reward model, streaming and a resume, under each backend (one 2-process launch: `backend_runs`)."""
    run = backend_runs[backend]
    outs, resumed, stdout = run["outs"], run["resumed"], run["stdout"]

    for name, out in outs.items():
        ref = references[name if name in references else "full" if name.startswith("full") else "lora"]
        if name == "reward":  # a sequence-classification model: its own checks
            assert_same_reward_run(out, ref)
            continue
        assert_same_run(out, ref)
        for key in ("rewards/margins", "logps/rejected", "eval_loss", "kl", "eval_kl"):  # all ranks' rows
            assert losses(out, key) == pytest.approx(losses(ref, key), abs=1e-4, rel=1e-5), (name, key)
        assert bool(losses(out, "rewards/margins")) == (name in preference_cases(assets))
        plan = (out / "plan.txt").read_text()
        assert f"({backend})" in plan and "2 on 1 machine(s)" in plan
        assert "fused_linear_cross_entropy: patched" in plan  # kernels on, FLCE inside the forward
        if CASES.get(name, ("", "off"))[1] == "auto":
            assert "activation ckpt     reentrant" in plan or "activation ckpt     non_reentrant" in plan
    got, want = (
        load_file(p / "reference_logps.safetensors") for p in (outs["dpo-full"], references["dpo-full"])
    )
    assert got.keys() == want.keys() == {"train", "eval"}  # both ranks' rows in the table rank 0 stored
    assert got["train"].shape == (34, 2) and got["eval"].shape == (6, 2)
    for split in got:
        torch.testing.assert_close(got[split], want[split], atol=1e-5, rtol=1e-6, msg=split)
    computed = [line for line in stdout.splitlines() if line.startswith("reference log-probs: computed")]
    assert len(computed) == 2 and all(f"under {backend}" in line for line in computed), computed  # dpo, kto
    assert max(losses(references["kto-full"], "kl")) > 0.1  # z0 above its clamp: the reduction counts
    assert losses(resumed) == pytest.approx(losses(outs["lora"])[2:], abs=1e-5, rel=0)
    got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (resumed, outs["lora"]))
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)
    others = len(DDP_ACCUMULATION) if backend == "ddp" else 0  # the split-step cases (test below)
    sharding = [line for line in stdout.splitlines() if line.startswith("sharding:")]
    assert len(sharding) == len(outs) + 1 + others
    # What is saved is what was trained: every case reloaded its final/ and compared it (verify.py).
    verified = [line for line in stdout.splitlines() if line.startswith("final model verified")]
    assert len(verified) == len(outs) + 1 + others, stdout[-3000:]
    if backend.startswith("fsdp"):
        assert all("LlamaDecoderLayer" in (outs[n] / "plan.txt").read_text() for n in ("lora", "lora-ac"))
        assert all("1/2" in line for line in sharding), sharding
        assert json.loads((outs["tied"] / "checks.json").read_text())["tied"]  # still one parameter
        tied = load_file(outs["tied"] / "final" / "model.safetensors")
        assert "model.embed_tokens.weight" in tied
    if backend == "fsdp1":
        message = (outs["lora"].parent / "ff1.ff1.txt").read_text()
        assert "size mismatch" in message or "shape" in message, message


ACCUMULATION_AGREES = (
    "note: accumulation check: micro-batch 4 x accumulation 1 vs 1 x 4 on a tiny twin "
    "(padding, uneven label counts): loss and every gradient agree"
)


def test_micro_batch_accumulation_and_processes_train_the_same_model(
    assets, references, backend_runs
) -> None:
    """How a step is split does not change the math, even where the micro-batch size changes (padding,
    each micro-batch's label count): 4 x 1 and 1 x 4 on one process and 1 x 2 on 2 DDP processes log
    the same losses and save the same adapter, on instruction data of uneven lengths and label counts."""
    rows = [json.loads(line) for line in assets["data"].read_text().splitlines()]
    assert len({len(r["output"]) for r in rows[:16]}) > 4  # uneven label counts: padding is needed
    reference = references["mb4-acc1"]
    runs = [references["mb1-acc4"], *(backend_runs["ddp"]["folder"] / name for name in DDP_ACCUMULATION)]
    for out in runs:
        assert_same_run(out, reference)  # losses within 1e-5, adapters within 2e-5
    for out in (reference, *runs):
        assert ACCUMULATION_AGREES in (out / "plan.txt").read_text()


@pytest.mark.timeout(600)
def test_a_killed_rank_ends_the_job_and_is_named(assets, tmp_path: Path) -> None:
    """Rank 1 killed mid-run: the job ends (within the wait's timeout, not hanging) and says which rank
    died. The waits are generous: this file runs beside another worker's 2-process runs."""
    import psutil

    recipe = write_recipe(assets, tmp_path / "out", "ddp", training__max_steps=100000)
    job = subprocess.Popen([sys.executable, "-m", "liger_cli", "train", str(recipe), "--set",
                            f"distributed.main_process_port={free_port()}"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())  # fmt: skip
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert job.poll() is None and time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        ranks = [
            p for p in psutil.Process(job.pid).children(recursive=True) if p.environ().get("RANK") == "1"
        ]
        assert len(ranks) == 1
        ranks[0].send_signal(signal.SIGKILL)
        _, stderr = job.communicate(timeout=150)  # a job that hangs on its dead rank fails here
    finally:
        if job.poll() is None:
            for child in psutil.Process(job.pid).children(recursive=True):
                child.kill()
            job.kill()
    assert job.returncode == 1
    assert "rank 1 died without a report" in stderr, stderr[-3000:]
    assert "the 2-process run failed" in stderr


def test_multi_machine_command(assets, tmp_path: Path) -> None:
    """A 2-machine recipe passes machine count, rank, address and port to accelerate, as an argv list."""
    from liger_cli.launch.multiprocess import accelerate_config, launch_argv, launch_env
    from liger_cli.plan import build_plan
    from liger_cli.recipe import load_recipe

    recipe_path = write_recipe(assets, tmp_path / "out", "fsdp1")
    recipe = load_recipe(recipe_path, ["distributed.num_machines=2", "distributed.machine_rank=1",
                                       "distributed.main_process_ip=10.0.0.7", "distributed.main_process_port=29511"])  # fmt: skip
    plan = build_plan(recipe)
    argv = launch_argv(recipe, plan, recipe_path, ["training.lr=1e-4"], tmp_path / "acc.yaml")
    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    flags = dict(zip(argv[3:], argv[4:], strict=False))
    assert flags["--config_file"] == str(tmp_path / "acc.yaml")
    assert flags["--num_processes"] == "4" and flags["--num_machines"] == "2"  # 2 per machine, 4 in all
    assert flags["--machine_rank"] == "1" and flags["--main_process_ip"] == "10.0.0.7"
    assert flags["--main_process_port"] == "29511"
    assert argv[-6:] == ["-m", "liger_cli", "train", str(recipe_path.resolve()), "--set", "training.lr=1e-4"]
    config = accelerate_config(recipe, plan)
    assert (config["num_machines"], config["machine_rank"], config["main_process_ip"]) == (2, 1, "10.0.0.7")
    assert launch_env(plan)["ACCELERATE_USE_CPU"] == "1"


@pytest.mark.timeout(600)
def test_a_run_with_fewer_processes_than_the_recipe_stops(assets, tmp_path: Path) -> None:
    """A launcher that starts ONE process for a 2-process recipe: refused before training, not run."""
    recipe = write_recipe(assets, tmp_path / "out", "fsdp1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
            str(free_port()), "-m", "liger_cli", "train", str(recipe)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=500, env=child_env())
    assert proc.returncode != 0
    assert "asks for 2 processes but this run has 1" in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def two_machines(
    recipe: Path, port: int, *overrides: str, procs: int = 1
) -> list[subprocess.CompletedProcess]:
    """`liger launch --nodes 2 --procs PROCS --main-ip 127.0.0.1`'s two commands, run at once as two `liger
    train` processes: each is one machine, its own `accelerate launch --num_machines 2 --machine_rank R`.
    Machine 0 is forked warm (warm_python, from one other thread), machine 1 a plain process writing to a
    file (a full pipe would stop it, and machine 0 would wait on it)."""
    import threading

    from liger_cli.launch.nodes import Job

    job = Job(2, procs, "127.0.0.1", port)
    argv = [["-m", "liger_cli", *job.command(recipe, list(overrides), rank)[1:]] for rank in (0, 1)]
    first: list = []
    thread = threading.Thread(
        target=lambda: first.append(warm_python.run(argv[0], env=child_env(), timeout=500))
    )
    log = recipe.with_name(f"{recipe.stem}-{port}.machine1")
    with open(log, "w") as sink:
        second = subprocess.Popen(
            [sys.executable, *argv[1]], env=child_env(), stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        thread.start()
        code = second.wait(timeout=500)
        thread.join(timeout=500)
    finally:
        second.kill()
    assert first, "machine 0 did not finish"
    done = first[0]
    return [subprocess.CompletedProcess(done.args, done.returncode, done.stdout + done.stderr, ""),
            subprocess.CompletedProcess(second.args, code, log.read_text(), "")]  # fmt: skip


@pytest.mark.timeout(1200)
def test_two_machines_and_each_launcher_give_the_same_run(
    assets, references, backend_runs, tmp_path: Path
) -> None:
    """Two "machines" on this one (FSDP-2, one process each): the same losses and adapter as the shared
    launch's 2-process FSDP-2 run and as 1 process, metrics and checkpoints written once (by global rank
    0, into the folder both machines see). Their step-2 checkpoint then resumed on one machine through
    `torchrun -m liger_cli` and through `accelerate launch -m liger_cli`: the same steps 3-4 and adapter."""
    from test_trackers import assert_one_run_each

    out = tmp_path / "two-machines"
    project = f"two-machines-{tmp_path.name}"  # one trackio run for the job, from global rank 0
    recipe = write_recipe(assets, out, "fsdp2", output__save_every=2, logging__report_to=["trackio"],
                          logging__project=project)  # fmt: skip
    for machine in two_machines(recipe, free_port()):
        assert machine.returncode == 0, machine.stdout[-3000:]
    assert_one_run_each(out, project, ["trackio"])
    assert_same_run(out, backend_runs["fsdp2"]["outs"]["lora"])
    assert_same_run(out, references["lora"])
    assert "2 on 2 machine(s)" in (out / "plan.txt").read_text()
    metrics = (out / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == len((references["lora"] / "metrics.jsonl").read_text().splitlines())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]

    checkpoint = out / "checkpoints" / "step-2"
    launchers = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
        "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"],
    }  # fmt: skip
    for name, launcher in launchers.items():
        resumed = tmp_path / name
        port = ["--master_port" if name == "torchrun" else "--main_process_port", str(free_port())]
        argv = [*launcher, *port, "-m", "liger_cli", "train", str(recipe),
                "--set", f"output.dir={resumed}", "--set", f"output.resume={checkpoint}"]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=child_env())
        assert proc.returncode == 0, name + proc.stderr[-5000:]
        assert f"resumed from {checkpoint} at step 2" in proc.stdout
        assert losses(resumed) == pytest.approx(losses(out)[2:], abs=1e-5, rel=0), name
        got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (resumed, out))
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


def liger_train(recipe: Path, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return warm_python.run(["-m", "liger_cli", "train", recipe, *args], timeout=timeout, env=child_env())
