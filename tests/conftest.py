"""Shared fixtures: tiny models saved to disk and loaded back through the real from_pretrained path."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Triton's CPU interpreter must be chosen before triton is first imported anywhere in this process.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests must never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny tensors: one math thread per process. Two test workers (and the 2-process runs they start) on
# two cores would otherwise each spin a thread per core against the others.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tokenized-data cache of every test (and of every process a test starts) lives in a throwaway
# folder, never in the user's cache.
if "LIGER_CACHE" not in os.environ or not os.environ["LIGER_CACHE"].startswith(tempfile.gettempdir()):
    os.environ["LIGER_CACHE"] = tempfile.mkdtemp(prefix="liger-test-cache-")
    atexit.register(shutil.rmtree, os.environ["LIGER_CACHE"], ignore_errors=True)

# The experiment trackers (logging.report_to) of every test and every process a test starts: offline,
# their stores in one throwaway folder (each test run a project of its own), no telemetry: nothing
# reaches a tracker's server, the network or the home folder.
if not os.environ.get("TRACKIO_DIR", "").startswith(tempfile.gettempdir()):
    _trackers = tempfile.mkdtemp(prefix="liger-test-trackers-")
    atexit.register(shutil.rmtree, _trackers, ignore_errors=True)
    os.environ.update(
        TRACKIO_DIR=os.path.join(_trackers, "trackio"), WANDB_MODE="offline", WANDB_DIR=_trackers,
        WANDB_CACHE_DIR=os.path.join(_trackers, "wandb-cache"), WANDB_CONFIG_DIR=os.path.join(_trackers, "wandb-config"),
        WANDB_DATA_DIR=os.path.join(_trackers, "wandb-data"), MLFLOW_TRACKING_URI=f"sqlite:///{_trackers}/mlflow.db",
        MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="1", GRADIO_ANALYTICS_ENABLED="False",
    )  # fmt: skip

REPO = Path(__file__).resolve().parents[1]

# The suite runs on pytest-xdist workers (pyproject's addopts), each test file whole on one worker.
# Seconds each of the slowest files took in the last measured run (docs/testing.md; the files cut since
# then scaled by their measured before/after, until the next full run): they start first,
# so the last file to start is a short one and both workers finish together. A file not listed starts
# after these, in alphabetical order.
SLOW_FILES: dict[str, int] = {
    "test_deepspeed.py": 407,  # the first test to ask for the shared 2-process launch waits for all of it
    "test_vllm_engine.py": 320,  # 155 s quiet before 5 runs were added (656 s -n 0 beside two benches: load 4-5); +4 runs
    "test_async_rl.py": 80,  # -n 0 quiet: 49 s for its runs in one process, the resume and the one-line errors; the bench 15 s
    "test_real_model_commands.py": 150,  # -n 0, load 4-5 on 2 cores: 125 CPU s, llama.cpp's 53 included
    "test_real_model_train.py": 146,  # -n 0, a loaded 2-core machine (load 6): its runs in one process
    "test_distributed.py": 146,
    "test_grpo_train.py": 106,
    "test_generate_cli.py": 97,
    "test_resume.py": 92,
    "test_memory_plan.py": 88,
    "test_bench.py": 78,
    "test_preference_train.py": 74,
    "test_vlm_model.py": 63,
    "test_trackers.py": 55,  # -n 0: 46 s quiet, 71 s loaded; its six runs in one process (trackers' starts included)
    "test_qlora.py": 51,
    "test_vlm_memory_plan.py": 44,
    "test_agent_train.py": 44,
    "test_startup.py": 43,
    "test_saved_is_trained.py": 38,
    "test_vlm_generate.py": 38,
    "test_vlm_wrap.py": 37,
    "test_reference_logps.py": 33,
    "test_kernel_sweep.py": 28,
    "test_train.py": 28,
    "test_data_cache.py": 26,
    "test_vision_recipe.py": 24,
    "test_kernel_check.py": 22,
    "test_vlm_kernels.py": 22,
    "test_inspect.py": 21,
    "test_wrap.py": 20,
    "test_kto.py": 18,
}


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: two workers (one where the machine has one core). More has not been proven stable next
    to the 2-process gloo tests; PYTEST_XDIST_AUTO_NUM_WORKERS overrides, `-n 0` runs in one process."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(2, cores)


# The files whose 2-process runs share ONE launch of tests/dist_driver.py (each launch costs ~20 CPU s of
# imports and process-group set-up in every process): each defines `launch_part(root) -> (cases,
# found)`, and its tests read `found` from the `two_process_launch` fixture below. The scheduler below
# keeps them on one worker, so the launch runs once.
TWO_PROCESS_FILES = (  # in the launch's order (test_memory_plan's case first: it measures memory)
    "test_memory_plan", "test_distributed", "test_grpo_backends", "test_qlora", "test_generate_backends", "test_vlm_distributed",
    "test_sequence_parallel", "test_deepspeed",
)  # fmt: skip
LAUNCH_TIMEOUT = 2400


def work_unit(path: Path) -> str:
    """What one worker runs whole: a test file, or all of TWO_PROCESS_FILES together."""
    return "two-process files" if path.stem in TWO_PROCESS_FILES else path.name


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with TWO_PROCESS_FILES one unit. (xdist's `loadgroup` would say the same with
    marks, but its way of naming a group, editing each test's node id, does nothing under pytest 9.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndTheLaunch(LoadScopeScheduling):
        dropped: dict[str, list[str]] = {}
        """A dead worker's test -> the rest of its work unit, failed without running (pytest_handlecrashitem)."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(Path(nodeid.split("::", 1)[0]))

        def remove_node(self, node) -> str | None:
            """xdist puts a dead worker's file back in the queue whole, to start again on the replacement
            (where it may die again, or wait on a launch that died with it); here it fails at once, and
            only the files the worker had not started go back."""
            workload = self.assigned_work.pop(node)
            crashed = None
            for scope, unit in workload.items():
                pending = [nodeid for nodeid, done in unit.items() if not done]
                if not pending:
                    continue
                if crashed is None:  # a worker runs its units in order: the first pending test was running
                    crashed = pending[0]
                    self.dropped[crashed] = pending[1:]
                elif len(pending) == len(unit):
                    self.workqueue[scope] = unit
                else:
                    self.dropped[crashed] += pending
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return FilesAndTheLaunch(config, log)


