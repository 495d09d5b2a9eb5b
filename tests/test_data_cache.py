"""The tokenized-data cache, several sources mixed by weight, and dataset folders / Hub names as sources."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from liger_cli import cli
from liger_cli.data import build, prepare_data
from liger_cli.errors import UserError

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart"
RECIPES = QUICKSTART.parent


@pytest.fixture
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QUICKSTART / "model")


@pytest.fixture
def encodes(monkeypatch) -> list[str]:
    """Every source that is tokenized (not read from the cache), by path."""
    calls: list[str] = []
    real = build._encode

    def counting(rows, source, data_cfg, tokenizer, tools=None):
        calls.append(str(source))
        return real(rows, source, data_cfg, tokenizer, tools)

    monkeypatch.setattr(build, "_encode", counting)
    return calls


def cfg(train, tmp_path, **kw):
    settings = dict(
        train=train,
        eval=None,
        eval_fraction=None,
        format="instruction",
        max_seq_len=64,
        packing=False,
        cache=True,
        cache_dir=tmp_path / "cache",
    )
    return SimpleNamespace(**(settings | kw))


def rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"instruction": "Write the number in words.", "input": str(i), "output": f"n{i}"}
        for i in range(start, start + n)
    ]


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def as_lists(ds) -> list:
    return [(ex["input_ids"], ex["labels"]) for ex in ds]


# ------------------------------------------------------------------------------ the cache
def test_second_run_reads_the_cache_and_tokenizes_nothing(tok, tmp_path, encodes):
    data = write_jsonl(tmp_path / "a.jsonl", rows(20))
    first, _ = prepare_data(cfg(data, tmp_path), tok, seed=0)
    assert first.cache.startswith("built (") and encodes == [str(data)]
    entry = Path(first.cache[len("built (") : -1])
    stamp = entry.stat().st_mtime_ns
    second, _ = prepare_data(cfg(data, tmp_path), tok, seed=0)
    assert second.cache == f"hit ({entry})" and encodes == [str(data)]  # not tokenized again
    assert entry.stat().st_mtime_ns == stamp
    assert as_lists(second.dataset) == as_lists(first.dataset)
    off, _ = prepare_data(cfg(data, tmp_path, cache=False), tok, seed=0)
    assert as_lists(off.dataset) == as_lists(first.dataset) and off.cache == "off"


def _entry(split) -> Path:
    return Path(split.cache.split("(", 1)[1][:-1])


def test_each_part_of_the_key_rebuilds(tok, tmp_path, encodes):
    data = write_jsonl(tmp_path / "a.jsonl", rows(8))
    base = _entry(prepare_data(cfg(data, tmp_path), tok, seed=0)[0])
    seen = {base}

    def rebuilt(data_cfg, tokenizer) -> None:
        n = len(encodes)
        split, _ = prepare_data(data_cfg, tokenizer, seed=0)
        assert split.cache.startswith("built") and len(encodes) == n + 1 and _entry(split) not in seen
        seen.add(_entry(split))

    write_jsonl(data, rows(8, start=1))  # the file's content
    rebuilt(cfg(data, tmp_path), tok)
    rebuilt(cfg(data, tmp_path, max_seq_len=32), tok)  # an encoding option
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # the chat template
    rebuilt(cfg(data, tmp_path), tok)
    folder = tmp_path / "tokenizer"  # a tokenizer file
    shutil.copytree(QUICKSTART / "model", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
    from transformers import AutoTokenizer

    rebuilt(cfg(data, tmp_path), AutoTokenizer.from_pretrained(folder))
    # the seed, packing and the eval split are applied after the cache: all hits
    n = len(encodes)
    for changed in (dict(packing=True), dict(eval_fraction=0.25)):
        split, _ = prepare_data(cfg(data, tmp_path, **changed), tok, seed=7)
        assert split.cache.startswith("hit")
    assert len(encodes) == n


def test_prompts_rendered_with_tools_are_their_own_entries(tmp_path, encodes):
    """Agentic RL renders prompts with the tools' schemas: other tools, another entry (never the ids of a
    prompt rendered without them); the same tools, a hit."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(RECIPES / "agent" / "tokenizer")
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is the code for {i}?"} for i in range(4)])
    settings = cfg(data, tmp_path, format="prompt", max_seq_len=256)
    schema = lambda name: [{"type": "function", "function": {"name": name, "description": "d"}}]  # noqa: E731
    plain, _ = prepare_data(settings, tok, seed=0)
    lookup, _ = prepare_data(settings, tok, seed=0, tools=schema("lookup"))
    other, _ = prepare_data(settings, tok, seed=0, tools=schema("search"))
    again, _ = prepare_data(settings, tok, seed=0, tools=schema("lookup"))
    assert (
        len(encodes) == 3
        and again.cache.startswith("hit")
        and len({_entry(x) for x in (plain, lookup, other)}) == 3
    )
    ids = [x.dataset[0]["prompt_ids"] for x in (plain, lookup, other, again)]
    assert ids[0] != ids[1] != ids[2] and ids[1] == ids[3]
    assert (
        "lookup: d" in tok.decode(ids[1])
        and "<|user|>" in tok.decode(ids[1])
        and "<|user|>" not in tok.decode(ids[0])
    )


