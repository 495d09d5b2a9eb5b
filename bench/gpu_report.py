"""The GPU report behind `bash bench/gpu.sh`: every GPU test, the kernel sweep with its peers, and a
kernels on/off A/B of a real training step, written as one markdown file with the GPU's name.

Each step runs in its own process and is recorded even when it fails; the exit code is 1 if any
test or step failed. Targets checked from the sweep: Triton RMSNorm forward at >= 85% of the HBM
bandwidth, and the fused linear cross-entropy faster than eager at <= 0.25x its memory.

    TRITON_INTERPRET=0 python bench/gpu_report.py --out bench/results
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The kernels compiled for the GPU, and whole training runs on it (test_train.py: on a CUDA machine
# its runs train on the GPU, final check included, which no CPU test can cover).
GPU_TESTS = [
    "tests/test_kernels_triton.py",
    "tests/test_flce_numerics.py",
    "tests/test_kernels_torch.py",
    "tests/test_train.py",
]
AB_RECIPE = "recipes/bench-gpu.yaml"
# Peak HBM bandwidth (GB/s) by name, for when torch does not report the memory clock and bus width.
HBM_GB_S = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
            "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10": 600}  # fmt: skip


def run(argv: list[str], timeout: int, env: dict | None = None) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        done = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, out = 124, f"timed out after {timeout} s\n{err.stdout or ''}"
    return code, out, time.perf_counter() - start


def gpu_facts() -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    else:
        bandwidth = next((v for k, v in HBM_GB_S.items() if k in props.name), float("nan"))
    import triton

    return {
        "name": props.name,
        "memory_gib": props.total_memory / 2**30,
        "hbm_gb_s": bandwidth,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def sweep_table(rows: list[dict]) -> list[str]:
    lines = [
        "| kernel | size | mode | variant | ms | MiB | time / eager | memory / eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| {r['kernel']} | {r['size']} | {r['mode']} | {r['variant']} | {r['error']} | | | |"
            )
            continue
        lines.append(
            f"| {r['kernel']} | {r['size']} | {r['mode']} | {r['variant']} | {r['ms']} | {r['peak_mb']} | "
            f"{r.get('time_vs_eager') or '-'} | {r.get('mem_vs_eager') or '-'} |"
        )
    return lines


def targets(rows: list[dict], hbm_gb_s: float, dtype_bytes: int) -> list[str]:
    """The issue's GPU targets, computed from the sweep's rows."""
    lines = []
    for r in rows:
        if (r["kernel"], r["variant"], r["mode"]) == ("rms_norm", "ours", "forward") and r.get("ms"):
            tokens, hidden = (int(n) for n in r["size"].split("x"))
            moved = 2 * tokens * hidden * dtype_bytes + hidden * dtype_bytes  # read x, write y, read w
            achieved = moved / (float(r["ms"]) / 1e3) / 1e9
            lines.append(
                f"- RMSNorm forward {r['size']}: {achieved:.0f} GB/s = {100 * achieved / hbm_gb_s:.0f}% of "
                f"{hbm_gb_s:.0f} GB/s (target >= 85%)"
            )
    for r in rows:
        if (r["kernel"], r["variant"], r["mode"]) == (
            "fused_linear_cross_entropy",
            "ours",
            "forward_backward",
        ):
            if r.get("time_vs_eager") and r.get("mem_vs_eager"):
                t, m = float(r["time_vs_eager"]), float(r["mem_vs_eager"])
                verdict = "met" if t < 1.0 and m <= 0.25 else "NOT met"
                lines.append(
                    f"- FLCE fwd+bwd {r['size']}: {t:.2f}x eager time, {m:.2f}x eager memory "
                    f"(target < 1x time at <= 0.25x memory): {verdict}"
                )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--ab-steps", type=int, default=10)
    parser.add_argument("--sweep-variants", help="bench/kernels.py --variants (default: all of them)")
    parser.add_argument(
        "--test-workers", type=int, default=0, help="pytest-xdist workers for the tests (0: one process)"
    )
    parser.add_argument(
        "--timeouts", default="3600,5400,3600", help="seconds for the tests, the sweep and the A/B"
    )
    args = parser.parse_args()
    test_s, sweep_s, ab_s = (int(t) for t in args.timeouts.split(","))

    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_report.py: no CUDA GPU visible to torch: nothing to run.")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    facts = gpu_facts()
    report = [
        f"# liger on {facts['name']}",
        "",
        f"{facts['name']}, {facts['memory_gib']:.0f} GiB, peak HBM {facts['hbm_gb_s']:.0f} GB/s; torch {facts['torch']} "
        f"(CUDA {facts['cuda']}), Triton {facts['triton']}, Python {facts['python']}. Written by `bash bench/gpu.sh` "
        f"on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
    ]
    failed = []
    path = args.out / "gpu-report.md"

    def write(final: bool = False) -> None:
        """Written after every step, so a machine taken back mid-way still leaves the finished steps."""
        tail = ["## Result", "", "all steps succeeded" if not failed else "FAILED: " + ", ".join(failed)]
        path.write_text("\n".join(report + (tail if final else ["(still running)"]) + [""]))

    print("gpu_report: GPU tests", flush=True)
    workers = ["-n", str(args.test_workers)]  # 0: one process (pyproject's addopts would start 2)
    code, out, secs = run(
        [sys.executable, "-m", "pytest", "-q", "-rs", *workers, *GPU_TESTS], test_s, {"TRITON_INTERPRET": "0"}
    )
    summary = [
        line for line in out.splitlines() if " passed" in line or " failed" in line or "SKIPPED" in line
    ]
    report += [
        "## GPU tests",
        "",
        f"`pytest -q -rs {' '.join(GPU_TESTS)}` ({secs:.0f} s, exit {code}):",
        "",
        "```",
    ]
    report += summary[-20:] + ["```", ""]
    if code != 0:
        failed.append("GPU tests")
        report += ["```", *out.splitlines()[-60:], "```", ""]
    write()

    print("gpu_report: kernel sweep", flush=True)
    sweep_dir = args.out / "gpu-sweep"
    variants = ["--variants", args.sweep_variants] if args.sweep_variants else []
    code, out, secs = run(
        [sys.executable, "bench/kernels.py", "--dtype", args.dtype, *variants, "--out", str(sweep_dir)],
        sweep_s,
    )
    csv_path = sweep_dir / f"kernels-cuda-{args.dtype}.csv"
    report += ["## Kernel sweep", "", f"`python bench/kernels.py --dtype {args.dtype}` ({secs:.0f} s, exit {code}); "
               "time is the median of the repeats, memory the peak the call adds (CUDA allocator).", ""]  # fmt: skip
    if code == 0 and csv_path.exists():
        rows = list(csv.DictReader(csv_path.open()))
        report += ["### Targets", "", *targets(rows, facts["hbm_gb_s"], 2), "", "### All rows", ""]
        report += sweep_table(rows) + [""]
    else:
        failed.append("kernel sweep")
        report += ["```", *out.splitlines()[-40:], "```", ""]
    write()

    print("gpu_report: training step A/B", flush=True)
    ab_dir = args.out / "gpu-ab"
    argv = [
        sys.executable,
        "-m",
        "liger_cli",
        "bench",
        AB_RECIPE,
        "--steps",
        str(args.ab_steps),
        "--warmup",
        "3",
    ]
    code, out, secs = run([*argv, "--out", str(ab_dir)], ab_s)
    report += ["## Training step, kernels on vs off", "", f"`liger bench {AB_RECIPE} --steps {args.ab_steps} "
               f"--warmup 3` ({secs:.0f} s, exit {code}):", "", "```", *out.strip().splitlines()[-25:], "```", ""]  # fmt: skip
    if code != 0:
        failed.append("training A/B")

    print("gpu_report: sequence parallelism", flush=True)
    report += ["## Sequence parallelism: 1 GPU at 16k vs 2 GPUs with `sequence_parallel: 2` at 32k", ""]
    if torch.cuda.device_count() < 2:
        report += [f"not run: the split needs 2 GPUs, this machine has {torch.cuda.device_count()}.", ""]
    else:
        argv = [sys.executable, "bench/sequence_parallel.py", "--recipe", "recipes/bench-llama-1b.yaml",
                "--length", "16384", "--steps", "3"]  # fmt: skip
        code, out, secs = run(argv, ab_s)
        report += [
            f"`{' '.join(argv[1:])}` ({secs:.0f} s, exit {code}):",
            "",
            *out.strip().splitlines()[-6:],
            "",
        ]
        if code != 0:
            failed.append("sequence parallelism")
    write(final=True)
    print(f"gpu_report: wrote {path}" + (f" (failed: {', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
