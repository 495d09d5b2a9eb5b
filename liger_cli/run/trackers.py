"""The experiment trackers of `logging.report_to`: TensorBoard, trackio, Weights & Biases and MLflow.

One class per tracker behind one small interface (`log`, `table`, `finish`, `state`), opened by the
main process alone (`MetricsLog`), so a job is one tracker run however many processes and machines
it has. They get what metrics.jsonl gets, under the same names and steps, and each logged step's rows
of rollouts.jsonl and samples.jsonl as a table, read back from those files: a tracker shows what the
run folder holds. A tracker's package is imported only when a run names it; where it connects is its
own environment variables' business. The tracker runs' ids live in OUT/trackers.json with the last
step they were given, so a resumed or continued run logs into the same runs and never logs a step
twice. A tracker that fails is warned about once and dropped: training, metrics.jsonl and the other
trackers go on.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from liger_cli.errors import UserError

STATE_FILE = "trackers.json"
INSTALL = "pip install 'liger-cli[trackers]'"
MODULES = {
    "tensorboard": "torch.utils.tensorboard",
    "trackio": "trackio",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
VERSIONS = ("liger-cli", "torch", "transformers", "peft", "accelerate", "datasets", "trackio", "wandb", "mlflow-skinny",
            "mlflow")  # fmt: skip
TABLES = {"rollouts.jsonl": "rollouts", "samples.jsonl": "eval_samples"}
"""The run's row files, and the name of the table each logged step's rows become."""
TOKEN_FIELDS = ("prompt_ids", "completion_ids", "completion_mask", "sampler_logprobs", "segments")
"""Rollout fields left out of the tables: token ids and per-token numbers, for programs, not people."""


def check_installed(logging, main: bool) -> None:
    """Every named tracker's package imports, on the main process (the only one that opens them), before
    anything is built: a tracker missing at the first log would cost the set-up before it."""
    if not main:
        return
    for name in logging.trackers:
        try:
            importlib.import_module(MODULES[name])
        except ImportError as err:
            raise UserError(
                f"logging.report_to names {name}, but {MODULES[name]} cannot be imported ({err}): {INSTALL}, "
                f"or take {name} out of report_to"
            ) from None


@dataclass(frozen=True)
class RunInfo:
    """What every tracker is told about the run when it opens it."""

    out: Path
    project: str
    name: str
    config: dict
    """The resolved recipe."""
    plan: str
    """The Plan as plan.txt holds it."""
    versions: dict[str, str]


class Tracker:
    """One tracker's run: a new one, or the one its stored `state` names (a resume)."""

    name = ""
    tables = True
    state: dict = {}
    """What opens the same run again (OUT/trackers.json)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        raise NotImplementedError

    def finish(self, summary: dict | None) -> None:
        """`summary`: final_metrics.json's values; None when the run stopped before its end."""
        raise NotImplementedError


