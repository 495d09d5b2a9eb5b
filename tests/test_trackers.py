"""Experiment trackers (`logging.report_to`): every value each tracker holds, read back through its own
API (trackio's local store, MLflow's `MlflowClient` on a file store, the W&B offline run's files), equals
metrics.jsonl; rollouts and eval samples are a table per logged step; a resumed or continued run logs into
the same tracker run without a step twice; a tracker never costs training.

Train once, assert many: the SFT run, its resume from a checkpoint, its continuation, the GRPO run, the
run whose MLflow store is deleted mid-run and the run whose MLflow server is down train in ONE fresh
process (test_train.liger_in_one_process). The stores are the session's (tests/conftest.py: offline,
in a throwaway folder); each run has a project of its own. The 2-process run is a case of the shared
launch (tests/test_distributed.py)."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path

import pytest
import warm_python
import yaml
from test_grpo_train import grpo_recipe, write_prompts
from test_output_safety import one_line_error
from test_train import QUICK_DATA, liger_here, liger_in_one_process, recipe_text

ALL = ["tensorboard", "trackio", "wandb", "mlflow"]
pytestmark = pytest.mark.timeout(1200)


# --- reading each tracker back through its own API ----------------------------------------------------------


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def expected(out: Path) -> dict[tuple[int, str], float]:
    """metrics.jsonl as (step, key) -> value: a step trained again after a resume (written again, its
    timings differ) keeps the value first written, the one the trackers were given."""
    found = {}
    for record in jsonl(out / "metrics.jsonl"):
        for key, value in record.items():
            if key != "step":
                found.setdefault((record["step"], key), value)
    return found


def trackio_runs(project: str) -> dict[str, list[dict]]:
    """Run name -> its logged records, from trackio's local store (TRACKIO_DIR)."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    return {run.name: SQLiteStorage.get_logs(project, run.name) for run in trackio.Api().runs(project)}


def trackio_values(records: list[dict]) -> tuple[dict, dict]:
    """(step, key) -> number, and (step, table name) -> its rows, of one trackio run, each at most once."""
    scalars, tables = {}, {}
    for record in records:
        for key, value in record.items():
            if key in ("step", "timestamp"):
                continue
            where = (record["step"], key)
            assert where not in scalars and where not in tables, f"{where} logged twice"
            if isinstance(value, dict) and value.get("_type") == "trackio.table":
                tables[where] = value["_value"]
            elif isinstance(value, int | float):
                scalars[where] = value
    return scalars, tables


def mlflow_client():
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])


def mlflow_runs(project: str) -> list:
    client = mlflow_client()
    experiment = client.get_experiment_by_name(project)
    return client.search_runs([experiment.experiment_id]) if experiment else []


