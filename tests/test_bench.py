"""`liger bench` (two fresh training processes compared) and the kernel micro-benchmarks.

Speed is not asserted (it depends on the machine and its load); these tests check behaviour: both
runs happen with the kernels they should have, the report and chart are written, disagreeing losses
exit 1, and the micro-benchmark measures and writes its CSV and PNG.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python

from liger_cli.bench import RunResult, bench, compare
from liger_cli.errors import UserError

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_recipe(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A LoRA recipe on the tiny Llama with 16 text rows: a step takes milliseconds."""
    root = tmp_path_factory.mktemp("bench-recipe")
    rows = [{"text": f"number {i} is written {i * 7} and then {i * 13} follows it."} for i in range(16)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = root / "recipe.yaml"
    recipe.write_text(
        f"model:\n  path: {tiny_model_dir}\n  dtype: float32\n"
        "data:\n  train: train.jsonl\n  max_seq_len: 32\n"
        "training:\n  micro_batch_size: 2\n  precision: fp32\n  max_steps: 50\n"
        "adapter:\n  r: 4\n"
        f"output:\n  dir: {root / 'run'}\n"
    )
    return recipe


def _steps(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def cli_bench(tiny_recipe: Path, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`liger bench` through the real command line, once: 1 warm-up + 2 measured steps per variant."""
    out = tmp_path_factory.mktemp("cli-bench") / "bench"
    proc = warm_python.run(
        ["-m", "liger_cli", "bench", tiny_recipe, "--steps", "2", "--warmup", "1", "--out", out], timeout=480
    )
    return proc, out


def test_bench_runs_both_variants_and_writes_report(cli_bench) -> None:
    proc, out = cli_bench
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "bench.json").read_text())
    assert set(report["runs"]) == {"kernels_on", "kernels_off"}
    for variant, run in report["runs"].items():
        # W + N steps were trained, every one logged, and the N after the warm-up measured.
        assert [r["step"] for r in _steps(out / variant / "metrics.jsonl")] == [1, 2, 3]
        assert run["measured_steps"] == 2
        assert run["step_time_s"] > 0 and run["tokens_per_s"] > 0 and run["peak_mem_mb"] > 0
    # The kernels really were on in one run and off in the other (each run's own plan says so).
    assert "fused_linear_cross_entropy: patched" in (out / "kernels_on" / "plan.txt").read_text()
    assert "none (all kernels off" in (out / "kernels_off" / "plan.txt").read_text()
    assert report["runs"]["kernels_on"]["kernels"] == [
        "rms_norm",
        "rope",
        "swiglu",
        "fused_linear_cross_entropy",
    ]
    on, off = report["runs"]["kernels_on"], report["runs"]["kernels_off"]
    assert report["ratios"]["step_time"] == pytest.approx(on["step_time_s"] / off["step_time_s"])
    assert report["ratios"]["peak_mem"] == pytest.approx(on["peak_mem_mb"] / off["peak_mem_mb"])
    loss = report["first_step_loss"]
    assert loss["agree"] and loss["rel_diff"] < 1e-4
    assert loss["kernels_on"] == pytest.approx(_steps(out / "kernels_on" / "metrics.jsonl")[0]["loss"])
    assert report["device"] == "cpu" and report["exit_code"] == 0
    assert "verdict: kernels on:" in proc.stdout and "on / off" in proc.stdout
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_disagreeing_first_losses_exit_1(cli_bench, tiny_recipe: Path, tmp_path: Path, monkeypatch) -> None:
    """A different seed for the kernels-off run gives different initial weights: a real disagreement.
    Run as on a plain install (matplotlib is an extra): the chart is skipped with a one-line note.
    The kernels-on run is the one `liger bench` made above (same recipe, steps and warm-up), copied in;
    the kernels-off run with seed 7 is trained here, in a fresh process as always."""
    import shutil

    compare_module = sys.modules["liger_cli.bench.compare"]  # the attribute `compare` is report.compare
    _, made = cli_bench
    real_run_variant, ran = compare_module.run_variant, []

    def run_variant(recipe_path, overrides, variant, out_dir):
        ran.append((variant, overrides))
        if variant == "kernels_off":
            return real_run_variant(recipe_path, overrides, variant, out_dir)
        shutil.copytree(made / variant, out_dir / variant)
        worker = json.loads((made / f"{variant}.worker.json").read_text())
        return {"exit_code": 0, "wall_s": 1.0, "log": str(made / f"{variant}.log"), **worker}

    monkeypatch.setattr(compare_module, "run_variant", run_variant)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    printed: list[str] = []
    code = bench(
        tiny_recipe,
        [],
        steps=2,
        warmup=1,
        out_dir=tmp_path,
        off_overrides=["training.seed=7"],
        echo=printed.append,
    )
    assert [variant for variant, _ in ran] == ["kernels_on", "kernels_off"]
    assert "training.seed=7" in ran[1][1] and "training.seed=7" not in ran[0][1]  # the off run only
    assert code == 1
    assert "error: CORRECTNESS FAILURE: the first-step losses differ" in printed[-1]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["first_step_loss"]["agree"] is False and report["exit_code"] == 1
    assert any("no chart: matplotlib is not installed" in line for line in printed)
    assert not (tmp_path / "bench.png").exists()


def _run(loss: float, seconds: float, memory: float) -> RunResult:
    return RunResult("x", [], loss, seconds, 1000 / seconds, memory, 3, 1.0)


def test_compare_tolerance_and_verdicts() -> None:
    base = _run(2.0, 1.0, 1000.0)
    assert compare(_run(2.0001, 1.0, 1000.0), base, "fp32").losses_agree  # 5e-5 relative: rounding
    assert not compare(_run(2.001, 1.0, 1000.0), base, "fp32").losses_agree  # 5e-4: a real difference
    assert compare(_run(2.001, 1.0, 1000.0), base, "bf16").losses_agree  # half precision rounds more
    faster = compare(_run(2.0, 0.8, 500.0), base, "fp32")
    assert faster.exit_code == 0 and faster.ratios["step_time"] == pytest.approx(0.8)
    assert faster.verdict == "kernels on: 20% less step time, 50% less peak memory: keep the kernels on"
    slower = compare(_run(2.0, 1.2, 500.0), base, "fp32").verdict
    assert "20% more step time" in slower and "keep them on if memory limits" in slower
    assert "turn the kernels off" in compare(_run(2.0, 1.2, 1200.0), base, "fp32").verdict
    assert "the same step time" in compare(_run(2.0, 1.01, 1000.0), base, "fp32").verdict


def test_user_errors(tiny_recipe: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--steps 0"):
        bench(tiny_recipe, [], steps=0, warmup=1, out_dir=tmp_path)
    off = [f"kernels.{k}=false" for k in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy")]
    with pytest.raises(UserError, match="every kernel is off"):
        bench(tiny_recipe, off, steps=1, warmup=0, out_dir=tmp_path)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match="is a file"):
        bench(tiny_recipe, [], steps=1, warmup=0, out_dir=tmp_path / "a-file")


# ------------------------------------------------------------------------------ micro-benchmarks


def _kernels_module():
    spec = importlib.util.spec_from_file_location("bench_kernels", REPO / "bench" / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux /proc")
def test_cpu_memory_measure_sees_a_temporary_tensor() -> None:
    import torch

    memory = _kernels_module().Memory("cpu")
    big = torch.ones(64 * 2**18)  # 64 MiB, freed again: the peak must still see it
    del big
    base = memory.start()
    tmp = torch.ones(32 * 2**18)  # 32 MiB
    del tmp
    assert memory.peak() - base == pytest.approx(32, abs=4)


def test_micro_benchmark_writes_csv_and_png(tmp_path: Path, capsys) -> None:
    """bench/kernels.py's main, in this process; it measures each kernel in a fresh worker process of
    the script, as on the command line."""
    code = _kernels_module().main(
        ["--kernels", "rms_norm", "--sizes", "small", "--variants", "ours,eager", "--repeats", "1",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    with (tmp_path / "kernels-cpu-float32.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["mode"], r["variant"]) for r in rows} == {
        (m, v) for m in ("forward", "forward_backward") for v in ("ours", "eager")
    }
    for r in rows:
        assert r["device"] == "cpu" and r["kernel"] == "rms_norm" and not r["error"]
        assert float(r["ms"]) > 0 and float(r["peak_mb"]) >= 0
        assert float(r["max_rel_diff_vs_eager"]) < 1e-5  # ours computes the same numbers as eager
    assert {r["path"] for r in rows if r["variant"] == "ours"} == {"torch"}
    assert (tmp_path / "kernels-cpu-float32.png").read_bytes()[:8] == PNG_MAGIC
