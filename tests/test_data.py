"""The data pipeline: label masks token by token, truncation, packing without attention leaks, the
eval split, and a precise error for every kind of malformed data."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from liger_cli.data import build_datasets, encode, prepare_data
from liger_cli.data.encode import IGNORE_INDEX, collate, pack_examples, render_instruction_prompt
from liger_cli.errors import UserError

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path_factory, monkeypatch):
    """Keep `datasets`' arrow cache for our throwaway files out of the user's cache folder."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf-datasets")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QUICKSTART / "model")


def cfg(train, fmt="instruction", max_seq_len=64, packing=False, eval=None, eval_fraction=None):
    return SimpleNamespace(
        train=Path(train),
        eval=eval,
        eval_fraction=eval_fraction,
        format=fmt,
        max_seq_len=max_seq_len,
        packing=packing,
    )


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def data_row(enc) -> tuple[list[int], list[int]]:
    return enc.input_ids, enc.labels


def labelled(ids, labels) -> list[int]:
    return [i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]


# ------------------------------------------------------------------------------ label masks
def test_text_format_learns_everything_but_bos(tok, tmp_path):
    text = "the farmer found 12 red apples."
    train, _ = build_datasets(cfg(write_jsonl(tmp_path / "t.jsonl", [{"text": text}]), "text"), tok, seed=0)
    ex = train[0]
    body = tok(text, add_special_tokens=False)["input_ids"]
    assert ex["input_ids"] == [tok.bos_token_id, *body, tok.eos_token_id]
    assert ex["labels"] == [IGNORE_INDEX, *body, tok.eos_token_id]
    assert ex["position_ids"] == list(range(len(body) + 2))
    assert tok.decode(labelled(ex["input_ids"], ex["labels"])) == text + tok.eos_token


@pytest.mark.parametrize("extra", [{"input": "347"}, {"input": ""}, {}])
def test_instruction_format_learns_only_the_output(tok, tmp_path, extra):
    row = {"instruction": "Write the number in words.", "output": "three hundred forty-seven", **extra}
    train, _ = build_datasets(cfg(write_jsonl(tmp_path / "i.jsonl", [row])), tok, seed=0)
    ex = train[0]
    prompt = render_instruction_prompt(row["instruction"], extra.get("input"))
    assert ("### Input:" in prompt) == bool(extra.get("input"))
    n_prompt = len(tok(prompt)["input_ids"])
    assert ex["input_ids"][0] == tok.bos_token_id
    assert tok.decode(ex["input_ids"][:n_prompt], skip_special_tokens=True) == prompt
    for i, (token, label) in enumerate(zip(ex["input_ids"], ex["labels"], strict=True)):
        assert label == (IGNORE_INDEX if i < n_prompt else token), f"token {i}"
    assert tok.decode(labelled(ex["input_ids"], ex["labels"])) == row["output"] + tok.eos_token


def test_chat_format_learns_only_assistant_turns(tok, tmp_path):
    messages = [
        {"role": "system", "content": "Answer in words."},
        {"role": "user", "content": "12"},
        {"role": "assistant", "content": "twelve"},
        {"role": "user", "content": "340"},
        {"role": "assistant", "content": "three hundred forty"},
    ]
    train, _ = build_datasets(
        cfg(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), "chat"), tok, 0
    )
    ids, labels = train[0]["input_ids"], train[0]["labels"]
    assert ids == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    # Walk the tokens: each labelled run is one assistant turn (content, eos, the template's newline).
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    runs += [current] if current else []
    assert [tok.decode(r) for r in runs] == ["twelve</s>\n", "three hundred forty</s>\n"]
    assert "<|assistant|>" not in tok.decode(labelled(ids, labels))


def test_bos_follows_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    no_bos = AutoTokenizer.from_pretrained(QUICKSTART / "model", add_bos_token=False)
    row = {"instruction": "Write the number in words.", "output": "five"}
    ids, labels = data_row(encode.encode_instruction(row, no_bos))
    assert no_bos.bos_token_id not in ids
    assert ids[-1] == no_bos.eos_token_id and labels[-1] == no_bos.eos_token_id
    assert no_bos.decode(labelled(ids, labels)) == "five</s>"