def mlflow_values(run) -> dict[tuple[int, str], float]:
    client, found = mlflow_client(), {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            where = (metric.step, key)
            assert where not in found, f"{where} logged twice"
            found[where] = metric.value
    return found


def mlflow_table(run_id: str, path: str) -> list[dict]:
    """An MLflow table artifact ({"columns", "data"}) as rows."""
    local = mlflow_client().download_artifacts(run_id, path)
    table = json.loads(Path(local).read_text())
    return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


def wandb_records(path: Path):
    """The records of a W&B run file (run-ID.wandb), parsed with W&B's own protobuf schema. The file is
    LevelDB's log format behind W&B's 7-byte header; W&B's Python reader of it
    (wandb.sdk.internal.datastore) left the package when its Go core took over, so the framing is read
    here: 32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_runs(project: str) -> dict[str, list[Path]]:
    """Run id -> its offline run folders (one per process that logged into it: a resume adds one)."""
    found: dict[str, list[Path]] = {}
    for folder in sorted(Path(os.environ["WANDB_DIR"], "wandb").glob("offline-run-*")):
        for file in folder.glob("run-*.wandb"):
            run = next(r.run for r in wandb_records(file) if r.WhichOneof("record_type") == "run")
            if run.project == project:
                found.setdefault(run.run_id, []).append(folder)
    return found


def wandb_items(items) -> dict:
    """A history or summary record's items (a key, or a nested key's parts) as a nested dict."""
    found: dict = {}
    for item in items:
        *parents, last = list(item.nested_key) or [item.key]
        place = found
        for part in parents:
            place = place.setdefault(part, {})
        place[last] = json.loads(item.value_json)
    return found


def wandb_values(folders: list[Path]) -> tuple[dict, dict, dict]:
    """(step, key) -> number and (step, table) -> rows over a W&B run's files, each at most once; the run
    record (config, notes) of its last file and the summary it ends with."""
    scalars, tables, run, summary = {}, {}, None, {}
    for folder in folders:
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            if kind == "summary":
                summary |= wandb_items(record.summary.update)
            if kind != "history":
                continue
            items = wandb_items(record.history.item)
            step = items.pop("_step")
            for key, value in items.items():
                if key.startswith("_"):
                    continue
                where = (step, key)
                assert where not in scalars and where not in tables, f"{where} logged twice"
                if isinstance(value, dict) and value.get("_type") == "table-file":
                    table = json.loads((folder / "files" / value["path"]).read_text())
                    tables[where] = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
                else:
                    scalars[where] = value
    return scalars, tables, {"run": run, "summary": summary}


def assert_same_numbers(got: dict, want: dict, who: str) -> None:
    assert set(got) == set(want), (who, sorted(set(got) ^ set(want))[:10])
    for where, value in want.items():
        assert got[where] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (who, where)


def assert_one_run_each(out: Path, project: str, trackers=("trackio", "wandb", "mlflow")) -> dict:
    """Exactly one run of the project in each tracker, holding every value of metrics.jsonl at its step
    and nothing else; returns each tracker's run and tables."""
    want, found = expected(out), {}
    if "trackio" in trackers:
        runs = trackio_runs(project)
        assert len(runs) == 1, runs.keys()
        scalars, tables = trackio_values(next(iter(runs.values())))
        assert_same_numbers(scalars, want, "trackio")
        found["trackio"] = tables
    if "mlflow" in trackers:
        runs = mlflow_runs(project)
        assert len(runs) == 1, [r.info.run_id for r in runs]
        assert_same_numbers(mlflow_values(runs[0]), want, "mlflow")
        found["mlflow"] = runs[0]
    if "wandb" in trackers:
        runs = wandb_runs(project)
        assert len(runs) == 1, runs
        scalars, tables, run = wandb_values(next(iter(runs.values())))
        assert_same_numbers(scalars, want, "wandb")
        found["wandb"] = (tables, run)
    return found


# --- the runs ---------------------------------------------------------------------------------------------


def logging_section(project: str, trackers=ALL, **more) -> str:
    return yaml.safe_dump({"every": 1, "report_to": list(trackers), "project": project, **more},
                          default_flow_style=True).strip()  # fmt: skip


def break_mlflow_on_call(folder: str, call: int) -> str:
    """A reward function that, at its `call`-th call, puts a file where its run's MLflow run writes its
    artifacts: MLflow's next write there fails as on a full disk."""
    return f"""
import json, shutil
from pathlib import Path
from urllib.parse import urlparse

calls = []


def break_mlflow(completions, **kwargs):
    calls.append(1)
    if len(calls) == {call}:
        from mlflow.tracking import MlflowClient

        state = json.loads((Path({folder!r}) / "trackers.json").read_text())["mlflow"]
        run = MlflowClient(state["tracking_uri"]).get_run(state["run_id"])
        artifacts = Path(urlparse(run.info.artifact_uri).path)
        shutil.rmtree(artifacts)
        artifacts.write_text("not a folder")
    return [0.0 for _ in completions]
"""


