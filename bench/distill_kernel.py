"""Benchmark, not a test: peak memory and time of distillation's per-token divergence between a
student's and a frozen teacher's next-token distributions (reverse KL, or TRL GKD's generalized JSD),
forward+backward, fused against eager, with the student's lm_head trainable and frozen (LoRA).

Variants, each in a fresh process: `eager` (what TRL's GKDTrainer does: both models' full fp32 logits
[tokens, vocab], log_softmax, the divergence; `fused_linear_divergence_reference`) and `ours`
(liger_kernels' fused_linear_divergence; its PyTorch path on a CPU: vocabulary blocks, no logits).
Every token is learned and gets its own upstream gradient. A size is NxHxHTxV: tokens, the student's
hidden size, the teacher's, the vocabulary. The floor is what the backward must return: grad_hidden,
plus grad_weight when the head trains. Peak memory is the growth of peak RSS on a CPU (glibc serving
>= 1 MiB with mmap, as `liger train` sets it; measured as in bench/flce_memory.py), of
max_memory_allocated on CUDA; time is the best of --repeats passes after a warm-up pass.

    python bench/distill_kernel.py                                  # CPU, 1024 tokens, H 256, V 32000
    python bench/distill_kernel.py --loss jsd --beta 0.5 --temperature 0.7
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flce_memory import peak_and_best_time  # noqa: E402

DEFAULT_SIZES = ("1024x256x512x32000",)
VARIANTS = ("eager", "ours")
LM_HEADS = ("trainable", "frozen")


def worker(variant, size, lm_head, loss, beta, temperature, device, repeats):
    """Runs in the subprocess: build inputs, run the variant, return its peak growth and best time."""
    cuda = device.startswith("cuda")
    if not cuda and sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").mallopt(-3, 2**20)  # M_MMAP_THRESHOLD = 1 MiB, as liger train sets
    import torch
    from liger_kernels import fused_linear_divergence
    from liger_kernels.fused_linear_distill import fused_linear_divergence_reference

    n, hidden, teacher_hidden, vocab = (int(x) for x in size.split("x"))
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, n, hidden, generator=g).to(device).requires_grad_()
    ws = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(device)
    ws.requires_grad_(lm_head == "trainable")
    ht = torch.randn(1, n, teacher_hidden, generator=g).to(device)
    wt = (torch.randn(vocab, teacher_hidden, generator=g) * 2 * teacher_hidden**-0.5).to(device)
    labels = torch.zeros(1, n, dtype=torch.long, device=device)  # every position learned
    upstream = torch.randn(1, n, generator=g).to(device) / n

    def step():
        if variant == "eager":
            div = fused_linear_divergence_reference(hs[0], ws, ht[0], wt, loss, beta, temperature)[None]
        else:
            div, _ = fused_linear_divergence(
                hs, ws, ht, wt, labels, loss=loss, beta=beta, temperature=temperature, shift=False
            )
        div.backward(upstream)
        return div

    peak, seconds, div = peak_and_best_time(step, [hs, ws], repeats, cuda)
    div = div.detach()
    grads = [hs.grad.flatten()] + ([ws.grad.flatten()] if ws.grad is not None else [])
    return {
        "peak_mib": peak,
        "seconds": seconds,
        "div": div.double().flatten().tolist(),
        "grads": [g.double().tolist()[:4096] for g in grads],
        "threads": torch.get_num_threads(),
    }


def floor_mib(size: str, lm_head: str) -> float:
    n, hidden, _, vocab = (int(x) for x in size.split("x"))
    return 4 * hidden * (n + (vocab if lm_head == "trainable" else 0)) / 2**20


def run_variant(variant: str, size: str, lm_head: str, args) -> dict:
    argv = [sys.executable, __file__, "--worker", variant, "--sizes", size, "--lm-head", lm_head]
    argv += ["--loss", args.loss, "--beta", str(args.beta), "--temperature", str(args.temperature)]
    argv += ["--device", args.device, "--repeats", str(args.repeats)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} at {size} ({lm_head}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def max_relative(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) / max(max(abs(y) for y in b), 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="NxHxHTxV")
    parser.add_argument("--lm-head", default="both", choices=[*LM_HEADS, "both"])
    parser.add_argument("--loss", default="reverse_kl", choices=["reverse_kl", "jsd"])
    parser.add_argument("--beta", type=float, default=0.5, help="jsd's beta (TRL GKD's convention)")
    parser.add_argument("--temperature", type=float, default=1.0, help="divides both models' logits")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes after the warm-up pass")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = worker(
            args.worker, args.sizes[0], args.lm_head, args.loss, args.beta, args.temperature, args.device,
            args.repeats,
        )  # fmt: skip
        print(json.dumps(result))
        return

    lm_heads = LM_HEADS if args.lm_head == "both" else (args.lm_head,)
    loss = args.loss + (f" beta {args.beta}" if args.loss == "jsd" else "")
    print(
        f"distillation divergence ({loss}, temperature {args.temperature}), forward+backward, fp32, "
        f"on {'CPU' if args.device == 'cpu' else args.device} (best of {args.repeats} after a warm-up; "
        f"load average {os.getloadavg()[0]:.1f}); memory = peak RSS growth"
    )
    print(
        f"{'N x H x HT x V':>22} {'lm_head':>9} {'variant':>8} {'peak MiB':>9} {'floor+':>7} "
        f"{'mem/eager':>9} {'seconds':>8} {'t/eager':>8}"
    )
    for size in args.sizes:
        for lm_head in lm_heads:
            floor = floor_mib(size, lm_head)
            results = {v: run_variant(v, size, lm_head, args) for v in VARIANTS}
            eager, ours = results["eager"], results["ours"]
            for variant, r in results.items():
                print(
                    f"{size:>22} {lm_head:>9} {variant:>8} {r['peak_mib']:>9.0f} {r['peak_mib'] - floor:>7.0f} "
                    f"{r['peak_mib'] / eager['peak_mib']:>8.2f}x {r['seconds']:>8.2f} "
                    f"{r['seconds'] / eager['seconds']:>7.2f}x"
                )
            diff = max(abs(a - b) for a, b in zip(ours["div"], eager["div"], strict=True))
            grad_diff = max(max_relative(a, b) for a, b in zip(ours["grads"], eager["grads"], strict=True))
            print(
                f"{'':>22} {'':>9} {'ours:':>8} {ours['peak_mib'] / eager['peak_mib']:.2f}x eager's memory, "
                f"{ours['seconds'] / eager['seconds']:.2f}x its time (floor {floor:.0f} MiB); "
                f"max |div - eager| {diff:.1e}, gradients' max relative difference {grad_diff:.1e}; "
                f"{ours['threads']} threads"
            )


if __name__ == "__main__":
    main()
