"""rl.max_staleness: GRPO sampling ahead of training, as a user runs it (`liger train` on recipes/grpo.yaml:
the quickstart model and its SFT adapter). K = 0, 1 and 2 train the same at a vanishing learning rate; a
K = 1 run's every sampled token and log-prob is what the weights of the version its row names compute;
a stopped K = 1 run resumes to the same weights; a row older than K leaves the loss with its group and
is counted; a background sampler that fails stops the run in one line, its last checkpoint kept.

Every run shares one process (test_train.liger_in_one_process); the resume is a fresh process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_output_safety import one_line_error
from test_train import liger_here, liger_in_one_process

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "recipes" / "grpo.yaml"
pytestmark = pytest.mark.timeout(1800)


def train(out: Path, *settings: str) -> list[str]:
    sets = ["training.eval_every=100", "logging.every=1", f"output.dir={out}", *settings]
    return ["train", str(GRPO), *(x for s in sets for x in ("--set", s))]


def fault(name: str) -> None:
    """Called in the runs' process between two runs: the pipeline's test hook for the next ones."""
    os.environ["PYTEST_LIGER_PIPELINE_FAULT"] = name


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ahead")
    still = "training.lr=1e-30"  # the weights never change: every K samples and trains the same
    cases = {
        "k0": train(root / "k0", "training.max_steps=3", still),
        "k1": train(root / "k1", "training.max_steps=3", still, "rl.max_staleness=1"),
        "k2": train(root / "k2", "training.max_steps=3", still, "rl.max_staleness=2"),
        "whole": train(root / "whole", "training.max_steps=4", "rl.max_staleness=1", "output.save_every=1"),
        "stopped": train(
            root / "stopped", "training.max_steps=2", "rl.max_staleness=1", "output.save_every=1"
        ),
        "stale": train(root / "stale", "training.max_steps=3", "rl.max_staleness=1"),
        "crash": train(root / "crash", "training.max_steps=5", "rl.max_staleness=1", "output.save_every=2"),
    }
    steps = [*(cases[n] for n in ("k0", "k1", "k2", "whole", "stopped")),
             {"call": "test_async_rl.fault", "args": ["stale_sample"]}, cases["stale"],
             {"call": "test_async_rl.fault", "args": ["sampler_crash"]}, cases["crash"]]  # fmt: skip
    procs = dict(zip(cases, liger_in_one_process(*steps, timeout=1500), strict=True))
    return {"root": root, "procs": procs, **{n: root / n for n in cases}}


def done(runs: dict, name: str) -> Path:
    proc = runs["procs"][name]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final model verified" in proc.stdout, proc.stdout[-3000:]
    return runs[name]


def test_sampling_ahead_trains_what_synchronous_steps_train_when_the_weights_stay(runs) -> None:
    """At lr 1e-30 every version holds the same weights, so K only changes which version each row names:
    the completions, their log-probs, rewards, advantages, losses and gradients equal K = 0's exactly."""
    base = lines(done(runs, "k0") / "rollouts.jsonl")
    base_steps = [m for m in lines(runs["k0"] / "metrics.jsonl") if "loss" in m]
    for k in (1, 2):
        rows = lines(done(runs, f"k{k}") / "rollouts.jsonl")
        assert len(rows) == len(base) == 3 * 8 * 8
        assert [r["policy_version"] for r in rows] == [max(0, r["step"] - 1 - k) for r in rows]
        strip = lambda r: {f: v for f, v in r.items() if f != "policy_version"}  # noqa: E731
        assert [strip(r) for r in rows] == [strip(r) for r in base]
        steps = [m for m in lines(runs[f"k{k}"] / "metrics.jsonl") if "loss" in m]
        assert [(m["loss"], m["grad_norm"]) for m in steps] == [
            (m["loss"], m["grad_norm"]) for m in base_steps
        ]
        assert all(m["rollout/stale_dropped"] == 0 and m["time/wait_s"] >= 0 for m in steps)
    assert "rollout/stale_dropped" not in base_steps[0]  # K = 0 logs what it always logged