def set_env(name: str, value: str | None) -> None:
    """Between two commands of liger_in_one_process: an environment variable set (None: removed)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpo_from_scratch(setup: dict, out: Path, **over) -> Path:
    """test_grpo_train's GRPO recipe from the tiny model itself (no SFT adapter first)."""
    path = grpo_recipe({**setup, "sft": ""}, out, **over)
    recipe = yaml.safe_load(path.read_text())
    del recipe["adapter"]["init"]
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trackers")
    tag = root.name
    sft, sft_recipe = root / "sft", root / "sft.yaml"
    sft_recipe.write_text(recipe_text(
        tiny_model_dir, sft,
        training="{max_steps: 4, micro_batch_size: 4, grad_accum: 1, lr: 5.0e-3, scheduler: constant, eval_every: 2, "
                 "eval_samples: 3, seed: 3}",
        output=f"{{dir: {sft}, save_every: 2}}", logging=logging_section(f"sft-{tag}", table_rows=2),
    ))  # fmt: skip
    setup = {"model": tiny_model_dir}
    setup["train"] = write_prompts(root / "train.jsonl", QUICK_DATA / "train.jsonl", 8)
    setup["eval"] = write_prompts(root / "eval.jsonl", QUICK_DATA / "eval.jsonl", 4)
    grpo = root / "grpo"
    grpo_yaml = grpo_from_scratch(setup, grpo, logging__report_to=ALL, logging__project=f"grpo-{tag}",
                                  logging__table_rows=5)  # fmt: skip
    broken = root / "b" / "broken"  # a folder of its own: its rewards.py breaks the MLflow run
    broken.parent.mkdir()
    broken_yaml = grpo_from_scratch(setup, broken, training__max_steps=3, data__eval=None,
                                    logging__report_to=["trackio", "mlflow"], logging__project=f"broken-{tag}",
                                    rl__rewards=[{"function": "rewards.py:break_mlflow"}])  # fmt: skip
    (broken.parent / "rewards.py").write_text(break_mlflow_on_call(str(broken), 3))
    down = root / "down"
    down_yaml = root / "down.yaml"
    down_yaml.write_text(recipe_text(tiny_model_dir, down, data=f"{{train: {QUICK_DATA / 'train.jsonl'}, format: instruction, max_seq_len: 48}}",
                                     training="{max_steps: 2, micro_batch_size: 4}", output=f"{{dir: {down}}}",
                                     logging=logging_section(f"down-{tag}", ["mlflow"])))  # fmt: skip
    uri = os.environ["MLFLOW_TRACKING_URI"]
    procs = liger_in_one_process(
        ["train", str(sft_recipe)],
        ["train", str(sft_recipe), "--set", f"output.resume={sft / 'checkpoints' / 'step-2'}"],
        ["train", str(sft_recipe), "--set", "output.resume=auto", "--set", "training.max_steps=6"],
        ["train", str(grpo_yaml)],
        ["train", str(broken_yaml)],
        {
            "call": "test_trackers.set_env",
            "args": ["MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}"],
        },
        {"call": "test_trackers.set_env", "args": ["MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"]},
        ["train", str(down_yaml)],
        {"call": "test_trackers.set_env", "args": ["MLFLOW_TRACKING_URI", uri]},
        timeout=1200,
    )
    names = ["sft", "resumed", "continued", "grpo", "broken", "down"]
    for name, proc in zip(names, procs, strict=True):
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return {"root": root, "tag": tag, "sft": sft, "grpo": grpo, "broken": broken, "down": down,
            "procs": dict(zip(names, procs, strict=True))}  # fmt: skip


def test_every_metric_reaches_each_tracker_once_across_a_resume_and_a_continuation(runs: dict) -> None:
    """The SFT run (4 steps, eval at 0, 2 and 4), resumed from its step-2 checkpoint (steps 3 and 4 trained
    again: not logged again), then continued to 6 steps: one run in each tracker, every value of
    metrics.jsonl at its step, eval metrics included, each once."""
    out, tag = runs["sft"], runs["tag"]
    records = jsonl(out / "metrics.jsonl")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6]  # what the three commands trained
    assert sorted({r["step"] for r in records if "eval_loss" in r}) == [0, 2, 4, 6]
    assert "resumed from" in runs["procs"]["resumed"].stdout and "step-2" in runs["procs"]["resumed"].stdout
    found = assert_one_run_each(out, f"sft-{tag}")
    assert len(wandb_runs(f"sft-{tag}").popitem()[1]) == 3  # one W&B run, a file per command
    state = json.loads((out / "trackers.json").read_text())
    assert state["logged"]["step"] == 6 and set(state) == {
        "tensorboard",
        "trackio",
        "wandb",
        "mlflow",
        "logged",
    }
    assert (
        found["mlflow"].info.run_id == state["mlflow"]["run_id"] and found["mlflow"].info.status == "FINISHED"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    loss = [(e.step, e.value) for e in board.Scalars("loss")]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]  # TensorBoard too: steps 3 and 4 once
    assert [v for _, v in loss] == pytest.approx([expected(out)[(s, "loss")] for s, _ in loss], rel=1e-6)


