"""Benchmark, not a test: what a GRPO rollout's sampling costs on each engine, per wall second and per CPU
second, on the real model (SmolLM2-135M-Instruct, fp32): liger's engine (`rl.engine: transformers`),
transformers' own `generate`, and vLLM (`rl.engine: vllm`: its CPU build's server, as a run starts it).

The same prompts (the GRPO quickstart's, rendered through the chat template), G samples each at
temperature 1, up to --new-tokens, stopping at the template's end of turn. liger's engine and `generate`
run in this process (CPU seconds: this process's); vLLM in its server (CPU seconds: its whole process
group's, read from /proc, plus this process's for the requests; its start is reported apart, as a run
pays it once). Each variant runs
--repeats times after a warm-up, alternated; the best of each is printed with the ratios to liger's
engine measured in the same run.

    .venv/bin/python bench/rollout_engines.py                 # 8 prompts x G 8, 32 new tokens
    .venv/bin/python bench/rollout_engines.py --prompts 4 --group 4 --new-tokens 16 --repeats 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def group_cpu(pgid: int) -> float:
    """User + system seconds of every live process in a process group (vLLM's server and its engine)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from liger_cli.generate.engine import Sampling, generate
    from liger_cli.generate.prompts import Renderer
    from liger_cli.generate.vllm_engine import VllmEngine
    from liger_cli.generate.vllm_server import free_port, server_command, server_env, start

    spec = importlib.util.spec_from_file_location("real_model", REPO / "scripts" / "real_model.py")
    real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real)
    folder = real.build(real.folder())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    renderer = Renderer(tokenizer, "chat")
    stops = renderer.stop_ids(model.generation_config)
    rows = [
        json.loads(line)
        for line in (REPO / "recipes" / "smollm2" / "grpo-train.jsonl").read_text().splitlines()
    ]
    prompts = [renderer.ids(r) for r in rows[: args.prompts] for _ in range(args.group)]
    keys = [f"0:{i // args.group}:{i % args.group}" for i in range(len(prompts))]
    sampling = Sampling(args.new_tokens, 1.0, seed=0)

    t0 = time.perf_counter()
    length = max(len(p) for p in prompts) + args.new_tokens
    server = start(
        server_command(folder, free_port(), max_model_len=length), Path("/tmp/bench-vllm.log"), server_env()
    )
    started = time.perf_counter() - t0
    engine = VllmEngine(server.url)

    def liger_engine():
        with torch.no_grad():
            return generate(
                model, prompts, sampling, stop_ids=stops, pad_id=tokenizer.pad_token_id, keys=keys
            )

    def transformers_generate():
        left = tokenizer.padding_side
        tokenizer.padding_side = "left"
        batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        tokenizer.padding_side = left
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=args.new_tokens, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return [row[batch["input_ids"].shape[1] :].tolist() for row in out]

    def vllm():
        return engine.complete(prompts, keys, sampling, stops)

    def tokens(found) -> int:
        ids = [c.ids if hasattr(c, "ids") else c for c in found]
        return sum(next((k + 1 for k, t in enumerate(seq) if t in stops), len(seq)) for seq in ids)

    variants = {"liger engine": (liger_engine, own_cpu), "transformers generate": (transformers_generate, own_cpu),
                "vllm server": (vllm, lambda: group_cpu(server.process.pid) + own_cpu())}  # fmt: skip
    best: dict[str, tuple[float, float, int]] = {}
    try:
        for run, _ in variants.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for name, (run, cpu) in variants.items():
                c0, w0 = cpu(), time.perf_counter()
                n = tokens(run())
                wall, used = time.perf_counter() - w0, cpu() - c0
                if name not in best or n / wall > best[name][2] / best[name][0]:
                    best[name] = (wall, used, n)
    finally:
        server.stop()
    threads = torch.get_num_threads()
    print(f"{args.prompts} prompts x G {args.group}, up to {args.new_tokens} new tokens, SmolLM2-135M-Instruct fp32, "
          f"torch threads {threads}; vLLM server started in {started:.0f} s (paid once per run)")  # fmt: skip
    base_wall = best["liger engine"][2] / best["liger engine"][0]
    base_cpu = best["liger engine"][2] / max(best["liger engine"][1], 1e-9)
    for name, (wall, used, n) in best.items():
        print(
            f"{name:22s} {n:5d} tokens  {n / wall:7.1f} tokens/s ({n / wall / base_wall:4.2f}x)  "
            f"{n / max(used, 1e-9):7.1f} tokens/CPU-s ({n / max(used, 1e-9) / base_cpu:4.2f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
