"""Benchmark, not a test: peak memory and time of the per-sequence log-probability a preference loss
needs (DPO/IPO/SimPO/ORPO), or with `--per-token` the per-token log-probability (at a sampling
temperature) that online RL (GRPO) needs, forward+backward, fused against eager, with lm_head
trainable and frozen.

Variants: `eager` (what TRL-style trainers do: logits for every position, hidden @ weight.T, then
log_softmax in fp32, gather the shifted labels, mask, sum per sequence) and `ours`
(liger_kernels' fused_linear_logprob; its PyTorch path on a CPU: learned rows only, blocks of the
vocabulary; per token: fused_linear_token_logprob, of which the per-sequence one is the sum). Each
sequence (per token: each token) gets its own upstream gradient (both signs), as the loss gives.
A size is BATCHxSEQxHIDDENxVOCAB; `--learned` is the fraction of each sequence that is answer (the
rest is prompt, label -100), 0.5 by default.

The floor is what the backward must return: grad_hidden for every position (zeros at the prompt),
plus grad_weight when lm_head trains. Peak memory and time are measured as in bench/flce_memory.py
(whose helpers this reuses): each (size, lm_head, variant) in a fresh process, peak RSS growth on a
CPU (glibc serving >= 1 MiB with mmap, as `liger train` sets it), max_memory_allocated on CUDA;
time is the best of --repeats passes after a warm-up pass (with --repeats 0 the one pass is timed).

    python bench/logprob_memory.py                           # Llama-3-8B head, 4 x 256 positions
    python bench/logprob_memory.py --sizes 8x512x4096x128256 --repeats 0   # 2048 learned tokens
    python bench/logprob_memory.py --per-token --temperature 0.7   # GRPO's per-token log-probs
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

# Llama-3-8B's head (H=4096, V=128256), with as many tokens as a 2-core CPU runs in a few minutes.
DEFAULT_SIZES = ("4x256x4096x128256",)
VARIANTS = ("eager", "ours")
LM_HEADS = ("trainable", "frozen")


def worker(variant, size, lm_head, learned, dtype, device, repeats, per_token=False, temperature=1.0):
    """Runs in the subprocess: build inputs, run the variant, return its peak growth and best time."""
    cuda = device.startswith("cuda")
    if not cuda and sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").mallopt(-3, 2**20)  # M_MMAP_THRESHOLD = 1 MiB, as liger train sets
    import torch
    from liger_kernels import fused_linear_logprob, fused_linear_token_logprob

    batch, seq, hidden_size, vocab = (int(n) for n in size.split("x"))
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, hidden_size, generator=g).to(device=device, dtype=torch_dtype)
    hidden.requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=g).mul_(hidden_size**-0.5)
    weight = weight.to(device=device, dtype=torch_dtype).requires_grad_(lm_head == "trainable")
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, : seq - int(seq * learned)] = -100  # the prompt
    labels = labels.to(device)
    upstream = torch.randn(*((batch, seq - 1) if per_token else (batch,)), generator=g).to(device)

    def step():
        if variant == "eager":
            logits = (hidden[:, :-1] @ weight.t()).float() / temperature
            targets = labels[:, 1:]
            mask = targets != -100
            token = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            logp = token * mask if per_token else (token * mask).sum(-1)
        elif per_token:
            logp = fused_linear_token_logprob(hidden, weight, labels, temperature=temperature)[0][:, :-1]
        else:
            logp, _ = fused_linear_logprob(hidden, weight, labels)
        logp.backward(upstream)
        return logp

    peak, seconds, logp = peak_and_best_time(step, [hidden, weight], repeats, cuda)
    logp = logp.detach()
    grad_norms = [float(hidden.grad.norm())] + (
        [float(weight.grad.norm())] if weight.grad is not None else []
    )
    return {
        "peak_mib": peak,
        "seconds": seconds,
        "logp": logp.double().flatten().tolist(),
        "grad_norms": grad_norms,
    }


def floor_mib(size: str, lm_head: str, dtype: str) -> float:
    batch, seq, hidden_size, vocab = (int(n) for n in size.split("x"))
    element = 4 if dtype == "float32" else 2
    return element * hidden_size * (batch * seq + (vocab if lm_head == "trainable" else 0)) / 2**20


def run_variant(variant: str, size: str, lm_head: str, args) -> dict:
    argv = [sys.executable, __file__, "--worker", variant, "--sizes", size, "--lm-head", lm_head]
    argv += ["--learned", str(args.learned), "--dtype", args.dtype, "--device", args.device]
    argv += ["--repeats", str(args.repeats), "--temperature", str(args.temperature)]
    argv += ["--per-token"] if args.per_token else []
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} at {size} ({lm_head}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="BATCHxSEQxHIDDENxVOCAB")
    parser.add_argument("--learned", type=float, default=0.5, help="answer fraction of each sequence")
    parser.add_argument("--lm-head", default="both", choices=[*LM_HEADS, "both"])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, eager first")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes after the warm-up pass")
    parser.add_argument("--per-token", action="store_true", help="GRPO's per-token log-probs")
    parser.add_argument("--temperature", type=float, default=1.0, help="divides the logits")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = worker(
            args.worker, args.sizes[0], args.lm_head, args.learned, args.dtype, args.device, args.repeats,
            args.per_token, args.temperature,
        )  # fmt: skip
        print(json.dumps(result))
        return

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    lm_heads = LM_HEADS if args.lm_head == "both" else (args.lm_head,)
    print(
        f"{'per-token' if args.per_token else 'per-sequence'} log-probs (temperature {args.temperature}): "
        f"device={args.device} dtype={args.dtype} learned={args.learned} repeats={args.repeats} "
        f"(time: best of repeats after a warm-up); load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'B x T x H x V':>22} {'lm_head':>9} {'variant':>8} {'peak MiB':>9} {'floor+':>7} "
        f"{'mem/eager':>9} {'seconds':>8} {'t/eager':>8}"
    )
    for size in args.sizes:
        for lm_head in lm_heads:
            floor = floor_mib(size, lm_head, args.dtype)
            results = {v: run_variant(v, size, lm_head, args) for v in variants}
            eager = results.get("eager")
            for variant, r in results.items():
                mem = f"{r['peak_mib'] / eager['peak_mib']:>8.2f}x" if eager else f"{'-':>9}"
                ratio = f"{r['seconds'] / eager['seconds']:>7.2f}x" if eager else f"{'-':>8}"
                print(
                    f"{size:>22} {lm_head:>9} {variant:>8} {r['peak_mib']:>9.0f} {r['peak_mib'] - floor:>7.0f} "
                    f"{mem} {r['seconds']:>8.2f} {ratio}"
                )
            if eager and "ours" in results:
                ours = results["ours"]
                diff = max(abs(a - b) for a, b in zip(ours["logp"], eager["logp"], strict=True))
                print(
                    f"{'':>22} {'':>9} {'ours:':>8} floor {floor:.0f} MiB, ours {ours['peak_mib'] - floor:+.0f} MiB "
                    f"over it; {ours['seconds'] / eager['seconds']:.2f}x eager's time, "
                    f"{ours['peak_mib'] / eager['peak_mib']:.2f}x its memory; max |logp - eager| {diff:.2e}"
                )


if __name__ == "__main__":
    main()