# --- a worker that dies fails its file at once; a test that hangs fails by name ---------------------------
# pytest-timeout fails a test past its timeout (pyproject's `timeout`, or its mark) with SIGALRM, naming it.
# Where that signal cannot reach (native code that never gives Python back control), faulthandler's
# watchdog, a C thread, ends the process HANG_GRACE seconds later, its stacks written to the worker's
# crash file. A worker that dies so, or of a signal, an out-of-memory kill or an exit, is reported by the
# controller (`pytest_handlecrashitem`) as a failure of the test it was running, with how it died and
# its stacks; the rest of that test's file fails without running (its fixtures died with the worker);
# the other files go on and the run ends with pytest's summary.
if "LIGER_TEST_CRASH_DIR" not in os.environ:  # the controller's, which its workers inherit
    os.environ["LIGER_TEST_CRASH_DIR"] = tempfile.mkdtemp(prefix="liger-test-crashes-")
    atexit.register(shutil.rmtree, os.environ["LIGER_TEST_CRASH_DIR"], ignore_errors=True)
CRASH_DIR = Path(os.environ["LIGER_TEST_CRASH_DIR"])
HANG_GRACE = float(os.environ.get("LIGER_TEST_HANG_GRACE", "60"))
_crash_file = []  # a worker's (with -n 0, stderr is where faulthandler writes)


def _worker_id(config) -> str:
    return getattr(config, "workerinput", {}).get("workerid", "main")


