"""The GPU report behind `bash bench/gpu.sh`: every GPU test, the kernel sweep with its peers, a
kernels on/off A/B of a real training step, sequence parallelism (2 GPUs), and a GRPO step on liger's
vLLM engine against TRL's `use_vllm=True`, written as one markdown file with the GPU's name.

Each step runs in its own process and is recorded even when it fails; the exit code is 1 if any
test or step failed. Targets checked from the sweep: Triton RMSNorm forward at >= 85% of the HBM
bandwidth, and the fused linear cross-entropy faster than eager at <= 0.25x its memory.

    TRITON_INTERPRET=0 python bench/gpu_report.py --out bench/results
    python bench/gpu_report.py --dry-run      # what a GPU run would run, in order; runs nothing

The last step, "GRPO step: vLLM engine vs TRL use_vllm", runs `bench/grpo_vs_trl.py --vllm --trl-vllm`
on Llama-3.2-1B's shape (`GRPO_ARGS`): TRL's GRPOTrainer with `use_vllm=True, vllm_mode="colocate"`,
liger with `rl.engine: transformers` and with `rl.engine: vllm` (its own server beside training), bf16,
the same prompts, G, lengths and LoRA. TRL runs in vLLM's own environment (LIGER_VLLM_PYTHON, else
`.venv-vllm`, which `scripts/setup-vllm.sh` fills with CUDA vllm on a GPU machine), where the step
first installs TRL when it is missing (`TRL_INSTALL`, under constraints-vllm.txt so that vLLM's
transformers stays). Version gap, from the packages' metadata (2026-12): TRL 1.16.0, the newest,
lists vllm >=0.22,<=0.31 (its `vllm` extra; at run time it only warns outside that), while setup-vllm
installs the newest vllm that fits constraints-vllm.txt's transformers 5.19.0, vllm 0.33.0 (torch
2.14.0); vllm 0.31.0 needs transformers < 5.18. No TRL release fits vllm 0.33, so the step installs
TRL 1.16.0 without its `vllm` extra (which would downgrade vllm and transformers) and TRL runs on a
vLLM it does not list. Where that Python has no vllm (a machine without a package index, say) the
step is recorded as not run. A step given 0 s in --timeouts is left out (a short lease: gpu.sh).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import re
import shlex
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
SP_ARGS = ["--recipe", "recipes/bench-llama-1b.yaml", "--length", "16384", "--steps", "3"]
VLLM_STEP = "GRPO step: vLLM engine vs TRL use_vllm"
AHEAD_STEP = "sampling ahead on vLLM"
"""bench/async_rl.py on the GRPO recipe with rl.engine vllm: K = 0, 1, 2 side by side (steps per hour,
held-out reward by step and by training time); the fifth of --timeouts (0 when fewer are given)."""
GRPO_ARGS = ["--vllm", "--trl-vllm", "--skip-kernels-off", "--model-config", "recipes/bench/llama-3.2-1b.json",
             "--steps", "3", "--warmup", "1", "--prompts", "4", "--new-tokens", "256"]  # fmt: skip
"""bench/grpo_vs_trl.py's arguments in the vLLM step: 4 prompts x 8 completions x 256 tokens, 1 warm-up
and 3 measured steps; liger with kernels off is left out (the A/B above measures the kernels)."""
TRL_INSTALL = ["-m", "pip", "--disable-pip-version-check", "-q", "install", "-c", "constraints-vllm.txt",
               "trl==1.16.0", "peft", "datasets"]  # fmt: skip
"""vLLM's Python's arguments that install TRL beside it (module docstring: why this version)."""
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


def vllm_python() -> Path:
    """The Python with vLLM that liger's `rl.engine: vllm` uses: LIGER_VLLM_PYTHON, else `.venv-vllm`."""
    return Path(os.environ.get("LIGER_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")


def commands(args) -> dict[str, list[str]]:
    """Every step's command line, by step, in the order they run (the vLLM step's TRL check and install
    first)."""
    py, vllm_py = sys.executable, str(vllm_python())
    workers = ["-n", str(args.test_workers)]  # 0: one process (pyproject's addopts would start 2)
    variants = ["--variants", args.sweep_variants] if args.sweep_variants else []
    return {
        "GPU tests": [py, "-m", "pytest", "-q", "-rs", *workers, *GPU_TESTS],
        "kernel sweep": [py, "bench/kernels.py", "--dtype", args.dtype, *variants, "--out", str(args.out / "gpu-sweep")],
        "training A/B": [py, "-m", "liger_cli", "bench", AB_RECIPE, "--steps", str(args.ab_steps), "--warmup", "3",
                         "--out", str(args.out / "gpu-ab")],
        "sequence parallelism": [py, "bench/sequence_parallel.py", *SP_ARGS],
        "TRL check": [vllm_py, "-c", "import trl, peft, datasets"],
        "TRL install": [vllm_py, *TRL_INSTALL],
        VLLM_STEP: [py, "bench/grpo_vs_trl.py", *GRPO_ARGS, "--trl-python", vllm_py,
                    "--out", str(args.out / "gpu-grpo-vllm")],
        AHEAD_STEP: [py, "bench/async_rl.py", "--engine", "vllm", "--recipes", "grpo", "--steps", "40",
                     "--eval-every", "20", "--out", str(args.out / "gpu-async-rl.json")],
    }  # fmt: skip


def dry_run(args, timeouts: dict[str, int]) -> int:
    """Print what a GPU run would run, in order, with each step's time limit; run nothing."""
    steps = commands(args)
    lines = [
        f"gpu_report --dry-run: what a GPU run would run, in order (nothing is run; report: {args.out / 'gpu-report.md'})"
    ]
    for title, argv in steps.items():
        limit = timeouts.get(title, timeouts[VLLM_STEP])
        when = {"GPU tests": " (TRITON_INTERPRET=0)", "sequence parallelism": " (only with 2 GPUs)",
                "TRL check": f" (part of '{VLLM_STEP}')", "TRL install": " (only if the check fails)"}.get(title, "")  # fmt: skip
        left_out = " LEFT OUT: --timeouts gives it 0 s" if limit == 0 else ""
        lines.append(f"- {title}{when}, limit {limit} s:{left_out}\n    {shlex.join(argv)}")
    print("\n".join(lines))
    return 0


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
        "--timeouts",
        default="3600,5400,3600,1800,1800",
        help="seconds for the tests, the sweep, the A/B (and sequence parallelism), the vLLM step (a fourth "
        "left out: 1800) and sampling ahead (a fifth left out: 0); 0 leaves a step out",
    )
    parser.add_argument("--dry-run", action="store_true", help="print every step's command; run nothing")
    args = parser.parse_args()
    given = [int(t) for t in args.timeouts.split(",")]
    defaults = [1800, 0]  # the vLLM step's and sampling ahead's, when --timeouts leaves them out
    test_s, sweep_s, ab_s, vllm_s, ahead_s = (given + defaults[len(given) - 3 :])[:5]
    timeouts = {"GPU tests": test_s, "kernel sweep": sweep_s, "training A/B": ab_s, "sequence parallelism": ab_s,
                VLLM_STEP: vllm_s, AHEAD_STEP: ahead_s}  # fmt: skip
    if args.dry_run:
        return dry_run(args, timeouts)

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
    failed, not_run = [], []
    path = args.out / "gpu-report.md"
    steps = commands(args)

    def write(final: bool = False) -> None:
        """Written after every step, so a machine taken back mid-way still leaves the finished steps."""
        result = "all steps succeeded" if not failed else "FAILED: " + ", ".join(failed)
        tail = ["## Result", "", result + (f"; not run: {', '.join(not_run)}" if not_run else "")]
        path.write_text("\n".join(report + (tail if final else ["(still running)"]) + [""]))

    def left_out(title: str, heading: str) -> bool:
        """A step --timeouts gives 0 s: recorded as not run."""
        if timeouts[title]:
            return False
        report.extend([heading, "", "not run: --timeouts gave it 0 s.", ""])
        not_run.append(title)
        return True

    print("gpu_report: GPU tests", flush=True)
    if not left_out("GPU tests", "## GPU tests"):
        code, out, secs = run(steps["GPU tests"], test_s, {"TRITON_INTERPRET": "0"})
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
    if not left_out("kernel sweep", "## Kernel sweep"):
        code, out, secs = run(steps["kernel sweep"], sweep_s)
        csv_path = args.out / "gpu-sweep" / f"kernels-cuda-{args.dtype}.csv"
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
    if not left_out("training A/B", "## Training step, kernels on vs off"):
        code, out, secs = run(steps["training A/B"], ab_s)
        report += ["## Training step, kernels on vs off", "", f"`liger bench {AB_RECIPE} --steps {args.ab_steps} "
                   f"--warmup 3` ({secs:.0f} s, exit {code}):", "", "```", *out.strip().splitlines()[-25:], "```", ""]  # fmt: skip
        if code != 0:
            failed.append("training A/B")

    print("gpu_report: sequence parallelism", flush=True)
    heading = "## Sequence parallelism: 1 GPU at 16k vs 2 GPUs with `sequence_parallel: 2` at 32k"
    if torch.cuda.device_count() < 2:
        report += [
            heading,
            "",
            f"not run: the split needs 2 GPUs, this machine has {torch.cuda.device_count()}.",
            "",
        ]
    elif not left_out("sequence parallelism", heading):
        argv = steps["sequence parallelism"]
        code, out, secs = run(argv, ab_s)
        report += [heading, "", f"`{' '.join(argv[1:])}` ({secs:.0f} s, exit {code}):", "", *out.strip().splitlines()[-6:], ""]  # fmt: skip
        if code != 0:
            failed.append("sequence parallelism")
    write()

    print(f"gpu_report: {VLLM_STEP}", flush=True)
    if not left_out(VLLM_STEP, f"## {VLLM_STEP}"):
        report += [f"## {VLLM_STEP}", "", *vllm_step(steps, vllm_s, failed, not_run), ""]
    write()

    print(f"gpu_report: {AHEAD_STEP}", flush=True)
    if not left_out(AHEAD_STEP, f"## {AHEAD_STEP}"):
        code, out, secs = run(steps[AHEAD_STEP], ahead_s)
        report += [f"## {AHEAD_STEP}", "", f"`{shlex.join(steps[AHEAD_STEP][1:])}` ({secs:.0f} s, exit {code}):", "",
                   *out.strip().splitlines()[-12:], ""]  # fmt: skip
        if code != 0:
            failed.append(AHEAD_STEP)
    write(final=True)
    print(f"gpu_report: wrote {path}" + (f" (failed: {', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


def vllm_step(steps: dict[str, list[str]], limit: int, failed: list[str], not_run: list[str]) -> list[str]:
    """The vLLM step: TRL installed into vLLM's Python if missing, then bench/grpo_vs_trl.py; the report's
    lines (its table, or why it did not run, or how it failed with the tail of each log it names)."""
    began, python = time.perf_counter(), steps["TRL check"][0]

    def left() -> int:
        return max(1, int(limit - (time.perf_counter() - began)))

    has_vllm = [
        python,
        "-c",
        "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)",
    ]
    if not Path(python).is_file() or run(has_vllm, left())[0] != 0:
        not_run.append(VLLM_STEP)
        return [f"not run: {python} has no vllm (`scripts/setup-vllm.sh` installs CUDA vllm into `.venv-vllm` on a "
                "GPU machine with a package index; LIGER_VLLM_PYTHON names another Python that has it)."]  # fmt: skip
    lines = []
    if run(steps["TRL check"], left())[0] != 0:
        code, out, secs = run(steps["TRL install"], left())
        lines += [f"`{shlex.join(steps['TRL install'][1:])}` ({secs:.0f} s, exit {code})", ""]
        if code != 0:
            failed.append(VLLM_STEP)
            return [*lines, "```", *out.strip().splitlines()[-30:], "```"]
    argv = steps[VLLM_STEP]
    code, out, secs = run(argv, left())
    lines += [f"`{shlex.join(argv[1:])}` ({secs:.0f} s, exit {code}):", ""]
    text = out.strip().splitlines()
    if code == 0:  # the bench's summary: from its "loss ..." line on
        first = next((i for i, line in enumerate(text) if line.startswith("loss ")), 0)
        return [*lines, *text[first:]]
    failed.append(VLLM_STEP)
    lines += ["```", *text[-30:], "```"]
    for log in dict.fromkeys(re.findall(r"see (\S+\.log)", out)):
        found = Path(log) if Path(log).is_absolute() else REPO / log
        tail = found.read_text(errors="replace").splitlines()[-40:] if found.is_file() else ["(missing)"]
        lines += ["", f"{log}, its end:", "", "```", *tail, "```"]
    return lines


if __name__ == "__main__":
    sys.exit(main())
