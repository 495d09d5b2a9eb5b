"""What each command imports before it works: `liger --help` only its CLI layer (its speed against
typer's own import is measured, not asserted: `python bench/startup.py`), `liger data` and `liger
train` only the stages they use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_train import liger_here

REPO = Path(__file__).resolve().parents[1]
# What made --help slow when it happened (5x typer's import and more): any of these at startup.
HEAVY = ("torch", "transformers", "peft", "accelerate", "datasets", "triton", "numpy", "liger_kernels")


def test_help_imports_the_cli_layer_and_nothing_heavy(tmp_path) -> None:
    """`liger --help` (and a subcommand's) imports typer and liger's CLI, nothing of torch, transformers
    or the stages: the cause of a slow --help, checked without a clock."""
    for argv in (["-m", "liger_cli", "--help"], ["-m", "liger_cli", "train", "--help"]):
        heavy = {m for m in _imported(argv, tmp_path) if m.split(".")[0] in HEAVY}
        assert heavy == set(), (argv, sorted(heavy))


def test_the_startup_benchmark_measures_both_commands() -> None:
    """bench/startup.py (the ratio quoted in the docs) runs and reports both timings; no limit asserted."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "startup.py"), "--runs", "2", "--json"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["best_s"]["typer_import"] > 0 and len(result["all_s"]["liger_help"]) == 2
    assert result["ratio"] == result["best_s"]["liger_help"] / result["best_s"]["typer_import"]


def _imported(argv: list[str], cwd: Path) -> set[str]:
    """The modules a process imports (`python -X importtime`), which must exit 0."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return {
        line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")
    } - {"imported package"}


def test_cached_liger_data_imports_only_what_its_work_needs(tmp_path) -> None:
    """On a cached entry `liger data` imports what tokenizing needs (datasets, the tokenizer through
    transformers, numpy, pyarrow, yaml, pydantic, rich) and its own CLI layer, nothing else: no peft,
    accelerate, kernels or model code."""
    recipe = REPO / "recipes" / "quickstart.yaml"
    cache = ["--set", f"data.cache_dir={tmp_path / 'cache'}"]
    liger = ["-m", "liger_cli", "data", str(recipe), *cache]
    first = liger_here("data", str(recipe), *cache)  # fills the cache; in this process (no 8 s of imports)
    assert first.returncode == 0, first.stderr
    used = _imported(liger, tmp_path)
    model = REPO / "recipes" / "quickstart" / "model"
    bare = _imported(["-c", "import datasets, numpy, pyarrow, pydantic, rich, yaml\n"
                      f"from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained({str(model)!r})"],
                     tmp_path)  # fmt: skip
    cli_layer = _imported(["-c", "import typer, annotated_types"], tmp_path)

    def top(names: set[str]) -> set[str]:
        return {name.split(".")[0] for name in names} - set(sys.stdlib_module_names)

    assert top(used) - top(bare | cli_layer) == {"liger_cli"}, sorted(top(used) - top(bare | cli_layer))
    assert not {m for m in used if m.startswith(("liger_cli.model", "liger_cli.run", "liger_cli.plan"))}


STOP_AT_DATA = """
import os, sys
import liger_cli.run.train as train
from liger_cli.cli import app

def data_ready(*args, **kwargs):
    train_load_data(*args, **kwargs)
    print(" ".join(sorted(name for name, module in sys.modules.items() if module is not None)))
    os._exit(0)

train_load_data, train.load_data = train.load_data, data_ready
sys.argv = ["liger", "train", *sys.argv[1:]]
app()
"""


def test_train_imports_no_stage_it_does_not_use_before_the_data_is_ready(tmp_path) -> None:
    """Before its data is ready an SFT run has built its Plan (the twin's proofs: torch, transformers,
    peft, the kernels, the generation engine for the greedy check) and its accelerator, and imported
    nothing of serving, merging, benchmarks, DeepSpeed, TRL or bitsandbytes (the run quantizes
    nothing), nor the run's sampler and samples."""
    recipe = REPO / "recipes" / "quickstart.yaml"
    sets = ["--set", f"output.dir={tmp_path / 'out'}", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run([sys.executable, "-c", STOP_AT_DATA, str(recipe), *sets],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = set(proc.stdout.split())
    assert {"liger_cli.run.train", "liger_cli.data", "peft", "accelerate"} <= modules
    # bitsandbytes, installed here, would come with `import peft` itself: an unquantized run hides it
    unused = ("liger_cli.serve", "liger_cli.merge", "liger_cli.bench", "deepspeed", "trl", "bitsandbytes")
    assert not {"liger_cli.run.online", "liger_cli.run.samples"} & modules
    assert not {m for m in modules if m.startswith(unused)}, sorted(
        m for m in modules if m.startswith(unused)
    )
