"""Statistics as column operations (liger_cli.data.columns) against the row-by-row Python they replace,
the default number of tokenizing processes, and what `liger data` imports before the data is ready."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from liger_cli.data import columns, prepare_data, processes
from liger_cli.data.encode import IGNORE_INDEX, pack_examples
from liger_cli.data.report import report_text

QUICKSTART_MODEL = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "model"


@pytest.fixture(scope="module")
def quickstart_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QUICKSTART_MODEL)


def random_examples(rng: random.Random, n: int) -> dict[str, list]:
    ids, labels = [], []
    for _ in range(n):
        length = rng.choice([0, 1, 2, rng.randint(3, 40)])
        ids.append([rng.randrange(100) for _ in range(length)])
        labels.append([t if rng.random() < 0.4 else IGNORE_INDEX for t in ids[-1]])
    return {"input_ids": ids, "labels": labels, "length": [len(x) + rng.randint(0, 5) for x in ids]}


def test_column_statistics_equal_the_python_loops_on_a_selection():
    import datasets

    rng = random.Random(0)
    table = datasets.Dataset.from_dict(random_examples(rng, 300))
    order = rng.sample(range(300), 200)  # a selection: an indices mapping over the table
    picked = table.select(order)
    rows = [table[i] for i in order]
    assert columns.list_lengths(picked, "input_ids").tolist() == [len(r["input_ids"]) for r in rows]
    assert columns.numbers(picked, "length").tolist() == [r["length"] for r in rows]
    expected = [sum(1 for label in r["labels"][1:] if label != IGNORE_INDEX) for r in rows]
    assert columns.learned_per_example(picked, "labels").tolist() == expected


@pytest.mark.parametrize("max_seq_len", [8, 40, 64])
def test_pack_starts_are_the_rows_of_the_greedy_packer(max_seq_len):
    rng = random.Random(max_seq_len)
    lengths = [rng.randint(1, max_seq_len) for _ in range(500)]
    examples = [{"input_ids": [1] * n, "labels": [1] * n} for n in lengths]
    packed = pack_examples(examples, max_seq_len)
    starts = columns.pack_starts(np.array(lengths), max_seq_len).tolist()
    assert len(starts) == len(packed)
    sizes = [b - a for a, b in zip(starts, [*starts[1:], len(lengths)], strict=True)]
    assert sizes == [row["position_ids"].count(0) for row in packed]


def test_histogram_counts_equal_the_python_loop():
    rng = random.Random(2)
    lengths = [rng.randint(0, 300) for _ in range(1000)]
    for max_seq_len, bins in ((256, 8), (100, 8), (7, 8)):
        width = -(-max_seq_len // bins)
        expected = [0] * (bins + 1)
        for n in lengths:
            expected[min((n - 1) // width, bins) if n <= max_seq_len else bins] += 1
        assert columns.histogram(np.array(lengths), max_seq_len, bins).tolist() == expected


def chat_rows(n: int) -> list[dict]:
    rows = []
    for k in range(n):
        messages = [{"role": "system", "content": "Write numbers in words."}]
        for j in range(1 + k % 3):
            messages += [
                {"role": "user", "content": str(10 * k + j)},
                {"role": "assistant", "content": " ".join(["one"] * (1 + (k + j) % 9))},
            ]
        rows.append({"messages": messages})
    return rows


def chat_config(tmp_path, rows, **options):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return SimpleNamespace(train=path, eval=None, eval_fraction=None, format="chat", max_seq_len=40,
                           packing=False, cache=False, **options)  # fmt: skip


def test_the_report_counts_what_the_examples_hold(tmp_path, quickstart_tokenizer):
    train, _ = prepare_data(chat_config(tmp_path, chat_rows(60), num_proc=1), quickstart_tokenizer, seed=0)
    examples = [train.examples[k] for k in range(len(train.examples))]
    tokens = sum(len(ex["input_ids"]) for ex in examples)
    learned = sum(sum(1 for label in ex["labels"][1:] if label != IGNORE_INDEX) for ex in examples)
    packed = pack_examples(examples, 40)
    text = report_text("train", train)
    assert f"tokens: {tokens:,}, learned {learned:,} " in text
    assert f"packing: true would fill {len(packed):,} rows of 40" in text
    lengths = sorted(ex["length"] for ex in examples)
    assert f"min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]}" in text
    assert "tokenized: by 1 process\n" in text + "\n"


def test_two_processes_tokenize_the_same_table_and_the_report_says_so(tmp_path, quickstart_tokenizer):
    rows = chat_rows(80)
    one, _ = prepare_data(chat_config(tmp_path, rows, num_proc=1), quickstart_tokenizer, seed=0)
    two, _ = prepare_data(chat_config(tmp_path, rows, num_proc=2), quickstart_tokenizer, seed=0)
    for name in ("input_ids", "labels", "row", "length"):
        assert two.examples[name][:] == one.examples[name][:]
    assert two.processes == 2 and "tokenized: by 2 processes" in report_text("train", two)


def test_num_proc_defaults_to_the_usable_cores_and_rows_worth_a_process(monkeypatch):
    monkeypatch.setattr(processes, "usable_cores", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    default = SimpleNamespace(num_proc=None)
    per = processes.MIN_ROWS_PER_PROCESS
    assert processes.tokenizing_processes(default, 100_000) == 8
    assert processes.tokenizing_processes(default, 3 * per + 1) == 3
    assert processes.tokenizing_processes(default, per - 1) == 1
    assert processes.tokenizing_processes(SimpleNamespace(num_proc=3), 10) == 3
    # cache off: every process of the machine tokenizes, so they share the cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert processes.tokenizing_processes(SimpleNamespace(num_proc=None, cache=False), 100_000) == 2
    assert processes.tokenizing_processes(default, 100_000) == 8  # cache on: the main process alone


def test_the_data_command_modules_import_neither_torch_nor_a_model():
    code = (
        "import sys\n"
        "import liger_cli.data.report, liger_cli.data.build, liger_cli.data.chat_batch, liger_cli.recipe\n"
        "print(sorted(m for m in ('torch', 'accelerate', 'peft', 'liger_kernels') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_pack_table_is_pack_examples_over_each_chunk_of_examples():
    import datasets

    rng = random.Random(5)
    examples = []
    for _ in range(2300):  # three chunks of 1000, so packed rows never cross a chunk's end
        n = rng.randint(2, 30)
        ids = [rng.randrange(1000) for _ in range(n)]
        examples.append(
            {"input_ids": ids, "labels": [t if rng.random() < 0.5 else IGNORE_INDEX for t in ids]}
        )
    table = datasets.Dataset.from_list(examples)
    expected = [row for k in range(0, 2300, 1000) for row in pack_examples(examples[k : k + 1000], 64)]
    packed = columns.pack_table(table.select(range(2300)), 64, chunk=1000)
    assert len(packed) == len(expected)
    for name in ("input_ids", "labels", "position_ids"):
        assert packed[name][:] == [row[name] for row in expected]
    assert str(packed.features["input_ids"]) == str(
        datasets.Dataset.from_list(expected).features["input_ids"]
    )