def test_a_corrupt_entry_is_rebuilt_never_read(tok, tmp_path, encodes, caplog):
    data = write_jsonl(tmp_path / "a.jsonl", rows(12))
    first, _ = prepare_data(cfg(data, tmp_path), tok, seed=0)
    entry, expected = _entry(first), as_lists(first.dataset)  # read before the file changes under its map
    arrow = next(entry.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    again, _ = prepare_data(cfg(data, tmp_path), tok, seed=0)
    assert again.cache == f"built ({entry})" and len(encodes) == 2
    assert "unreadable" in caplog.text
    assert as_lists(again.dataset) == expected
    # a leftover temporary folder (a run killed while writing) is never read as an entry
    (entry.parent / f"{entry.name}.tmp-host-1").mkdir()
    assert prepare_data(cfg(data, tmp_path), tok, seed=0)[0].cache.startswith("hit")


def test_cache_off_writes_nothing_and_liger_cache_moves_it(tok, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "a.jsonl", rows(6))
    split, _ = prepare_data(cfg(data, tmp_path, cache=False), tok, seed=0)
    assert split.cache == "off" and not (tmp_path / "cache").exists()
    monkeypatch.setenv("LIGER_CACHE", str(tmp_path / "elsewhere"))
    split, _ = prepare_data(cfg(data, tmp_path, cache_dir=None), tok, seed=0)
    assert _entry(split).parent == tmp_path / "elsewhere" / "data"


def test_a_bad_row_in_a_changed_file_is_still_found(tok, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", rows(5))
    prepare_data(cfg(data, tmp_path), tok, seed=0)
    write_jsonl(data, [*rows(4), {"instruction": 3, "output": "x"}])
    with pytest.raises(UserError, match=r'a\.jsonl row 5: field "instruction" must be a string'):
        prepare_data(cfg(data, tmp_path), tok, seed=0)


def test_eval_fraction_and_num_proc_give_what_no_cache_gives(tok, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", rows(40))
    off = prepare_data(cfg(data, tmp_path, cache=False, eval_fraction=0.2), tok, seed=3)
    for _ in range(2):  # built, then hit
        on = prepare_data(cfg(data, tmp_path, eval_fraction=0.2, num_proc=2), tok, seed=3)
        for a, b in zip(off, on, strict=True):
            assert as_lists(a.dataset) == as_lists(b.dataset) and a.examples["row"] == b.examples["row"]


# ------------------------------------------------------------------------------ mixing
def test_mixture_shares_determinism_and_weight_changes_reuse_the_cache(tok, tmp_path, encodes):
    a = write_jsonl(tmp_path / "a.jsonl", rows(10))
    b = write_jsonl(tmp_path / "b.jsonl", rows(4, start=100))
    mix = [{"path": a, "weight": 3}, {"path": b, "weight": 1}]
    train, _ = prepare_data(cfg(mix, tmp_path), tok, seed=0)
    # an epoch is as many examples as the sources keep (14); a 3:1 share is 11 (10 once, 1 twice) and 3 of 4
    assert len(train.dataset) == 14 and [len(s.taken) for s in train.shares] == [11, 3]
    assert sorted(train.shares[0].taken) == sorted([*range(10), train.shares[0].taken[-1]])
    assert train.source_of.count(0) == 11 and len(set(train.shares[1].taken)) == 3
    again, _ = prepare_data(cfg(mix, tmp_path), tok, seed=0)
    assert as_lists(again.dataset) == as_lists(train.dataset)
    other, _ = prepare_data(cfg(mix, tmp_path), tok, seed=1)
    assert as_lists(other.dataset) != as_lists(train.dataset)
    assert len(encodes) == 2
    flipped, _ = prepare_data(
        cfg([{"path": a, "weight": 1}, {"path": b, "weight": 1}], tmp_path), tok, seed=0
    )
    assert [len(s.taken) for s in flipped.shares] == [7, 7]  # b's 4 examples, each at least once
    assert all(s.split.cache.startswith("hit") for s in flipped.shares) and len(encodes) == 2


def test_a_source_with_its_own_format(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows(3))
    t = write_jsonl(tmp_path / "t.jsonl", [{"text": "one two three"}] * 3)
    train, _ = prepare_data(cfg([{"path": a}, {"path": t, "format": "text"}], tmp_path), tok, seed=0)
    assert len(train.dataset) == 6 and {s.split.path.name for s in train.shares} == {"a.jsonl", "t.jsonl"}
    with pytest.raises(UserError, match="cannot be mixed with data.format instruction"):
        prepare_data(cfg([{"path": a}, {"path": t, "format": "preference"}], tmp_path), tok, seed=0)


def test_liger_data_reports_the_cache_and_the_shares(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows(10))
    b = write_jsonl(tmp_path / "b.jsonl", rows(4, start=50))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {{path: {QUICKSTART / 'model'}}}\n"
        f"data:\n  format: instruction\n  max_seq_len: 64\n  cache_dir: {tmp_path / 'c'}\n"
        f"  train: [{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]\n"
    )
    first = CliRunner().invoke(cli.app, ["data", str(recipe)])
    assert first.exit_code == 0, first.output
    assert first.output.count("cache: built (") == 2
    assert "train mixture: 14 examples per epoch from 2 sources" in first.output
    assert "a.jsonl: weight 3 (75.0%), 11 examples (78.6%, 1.10x its 10), learned tokens" in first.output
    second = CliRunner().invoke(cli.app, ["data", str(recipe), "--set", "data.packing=true"])
    assert second.output.count("cache: hit (") == 2, second.output
    off = CliRunner().invoke(cli.app, ["data", str(recipe), "--set", "data.cache=false"])
    assert off.output.count("cache: off") == 2


# ------------------------------------------------------------------------------ folders and the Hub
def test_dataset_folders_as_sources(tok, tmp_path):
    import datasets

    items = rows(6)
    expected = as_lists(
        prepare_data(cfg(write_jsonl(tmp_path / "f.jsonl", items), tmp_path), tok, 0)[0].dataset
    )
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(items).save_to_disk(str(saved))
    whole = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(items), "test": datasets.Dataset.from_list(items[:2])}
    ).save_to_disk(str(whole))
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    datasets.Dataset.from_list(items[:4]).to_parquet(str(parquet / "part-0.parquet"))
    datasets.Dataset.from_list(items[4:]).to_parquet(str(parquet / "part-1.parquet"))
    shards = tmp_path / "jsonl"
    shards.mkdir()
    write_jsonl(shards / "00.jsonl", items[:3])
    write_jsonl(shards / "01.jsonl", items[3:])
    for source in (saved, whole, parquet, shards):
        split, _ = prepare_data(cfg(source, tmp_path), tok, seed=0)
        assert as_lists(split.dataset) == expected, source
    test, _ = prepare_data(cfg({"path": whole, "split": "test"}, tmp_path), tok, seed=0)
    assert len(test.dataset) == 2
    with pytest.raises(UserError, match="has no split 'dev' .*set split:"):
        prepare_data(cfg({"path": whole, "split": "dev"}, tmp_path), tok, seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no dataset"):
        prepare_data(cfg(tmp_path / "empty", tmp_path), tok, seed=0)


def test_a_hub_name_offline_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{path: {QUICKSTART / 'model'}}}\ndata:\n  train: someone/no-such-dataset-x\n")
    result = CliRunner().invoke(cli.app, ["data", str(recipe)])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "someone/no-such-dataset-x" in line and "HF_HUB_OFFLINE" in line


