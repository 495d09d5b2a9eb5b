"""`data.streaming: true`: the stream encodes exactly as the cached path, seeks to a saved position,
gives each rank its share of the global micro-batch, and refuses what it cannot do (the refusals in this
process, `liger_here`: the real processes of `train` and `data` refusing are test_recipe.py's and
test_user_errors.py's)."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_chat_templates import QWEN3_CHAT, TOOL_CHAT, TWO_TURNS, family_tokenizer
from test_output_safety import one_line_error
from test_train import liger_here

from liger_cli.data import prepare_data
from liger_cli.data.stream import START, StreamBatches, encoded_stream
from liger_cli.errors import UserError

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"


@pytest.fixture
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QUICKSTART / "model")


def cfg(train, fmt="instruction", max_seq_len=64, **kw):
    settings = dict(train=train, eval=None, eval_fraction=None, format=fmt, max_seq_len=max_seq_len,
                    packing=False, cache=False)  # fmt: skip
    return SimpleNamespace(**(settings | kw))


def instruction_rows(n: int) -> list[dict]:
    """Short answers, a few long ones (truncated), and every 7th with a prompt so long that its answer
    is cut away (dropped): rows and kept examples do not line up."""
    found = []
    for i in range(n):
        prompt = "Write the number in words. " * (30 if i % 7 == 3 else 1)
        answer = f"n{i}" + (" and more words" * 12 if i % 5 == 1 else "")
        found.append({"instruction": prompt, "input": str(i), "output": answer})
    return found


def write_jsonl(path: Path, rows: list[dict], blank_every: int = 0) -> Path:
    lines = []
    for i, row in enumerate(rows):
        lines.append(json.dumps(row) + "\n")
        if blank_every and i % blank_every == 0:
            lines.append("\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict], row_group_size: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def cached(path: Path, tokenizer, **kw) -> list[tuple]:
    train, _ = prepare_data(cfg(path, **kw), tokenizer, seed=0)
    return [(ex["input_ids"], ex["labels"]) for ex in train.examples]


def streamed(path: Path, tokenizer, n: int, start=START, **kw) -> list[tuple]:
    stream = encoded_stream(path, kw.pop("fmt", "instruction"), cfg(path, **kw), tokenizer, start)
    return [(ex["input_ids"], ex["labels"]) for ex, _ in islice(stream, n)]


# ------------------------------------------------------------------------------ the same examples
def test_instruction_rows_stream_exactly_as_the_cached_path_encodes_them(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", instruction_rows(40), blank_every=9)
    want = cached(path, tok)
    assert len(want) < 40  # some rows are dropped
    assert streamed(path, tok, len(want)) == want
    # the stream then starts its second pass at the first example
    assert streamed(path, tok, len(want) + 2)[-2:] == want[:2]


def test_chat_rows_stream_exactly_as_the_cached_path_encodes_them(tmp_path):
    """Tool calls beside plain turns (Arrow adds null keys to the cached path's rows), reasoning, and
    truncation: identical input_ids and labels, example by example."""
    chats = [TWO_TURNS, TOOL_CHAT, QWEN3_CHAT] * 3
    for family, max_len in (("chatml", 512), ("qwen3", 512), ("chatml", 90)):
        tok = family_tokenizer(family)
        path = write_jsonl(tmp_path / f"{family}{max_len}.jsonl", [{"messages": m} for m in chats])
        want = cached(path, tok, fmt="chat", max_seq_len=max_len)
        got = streamed(path, tok, len(want), fmt="chat", max_seq_len=max_len)
        assert got == want, family
        assert (
            streamed(path, tok, 1, fmt="chat", max_seq_len=max_len, learn_turns="last")
            == cached(path, tok, fmt="chat", max_seq_len=max_len, learn_turns="last")[:1]
        )


def test_parquet_streams_as_its_rows_encode(tok, tmp_path):
    rows = instruction_rows(30)
    want = cached(write_jsonl(tmp_path / "a.jsonl", rows), tok)
    path = write_parquet(tmp_path / "a.parquet", rows, row_group_size=4)
    assert cached(path, tok) == want
    assert streamed(path, tok, len(want)) == want


# ------------------------------------------------------------------------------ positions
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "folder"])
def test_a_saved_position_continues_the_stream_exactly(tok, tmp_path, kind):
    rows = instruction_rows(50)
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "a.jsonl", rows, blank_every=4)
    elif kind == "parquet":
        path = write_parquet(tmp_path / "a.parquet", rows, row_group_size=6)
    else:
        path = tmp_path / "shards"
        path.mkdir()
        for k in range(3):
            write_jsonl(path / f"part-{k}.jsonl", rows[k * 17 : (k + 1) * 17])
    whole = list(islice(encoded_stream(path, "instruction", cfg(path), tok), 90))  # into the second pass
    for k in (0, 13, 37, 60):
        position = json.loads(json.dumps(whole[k][1]))  # as a checkpoint stores it
        rest = streamed(path, tok, 90 - k - 1, start=position)
        assert rest == [(ex["input_ids"], ex["labels"]) for ex, _ in whole[k + 1 :]], k
    assert whole[60][1]["pass"] == 1


def test_a_jsonl_position_seeks_and_reads_nothing_before_it(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", instruction_rows(200))  # more rows than a chunk reads
    (_, at), *_ = islice(encoded_stream(path, "instruction", cfg(path), tok), 1)
    with path.open("r+b") as f:  # the first row is now unreadable: a seek never reads it again
        f.write(b"{" * len(path.read_bytes().split(b"\n")[0]))
    next(encoded_stream(path, "instruction", cfg(path), tok, at))
    with pytest.raises(UserError, match="line 1: invalid JSON"):
        next(encoded_stream(path, "instruction", cfg(path), tok))


# ------------------------------------------------------------------------------ ranks and the thread
def test_ranks_share_each_global_micro_batch_as_one_process_sees_it(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", instruction_rows(30))

    def opener(position):
        return encoded_stream(path, "instruction", cfg(path), tok, position)

    one = StreamBatches(opener, 6, 1, 0)
    ranks = [StreamBatches(opener, 2, 3, r) for r in range(3)]
    for g in range(8):  # past the end of the first pass
        together = [ex for r in ranks for ex in r.examples(g)]
        assert together == one.examples(g), g
        assert {json.dumps(r.position()) for r in ranks} == {json.dumps(one.position())}
    assert one.position()["examples"] == 48
    for b in [one, *ranks]:
        b.close()


def test_batches_resume_from_a_position(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", instruction_rows(30))

    def opener(position):
        return encoded_stream(path, "instruction", cfg(path), tok, position)

    straight = StreamBatches(opener, 4, 1, 0)
    seen = [straight.examples(g) for g in range(6)]
    resumed = StreamBatches(opener, 4, 1, 0)
    first = StreamBatches(opener, 4, 1, 0)
    first.examples(0), first.examples(1)
    resumed.seek(json.loads(json.dumps(first.position())), 2)
    assert [resumed.examples(g) for g in range(2, 6)] == seen[2:]
    assert resumed.probe(3) == seen[0][:3]
    for b in (straight, resumed, first):
        b.close()


def test_a_bad_row_read_on_the_thread_is_the_usual_error_in_the_loop(tok, tmp_path):
    rows = instruction_rows(200)
    rows[150] = {"instruction": "x", "output": 5}
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(UserError) as cached_error:
        prepare_data(cfg(path), tok, seed=0)
    batches = StreamBatches(lambda p: encoded_stream(path, "instruction", cfg(path), tok, p), 8, 1, 0)
    with pytest.raises(UserError) as stream_error:
        for g in range(100):
            batches.examples(g)
    assert str(stream_error.value) == str(cached_error.value)
    assert "row 151" in str(stream_error.value)


# ------------------------------------------------------------------------------ what it refuses
@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("training.epochs=1", "data.streaming needs training.max_steps"),
        ("data.eval_fraction=0.1", "data.streaming does not support data.eval_fraction"),
        ("data.packing=true", "data.streaming does not support data.packing"),
        ("data.train=org/name", "is a Hub dataset name"),
        ("data.train=x.csv", "reads .jsonl and .parquet files"),
    ],
)
def test_what_streaming_cannot_do_is_one_line_exit_2(tmp_path, change, says):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{path: {QUICKSTART / 'model'}}}\n"
        f"data: {{train: {QUICKSTART / 'data' / 'train.jsonl'}, format: instruction, streaming: true}}\n"
        f"training: {{max_steps: 2}}\noutput: {{dir: {tmp_path / 'out'}}}\n"
    )
    overrides = ["--set", change]
    if change.startswith("training.epochs"):
        overrides = ["--set", "training.max_steps=null", *overrides]
    line = one_line_error(liger_here("train", str(recipe), "--dry-run", *overrides))
    assert says in line, line


def test_a_list_of_sources_is_refused_while_streaming(tmp_path):
    from pydantic import ValidationError

    from liger_cli.recipe.data_section import DataSection

    data = str(QUICKSTART / "data" / "train.jsonl")
    with pytest.raises(ValidationError, match="one train source"):
        DataSection(train=[data, data], streaming=True)
    DataSection(train=data, streaming=True)


def test_liger_data_refuses_a_streaming_recipe_and_says_how_to_check_a_sample(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{path: {QUICKSTART / 'model'}}}\n"
        f"data: {{train: {QUICKSTART / 'data' / 'train.jsonl'}, format: instruction, streaming: true}}\n"
        "training: {max_steps: 2}\n"
    )
    line = one_line_error(liger_here("data", str(recipe)))
    assert "data.streaming" in line and "--set data.streaming=false" in line, line
