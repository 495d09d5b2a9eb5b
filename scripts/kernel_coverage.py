"""Walk every causal-LM model type of the installed transformers and check our kernels on each.

For each type: its config class's defaults, shrunk to a tiny twin (`liger_cli.twin.tiny`), the router's
auxiliary loss on where the config has one, one training step unpatched and then with every kernel
patched, each alone where they differ (`liger_cli.twin.kernel_check.compare_kernels`): the loss and
every gradient must agree, or the
kernel must be left alone by `patch_model` with a reason. A disagreement is "silently wrong", an
exception in a patched model is a crash; either exits 1.

    python scripts/kernel_coverage.py                    # writes docs/kernel-coverage.md
    python scripts/kernel_coverage.py --check --compare-docs   # the full sweep as a check (CI's pins)
    python scripts/kernel_coverage.py --json out.json --workers 2 --only llama,mixtral

`--check` also requires the coverage targets (every type once, every kernel patched or left alone with
a reason, >= 150 types built, >= 45 with all four kernels, the MoE router losses kept); `--compare-docs`
compares the table with the committed one instead of writing it. tests/test_kernel_sweep.py runs one
type per code path; this runs all of them.

Types run in worker processes (one crash or hang cannot stop the sweep).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOUR = ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy")
ALL = ("rms_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"


def check_type(model_type: str) -> dict:
    """Build the tiny twin of one model type and compare every kernel on it."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from transformers import AutoConfig
    from transformers.utils import logging

    from liger_cli.twin.kernel_check import compare_kernels, train_step
    from liger_cli.twin.tiny import TinyModelError, tiny_batch, tiny_causal_lm

    torch.set_num_threads(1)  # tiny tensors: one thread per worker, no spinning threads fighting
    logging.set_verbosity_error()
    start = time.perf_counter()
    row: dict = {"type": model_type}
    try:
        config = AutoConfig.for_model(model_type)
        if getattr(config, "is_decoder", None) is False and not getattr(config, "is_encoder_decoder", False):
            config.is_decoder = True  # what a causal-LM config of an encoder family says
        if hasattr(config, "output_router_logits"):
            config.output_router_logits = True
        model = tiny_causal_lm(config, image_text=False)
        row["class"] = type(model).__name__
        batch = tiny_batch(model)
        train_step(model, batch)
        if getattr(model.config, "output_router_logits", False):
            row["router_loss"] = True
    except (TinyModelError, Exception) as err:
        row["built"] = False
        row["reason"] = str(err) if isinstance(err, TinyModelError) else _first_line(err)
        return row
    row["built"] = True
    row["params"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    try:
        wrong, crashed, report = compare_kernels(
            lambda: tiny_causal_lm(config, image_text=False), batch, dict.fromkeys(ALL, True)
        )
    except Exception as err:
        row["crash"] = _first_line(err)
        return row
    row["wrong"], row["crashed"], row["report"] = wrong, crashed, report
    row["patched"] = [
        k for k in ALL if any(line.startswith(f"{k}: patched") for line in report) and k not in wrong
    ]
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _worker(tasks, results) -> None:
    sys.path.insert(0, str(ROOT))
    while True:
        try:
            model_type = tasks.get_nowait()
        except queue.Empty:
            return
        results.put((model_type, "start", None))
        try:
            results.put((model_type, "done", check_type(model_type)))
        except BaseException as err:  # the row says what happened; the worker goes on
            results.put((model_type, "done", {"type": model_type, "crash": _first_line(err)}))


def sweep(types: list[str], workers: int, timeout: float) -> list[dict]:
    """Run `check_type` over `types` in `workers` processes; a type that kills or hangs one is recorded."""
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for t in types:
        tasks.put(t)
    procs = [ctx.Process(target=_worker, args=(tasks, results), daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    rows, running = {}, {}
    while len(rows) < len(types):
        try:
            model_type, event, row = results.get(timeout=5)
        except queue.Empty:
            now = time.monotonic()
            for model_type, since in list(running.items()):
                if now - since > timeout:
                    rows[model_type] = {"type": model_type, "crash": f"no answer in {timeout:.0f} s"}
                    del running[model_type]
            if not any(p.is_alive() for p in procs) and not running:
                for t in types:
                    rows.setdefault(t, {"type": t, "crash": "its worker process died"})
            if running and all(not p.is_alive() for p in procs):
                for t in running:
                    rows[t] = {"type": t, "crash": "its worker process died"}
                running.clear()
            continue
        if event == "start":
            running[model_type] = time.monotonic()
        else:
            running.pop(model_type, None)
            rows[model_type] = row
    for p in procs:  # a worker ends once the queue is empty; only one that hangs is killed
        p.join(timeout=15)
        if p.is_alive():
            p.kill()
    return [rows[t] for t in types]


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _cell(row: dict, kernel: str) -> str:
    if kernel in row.get("wrong", {}):
        return "WRONG"
    if kernel in row.get("crashed", {}):
        return "CRASH"
    return "yes" if kernel in row.get("patched", []) else "-"


def markdown(rows: list[dict]) -> str:
    import transformers

    built = [r for r in rows if r.get("built")]
    full = [r for r in built if all(k in r.get("patched", []) for k in FOUR)]
    bad = [r for r in rows if r.get("wrong") or r.get("crashed") or r.get("crash")]
    lines = [
        "# Kernel coverage by model type",
        "",
        f"Generated by `python scripts/kernel_coverage.py` with transformers {transformers.__version__}: every",
        "causal-LM model type, built tiny from its own config class (router auxiliary loss on), one training",
        "step unpatched and with every kernel patched (each alone where they differ); the loss and every gradient",
        "compared. `yes`: patched and equal; `-`: left alone by `patch_model` (why: last column). Do not edit by",
        "hand.",
        "",
        f"**{len(rows)} types, {len(built)} built tiny, {len(full)} with all four of RMSNorm, RoPE, SwiGLU and the",
        f"fused loss patched; {len(bad)} silently wrong or crashing.**",
        "",
        "| type | class | RMSNorm | RoPE | SwiGLU | fused loss | CE | why not |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("built"):
            continue
        why = [
            line.split(": not patched: ", 1)[1]
            for line in r.get("report", [])
            if ": not patched: " in line and not line.startswith("cross_entropy")
        ]
        cells = " | ".join(_cell(r, k) for k in ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"))
        why_text = "; ".join(w.replace("|", "/") for w in why)[:400]
        lines.append(
            f"| {r['type']} | {r.get('class', '')} | {cells} | {_cell(r, 'cross_entropy')} | {why_text} |"
        )
    lines += ["", "## Types that cannot be built tiny", "", "| type | why |", "|---|---|"]
    for r in rows:
        if not r.get("built") and not r.get("crash"):
            lines.append(f"| {r['type']} | {r.get('reason', '').replace('|', '/')[:300]} |")
    return "\n".join(lines) + "\n"


MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def target_failures(rows: list[dict], all_types: list[str]) -> list[str]:
    """What `--check` requires of a full sweep, beyond no type wrong or crashing."""
    failures = []
    if [r["type"] for r in rows] != all_types:
        failures.append("the rows are not every causal-LM type, once each, in order")
    built = [r for r in rows if r.get("built")]
    if len(built) < 150:
        failures.append(f"only {len(built)} types built tiny (target 150)")
    for r in rows:
        if not r.get("built"):
            if not r.get("reason") and not r.get("crash"):
                failures.append(f"{r['type']}: not built, and no reason")
            continue
        for kernel in FOUR:
            line = next((line for line in r.get("report", []) if line.startswith(kernel + ":")), "")
            if kernel not in r.get("patched", []) and ": not patched: " not in line:
                failures.append(
                    f"{r['type']}: {kernel} neither patched nor left alone with a reason: {line!r}"
                )
    full = [r for r in built if all(k in r.get("patched", []) for k in FOUR)]
    if len(full) < 45:
        failures.append(f"only {len(full)} types with all four kernels (target 45)")
    by_type = {r["type"]: r for r in rows}
    for moe in MOE:
        row = by_type.get(moe, {})
        if not (row.get("router_loss") and all(k in row.get("patched", []) for k in FOUR)):
            failures.append(f"{moe}: router loss off or a kernel not patched")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one type may take")
    parser.add_argument("--only", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--markdown", type=Path, default=ROOT / "docs" / "kernel-coverage.md")
    parser.add_argument("--no-markdown", action="store_true")
    parser.add_argument("--check", action="store_true", help="also require the coverage targets")
    parser.add_argument(
        "--compare-docs", action="store_true", help="compare the table with --markdown instead of writing it"
    )
    args = parser.parse_args()
    if args.check and args.only:
        parser.error("--check is for the full sweep: leave out --only")
    types = [t for t in args.only.split(",") if t] or causal_lm_types()
    start = time.perf_counter()
    rows = sweep(types, args.workers, args.timeout)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    failures = target_failures(rows, causal_lm_types()) if args.check else []
    if args.compare_docs:
        if not args.markdown.is_file() or args.markdown.read_text() != markdown(rows):
            failures.append(f"{args.markdown} is stale: run python scripts/kernel_coverage.py")
    elif not args.no_markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(rows))
    built = [r for r in rows if r.get("built")]
    full = [r for r in built if all(k in r.get("patched", []) for k in FOUR)]
    bad = [r for r in rows if r.get("wrong") or r.get("crashed") or r.get("crash")]
    print(
        f"{len(rows)} types, {len(built)} built, {len(full)} with all four kernels, "
        f"{len(bad)} wrong or crashing ({time.perf_counter() - start:.0f} s)"
    )
    for r in bad:
        print(f"  {r['type']}: {r.get('wrong') or r.get('crashed') or r.get('crash')}")
    for failure in failures:
        print(f"  check: {failure}")
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())