# ------------------------------------------------------------------------------ two processes
@pytest.mark.timeout(900)
def test_two_processes_tokenize_once_and_share_the_cache(tmp_path):
    """2 gloo processes (DDP): the main process builds the one entry while the other waits on the store,
    then reads it (a hit); the run trains."""
    from conftest import save_tiny_model
    from test_distributed import QUICK_TRAIN, run_driver, write_recipe

    data = tmp_path / "train.jsonl"
    data.write_text("".join(QUICK_TRAIN.read_text().splitlines(keepends=True)[:32]))
    assets = {"data": data, "model": save_tiny_model(tmp_path / "llama")}
    cache = tmp_path / "cache"
    recipe = write_recipe(assets, tmp_path / "out", backend="ddp", data__cache_dir=str(cache))
    text = recipe.read_text().replace("max_steps: 4", "max_steps: 1")
    recipe.write_text(text)
    proc = run_driver({"cases": [{"recipe": str(recipe)}]}, tmp_path, nproc=2)
    entries = [p.name for p in cache.iterdir()]
    assert len(entries) == 1 and ".tmp-" not in entries[0], entries
    assert (tmp_path / "out" / "final").is_dir()
    log = proc.stdout + proc.stderr
    assert log.count("data cache: built") <= 1 and "Traceback" not in log


