"""Benchmark, not a test: each of our kernels against its peers, forward and forward+backward, over a
sweep of sizes; time and peak memory to CSV and PNG.

Peers: eager PyTorch, torch.compile of it, torch's own chunked loss for the fused linear
cross-entropy (F.linear_cross_entropy with options=torch.nn.LinearCrossEntropyOptions()), and on a
GPU, when installed, Liger-Kernel (every kernel) and Apple's Cut Cross-Entropy (the fused loss).

Eager is what a model runs without our kernels: transformers' LlamaRMSNorm and apply_rotary_pos_emb,
silu(gate) * up, F.cross_entropy, and F.linear followed by F.cross_entropy for the fused loss. `ours`
is liger_kernels' public function: its PyTorch path on a CPU, its Triton path on a GPU (the output
names the device and the path measured). `compile` is torch.compile of the eager function, where it
compiles (a failure is recorded, not fatal).

How it measures, per (kernel, size, variant, mode):
- time: the median of the repeats after one warm-up call (which also compiles);
- memory: the peak over the repeats minus the memory held right before them (inputs and the
  gradient fed to backward are held already, so the number is what the operation itself adds).
  GPU: torch.cuda.max_memory_allocated. CPU: the process's peak RSS (VmHWM, reset through
  /proc/self/clear_refs before each measurement) over its RSS; glibc is told to mmap every
  allocation above 64 KiB, so a freed tensor leaves the RSS at once and cannot hide a later peak.
Each kernel runs in its own fresh process.

    python bench/kernels.py                                   # the default sweep, all variants
    python bench/kernels.py --kernels fused_linear_cross_entropy --sizes 4096x2048x128256
    python bench/kernels.py --sizes small --variants ours,eager --repeats 1 --out /tmp/kb   # quick check
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

KERNELS = ("rms_norm", "swiglu", "rope", "cross_entropy", "fused_linear_cross_entropy")
VARIANTS = ("eager", "ours", "compile", "torch_chunked", "liger_kernel", "cut_cross_entropy")
GPU_PEERS = {"liger_kernel": "liger_kernel", "cut_cross_entropy": "cut_cross_entropy"}  # variant: module
MODES = ("forward", "forward_backward")

# Sizes: rms_norm TOKENSxHIDDEN; swiglu TOKENSxINTERMEDIATE; rope BATCHxSEQxQ_HEADSxKV_HEADSxHEAD_DIM;
# cross_entropy TOKENSxVOCAB; fused_linear_cross_entropy TOKENSxHIDDENxVOCAB.
SIZES = {
    "rms_norm": {"default": ["1024x2048", "4096x2048", "4096x4096"], "small": ["64x128"]},
    "swiglu": {"default": ["1024x5632", "4096x5632", "4096x14336"], "small": ["64x256"]},
    "rope": {"default": ["1x1024x32x8x128", "1x4096x32x8x128", "4x4096x32x8x128"], "small": ["1x32x4x2x16"]},
    "cross_entropy": {"default": ["1024x32000", "4096x32000", "2048x128256"], "small": ["64x1000"]},
    "fused_linear_cross_entropy": {
        "default": ["1024x1024x32000", "4096x2048x32000", "4096x2048x128256"],
        "small": ["64x64x1000"],
    },
}
TIME_BUDGET_S = 6.0  # repeats stop once they have taken this long (at least one always runs)


# ------------------------------------------------------------------------------ the kernels' cases


def make_case(kernel: str, size: str, dtype, device: str):
    """(inputs to differentiate, output gradients or None for a scalar loss, {variant: fn(*inputs)}).

    The `compile` variant is added by the caller: torch.compile of the eager function."""
    import liger_kernels as ours
    import torch
    import torch.nn.functional as F

    dims = [int(n) for n in size.split("x")]
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype).requires_grad_()

    if kernel == "rms_norm":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        tokens, hidden = dims
        norm = LlamaRMSNorm(hidden, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(1.0 + 0.1 * torch.randn(hidden, generator=g))
        norm = norm.to(device=device, dtype=dtype)
        inputs = [randn(tokens, hidden), norm.weight]
        fns = {
            "eager": lambda x, w: norm(x),
            "ours": lambda x, w: ours.rms_norm(x, w, 1e-6),
            "liger_kernel": lambda x, w: _upstream().liger_rms_norm(x, w, 1e-6),
        }
        grads = [torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)]
    elif kernel == "swiglu":
        tokens, inter = dims
        inputs = [randn(tokens, inter), randn(tokens, inter)]
        fns = {
            "eager": lambda a, b: F.silu(a) * b,
            "ours": lambda a, b: ours.swiglu(a, b),
            "liger_kernel": lambda a, b: _upstream().liger_swiglu(a, b),
        }
        grads = [torch.randn(tokens, inter, generator=g).to(device=device, dtype=dtype)]
    elif kernel == "rope":
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        batch, seq, q_heads, kv_heads, head_dim = dims
        q, k = randn(batch, q_heads, seq, head_dim), randn(batch, kv_heads, seq, head_dim)
        angles = torch.arange(seq)[:, None] * 10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim)
        angles = torch.cat([angles, angles], dim=-1)[None]
        cos, sin = angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)
        inputs = [q, k]
        fns = {
            "eager": lambda q, k: apply_rotary_pos_emb(q, k, cos, sin),
            "ours": lambda q, k: ours.apply_rope(q, k, cos, sin),
            "liger_kernel": lambda q, k: _upstream().liger_rope(q, k, cos, sin),
        }
        grads = [
            torch.randn(q.shape, generator=g).to(device=device, dtype=dtype),
            torch.randn(k.shape, generator=g).to(device=device, dtype=dtype),
        ]
    elif kernel == "cross_entropy":
        tokens, vocab = dims
        labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
        labels[: tokens // 10] = -100
        inputs = [randn(tokens, vocab)]
        fns = {
            "eager": lambda x: F.cross_entropy(x.float(), labels),
            "ours": lambda x: ours.cross_entropy(x, labels),
            "liger_kernel": lambda x: _upstream().liger_cross_entropy(x, labels),
        }
        grads = None
    elif kernel == "fused_linear_cross_entropy":
        tokens, hidden, vocab = dims
        labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
        labels[: tokens // 10] = -100
        inputs = [randn(tokens, hidden), randn(vocab, hidden, scale=hidden**-0.5)]
        fns = {
            "eager": lambda h, w: F.cross_entropy(F.linear(h, w).float(), labels),
            "ours": lambda h, w: ours.fused_linear_cross_entropy(h, w, labels),
            "liger_kernel": lambda h, w: _upstream().liger_fused_linear_cross_entropy(h, w, labels),
            "torch_chunked": lambda h, w: F.linear_cross_entropy(
                h, w, labels, options=torch.nn.LinearCrossEntropyOptions()
            ),
            "cut_cross_entropy": lambda h, w: _cut_cross_entropy()(h, w, labels),
        }
        grads = None
    else:
        raise SystemExit(f"unknown kernel {kernel!r}; choose from {', '.join(KERNELS)}")
    return inputs, grads, fns


def _upstream():
    """Liger-Kernel's functional API (the upstream project), used only on a GPU where it is installed."""
    from liger_kernel.transformers import functional

    return functional


