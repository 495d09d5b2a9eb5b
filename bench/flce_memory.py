"""Benchmark, not a test: peak memory and time of the fused linear cross-entropy forward+backward
against eager PyTorch and against torch's own chunked loss, with lm_head trainable and frozen.

Variants: `eager` (hidden @ weight.T, then F.cross_entropy), `ours` (liger_kernels'
fused_linear_cross_entropy; its PyTorch path on a CPU) and `torch_chunked` (torch's
F.linear_cross_entropy(..., options=torch.nn.LinearCrossEntropyOptions())). `frozen` is the LoRA
case: lm_head.weight does not require grad, so only grad_hidden is returned.

The floor is what the loss must return: grad_hidden, plus grad_weight when lm_head trains. Target:
`ours` within 64 MiB of it, at <= 0.8x eager's time and faster than torch_chunked.

Each (size, lm_head, variant) runs in a fresh process. On the CPU, peak memory is the process's peak
RSS (VmHWM, reset through /proc/self/clear_refs once the inputs exist) over its RSS at that moment;
as in `liger train`, glibc serves blocks of 256 KiB and more with mmap, so freed tensors leave the
RSS. On CUDA it is torch.cuda.max_memory_allocated over the same baseline. Time is the best of
--repeats forward+backward passes after a warm-up pass (whose peak counts too).

    python bench/flce_memory.py                                  # both default sizes, fp32, CPU
    python bench/flce_memory.py --sizes 2048x1024x65536 --lm-head frozen --variants eager,ours
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_SIZES = ("2048x1024x65536", "4096x2048x128256")
VARIANTS = ("eager", "ours", "torch_chunked")
LM_HEADS = ("trainable", "frozen")
FLOOR_SLACK_MIB = 64


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_and_best_time(step, params: list, repeats: int, cuda: bool):
    """Run `step()` once to warm up, then `repeats` times (each from fresh .grad on `params`): the peak
    memory over what was held before the first pass (MiB: CUDA's allocator, or the CPU's VmHWM reset
    to VmRSS), the best time of the measured passes (the warm-up's when repeats is 0), and the last
    pass's result."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated() / 2**20
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        baseline = _status_mib("VmRSS")
    times, result = [], None
    for _ in range(repeats + 1):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        result = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else _status_mib("VmHWM")) - baseline
    return peak, min(times[1:] or times), result


def worker(
    variant: str, size: str, lm_head: str, dtype: str, device: str, repeats: int, chunk_rows: int | None
) -> dict:
    """Runs in the subprocess: build inputs, run the variant, return its peak growth and best time."""
    cuda = device.startswith("cuda")
    if not cuda and sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD = 256 KiB, as liger train sets
    import torch
    import torch.nn.functional as F
    from liger_kernels import fused_linear_cross_entropy

    tokens, hidden_size, vocab = (int(n) for n in size.split("x"))
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(device=device, dtype=torch_dtype)
    hidden.requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=g).mul_(hidden_size**-0.5)
    weight = weight.to(device=device, dtype=torch_dtype).requires_grad_(lm_head == "trainable")
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    labels[: tokens // 10] = -100

    def step():
        if variant == "eager":
            loss = F.cross_entropy((hidden @ weight.t()).float(), labels)
        elif variant == "ours":
            loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows)
        else:
            options = torch.nn.LinearCrossEntropyOptions()
            loss = F.linear_cross_entropy(hidden, weight, labels, options=options)
        loss.backward()
        return loss

    peak, seconds, loss = peak_and_best_time(step, [hidden, weight], repeats, cuda)
    loss = float(loss)
    grad_norms = [float(hidden.grad.norm())] + (
        [float(weight.grad.norm())] if weight.grad is not None else []
    )
    return {"peak_mib": peak, "seconds": seconds, "loss": loss, "grad_norms": grad_norms}


def floor_mib(size: str, lm_head: str, dtype: str) -> float:
    tokens, hidden_size, vocab = (int(n) for n in size.split("x"))
    element = 4 if dtype == "float32" else 2
    return element * hidden_size * (tokens + (vocab if lm_head == "trainable" else 0)) / 2**20


def run_variant(variant: str, size: str, lm_head: str, args) -> dict:
    argv = [sys.executable, __file__, "--worker", variant, "--sizes", size, "--lm-head", lm_head]
    argv += ["--dtype", args.dtype, "--device", args.device, "--repeats", str(args.repeats)]
    argv += ["--chunk-rows", str(args.chunk_rows)] if args.chunk_rows else []
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} at {size} ({lm_head}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="TOKENSxHIDDENxVOCAB")
    parser.add_argument("--lm-head", default="both", choices=[*LM_HEADS, "both"])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, eager first")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes after the warm-up pass")
    parser.add_argument("--chunk-rows", type=int, help="force ours' tokens per chunk (for tuning)")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = worker(
            args.worker, args.sizes[0], args.lm_head, args.dtype, args.device, args.repeats, args.chunk_rows
        )
        print(json.dumps(result))
        return

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    lm_heads = LM_HEADS if args.lm_head == "both" else (args.lm_head,)
    print(
        f"device={args.device} dtype={args.dtype} repeats={args.repeats} (time: best of repeats after a warm-up); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'BT x H x V':>18} {'lm_head':>9} {'variant':>13} {'peak MiB':>9} {'floor+':>7} {'seconds':>8} {'t/eager':>8} {'loss':>9}"
    )
    for size in args.sizes:
        for lm_head in lm_heads:
            floor = floor_mib(size, lm_head, args.dtype)
            results = {v: run_variant(v, size, lm_head, args) for v in variants}
            eager = results.get("eager")
            for variant, r in results.items():
                ratio = f"{r['seconds'] / eager['seconds']:>7.2f}x" if eager else f"{'-':>8}"
                print(
                    f"{size:>18} {lm_head:>9} {variant:>13} {r['peak_mib']:>9.0f} {r['peak_mib'] - floor:>7.0f} "
                    f"{r['seconds']:>8.2f} {ratio} {r['loss']:>9.5f}"
                )
            ours = results.get("ours")
            if ours:
                verdict = [
                    f"floor {floor:.0f} MiB; ours {ours['peak_mib'] - floor:+.0f} MiB over it (target <= {FLOOR_SLACK_MIB})"
                ]
                if eager:
                    verdict.append(f"time {ours['seconds'] / eager['seconds']:.2f}x eager (target <= 0.8x)")
                if "torch_chunked" in results:
                    verdict.append(
                        f"{ours['seconds'] / results['torch_chunked']['seconds']:.2f}x torch_chunked (target < 1)"
                    )
                print(f"{'':>18} {'':>9} {'ours:':>13} " + "; ".join(verdict))


if __name__ == "__main__":
    main()