def pytest_sessionstart(session) -> None:  # after pytest's faulthandler plugin pointed it at stderr
    import faulthandler

    config = session.config
    if hasattr(config, "workerinput"):
        CRASH_DIR.mkdir(parents=True, exist_ok=True)
        _crash_file.append(open(CRASH_DIR / f"{_worker_id(config)}.txt", "w"))  # noqa: SIM115 - for its life
        faulthandler.enable(file=_crash_file[0], all_threads=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler

    mark = item.get_closest_marker("timeout")
    seconds = float(mark.args[0]) if mark and mark.args else float(item.config.getini("timeout") or 0)
    out = _crash_file[0] if _crash_file else sys.stderr
    if _crash_file:
        out.write(f"running {item.nodeid}\n")
        out.flush()
    if seconds:
        faulthandler.dump_traceback_later(seconds + HANG_GRACE, exit=True, file=out)
    yield
    faulthandler.cancel_dump_traceback_later()


def pytest_handlecrashitem(crashitem: str, report, sched) -> None:
    """The dead worker's test failed with how its process ended and its stacks; the rest of its file too."""
    worker = report.node
    name = worker.gateway.id
    how = "it ended"
    popen = getattr(getattr(worker.gateway, "_io", None), "popen", None)
    if popen is not None:
        import signal
        import subprocess

        try:
            code = popen.wait(timeout=10)
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        except (subprocess.TimeoutExpired, ValueError):
            pass
    found = CRASH_DIR / f"{name}.txt"
    stacks = found.read_text(errors="replace") if found.is_file() else ""
    stacks = stacks[stacks.rfind(f"running {crashitem}") :].partition("\n")[2]
    why = "past its timeout (stuck where SIGALRM cannot reach)" if "Timeout (" in stacks else how
    report.longrepr = f"worker {name} died while running {crashitem}: {why}\n{stacks[-6000:]}"
    for nodeid in getattr(sched, "dropped", {}).pop(crashitem, []):
        rest = pytest.TestReport(
            nodeid=nodeid, location=(nodeid.split("::")[0], None, nodeid), keywords={}, outcome="failed",
            longrepr=f"not run: worker {name} died while running {crashitem} ({why}) in this file", when="call",
        )  # fmt: skip
        rest.node = worker
        worker.config.hook.pytest_runtest_logreport(report=rest)


def pytest_collection_modifyitems(items) -> None:
    """The slowest work units first (a stable sort: each file's tests keep their order); a test that
    needs the shared launch may wait for all of it."""
    weight: dict[str, int] = {}
    for name in {item.path.name for item in items}:
        unit = work_unit(Path(name))
        weight[unit] = weight.get(unit, 0) + SLOW_FILES.get(name, 0)
    for item in items:
        if "two_process_launch" in item.fixturenames:
            item.add_marker(pytest.mark.timeout(LAUNCH_TIMEOUT + 600), append=False)
    items.sort(key=lambda item: (-weight[work_unit(item.path)], work_unit(item.path)))


@pytest.fixture(scope="session")
def two_process_launch(tmp_path_factory) -> dict[str, object]:
    """Every TWO_PROCESS_FILES file's cases in ONE 2-process launch, DeepSpeed's last (it keeps
    process-wide state: nothing runs after it); accelerate's state is reset between runs. Returns what
    each file's `launch_part` said its tests read, by file, and under "stdout" what the launch printed."""
    import importlib
    import importlib.util

    import yaml
    from test_distributed import run_driver

    root = tmp_path_factory.mktemp("two-processes")
    cases, found = [], {}
    for name in TWO_PROCESS_FILES:
        if name == "test_deepspeed" and importlib.util.find_spec("deepspeed") is None:
            continue  # its tests skip (scripts/setup.sh installs DeepSpeed)
        part, found[name] = importlib.import_module(name).launch_part(root / name)
        cases += part

    def order(case: dict) -> tuple[bool, bool]:  # DeepSpeed's checks after its runs: no run ends a check
        deepspeed = yaml.safe_load(Path(case["recipe"]).read_text())["distributed"]["backend"] == "deepspeed"
        return deepspeed, deepspeed and "check" in case

    cases.sort(key=order)
    found["stdout"] = run_driver({"cases": cases}, root, nproc=2, timeout=LAUNCH_TIMEOUT).stdout
    return found


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder: real weights, a 49,152-token tokenizer and its chat
    template. scripts/real_model.py builds it once per machine (scripts/setup.sh prepares it), here if the
    set-up has not; loaded from its path under a name of its own (scripts/ may be on sys.path too)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "liger_scripts_real_model", REPO / "scripts" / "real_model.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.build(script.folder())


@pytest.fixture(scope="module")
def tokenizer(real_model: Path):
    """The real model's tokenizer (real-model tests; a module's own `tokenizer` fixture overrides it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model)


def causal_lm(path: Path, adapter: Path | None = None):
    """An independent reference: a fresh fp32 transformers model from `path`, with peft's adapter on it
    (peft wraps its model in place: each reference loads its own)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


QUICKSTART_MODEL = REPO / "recipes" / "quickstart" / "model"


def tiny_llama_settings(tokenizer) -> dict:
    """Config sizes of the tests' tiny models (2 layers, hidden 32) and the tokenizer's special ids."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny causal LM of `model_type` with the quickstart tokenizer, saved with save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    config = AutoConfig.for_model(model_type, **{**tiny_llama_settings(tokenizer), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama (hidden 32) with the quickstart tokenizer, on disk."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


REMOTE_CODE = Path(__file__).resolve().parent / "fixtures" / "scaled_llama"


def save_remote_code_model(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny remote-code model (tests/fixtures/scaled_llama: Llama with an MLP multiplier and a logit
    multiplier) with the quickstart tokenizer, saved as a Hub repo would hold it: code + auto_map."""
    import json
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    for source in REMOTE_CODE.glob("*.py"):
        shutil.copy(source, path / source.name)
    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    settings = dict(
        model_type="scaled_llama",
        architectures=["ScaledLlamaForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_scaled_llama.ScaledLlamaConfig",
            "AutoModelForCausalLM": "modeling_scaled_llama.ScaledLlamaForCausalLM",
        },
        **tiny_llama_settings(tokenizer),
        mlp_multiplier=0.5,
        logit_multiplier=2.0,
    )
    settings.update(overrides)
    (path / "config.json").write_text(json.dumps(settings))
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