def test_chat_needs_a_template_and_a_prefix_stable_one(tmp_path):
    from transformers import AutoTokenizer

    rows = [{"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "one"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    plain = AutoTokenizer.from_pretrained(QUICKSTART / "model")
    plain.chat_template = None
    with pytest.raises(UserError, match="chat template.*format: instruction"):
        build_datasets(cfg(path, "chat"), plain, 0)
    # A template that marks the last message renders a prefix differently from the whole chat.
    unstable = AutoTokenizer.from_pretrained(QUICKSTART / "model")
    unstable.chat_template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(UserError, match=r"c\.jsonl row 1: .*not prefix-stable at message 1"):
        build_datasets(cfg(path, "chat"), unstable, 0)
    # Unstable for one row only, at a turn that is not the last: the turn is still located exactly in
    # the whole conversation (its content, then what the template closes a turn with).
    unstable.chat_template = (
        "{% for m in messages %}{% if loop.last and m['content'] == 'odd' %}X{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    chat = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "one"}]
    rows = [{"messages": chat + chat}] * 9
    rows.insert(6, {"messages": [chat[0], {"role": "assistant", "content": "odd"}] + chat})
    path = write_jsonl(tmp_path / "c10.jsonl", rows)
    train, _ = prepare_data(cfg(path, "chat"), unstable, 0)
    ex = train.examples[6]
    assert ex["row"] == 6
    assert unstable.decode(labelled(ex["input_ids"], ex["labels"])) == " odd\n one\n"
    # ... but a turn that renders differently as the last one cannot be: the error names the row.
    rows[6] = {"messages": [chat[0], {"role": "assistant", "content": "odd"}]}
    path = write_jsonl(tmp_path / "c10.jsonl", rows)
    unstable.chat_template = unstable.chat_template.replace("loop.last and ", "")
    with pytest.raises(UserError, match=r"c10\.jsonl row 7: .*not prefix-stable at message 1"):
        build_datasets(cfg(path, "chat", eval_fraction=0.5), unstable, 0)


# ------------------------------------------------------------------------------ truncation
def test_truncation_and_dropping(tok, tmp_path, caplog):
    long_prompt = {"instruction": "Repeat the sentence. " * 20, "output": "ok"}
    fits = {"instruction": "Write the number in words.", "output": "one hundred twenty-three"}
    path = write_jsonl(tmp_path / "i.jsonl", [long_prompt, fits])
    with caplog.at_level(logging.WARNING, logger="liger_cli.data"):
        train, _ = build_datasets(cfg(path, max_seq_len=20), tok, seed=0)
    assert "dropped 1 of 2 examples" in caplog.text  # the long prompt left nothing to learn
    assert len(train) == 1
    ex = train[0]
    full_ids, full_labels = data_row(encode.encode_instruction(fits, tok))
    assert len(full_ids) > 20 and ex["input_ids"] == full_ids[:20] and ex["labels"] == full_labels[:20]
    assert ex["position_ids"] == list(range(20))
    with pytest.raises(UserError, match="no example has a trainable token left.*max_seq_len=8"):
        build_datasets(cfg(path, max_seq_len=8), tok, seed=0)


# ------------------------------------------------------------------------------ packing
def test_pack_examples_boundaries():
    examples = [
        {"input_ids": [1, 10, 11, 2], "labels": [-100, 10, 11, 2]},
        {"input_ids": [1, 12, 2], "labels": [5, 12, 2]},  # a first label must not leak into the row
        {"input_ids": [1, 13, 14, 15, 2], "labels": [-100, -100, 14, 15, 2]},
        {"input_ids": [1, 16], "labels": [-100, 16]},
    ]
    packed = pack_examples(examples, max_seq_len=8)
    assert [p["input_ids"] for p in packed] == [[1, 10, 11, 2, 1, 12, 2], [1, 13, 14, 15, 2, 1, 16]]
    assert [p["position_ids"] for p in packed] == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1]]
    assert [p["labels"] for p in packed] == [
        [-100, 10, 11, 2, -100, 12, 2],
        [-100, -100, 14, 15, 2, -100, 16],
    ]


def test_packing_in_build_datasets_keeps_every_token(tok):
    source = cfg(QUICKSTART / "data" / "eval.jsonl", max_seq_len=64)
    plain, _ = build_datasets(source, tok, seed=0)
    source.packing = True
    packed, _ = build_datasets(source, tok, seed=0)
    assert len(packed) < len(plain) / 1.5
    assert max(len(x) for x in packed["input_ids"]) <= 64
    flat = [t for row in packed["input_ids"] for t in row]
    assert flat == [t for row in plain["input_ids"] for t in row]
    n_examples = sum(pos.count(0) for pos in packed["position_ids"])
    assert n_examples == len(plain)


def test_collate_pads_and_masks():
    a = {"input_ids": [1, 5, 6], "labels": [-100, 5, 6], "position_ids": [0, 1, 2]}
    b = {"input_ids": [1, 7], "labels": [-100, 7], "position_ids": [0, 1]}
    batch = collate([a, b], pad_token_id=3)
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 3]]
    assert batch["labels"].tolist() == [[-100, 5, 6], [-100, 7, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    packed = {"input_ids": [1, 5, 1, 6, 7], "labels": [-100, 5, -100, 6, 7], "position_ids": [0, 1, 0, 1, 2]}
    batch = collate([packed, b], pad_token_id=3)
    assert "attention_mask" not in batch  # transformers derives the block mask from position_ids
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 0, 1, 2]]  # padding: its own sequence
    assert batch["labels"].tolist()[1] == [-100, 7, -100, -100, -100]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_do_not_attend_across_examples(attn):
    """Logits of each example inside a packed (and padded) batch equal those of the example alone."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n in (5, 7, 4, 6):
        ids = torch.randint(4, 64, (n,), generator=gen).tolist()
        examples.append({"input_ids": ids, "labels": ids, "position_ids": list(range(n))})
    rows = pack_examples(examples, max_seq_len=16)
    assert [len(r["input_ids"]) for r in rows] == [16, 6]  # 5+7+4 in one row, then 6 (padded to 16)
    batch = collate(rows, pad_token_id=0)
    with torch.no_grad():
        # use_cache=False as in training: with a KV cache transformers does not look for packed rows.
        logits = model(**batch, use_cache=False).logits
        alone = [model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in examples]
        # Control: the same packed row with positions that do not restart lets attention leak.
        leaky = model(input_ids=batch["input_ids"][:1], use_cache=False).logits[0]
    spans = [(0, 0, 5), (0, 5, 12), (0, 12, 16), (1, 0, 6)]
    for (row, start, end), expected in zip(spans, alone, strict=True):
        torch.testing.assert_close(logits[row, start:end], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(leaky[5:12], alone[1], atol=1e-3)


# ------------------------------------------------------------------------------ eval split
def test_eval_fraction_split_is_deterministic(tok, tmp_path):
    rows = [{"text": f"line number {i}."} for i in range(40)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)

    def eval_texts(seed):
        train, evald = build_datasets(cfg(path, "text", eval_fraction=0.25), tok, seed)
        assert (len(train), len(evald)) == (30, 10)
        texts = {tok.decode(x, skip_special_tokens=True) for x in evald["input_ids"]}
        train_texts = {tok.decode(x, skip_special_tokens=True) for x in train["input_ids"]}
        assert texts.isdisjoint(train_texts) and len(texts | train_texts) == 40
        return texts

    assert eval_texts(0) == eval_texts(0)
    assert eval_texts(0) != eval_texts(1)
    with pytest.raises(UserError, match="eval_fraction 0.01 of 40 rows leaves 0 eval rows"):
        build_datasets(cfg(path, "text", eval_fraction=0.01), tok, 0)


def test_separate_eval_file(tok):
    train, evald = build_datasets(
        cfg(QUICKSTART / "data" / "train.jsonl", eval=QUICKSTART / "data" / "eval.jsonl"), tok, seed=0
    )
    assert len(train) == sum(1 for _ in open(QUICKSTART / "data" / "train.jsonl"))
    assert len(evald) == sum(1 for _ in open(QUICKSTART / "data" / "eval.jsonl"))


# ------------------------------------------------------------------------------ malformed data
GOOD = {"instruction": "Write the number in words.", "input": "1", "output": "one"}


def _jsonl(rows):
    return lambda p: p.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _raw(suffix, text):
    return lambda p: p.with_suffix(suffix).write_text(text)


def _parquet(rows):
    def write(p):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), p.with_suffix(".parquet"))

    return write


MALFORMED = {
    "missing field": (
        "instruction",
        _jsonl([GOOD, {"instruction": "x", "input": ""}]),
        ".jsonl",
        r'row 2: field "output" is missing \(instruction format needs instruction, output and optional input\)',
    ),
    "wrong type": (
        "instruction",
        _jsonl([GOOD, GOOD, {**GOOD, "output": 5}]),
        ".jsonl",
        r'row 3: field "output" must be a string, found int',
    ),
    "wrong type everywhere": (
        "instruction",
        _jsonl([{**GOOD, "input": [1]}]),
        ".jsonl",
        r'row 1: field "input" must be a string, found list',
    ),
    "null field": (
        "text",
        _jsonl([{"text": "a"}, {"text": None}]),
        ".jsonl",
        r'row 2: field "text" is missing',
    ),
    "empty field": ("text", _jsonl([{"text": "   "}]), ".jsonl", r'row 1: field "text" is empty'),
    "bad JSON line": (
        "text",
        _raw(".jsonl", '{"text": "a"}\n{"text": "b"\n'),
        ".jsonl",
        r"line 2: invalid JSON",
    ),
    "not an object": (
        "text",
        _raw(".jsonl", '{"text": "a"}\n["b"]\n'),
        ".jsonl",
        r"row 2: expected a JSON object, found list",
    ),
    "bad JSON array": (
        "text",
        _raw(".json", '[{"text": "a"},\n {"text": }]'),
        ".json",
        r"line 2: invalid JSON",
    ),
    "blank lines shift rows": (
        "text",
        _raw(".jsonl", '{"text": "a"}\n\n{"txt": "b"}\n'),
        ".jsonl",
        r'row 2 \(line 3\): field "text" is missing',
    ),
    "empty file": ("text", _raw(".jsonl", ""), ".jsonl", r": the file is empty"),
    "only blank lines": ("text", _raw(".jsonl", "\n\n"), ".jsonl", r": the file has no rows"),
    "unknown extension": (
        "text",
        _raw(".txt", "hello"),
        ".txt",
        r"unknown file type '\.txt'; use one of \.jsonl, \.json, \.parquet, \.csv",
    ),
    "csv missing column": (
        "instruction",
        _raw(".csv", "instruction,input\nx,y\n"),
        ".csv",
        r'row 1: field "output" is missing',
    ),
    "csv empty cell": (
        "instruction",
        _raw(".csv", "instruction,input,output\nx,y,z\nx,y,\n"),
        ".csv",
        r'row 2: field "output" is empty',
    ),
    "parquet wrong type": (
        "text",
        _parquet([{"text": 3.5}]),
        ".parquet",
        r'row 1: field "text" must be a string, found float',
    ),
    "chat content type": (
        "chat",
        _jsonl([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 7}]}]),
        ".jsonl",
        r'row 1: field "messages\[1\]\.content" must be a string, found int',
    ),
    "chat no assistant": (
        "chat",
        _jsonl([{"messages": [{"role": "user", "content": "a"}]}]),
        ".jsonl",
        r'row 1: field "messages" has no assistant turn',
    ),
    "chat not a list": (
        "chat",
        _jsonl([{"messages": "hi"}]),
        ".jsonl",
        r'row 1: field "messages" must be a list, found str',
    ),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_data_names_file_row_and_field(tok, tmp_path, case):
    fmt, write, suffix, message = MALFORMED[case]
    base = tmp_path / "train"
    write(base)
    path = base.with_suffix(suffix)
    with pytest.raises(UserError) as err:
        build_datasets(cfg(path, fmt), tok, seed=0)
    text = str(err.value)
    assert text.startswith(f"data error: {path}"), text
    assert "\n" not in text
    assert re.search(message, text), text


def test_missing_file_and_bad_eval_file(tok, tmp_path):
    with pytest.raises(UserError, match=r"nope\.jsonl: file not found"):
        build_datasets(cfg(tmp_path / "nope.jsonl"), tok, seed=0)
    train = write_jsonl(tmp_path / "train.jsonl", [GOOD])
    bad_eval = write_jsonl(tmp_path / "eval.jsonl", [GOOD, {"instruction": 1, "output": "x"}])
    with pytest.raises(
        UserError, match=r'eval\.jsonl row 2: field "instruction" must be a string, found int'
    ):
        build_datasets(cfg(train, eval=bad_eval), tok, seed=0)


def test_validation_runs_before_any_tokenizing(tmp_path):
    """A bad last row fails before the tokenizer is touched, so a long file fails in seconds."""

    class Untouchable:
        eos_token_id, chat_template = 2, None

        def __call__(self, *args, **kwargs):
            raise AssertionError("tokenized before validation finished")

    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "fine"}] * 50 + [{"text": 1}])
    with pytest.raises(UserError, match='row 51: field "text"'):
        build_datasets(cfg(path, "text"), Untouchable(), seed=0)


def test_cli_train_exits_2_on_bad_data(tmp_path):
    """End to end: `liger train` stops before building the model, one line on stderr, exit 2 (in this
    process, `liger_here`: train's real process refusing is test_recipe.py's)."""
    from test_train import liger_here

    train = write_jsonl(
        tmp_path / "train.jsonl", [GOOD] * 3 + [{"instruction": "x", "input": "", "output": None}]
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {{path: {QUICKSTART / 'model'}, dtype: float32}}\n"
        f"data: {{train: {train}, format: instruction, max_seq_len: 64}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    proc = liger_here("train", str(recipe))
    assert proc.returncode == 2, proc.stderr
    assert f'{train} row 4: field "output" is missing' in proc.stderr
    assert "Traceback" not in proc.stderr