def _cut_cross_entropy():
    """Apple's Cut Cross-Entropy (ml-cross-entropy), used only on a GPU where it is installed."""
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy


# ------------------------------------------------------------------------------ memory and timing


class Memory:
    """Peak memory an operation adds: CUDA allocator statistics, or the process's RSS on a CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.libc = None
        if not self.cuda and sys.platform.startswith("linux"):
            self.libc = ctypes.CDLL("libc.so.6")
            self.libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: big blocks are mmapped, freed at once

    def start(self) -> float | None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / 2**20
        if self.libc is None:
            return None
        self.libc.malloc_trim(0)
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        except OSError:
            return None
        return self._status("VmRSS")

    def peak(self) -> float:
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated() / 2**20
        return self._status("VmHWM")

    @staticmethod
    def _status(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no {field} in /proc/self/status")


def _call(fn, inputs, grads, mode: str):
    import torch

    out = fn(*inputs)
    if mode == "forward_backward":
        outs = list(out) if isinstance(out, tuple) else [out]
        torch.autograd.backward(outs, grads)
    return out


def measure(fn, inputs, grads, mode: str, repeats: int, memory: Memory, sync) -> dict:
    for x in inputs:
        x.grad = None
    reference = _call(fn, inputs, grads, mode)  # warm-up (and compilation)
    value = reference if not isinstance(reference, tuple) else reference[0]
    value = value.detach().float().cpu()
    del reference
    for x in inputs:
        x.grad = None
    sync()
    base = memory.start()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = _call(fn, inputs, grads, mode)
        sync()
        times.append(time.perf_counter() - start)
        del out
        for x in inputs:
            x.grad = None
        if sum(times) > TIME_BUDGET_S:
            break
    peak = memory.peak() - base if base is not None else float("nan")
    return {
        "ms": 1e3 * statistics.median(times),
        "ms_min": 1e3 * min(times),
        "repeats": len(times),
        "peak_mb": peak,
        "value": value,
    }


def run_kernel(
    kernel: str,
    sizes: list[str],
    variants: list[str],
    modes: list[str],
    dtype_name: str,
    device: str,
    repeats: int,
) -> list[dict]:
    """Runs in the kernel's own process: every size, variant and mode; one CSV row each."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dtype = getattr(torch, dtype_name)
    memory = Memory(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for size in sizes:
        inputs, grads, fns = make_case(kernel, size, dtype, device)
        if "compile" in variants:  # importing dynamo costs seconds: only when asked
            fns["compile"] = torch.compile(fns["eager"], dynamic=False)
        eager_value = None
        for mode in modes:
            for variant in [v for v in variants if v in fns]:  # a peer only where it has this kernel
                row = {
                    "kernel": kernel,
                    "size": size,
                    "variant": variant,
                    "mode": mode,
                    "dtype": dtype_name,
                    "device": device,
                    "path": _path(variant, device),
                }
                try:
                    result = measure(fns[variant], inputs, grads, mode, repeats, memory, sync)
                except Exception as err:  # noqa: BLE001  (a variant that cannot run here is recorded, not fatal)
                    row["error"] = (
                        f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                    )
                    rows.append(row)
                    print(f"{kernel} {size} {mode} {variant}: {row['error']}", file=sys.stderr)
                    continue
                value = result.pop("value")
                if variant == "eager":
                    eager_value = value
                if eager_value is not None:
                    scale = eager_value.abs().max().clamp(min=1e-12)
                    row["max_rel_diff_vs_eager"] = float((value - eager_value).abs().max() / scale)
                row.update(result)
                rows.append(row)
                print(
                    f"{kernel} {size} {mode} {variant}: {result['ms']:.2f} ms, {result['peak_mb']:.1f} MiB",
                    file=sys.stderr,
                )
        del inputs, grads, fns
    return rows


def _path(variant: str, device: str) -> str:
    if variant == "ours":
        import torch
        from liger_kernels._backend import use_triton

        return "triton" if use_triton(torch.empty(0, device=device)) else "torch"
    return {
        "eager": "torch",
        "compile": "inductor",
        "torch_chunked": "torch",
        "liger_kernel": "triton",
        "cut_cross_entropy": "triton",
    }[variant]


# ------------------------------------------------------------------------------ the driver


FIELDS = [
    "device",
    "device_name",
    "kernel",
    "size",
    "dtype",
    "mode",
    "variant",
    "path",
    "ms",
    "ms_min",
    "repeats",
    "peak_mb",
    "time_vs_eager",
    "mem_vs_eager",
    "max_rel_diff_vs_eager",
    "error",
]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.processor() or platform.machine()} {cores} cores"


