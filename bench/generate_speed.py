"""Benchmark, not a test: tokens/s of liger's generation engine (what `liger generate`, `liger chat`,
eval samples and RL call) against transformers' own `generate` on the same model, prompts and batch.

Both decode greedily with a KV cache from the same left-padded prompts and stop each row at eos (or
--new-tokens); tokens/s counts the tokens each variant generated (up to and including eos), and
every variant keeps stepping until its last row stops. Variants, each in this process, alternated, best of --repeats after a warm-up:
`transformers` (model.generate, unpatched), `liger` (our engine, unpatched) and `liger + kernels`
(our engine with RMSNorm, RoPE and SwiGLU patched in). The greedy tokens of every variant must be
those of transformers' generate; the script says so, or exits 1.

Models: `quickstart` (the shipped 2-layer model) and `llama-1b` (Llama-3.2-1B's shape, random
weights built from its config: hidden 2048, 16 layers, vocab 128256, tied embeddings; ~5 GB fp32).

    python bench/generate_speed.py                      # both models
    python bench/generate_speed.py --models quickstart --batch 16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart" / "model"
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096,
    tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip


def build(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART)
    if name == "quickstart":
        return AutoModelForCausalLM.from_pretrained(QUICKSTART).eval(), tokenizer
    config = AutoConfig.for_model("llama", **LLAMA_1B, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval(), tokenizer


def prompts_for(tokenizer, batch: int) -> list[list[int]]:
    """Instruction prompts like the quickstart's eval rows, of different lengths."""
    from liger_cli.data.encode import _encode_with_prefix, render_instruction_prompt

    rows = [("Write the number in words.", str(17 * k + 3) * (1 + k % 3)) for k in range(batch)]
    return [_encode_with_prefix(tokenizer, render_instruction_prompt(i, x))[0] for i, x in rows]


def run_transformers(model, tokenizer, prompts, new_tokens):
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    rows = out[:, batch["input_ids"].shape[1] :].tolist()
    return [r[: r.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in r else r for r in rows]


def run_liger(model, tokenizer, prompts, new_tokens):
    from liger_cli.generate.engine import Sampling, generate

    found = generate(
        model,
        prompts,
        Sampling(new_tokens, temperature=0),
        stop_ids=[tokenizer.eos_token_id],
        pad_id=tokenizer.pad_token_id,
    )
    return [c.ids for c in found]


def measure(name: str, batch: int, new_tokens: int, repeats: int) -> list[tuple[str, float, bool]]:
    from liger_kernels import patch_model

    model, tokenizer = build(name)
    patched, _ = build(name)
    report = patch_model(patched, rms_norm=True, rope=True, swiglu=True, cross_entropy=False,
                         fused_linear_cross_entropy=False)  # fmt: skip
    print(f"# {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; kernels: "
          f"{'; '.join(report.lines())}", flush=True)  # fmt: skip
    prompts = prompts_for(tokenizer, batch)
    variants = {
        "transformers generate": lambda: run_transformers(model, tokenizer, prompts, new_tokens),
        "liger": lambda: run_liger(model, tokenizer, prompts, new_tokens),
        "liger + kernels": lambda: run_liger(patched, tokenizer, prompts, new_tokens),
    }
    best = {v: float("inf") for v in variants}
    outputs = {}
    torch.set_grad_enabled(False)
    for attempt in range(repeats + 1):  # the first pass warms up and is not timed
        for variant, call in variants.items():
            start = time.perf_counter()
            outputs[variant] = call()
            if attempt:
                best[variant] = min(best[variant], time.perf_counter() - start)
    reference = outputs["transformers generate"]
    return [(v, sum(map(len, outputs[v])) / best[v], outputs[v] == reference) for v in variants]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["quickstart", "llama-1b"], choices=["quickstart", "llama-1b"]
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"{args.new_tokens} new tokens, best of {args.repeats}")  # fmt: skip
    same = True
    for name in args.models:
        rows = measure(name, args.batch, args.new_tokens, args.repeats)
        base = rows[0][1]
        print(f"\n| {name} | tokens/s | vs transformers | greedy tokens identical |\n|---|---|---|---|")
        for variant, rate, identical in rows:
            print(f"| {variant} | {rate:.1f} | {rate / base:.2f}x | {'yes' if identical else 'NO'} |")
            same &= identical
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