def test_the_recipe_reads_every_form_of_a_source(tmp_path):
    from pydantic import ValidationError

    from liger_cli.recipe.data_section import DataSection

    (tmp_path / "a.jsonl").write_text("{}\n")
    ctx = {"base_dir": tmp_path}
    one = DataSection.model_validate({"train": "a.jsonl"}, context=ctx)
    assert one.train == tmp_path / "a.jsonl"
    hub = DataSection.model_validate({"train": {"path": "org/name", "split": "test"}}, context=ctx)
    assert hub.entries()[0].path == "org/name" and hub.entries()[0].split == "test"
    listed = DataSection.model_validate({"train": ["a.jsonl", {"path": "org/x", "weight": 2}]}, context=ctx)
    assert [e.path for e in listed.entries()] == [tmp_path / "a.jsonl", "org/x"]
    for bad, message in [
        (
            {"train": "a.jsonl", "eval": [{"path": "a.jsonl", "weight": 2}]},
            "eval sources are each read whole",
        ),
        ({"train": [{"path": "a.jsonl", "format": "preference"}]}, "cannot be mixed with data.format text"),
        ({"train": [{"path": "a.jsonl", "weight": 0}]}, "greater than 0"),
        ({"train": "a.jsonl", "num_proc": 0}, "greater than or equal to 1"),
    ]:
        with pytest.raises(ValidationError, match=message):
            DataSection.model_validate(bad, context=ctx)