def add_ratios(rows: list[dict]) -> None:
    eager = {(r["kernel"], r["size"], r["mode"]): r for r in rows if r["variant"] == "eager" and "ms" in r}
    for r in rows:
        e = eager.get((r["kernel"], r["size"], r["mode"]))
        if e and "ms" in r:
            r["time_vs_eager"] = r["ms"] / e["ms"]
            if e["peak_mb"] > 0 and not math.isnan(r["peak_mb"]):
                r["mem_vs_eager"] = r["peak_mb"] / e["peak_mb"]


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})


def write_png(rows: list[dict], path: Path, title: str) -> None:
    """One row of panels per kernel: forward time, forward+backward time, forward+backward memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = [k for k in KERNELS if any(r["kernel"] == k for r in rows)]
    panels = [
        ("forward", "ms", "forward time (ms)"),
        ("forward_backward", "ms", "fwd+bwd time (ms)"),
        ("forward_backward", "peak_mb", "fwd+bwd peak memory (MiB)"),
    ]
    variants = [v for v in VARIANTS if any(r["variant"] == v and "ms" in r for r in rows)]
    fig, axes = plt.subplots(len(kernels), len(panels), figsize=(13, 2.8 * len(kernels)), squeeze=False)
    for i, kernel in enumerate(kernels):
        sizes = list(dict.fromkeys(r["size"] for r in rows if r["kernel"] == kernel))
        for j, (mode, key, label) in enumerate(panels):
            ax = axes[i][j]
            width = 0.8 / max(1, len(variants))
            for v, variant in enumerate(variants):
                values = []
                for size in sizes:
                    match = [
                        r
                        for r in rows
                        if (r["kernel"], r["size"], r["mode"], r["variant"]) == (kernel, size, mode, variant)
                        and key in r
                    ]
                    values.append(match[0][key] if match else 0.0)
                ax.bar([s + v * width for s in range(len(sizes))], values, width, label=variant)
            ax.set_xticks([s + width * (len(variants) - 1) / 2 for s in range(len(sizes))], sizes, fontsize=7)
            ax.set_title(f"{kernel}: {label}", fontsize=9)
            ax.tick_params(axis="y", labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _choose(value: str, allowed, what: str) -> list[str]:
    items = list(allowed) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; choose from {', '.join(allowed)} or all")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernels", default="all", help=f"comma-separated, from {', '.join(KERNELS)}")
    parser.add_argument("--sizes", default="default", help="default, small, or sizes (one kernel only)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--modes", default="all", help="forward, forward_backward or all")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument(
        "--repeats", type=int, default=5, help=f"at most this many (stops after {TIME_BUDGET_S} s)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    kernels = _choose(args.kernels, KERNELS, "kernel")
    variants = sorted(_choose(args.variants, VARIANTS, "variant"), key=VARIANTS.index)  # eager first
    modes = _choose(args.modes, MODES, "mode")
    if args.sizes not in ("default", "small") and len(kernels) != 1:
        raise SystemExit("explicit --sizes need exactly one --kernels")
    for variant, module in GPU_PEERS.items():  # Triton-only peers: GPU runs where they are installed
        if variant in variants and not (device.startswith("cuda") and _installed(module)):
            variants.remove(variant)

    if args.worker:
        sizes = (
            args.sizes.split(",")
            if args.sizes not in ("default", "small")
            else SIZES[args.worker][args.sizes]
        )
        rows = run_kernel(args.worker, sizes, variants, modes, args.dtype, device, args.repeats)
        print(json.dumps(rows))
        return 0

    name = device_name(device)
    print(
        f"device {device} ({name}), dtype {args.dtype}, variants {', '.join(variants)}; "
        f"load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    rows: list[dict] = []
    for kernel in kernels:
        argv_ = [
            sys.executable,
            __file__,
            "--worker",
            kernel,
            "--kernels",
            kernel,
            "--sizes",
            args.sizes,
            "--variants",
            ",".join(variants),
            "--modes",
            ",".join(modes),
            "--dtype",
            args.dtype,
            "--device",
            device,
            "--repeats",
            str(args.repeats),
        ]
        done = subprocess.run(argv_, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(f"{kernel}: the benchmark process failed (exit {done.returncode})", file=sys.stderr)
            return 1
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    for r in rows:
        r["device_name"] = name
    add_ratios(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"kernels-{device.split(':')[0]}-{args.dtype}"
    write_csv(rows, args.out / f"{stem}.csv")
    write_png(rows, args.out / f"{stem}.png", f"liger kernels vs eager: {device} ({name}), {args.dtype}")
    _print_table(rows)
    print(f"wrote {args.out / (stem + '.csv')} and {args.out / (stem + '.png')}")
    return 0


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _print_table(rows: list[dict]) -> None:
    print(
        f"{'kernel':<27} {'size':<17} {'mode':<16} {'variant':<12} {'ms':>9} {'MiB':>8} {'t/eager':>8} {'m/eager':>8}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:<27} {r['size']:<17} {r['mode']:<16} {r['variant']:<12} {r['error']}")
            continue
        print(
            f"{r['kernel']:<27} {r['size']:<17} {r['mode']:<16} {r['variant']:<12} {r['ms']:>9.2f} "
            f"{r['peak_mb']:>8.1f} {r.get('time_vs_eager', float('nan')):>7.2f}x {r.get('mem_vs_eager', float('nan')):>7.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
