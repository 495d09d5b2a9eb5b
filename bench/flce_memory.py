"""Benchmark, not a test: peak memory and time of fused linear cross-entropy (FLCE) forward+backward
against eager PyTorch (hidden @ weight.T, then F.cross_entropy), side by side.

Each variant runs in a fresh subprocess, so one run's allocations cannot hide in another's peak. On
the CPU, peak memory is the growth of the process's peak RSS (ru_maxrss) over its RSS once the inputs
exist (torch's CPU allocator keeps no peak statistic); on CUDA it is torch.cuda.max_memory_allocated
over the same baseline. Time is the best of --repeats forward+backward passes.

    python bench/flce_memory.py                        # 4096x2048x128256 and a smaller size, fp32, CPU
    python bench/flce_memory.py --sizes 1024x1024x32000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

DEFAULT_SIZES = ("4096x2048x128256", "1024x1024x32000")
VARIANTS = ("eager", "flce")


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def worker(
    variant: str, tokens: int, hidden_size: int, vocab: int, dtype: str, device: str, repeats: int
) -> dict:
    """Runs in the subprocess: build inputs, run the variant, return its peak growth and best time."""
    import torch
    import torch.nn.functional as F
    from liger_kernels import fused_linear_cross_entropy

    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    hidden = torch.randn(tokens, hidden_size, dtype=torch_dtype, device=device, requires_grad=True)
    weight = (
        torch.randn(vocab, hidden_size, dtype=torch_dtype, device=device) * hidden_size**-0.5
    ).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)
    labels[: tokens // 10] = -100

    def step():
        if variant == "eager":
            loss = F.cross_entropy((hidden @ weight.t()).float(), labels)
        else:
            loss = fused_linear_cross_entropy(hidden, weight, labels)
        loss.backward()
        return loss

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = _rss_bytes()
    times, losses = [], []
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        losses.append(float(step()))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    return {"peak_bytes": peak, "seconds": min(times), "loss": losses[-1]}


def run_variant(variant: str, size: str, args) -> dict:
    tokens, hidden_size, vocab = (int(n) for n in size.split("x"))
    argv = [sys.executable, __file__, "--worker", variant, "--sizes", size, "--dtype", args.dtype]
    argv += ["--device", args.device, "--repeats", str(args.repeats)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} at {size} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="TOKENSxHIDDENxVOCAB")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        tokens, hidden_size, vocab = (int(n) for n in args.sizes[0].split("x"))
        print(
            json.dumps(worker(args.worker, tokens, hidden_size, vocab, args.dtype, args.device, args.repeats))
        )
        return

    header = f"{'BT x H x V':>22} {'variant':>7} {'peak MiB':>10} {'seconds':>9} {'loss':>10}"
    print(f"device={args.device} dtype={args.dtype} repeats={args.repeats} (time: best of repeats)")
    print(header)
    for size in args.sizes:
        results = {variant: run_variant(variant, size, args) for variant in VARIANTS}
        for variant, r in results.items():
            print(
                f"{size:>22} {variant:>7} {r['peak_bytes'] / 2**20:>10.0f} {r['seconds']:>9.2f} {r['loss']:>10.5f}"
            )
        eager, flce = results["eager"], results["flce"]
        print(
            f"{size:>22} {'ratio':>7} {flce['peak_bytes'] / eager['peak_bytes']:>9.3f}x "
            f"{flce['seconds'] / eager['seconds']:>8.3f}x   (flce / eager; target memory <= 0.25x, time <= 1.0x)"
        )


if __name__ == "__main__":
    main()