def version_model(run: Path, version: int):
    """The policy of `version`, rebuilt from what is on disk: the SFT adapter the run starts from, then
    (version > 0) the trainable weights of the run's checkpoint of that step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        REPO / "recipes" / "quickstart" / "model", dtype=torch.float32
    )
    model = PeftModel.from_pretrained(base, REPO / "recipes" / "grpo" / "sft-start")
    if version > 0:
        weights = load_file(run / "checkpoints" / f"step-{version}" / "model.safetensors")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(weights) == {k for k in model.state_dict() if "lora_" in k}
    return model.eval()


def test_every_sampled_token_is_what_its_version_samples(runs) -> None:
    """Each step's rows of a K = 1 run (a checkpoint every step) regenerated by the weights of the version
    they name (rebuilt from disk), as one batch with their keys, as the sampler made them: the same tokens,
    the same log-probs. Rows of step s name
    version s - 2 (the starting weights for the first two steps), and the run's trainer agreed with its
    sampler every step."""
    from transformers import AutoTokenizer

    from liger_cli.generate.engine import Sampling, generate
    from liger_cli.generate.prompts import Renderer

    run = done(runs, "whole")
    rows = lines(run / "rollouts.jsonl")
    assert [r["policy_version"] for r in rows] == [max(0, r["step"] - 2) for r in rows]
    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes" / "quickstart" / "model")
    sampling = Sampling(16, 1.0, 1.0, 0, 0)  # recipes/grpo.yaml's rl section and training.seed
    for step in sorted({r["step"] for r in rows}):  # one generate call per step, as the sampler made it
        mine = [r for r in rows if r["step"] == step]
        model = version_model(run, mine[0]["policy_version"])
        stops = Renderer(tokenizer, "chat" if tokenizer.chat_template else "text").stop_ids(
            model.generation_config
        )
        found = generate(model, [r["prompt_ids"] for r in mine], sampling, stop_ids=stops,
                         pad_id=tokenizer.pad_token_id, keys=[r["key"] for r in mine])  # fmt: skip
        assert [c.ids for c in found] == [r["completion_ids"] for r in mine]
        for r, c in zip(mine, found, strict=True):
            assert c.full_logprobs == pytest.approx(r["sampler_logprobs"], abs=1e-6), r["key"]
    steps = [m for m in lines(run / "metrics.jsonl") if "loss" in m]
    assert len(steps) == 4 and all(m["sampler/abs_logp_diff"] < 1e-5 for m in steps)
    assert steps[1]["clip_fraction"] > 0 or steps[2]["clip_fraction"] > 0  # off-policy: the ratio moves


def test_a_stopped_run_resumes_to_the_same_weights(runs) -> None:
    """Stopped after step 2, resumed in a fresh process to step 4: the batch its checkpoint had sampled
    ahead and the snapshot for the next one come back, and the run ends where the whole run ends."""
    stopped = done(runs, "stopped")
    proc = liger_here(*train(stopped, "training.max_steps=4", "rl.max_staleness=1", "output.save_every=1",
                             "output.resume=auto", "output.overwrite=false"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (stopped, done(runs, "whole")))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    resumed, whole = lines(stopped / "rollouts.jsonl"), lines(runs["whole"] / "rollouts.jsonl")
    assert [(r["key"], r["completion_ids"], r["policy_version"]) for r in resumed] == [
        (r["key"], r["completion_ids"], r["policy_version"]) for r in whole
    ]


def test_a_row_older_than_the_bound_is_dropped_with_its_group_and_counted(runs) -> None:
    """The test hook makes step 3's first row say an older version sampled it (as an engine answering with
    older weights than asked would): its group of 8 leaves the loss, counted; the others train."""
    run = done(runs, "stale")
    rows = lines(run / "rollouts.jsonl")
    dropped = [i for i, r in enumerate(rows) if r.get("stale_dropped")]
    assert dropped == list(range(2 * 64, 2 * 64 + 8))
    steps = [m for m in lines(run / "metrics.jsonl") if "loss" in m]
    assert [m["rollout/stale_dropped"] for m in steps] == [0, 0, 8]


def test_a_sampler_that_fails_stops_the_run_in_one_line_keeping_the_checkpoint(runs) -> None:
    proc = runs["procs"]["crash"]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: the background sampler failed on the batch of step 4 (RuntimeError: the test hook sampler_crash); "
        "the last checkpoint is kept"
    ], proc.stderr[-2000:]
    assert sorted(p.name for p in (runs["crash"] / "checkpoints").iterdir()) == ["step-2"]
    assert not (runs["crash"] / "final").exists()


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["rl.num_iterations=2"], "rl.num_iterations 2 with rl.max_staleness 1: both reuse old completions"),
        (["adapter.type=none", "adapter.init=null", "rl.engine=vllm"], "the server holds one set of weights"),
        (["distributed.backend=fsdp2", "distributed.num_processes=2"], "keeps a whole copy of the policy"),
        (["model.quantize=nf4"], "the background sampler's copy of a 4-bit model is not supported yet"),
    ],
)
def test_what_sampling_ahead_cannot_do_is_one_line(tmp_path, sets, message) -> None:
    proc = liger_here(*train(tmp_path / "out", "rl.max_staleness=1", *sets))
    assert message in one_line_error(proc)
    assert not (tmp_path / "out").exists()


def test_resuming_with_another_bound_is_refused(runs) -> None:
    proc = liger_here(*train(done(runs, "whole"), "training.max_steps=5", "output.resume=auto",
                             "output.overwrite=false"))  # fmt: skip
    assert "rl.max_staleness differs (checkpoint: 1, recipe: null)" in one_line_error(proc)


def test_the_bench_reports_each_bound_side_by_side(tmp_path) -> None:
    """bench/async_rl.py (what docs/rl.md's figures come from) runs K = 0 and 1 for 2 steps and reports
    each run's steps per hour, waits and held-out reward by step and training time, from its metrics."""
    out = tmp_path / "async.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "async_rl.py"), "--recipes", "grpo", "--steps", "2",
                           "--eval-every", "2", "--staleness", "0", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [(r["recipe"], r["max_staleness"], r["steps"]) for r in results] == [
        ("grpo", 0, 2),
        ("grpo", 1, 2),
    ]
    for r in results:
        assert [c["step"] for c in r["curve"]] == [0, 2] and r["curve"][0]["eval_reward"] == 0.47
        assert (
            r["train_s"] > 0 and abs(r["steps_per_hour"] - 7200 / r["train_s"]) <= 0.1 * r["steps_per_hour"]
        )
    # K = 1 waits for its first batch, sampled in the background while nothing else runs
    assert results[0]["wait_s_per_step"] == 0 and results[1]["wait_s_per_step"] > 0
    table = proc.stdout.splitlines()
    assert table[0].startswith("| recipe | K |") and len(table) == 4 and "| 1.00x |" in table[2]
