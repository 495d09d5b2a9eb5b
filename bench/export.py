"""`liger export` on a finished run: the GGUF's size and verification figures per type, and llama.cpp's
generation speed on it against liger's engine on the same merged model and prompts, both measured here.

    python bench/export.py                                  # runs/quickstart (the README's quickstart)
    python bench/export.py --source runs/dpo --quants f16 q8_0 --max-new-tokens 64

Each type is a real `liger export` (merge, write, llama.cpp's quantizer, the whole verification). Speed:
the run's eval prompts completed greedily, one sequence at a time, by llama.cpp (llama-cpp-python's
`generate`, the f16 file, threads = CPU cores) and by liger's engine (the merged model in f32, one
sequence at a time and the whole batch at once); tokens per second count generated tokens only, and the
two engines generate the same tokens (the export verified it), so the ratio is of equal work.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def exports(source: Path, quants: list[str], root: Path) -> list[dict]:
    from liger_cli.export.command import export_gguf

    rows = []
    for quant in quants:
        done = export_gguf(source, root / quant, quant=quant, say=lambda line: None)
        rows.append({"quant": quant, "path": done.path, "MiB": done.path.stat().st_size / 2**20,
                     **done.report.as_dict()})  # fmt: skip
    return rows


def prompts_of(source: Path, count: int):
    """The run's first `count` eval prompts as training rendered them, its stop ids and its tokenizer."""
    from liger_cli.export.command import without_answer
    from liger_cli.generate.load import chat_or_text, find_target, load_tokenizer_for
    from liger_cli.generate.prompts import Renderer

    target = find_target(source)
    tokenizer = load_tokenizer_for(target)
    renderer = Renderer(tokenizer, chat_or_text(target, tokenizer))
    rows = []
    for entry in target.recipe.data.entries("eval"):
        rows += [json.loads(line) for line in Path(str(entry.path)).read_text().splitlines() if line.strip()]
    return [renderer.ids(without_answer(r)) for r in rows[:count]], renderer.stop_ids(), tokenizer


def llama_speed(
    path: Path, prompts, stops, max_new_tokens: int, threads: int
) -> tuple[float, list[list[int]]]:
    from llama_cpp import Llama

    from liger_cli.export.runtime import binding

    binding()
    model = Llama(model_path=str(path), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    outs, start = [], time.perf_counter()
    for prompt in prompts:
        model.reset()
        out = []
        for token in model.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(token)
            if token in stops or len(out) == max_new_tokens:  # llama.cpp's EOG set: equal (verified)
                break
        outs.append(out)
    seconds = time.perf_counter() - start
    model.close()
    return sum(map(len, outs)) / seconds, outs


def engine_speed(folder: Path, prompts, stops, pad: int, max_new_tokens: int, batched: bool):
    import torch
    from transformers import AutoModelForCausalLM

    from liger_cli.generate.engine import Sampling, generate

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=0)
    start = time.perf_counter()
    groups = [prompts] if batched else [[p] for p in prompts]
    outs = [c.ids for group in groups for c in generate(model, group, sampling, stop_ids=stops, pad_id=pad)]
    return sum(map(len, outs)) / (time.perf_counter() - start), outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=REPO / "runs" / "quickstart")
    parser.add_argument(
        "--quants", nargs="+", default=["f32", "f16", "bf16", "q8_0", "q6_k", "q4_k_m", "q2_k"]
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    if not (args.source / "recipe.yaml").is_file():
        sys.exit(f"{args.source}: not a finished run; train one first (liger train recipes/quickstart.yaml)")
    import torch

    from liger_cli import process_state
    from liger_cli.export.runtime import threads
    from liger_cli.merge import merge_adapter

    process_state.quiet_libraries()
    root = Path(tempfile.mkdtemp(prefix="liger-export-bench-"))
    try:
        rows = exports(args.source, args.quants, root)
        print("| type | file MiB | greedy agreement | mean KL | largest log-prob diff | positions |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['quant']} | {r['MiB']:.2f} | {r['agreement']:.1%} | {r['mean_kl']:.2g} | "
                  f"{r['largest_logprob_diff']:.2g} | {r['positions']} |")  # fmt: skip
        prompts, stops, tokenizer = prompts_of(args.source, args.prompts)
        merged = root / "merged"
        folder = (
            merged if (args.source / "final" / "adapter_config.json").is_file() else args.source / "final"
        )
        if folder == merged:
            merge_adapter(args.source, merged)
        torch.set_num_threads(threads())
        f16 = next((r["path"] for r in rows if r["quant"] == "f16"), rows[0]["path"])
        llama_tps, llama_out = llama_speed(f16, prompts, stops, args.max_new_tokens, threads())
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
        one_tps, one_out = engine_speed(folder, prompts, stops, pad, args.max_new_tokens, batched=False)
        batch_tps, _ = engine_speed(folder, prompts, stops, pad, args.max_new_tokens, batched=True)
        same = sum(a == b for a, b in zip(llama_out, one_out, strict=True))
        print(f"\n{len(prompts)} eval prompts, greedy, up to {args.max_new_tokens} new tokens, {threads()} threads "
              f"({same} of {len(prompts)} completions identical):")  # fmt: skip
        print("| engine | tokens/s | vs liger, one at a time |")
        print("|---|---|---|")
        print(
            f"| llama.cpp ({Path(f16).name}), one at a time | {llama_tps:.0f} | {llama_tps / one_tps:.2f}x |"
        )
        print(f"| liger engine (f32), one at a time | {one_tps:.0f} | 1.00x |")
        print(
            f"| liger engine (f32), {len(prompts)} at once | {batch_tps:.0f} | {batch_tps / one_tps:.2f}x |"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