def test_eval_samples_are_a_table_per_evaluation(runs: dict) -> None:
    """SFT's eval samples (3 a step, table_rows 2): the first two rows of samples.jsonl at each eval step."""
    out, tag = runs["sft"], runs["tag"]
    samples = jsonl(out / "samples.jsonl")
    found = assert_one_run_each(out, f"sft-{tag}")
    mlflow_run = found["mlflow"]
    for step in (0, 2, 4, 6):
        want = [{k: v for k, v in r.items()} for r in samples if r["step"] == step][:2]
        assert len(want) == 2
        assert found["trackio"][(step, "eval_samples")] == want
        assert found["wandb"][0][(step, "eval_samples")] == want
        assert mlflow_table(mlflow_run.info.run_id, f"eval_samples/step-{step:06d}.json") == want
    assert sorted(w for w in found["trackio"] if w[1] == "summary") == [(4, "summary"), (6, "summary")]


def test_the_run_is_described_in_each_tracker(runs: dict) -> None:
    """The recipe as the run's config, the Plan as text, the versions, final_metrics.json as the summary."""
    out, tag = runs["sft"], runs["tag"]
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    plan = (out / "plan.txt").read_text()
    final = json.loads((out / "final_metrics.json").read_text())
    found = assert_one_run_each(out, f"sft-{tag}")
    from importlib.metadata import version

    import trackio

    trackio_run = next(iter(trackio.Api().runs(f"sft-{tag}")))
    config = trackio_run.config
    assert config["training"]["max_steps"] == 6 and config["model"]["path"] == recipe["model"]["path"]
    assert config["plan"] == plan and config["versions"]["torch"] == version("torch")
    summary = found["trackio"][(6, "summary")]
    assert summary == [pytest.approx(final, nan_ok=True)]
    tables, wandb = found["wandb"]
    assert {k: wandb["summary"][k] for k in final} == pytest.approx(final, nan_ok=True)
    run = wandb["run"]
    wandb_config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert wandb_config["model"]["path"] == recipe["model"]["path"]
    assert wandb_config["versions"]["liger-cli"] == version("liger-cli")
    assert run.notes == plan
    mlflow_run = found["mlflow"]
    client = mlflow_client()
    params = mlflow_run.data.params
    assert (
        params["training.lr"] == json.dumps(recipe["training"]["lr"])
        and params["model.path"] == recipe["model"]["path"]
    )
    assert mlflow_run.data.tags["versions.transformers"] == version("transformers")
    assert Path(client.download_artifacts(mlflow_run.info.run_id, "plan.txt")).read_text() == plan
    saved = json.loads(
        Path(client.download_artifacts(mlflow_run.info.run_id, "final_metrics.json")).read_text()
    )
    assert saved == pytest.approx(final, nan_ok=True)