class TensorBoard(Tracker):
    """Scalars in OUT/tensorboard, as before report_to existed (`tensorboard --logdir OUT/tensorboard`)."""

    name, tables = "tensorboard", False

    def __init__(self, info: RunInfo, stored: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(info.out / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, summary: dict | None) -> None:
        self.writer.close()


class Trackio(Tracker):
    """trackio's local store (TRACKIO_DIR) or the Space / server its variables name; resumed by run name.
    trackio has no summary: the final metrics are a one-row table `summary` at the last step logged."""

    name = "trackio"

    def __init__(self, info: RunInfo, stored: dict):
        import trackio

        self.trackio = trackio
        config = {**info.config, "plan": info.plan, "versions": info.versions}
        self.run = trackio.init(project=info.project, name=stored.get("name", info.name), config=config,
                                resume="allow" if stored else "never", embed=False)  # fmt: skip
        self.state = {"name": self.run.name}
        self.step: int | None = None
        """The last step this process logged: the summary's (none when a resume logged nothing new)."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)
        self.step = step

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.trackio.Table(columns=columns, data=rows)}, step=step)

    def finish(self, summary: dict | None) -> None:
        if summary is not None and self.step is not None:
            self.table(self.step, "summary", list(summary), [list(summary.values())])
        self.trackio.finish()  # the current run (this one), which trackio's exit hook would finish again


class WandB(Tracker):
    """A W&B run (WANDB_* variables); offline unless WANDB_MODE says otherwise or a key is known, since W&B
    alone would stop to ask for one. Resumed by id; the Plan is its notes, the final metrics its summary."""

    name = "wandb"

    def __init__(self, info: RunInfo, stored: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=info.project,
            name=info.name,
            id=stored.get("id"),
            resume="allow" if stored else None,
            config={**info.config, "versions": info.versions},
            notes=info.plan,
            mode=wandb_mode(),
            settings=wandb.Settings(console="off"),
            reinit="create_new",
        )  # console off: W&B would otherwise wrap the run's stdout and stderr
        self.state = {"id": self.run.id}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows, allow_mixed_types=True)}, step=step)

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.summary.update(summary)
        self.run.finish(exit_code=0 if summary is not None else 1)


def wandb_mode() -> str | None:
    """None (W&B decides) when WANDB_MODE is set or a key is known (WANDB_API_KEY, `wandb login`'s netrc)."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY"):
        return None
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return None if netrc.netrc(os.environ.get("NETRC")).authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class MLflow(Tracker):
    """A run in the MLFLOW_TRACKING_URI store, else in MLflow's own default, ./mlflow.db (made absolute,
    so a resume from elsewhere finds it); the experiment is the project, created with its artifacts beside
    a local database (MLflow would put them in the current folder). The recipe is its parameters (as the
    run started: MLflow never changes one) and recipe.json, the Plan its description and plan.txt (both as
    the last command ran), the final metrics final_metrics.json; tables are table artifacts, a file a step."""

    name = "mlflow"

    def __init__(self, info: RunInfo, stored: dict):
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"
        self.client = client = MlflowClient(tracking_uri=uri)
        if stored.get("tracking_uri") == uri:  # the same store: the same run
            self.run_id = stored["run_id"]
            client.update_run(self.run_id, status="RUNNING")
        else:
            found = client.get_experiment_by_name(info.project)
            db = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
            artifacts = (Path(db).resolve().parent / "mlruns").as_uri() if db else None
            experiment = found.experiment_id if found else client.create_experiment(info.project, artifacts)
            self.run_id = client.create_run(experiment, run_name=info.name).info.run_id
            params = [Param(k, v[:6000]) for k, v in flat_params(info.config).items()]
            for at in range(0, len(params), 100):  # MLflow takes at most 100 a call; params never change
                client.log_batch(self.run_id, params=params[at : at + 100])
        tags = {f"versions.{k}": v for k, v in info.versions.items()}
        tags["mlflow.note.content"] = f"```\n{info.plan}\n```"  # the run's description in MLflow's UI
        client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        client.log_dict(self.run_id, info.config, "recipe.json")  # a resume's recipe and Plan replace them
        client.log_text(self.run_id, info.plan, "plan.txt")
        self.state = {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )

    def table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"{name}/step-{step:06d}.json")

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.client.log_dict(self.run_id, summary, "final_metrics.json")
        self.client.set_terminated(self.run_id, "FINISHED" if summary is not None else "FAILED")


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The recipe as MLflow parameters: `section.key` -> its value as text (lists as JSON)."""
    found = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            found |= flat_params(value, f"{prefix}{key}.")
        else:
            found[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return found


TRACKER_CLASSES: dict[str, type[Tracker]] = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": WandB,
                                              "mlflow": MLflow}  # fmt: skip


class Trackers:
    """The run's open trackers: each metric record and each step's table rows go to all of them."""

    def __init__(self, out: Path, recipe):
        logging = recipe.logging
        self.out, self.max_rows = out, logging.table_rows
        path = out / STATE_FILE
        self.states: dict = json.loads(path.read_text()) if path.is_file() else {}
        self.logged = self.states.pop("logged", {"step": -1, "keys": []})
        """The last step the trackers were given and its keys: a resume logs only what comes after."""
        name = out.resolve().name
        plan = out / "plan.txt"
        info = RunInfo(out, logging.project or name, logging.run_name or name, recipe.model_dump(mode="json"),
                       plan.read_text() if plan.is_file() else "", versions())  # fmt: skip
        self.open: list[Tracker] = []
        for tracker in logging.trackers:
            try:
                opened = TRACKER_CLASSES[tracker](info, self.states.get(tracker, {}))
            except Exception as err:  # noqa: BLE001 - a tracker never stops training
                self._warn(tracker, "could not start", err)
                continue
            self.open.append(opened)
            self.states[tracker] = opened.state
        self.offsets = {f: (out / f).stat().st_size if (out / f).is_file() else 0 for f in TABLES}
        self._save()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        tables = self._tables(step)
        last, seen = self.logged["step"], set(self.logged["keys"])
        if step < last:
            return  # logged before the resume
        if step > last:
            seen = set()
        metrics = {k: v for k, v in metrics.items() if k not in seen}
        tables = {k: v for k, v in tables.items() if k not in seen}
        if not metrics and not tables:
            return
        for tracker in list(self.open):
            self._call(tracker, "log", step, metrics)
            for table, (columns, rows) in tables.items():
                if tracker.tables:
                    self._call(tracker, "table", step, table, columns, rows)
        self.logged = {"step": step, "keys": sorted(seen | set(metrics) | set(tables))}
        self._save()

    def finish(self, summary: dict | None) -> None:
        for tracker in list(self.open):
            self._call(tracker, "finish", summary)
        self.open = []

    def _tables(self, step: int) -> dict[str, tuple[list[str], list[list]]]:
        """This step's new rows of rollouts.jsonl and samples.jsonl (at most logging.table_rows each)."""
        if not self.max_rows or not any(t.tables for t in self.open):
            return {}
        found = {}
        for file, table in TABLES.items():
            path = self.out / file
            if not path.is_file():
                continue
            with open(path, encoding="utf-8") as f:
                f.seek(self.offsets[file])
                rows = [json.loads(line) for line in f if line.strip()]
                self.offsets[file] = f.tell()
            rows = [table_row(r) for r in rows if r.get("step") == step][: self.max_rows]
            if rows:
                columns = list(dict.fromkeys(k for r in rows for k in r))
                found[table] = (columns, [[r.get(c) for c in columns] for r in rows])
        return found

    def _call(self, tracker: Tracker, method: str, *args) -> None:
        try:
            getattr(tracker, method)(*args)
        except Exception as err:  # noqa: BLE001 - a tracker never stops training
            self.open.remove(tracker)
            self._warn(
                tracker.name, f"failed at step {args[0]}" if method != "finish" else "failed to finish", err
            )

    def _warn(self, name: str, what: str, err: Exception) -> None:
        why = (str(err).strip().splitlines() or [""])[0][:300]
        print(f"warning: tracker {name} {what} ({type(err).__name__}: {why}): dropped for the rest of the run; "
              "training, metrics.jsonl and the other trackers go on", file=sys.stderr, flush=True)  # fmt: skip

    def _save(self) -> None:
        path = self.out / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.states, "logged": self.logged}, indent=2))
        os.replace(tmp, path)


def table_row(row: dict) -> dict:
    """A row file's row as table cells: numbers and text as they are, a dict of numbers (GRPO's
    `rewards`) as a column each, anything else (messages, tool calls, a chat prompt) as JSON text."""
    found = {}
    for key, value in row.items():
        if key in TOKEN_FIELDS:
            continue
        if isinstance(value, dict) and all(v is None or isinstance(v, int | float) for v in value.values()):
            found |= {f"{key}/{k}": v for k, v in value.items()}
        elif value is None or isinstance(value, str | int | float | bool):
            found[key] = value
        else:
            found[key] = json.dumps(value, ensure_ascii=False)
    return found


def versions() -> dict[str, str]:
    """liger's and the libraries' versions, as installed."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in VERSIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found
