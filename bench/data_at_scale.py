"""Data at scale: tokenizing a 100k-row chat file (first run, cached start, TRL's SFT preprocessing, the
default number of processes, a cached `liger data`) and the peak memory of streaming files of two sizes.

    python bench/data_at_scale.py [--rows 100000] [--trl-python /path/to/.venv-trl/bin/python]
                                  [--stream-rows 10000 40000] [--no-stream]

(a) Writes a synthetic, deterministic chat jsonl (system, user, assistant, user, assistant) and, each in a
    fresh process, times `liger_cli.data.prepare_data` (the function `liger train` and `liger data` call)
    with one tokenizing process and an empty cache (tokenizes and writes the cache), then again (reads
    the cache); when `--trl-python` names an interpreter with `trl`, TRL's `SFTTrainer._prepare_dataset`
    on the same file (one process, its default; a note says so when it is absent); the first run again
    with the default `data.num_proc` (an empty cache of its own); and the whole `liger data RECIPE`
    process on the cached entry against a process that only imports what it needs and loads the same
    tokenizer (best of 3 each). Tokenizer: the quickstart model's (recipes/quickstart/model).
(b) Streams text files of two sizes through `liger_cli.data.stream.encoded_stream` (one whole pass) in a
    fresh process each and reports the peak RSS and its growth over the process's RSS before streaming;
    the cached path (`prepare_data`, cache off) on the same files for contrast. `--no-stream` skips it.
Results are printed and written to bench/results/data_at_scale.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "recipes" / "quickstart" / "model"
RESULTS = REPO / "bench" / "results"
ONES = "zero one two three four five six seven eight nine".split()


def words(n: int) -> str:
    return " ".join(ONES[int(d)] for d in str(n))


def write_chat(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(rows):
            a, b = rng.randrange(10**6), rng.randrange(10**6)
            messages = [
                {"role": "system", "content": "Write numbers in words."},
                {"role": "user", "content": str(a)},
                {"role": "assistant", "content": words(a)},
                {"role": "user", "content": str(b)},
                {"role": "assistant", "content": words(b)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def write_text(path: Path, rows: int) -> None:
    rng = random.Random(1)
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(words(rng.randrange(10**6)) for _ in range(60))}) + "\n")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ------------------------------------------------------------------------------ children (one measure each)
def child_liger(file: Path, cache: Path, fmt: str, cache_on: bool, num_proc: int | None = None) -> dict:
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from liger_cli.data import prepare_data

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = SimpleNamespace(train=file, eval=None, eval_fraction=None, format=fmt, max_seq_len=512,
                          packing=False, cache=cache_on, cache_dir=cache, num_proc=num_proc)  # fmt: skip
    before = rss_mb()
    start = time.perf_counter()
    train, _ = prepare_data(cfg, tok, seed=0)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "cache": train.cache.split(" ")[0], "examples": len(train.examples),
            "processes": train.processes, "rss_before_mb": before, "peak_rss_mb": peak}  # fmt: skip


def child_stream(file: Path, fmt: str) -> dict:
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from liger_cli.data.stream import encoded_stream

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = SimpleNamespace(format=fmt, max_seq_len=512)
    before = rss_mb()
    start, n = time.perf_counter(), 0
    for _, at in encoded_stream(file, fmt, cfg, tok):
        if at["pass"] > 0:
            break
        n += 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "seconds": time.perf_counter() - start,
        "examples": n,
        "rss_before_mb": before,
        "peak_rss_mb": peak,
    }


TRL_CHILD = """
import json, sys, tempfile, time
from types import SimpleNamespace
from datasets import load_dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer
import trl
file, tokenizer = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(tokenizer)
start = time.perf_counter()
ds = load_dataset("json", data_files=file, split="train", cache_dir=tempfile.mkdtemp())
args = SFTConfig(output_dir=tempfile.mkdtemp(), max_length=512, report_to=[], use_cpu=True, bf16=False)
stub = SimpleNamespace(_tokenizer=tok, chat_template=None, completion_only_loss=None)
out = SFTTrainer._prepare_dataset(stub, ds, tok, args, False, None, "train")
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "examples": len(out), "trl": trl.__version__}))
"""


def run_child(argv: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {' '.join(argv)}\n{proc.stderr[-3000:]}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    found["process_s"] = time.perf_counter() - start  # the whole fresh process: imports, tokenizer, data
    return found


def me(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--trl-python", type=Path, default=None)
    parser.add_argument("--stream-rows", type=int, nargs=2, default=[10_000, 40_000])
    parser.add_argument("--child", choices=["liger", "stream"], default=None)
    parser.add_argument("--file", type=Path)
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--format", default="chat")
    parser.add_argument("--cache-off", action="store_true")
    parser.add_argument("--num-proc", type=int, default=1, help="0: the default (liger_cli.data.processes)")
    parser.add_argument("--no-stream", action="store_true", help="skip (b)")
    parser.add_argument("--only-data-command", action="store_true",
                        help="build the cache, then only the cached `liger data` process against the bare imports")  # fmt: skip
    a = parser.parse_args()
    if a.child == "liger":
        print(json.dumps(child_liger(a.file, a.cache, a.format, not a.cache_off, a.num_proc or None)))
        return
    if a.child == "stream":
        print(json.dumps(child_stream(a.file, a.format)))
        return

    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="liger-data-at-scale-"))
    chat, cache = work / "chat.jsonl", work / "cache"
    write_chat(chat, a.rows)
    results: dict = {"rows": a.rows, "file_mb": chat.stat().st_size / 2**20}
    print(f"(a) {a.rows} chat rows, {results['file_mb']:.1f} MiB, tokenizer {TOKENIZER.name}")
    liger = lambda cache_dir, procs: run_child(  # noqa: E731
        me("--child", "liger", "--file", str(chat), "--cache", str(cache_dir), "--num-proc", str(procs))
    )
    results["liger_first"] = liger(cache, 1)
    if a.only_data_command:
        results["data_command"] = cli = data_command(work, chat, cache)
        _print_data_command(cli)
        return
    results["liger_cached"] = liger(cache, 1)
    first, hit = results["liger_first"], results["liger_cached"]
    assert first["cache"] == "built" and hit["cache"] == "hit", (first, hit)
    print(f"  liger first run, 1 process (tokenize + write cache): {first['seconds']:.2f} s  "
          f"({first['process_s']:.1f} s process)")  # fmt: skip
    print(f"  liger cached start (read cache):                   {hit['seconds']:.2f} s  "
          f"({hit['process_s']:.1f} s process)")  # fmt: skip
    print(f"  cached / first: {hit['seconds'] / first['seconds']:.3f}x")
    if a.trl_python is not None and a.trl_python.exists():
        trl = run_child([str(a.trl_python), "-c", TRL_CHILD, str(chat), str(TOKENIZER)])
        results["trl"] = trl
        print(f"  TRL {trl['trl']} SFT _prepare_dataset, 1 process:      {trl['seconds']:.2f} s  "
              f"({trl['process_s']:.1f} s process)")  # fmt: skip
        print(f"  liger first / TRL: {first['seconds'] / trl['seconds']:.2f}x")
    else:
        print("  TRL: skipped (no --trl-python interpreter given or found)")
    results["liger_first_default"] = default = liger(work / "cache-default", 0)
    print(f"  liger first run, default num_proc ({default['processes']} processes): {default['seconds']:.2f} s; "
          f"against 1 process: {default['seconds'] / first['seconds']:.2f}x")  # fmt: skip
    results["data_command"] = cli = data_command(work, chat, cache)
    _print_data_command(cli)
    if a.no_stream:
        _write(results)
        return

    print(f"(b) streaming memory, text rows of about 2 KiB, {a.stream_rows[0]} and {a.stream_rows[1]} rows")
    results["stream"] = []
    for rows in a.stream_rows:
        text = work / f"text-{rows}.jsonl"
        write_text(text, rows)
        mb = text.stat().st_size / 2**20
        streamed = run_child(me("--child", "stream", "--file", str(text), "--format", "text"))
        whole = run_child(me("--child", "liger", "--file", str(text), "--format", "text", "--cache-off",
                             "--cache", str(cache)))  # fmt: skip
        results["stream"].append({"rows": rows, "file_mb": mb, "streaming": streamed, "cached_path": whole})
        print(f"  {mb:6.1f} MiB file: streaming peak RSS {streamed['peak_rss_mb']:.0f} MiB "
              f"(+{streamed['peak_rss_mb'] - streamed['rss_before_mb']:.0f} over start), cached path "
              f"{whole['peak_rss_mb']:.0f} MiB (+{whole['peak_rss_mb'] - whole['rss_before_mb']:.0f})")  # fmt: skip
    small, large = results["stream"]
    grow = lambda r: r["peak_rss_mb"] - r["rss_before_mb"]  # noqa: E731
    print(f"  file {large['file_mb'] / small['file_mb']:.1f}x larger: streaming growth "
          f"{grow(large['streaming']) - grow(small['streaming']):+.0f} MiB, cached path growth "
          f"{grow(large['cached_path']) - grow(small['cached_path']):+.0f} MiB")  # fmt: skip
    _write(results)


def _write(results: dict) -> None:
    out = RESULTS / "data_at_scale.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


BARE_IMPORTS = "datasets, numpy, pyarrow, pydantic, rich, yaml, and the tokenizer loaded by AutoTokenizer"


def _print_data_command(cli: dict) -> None:
    print(f"  cached `liger data` process: {cli['liger_data_s']:.2f} s wall, {cli['liger_data_cpu_s']:.2f} s CPU; "
          f"the bare imports it needs ({cli['imports']}): {cli['imports_s']:.2f} s wall, "
          f"{cli['imports_cpu_s']:.2f} s CPU; difference {cli['liger_data_s'] - cli['imports_s']:.2f} s wall, "
          f"{cli['liger_data_cpu_s'] - cli['imports_cpu_s']:.2f} s CPU")  # fmt: skip


def data_command(work: Path, chat: Path, cache: Path, repeats: int = 5) -> dict:
    """The whole `liger data RECIPE` process on the cached entry, against a process that only imports
    what it needs (best of `repeats` each, interleaved). Wall time and the child's CPU time (user +
    system, from the kernel's accounting of the reaped child): on a shared machine the wall time of
    the same imports moves by seconds from one process to the next, the CPU time far less."""
    recipe = work / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": {"path": str(TOKENIZER), "dtype": "float32"},
                "data": {"train": str(chat), "format": "chat", "max_seq_len": 512, "cache_dir": str(cache)},
                "training": {"max_steps": 1, "micro_batch_size": 1, "seed": 0},
                "output": {"dir": str(work / "out")},
            }
        )
    )
    liger = [str(Path(sys.executable).with_name("liger")), "data", str(recipe)]
    imports = [sys.executable, "-c", "import datasets, numpy, pyarrow, pydantic, rich, yaml\n"
               f"from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained({str(TOKENIZER)!r})"]  # fmt: skip
    times: dict[str, list[float]] = {
        "liger_data_s": [],
        "imports_s": [],
        "liger_data_cpu_s": [],
        "imports_cpu_s": [],
    }
    for _ in range(repeats):
        for name, argv in (("liger_data_s", liger), ("imports_s", imports)):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            times[name.replace("_s", "_cpu_s")].append(cpu)
            if proc.returncode != 0:
                raise SystemExit(f"failed: {' '.join(argv)}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
            times[name].append(time.perf_counter() - start)
            if name == "liger_data_s":
                assert "cache: hit" in proc.stdout, proc.stdout
    return {name: min(found) for name, found in times.items()} | {"imports": BARE_IMPORTS}


if __name__ == "__main__":
    main()