def test_grpo_rollouts_are_a_table_per_logged_step(runs: dict) -> None:
    """Each step's rollouts (16: 4 prompts x 4 completions; table_rows 5): the first 5 rows of the step in
    rollouts.jsonl, with prompt, completion, each reward, the advantage and the turns; no token ids."""
    out, tag = runs["grpo"], runs["tag"]
    rollouts = jsonl(out / "rollouts.jsonl")
    found = assert_one_run_each(out, f"grpo-{tag}")
    mlflow_id = found["mlflow"].info.run_id
    for step in (1, 2, 3):
        rows = [r for r in rollouts if r["step"] == step]
        assert len(rows) == 16
        for tracker_rows in (found["trackio"][(step, "rollouts")], found["wandb"][0][(step, "rollouts")],
                             mlflow_table(mlflow_id, f"rollouts/step-{step:06d}.json")):  # fmt: skip
            assert len(tracker_rows) == 5
            for got, want in zip(tracker_rows, rows, strict=False):
                assert (
                    got["completion"] == want["completion"]
                    and json.loads(got["messages"]) == want["messages"]
                )
                assert got["prompt"] == want["prompt"] and got["turns"] == want["turns"] == 1
                assert got["reward"] == pytest.approx(want["reward"]) and got["advantage"] == pytest.approx(
                    want["advantage"]
                )
                assert got["rewards/exact_match"] == want["rewards"]["exact_match"]
                assert got["rewards/short"] == want["rewards"]["short"]
                assert "completion_ids" not in got and "sampler_logprobs" not in got


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning(runs: dict) -> None:
    """The broken run's MLflow artifact folder becomes a file during step 2 (its metrics of step 2 are
    written, its rollouts table is not): one warning, MLflow keeps the metrics of steps 1 and 2, trackio
    every step, and the run trains to its end with metrics.jsonl complete."""
    out, tag, proc = runs["broken"], runs["tag"], runs["procs"]["broken"]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: tracker")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "mlflow failed at step 2" in warnings[0] and "dropped" in warnings[0]
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert (out / "final_metrics.json").is_file() and "final model verified" in proc.stdout
    found = assert_one_run_each(out, f"broken-{tag}", trackers=("trackio",))
    assert sorted(found["trackio"]) == [(1, "rollouts"), (2, "rollouts"), (3, "rollouts"), (3, "summary")]
    (run,) = mlflow_runs(f"broken-{tag}")
    want = {where: value for where, value in expected(out).items() if where[0] <= 2}
    assert_same_numbers(mlflow_values(run), want, "mlflow")
    assert run.info.status == "RUNNING"  # dropped: never told the run ended


def test_a_tracker_that_cannot_start_is_dropped_with_one_warning(runs: dict) -> None:
    """MLflow at a server that is down (no retries): one warning, the run trains as without it."""
    proc, out = runs["procs"]["down"], runs["down"]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: tracker")]
    assert len(warnings) == 1 and "mlflow could not start" in warnings[0], proc.stderr[-3000:]
    assert [r["step"] for r in jsonl(out / "metrics.jsonl")] == [1, 2]
    assert "mlflow" not in json.loads((out / "trackers.json").read_text())


def test_an_unknown_tracker_is_a_one_line_error_naming_the_choices(runs: dict, tmp_path: Path) -> None:
    recipe = runs["root"] / "sft.yaml"
    line = one_line_error(liger_here("train", str(recipe), "--set", "logging.report_to=[tensorboard, comet]",
                                     "--set", f"output.dir={tmp_path / 'out'}"))  # fmt: skip
    assert "logging.report_to" in line and all(name in line for name in ALL), line
    assert not (tmp_path / "out").exists()


def test_a_missing_tracker_package_is_a_one_line_error_naming_the_extra(runs: dict, tmp_path: Path) -> None:
    """A real `liger train` process in which wandb cannot be imported (a module on PYTHONPATH that
    fails as a missing one does): exit 2 naming the extra, before the output folder is made."""
    hidden = tmp_path / "hidden" / "wandb"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n"
    )
    recipe = runs["root"] / "sft.yaml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hidden.parent), os.environ.get("PYTHONPATH")])),
    }
    proc = warm_python.run(["-m", "liger_cli", "train", str(recipe), "--set", f"output.dir={tmp_path / 'out'}"],
                           env=env, timeout=600)  # fmt: skip
    line = one_line_error(proc)
    assert "wandb" in line and "pip install 'liger-cli[trackers]'" in line, line
    assert not (tmp_path / "out").exists()
