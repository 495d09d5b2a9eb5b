"""`rl.engine: vllm` for real: vLLM's CPU build (.venv-vllm, scripts/setup-vllm.sh) serving the quickstart
model. One server for the module, started by `liger vllm-serve` (the command a user runs on another node):
the engine's contract is checked against liger's own engine and transformers, adapters against peft,
GRPO runs point at it (rl.vllm.server), and each kind of stale engine stops a run at the first step it
happens. The runs that need a server of their own (full fine-tuning reloads the served weights; a server
that dies) start one as a run does when rl.vllm.server is null."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from conftest import QUICKSTART_MODEL
from safetensors.torch import load_file
from test_output_safety import one_line_error
from test_train import REPO, liger

from liger_cli.errors import RunFailed
from liger_cli.generate.engine import Sampling, generate
from liger_cli.generate.vllm_engine import VllmEngine, check_served
from liger_cli.generate.vllm_server import free_port

pytestmark = pytest.mark.timeout(1200)
GRPO = REPO / "recipes" / "grpo"
PROMPTS = [[1, 5, 6, 7], [1, 44, 45, 46, 47, 48], [1, 300, 301], [1, 120, 121, 122, 123]]


def launched(recipe: Path, port: int) -> tuple[list[str], list[str]]:
    """`liger launch RECIPE --vllm-serve` for one machine: the serving machine's argv and the training
    machine's, as printed (the port made a free one), `liger` run as `python -m liger_cli`."""
    proc = liger("launch", str(recipe), "--vllm-serve", "--vllm-ip", "127.0.0.1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [shlex.split(line) for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    serve, train = [[a.replace(":8000", f":{port}") if a.startswith("rl.vllm.server=") else a for a in argv]
                    for argv in lines]  # fmt: skip
    assert serve[:2] == ["liger", "vllm-serve"] and serve[serve.index("--port") + 1] == "8000"
    serve[serve.index("--port") + 1] = str(port)
    assert train[:2] == ["liger", "train"] and f"rl.vllm.server=http://127.0.0.1:{port}" in train
    return [sys.executable, "-m", "liger_cli", *serve[1:]], train[1:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The serving machine's command that `liger launch --vllm-serve` prints for the GRPO recipe
    (`liger vllm-serve` on the quickstart model, adapters up to its rank 16, data.max_seq_len 256), on a
    free port; stopped after."""
    port = free_port()
    folder = tmp_path_factory.mktemp("vllm")
    log = folder / "serve.log"
    command, _ = launched(grpo_recipe(folder, "fixture", max_seq_len=256), port)
    assert command[command.index("--max-model-len") + 1] == "256" and "--max-lora-rank" in command
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        yield url
    finally:  # SIGTERM to `liger vllm-serve` alone: the server must end with it (no server left behind)
        proc.terminate()
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _gone(url):
            time.sleep(1)
        gone = _gone(url)
        if not gone:
            os.killpg(proc.pid, signal.SIGKILL)
        assert gone, f"the server at {url} outlived liger vllm-serve"


def _gone(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
    except OSError:
        return True
    return False


def quickstart_model(adapter: Path | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(QUICKSTART_MODEL, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def token_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    """transformers: log softmax(logits / T) of each id after the prompt, over the whole vocabulary."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp[torch.arange(len(ids)), torch.tensor(ids)].tolist()


# --- the engine's contract ---------------------------------------------------------------------------------


def test_the_engine_samples_what_transformers_computes(server):
    """Greedy ids equal liger's own engine's; each sampled token's log-prob equals a transformers forward
    of the same ids within 1e-4; a completion depends on its key only (alone, or in another batch)."""
    engine, model = VllmEngine(server), quickstart_model()
    greedy = Sampling(max_new_tokens=12, temperature=0)
    ours = generate(model, PROMPTS, greedy, stop_ids=[2], pad_id=3, keys=list(range(4)))
    served = engine.complete(PROMPTS, list(range(4)), greedy, [2])
    assert [c.ids for c in served] == [c.ids for c in ours]
    assert [c.finish_reason for c in served] == [c.finish_reason for c in ours]
    sampling = Sampling(max_new_tokens=12, temperature=0.8, seed=7)
    keys = ["0:1:0", "0:1:1", "0:2:0", "0:3:0"]
    sampled = engine.complete(PROMPTS, keys, sampling, [2])
    for prompt, c in zip(PROMPTS, sampled, strict=True):
        want = token_logprobs(model, prompt, c.ids, 0.8)
        assert max(abs(a - b) for a, b in zip(c.logprobs, want, strict=True)) < 1e-4
        assert c.full_logprobs == c.logprobs  # nothing truncated: the whole vocabulary's
    again = engine.complete(PROMPTS[::-1], keys[::-1], sampling, [2])[::-1]
    assert [c.ids for c in again] == [c.ids for c in sampled]
    assert len({tuple(c.ids) for c in engine.complete([PROMPTS[0]] * 4, keys, sampling, [2])}) > 1


def test_an_adapter_is_served_as_peft_computes_it(server, tmp_path):
    """A LoRA adapter loaded at run time: greedy ids and log-probs are peft's; the next version replaces it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(quickstart_model(), config)
    peft_model.save_pretrained(tmp_path / "a")
    engine = VllmEngine(server)
    engine.load_adapter(tmp_path / "a", "test-a")
    assert engine.policy == "test-a"
    greedy = Sampling(max_new_tokens=10, temperature=0)
    served = engine.complete(PROMPTS, list(range(4)), greedy, [2])
    reference = quickstart_model(tmp_path / "a")
    ours = generate(reference, PROMPTS, greedy, stop_ids=[2], pad_id=3, keys=list(range(4)))
    assert [c.ids for c in served] == [c.ids for c in ours]
    base = [c.ids for c in VllmEngine(server).complete(PROMPTS, list(range(4)), greedy, [2])]
    assert base != [c.ids for c in served]  # the adapter changes what is served
    models = json.loads(urllib.request.urlopen(server + "/v1/models").read())["data"]
    assert [m["id"] for m in models if m.get("parent")] == ["test-a"]
    engine.unload("test-a")  # the runs below load theirs


def test_a_server_of_another_model_or_length_is_refused(server, real_model):
    from transformers import AutoTokenizer

    engine = VllmEngine(server)
    quick = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    check_served(engine, quick, 64, "Hello world: 12 + 30 = 42.", None)  # the served model's own: fine
    with pytest.raises(RunFailed, match="tokenizes text differently"):
        check_served(
            engine, AutoTokenizer.from_pretrained(real_model), 64, "Hello world: 12 + 30 = 42.", None
        )
    with pytest.raises(RunFailed, match="holds 256 positions, fewer than data.max_seq_len 512"):
        check_served(engine, quick, 512, "Hello", None)


# --- runs -------------------------------------------------------------------------------------------------


def grpo_recipe(tmp_path: Path, name: str, max_seq_len: int = 64, **rl) -> Path:
    """The shipped GRPO recipe (quickstart model, its SFT adapter) for 3 steps with the vllm engine."""
    recipe = yaml.safe_load((REPO / "recipes" / "grpo.yaml").read_text())
    recipe["model"]["path"] = str(QUICKSTART_MODEL)
    recipe["adapter"]["init"] = str(GRPO / "sft-start")
    recipe["data"].update(
        train=str(GRPO / "train.jsonl"), eval=str(GRPO / "eval.jsonl"), max_seq_len=max_seq_len
    )
    recipe["training"].update(max_steps=3, micro_batch_size=4, eval_every=100)
    recipe["rl"].update(engine="vllm", **rl)
    recipe["output"] = {"dir": str(tmp_path / name), "overwrite": True, "save_every": 1}
    recipe["logging"] = {"every": 1}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def steps(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_a_grpo_run_samples_on_the_server_and_every_update_reaches_it(server, tmp_path):
    """3 steps, started as `liger launch --vllm-serve` prints the training machine's command: every step's
    sampled tokens are scored by the trainer within 1e-5 of the server's log-probs (each update served),
    the rollouts written; the run's folder keeps no pushed policy. The same run with a server that hangs
    after step 2 (it takes requests and never answers): one line naming it, exit 1, step 1's checkpoint
    kept; resumed, it samples step 2 again as it did and trains the same."""
    _, train = launched(grpo_recipe(tmp_path, "run"), int(server.rsplit(":", 1)[1]))
    proc = liger(*train)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    found = steps(tmp_path / "run")
    assert [m["step"] for m in found] == [1, 2, 3]
    assert all(m["sampler/abs_logp_diff"] < 1e-5 and m["sampler/abs_logp_diff_max"] < 1e-4 for m in found)
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 4 * 8 and [r["step"] for r in rows[::32]] == [1, 2, 3]
    assert all(len(r["sampler_logprobs"]) == len(r["completion_ids"]) for r in rows)
    assert not (tmp_path / "run" / ".vllm").exists()
    # The server hangs after step 2: the run stops at the update, one line, exit 1, step 1's checkpoint kept.
    stopped = grpo_recipe(tmp_path, "stopped", vllm={"server": server, "timeout": 5})
    env = {**os.environ, "PYTEST_LIGER_VLLM_FAULT": "hang_server"}
    proc = subprocess.run([sys.executable, "-m", "liger_cli", "train", str(stopped)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "did not answer /v1/load_lora_adapter within 5 s (hung" in error[0], error
    assert [m["step"] for m in steps(tmp_path / "stopped")] == [1]
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["step-1"]
    proc = liger("train", str(stopped), "--set", "output.resume=auto", "--set", "output.overwrite=false")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    again = [json.loads(line) for line in (tmp_path / "stopped" / "rollouts.jsonl").read_text().splitlines()]
    # step 2's rows twice: as sampled before the hang, and again after resuming (the same seeds, weights)
    ids = lambda found: [r["completion_ids"] for r in found]  # noqa: E731
    assert ids(again) == ids(rows[:64] + rows[32:])
    got, want = (
        load_file(tmp_path / name / "final" / "adapter_model.safetensors") for name in ("stopped", "run")
    )
    assert got.keys() == want.keys() and all((got[k] - want[k]).abs().max() < 1e-6 for k in want)


def test_a_server_of_another_model_is_refused_before_the_first_step(server, tmp_path):
    """The server's model tokenizes as the run's but is another (its weights perturbed) or has fewer ids
    than the trained model's vocabulary: the log-prob probe refuses it before any step, one line, exit 1."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    for name in ("other", "larger_vocabulary"):
        model = AutoModelForCausalLM.from_pretrained(QUICKSTART_MODEL, dtype=torch.float32)
        with torch.no_grad():
            if name == "other":
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
            else:
                model.resize_token_embeddings(model.config.vocab_size + 64, mean_resizing=False)
        model.save_pretrained(tmp_path / name)
        for f in QUICKSTART_MODEL.iterdir():
            if f.name.startswith(("tokenizer", "chat_template")):
                shutil.copy(f, tmp_path / name)
    want = {"other": "computes other log-probs than the model being trained",
            "larger_vocabulary": "has a smaller vocabulary than the model being trained"}  # fmt: skip
    for name, message in want.items():
        recipe = grpo_recipe(tmp_path, f"run-{name}", vllm={"server": server})
        proc = liger(
            "train", str(recipe), "--set", f"model.path={tmp_path / name}", "--set", "adapter.init=null"
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and message in error[0], proc.stderr[-2000:]
        assert not (tmp_path / f"run-{name}" / "metrics.jsonl").exists() or not steps(
            tmp_path / f"run-{name}"
        )


@pytest.fixture(scope="module")
def one_process(server, tmp_path_factory) -> Path:
    """2 steps of the GRPO recipe on the server in 1 process (micro-batch 4)."""
    out = tmp_path_factory.mktemp("one")
    proc = liger(
        "train", str(grpo_recipe(out, "one", vllm={"server": server})), "--set", "training.max_steps=2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "one"


@pytest.mark.parametrize("backend", ["ddp", "fsdp1", "fsdp2", "deepspeed"])
def test_two_processes_sample_and_train_what_one_does(server, one_process, tmp_path, backend):
    """2 processes (micro-batch 2 each) against 1 (micro-batch 4), both on the server, under each backend
    (ZeRO-3 for deepspeed): every process sends its own prompts, the weights gathered from the shards are
    pushed once per step, and the completions and the adapter are the 1-process run's."""
    two = grpo_recipe(tmp_path, "two", vllm={"server": server})
    proc = liger("train", str(two), "--set", "training.max_steps=2", "--set", "training.micro_batch_size=2",
                 "--set", f"distributed.backend={backend}", "--set", "distributed.num_processes=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    read = lambda out: sorted(  # noqa: E731
        json.dumps(json.loads(line)["completion_ids"]) for line in (out / "rollouts.jsonl").open()
    )
    assert read(tmp_path / "two") == read(one_process) and len(read(one_process)) == 2 * 4 * 8
    got, want = (
        load_file(out / "final" / "adapter_model.safetensors") for out in (tmp_path / "two", one_process)
    )
    assert got.keys() == want.keys() and all((got[k] - want[k]).abs().max() < 1e-5 for k in want)
    assert all(m["sampler/abs_logp_diff"] < 1e-5 for m in steps(tmp_path / "two"))


def test_sampling_ahead_names_each_batch_s_policy_and_fsdp2_equals_one_process(server, tmp_path):
    """rl.max_staleness 1 on the server: each batch's requests name the adapter of the version that samples
    it (step s: version s - 2, the starting weights for the first two), the trainer scores every sampled
    token within 1e-5 of the server with that version's weights, and the server keeps no adapter of the
    run when it ends. 2 processes under FSDP-2 (the shards gathered for each push) train what 1 does; the
    run stopped after step 2 and resumed serves version 1 again for step 3 and ends as the whole run."""
    runs = {"one": [], "two": ["--set", "training.micro_batch_size=2", "--set", "distributed.backend=fsdp2",
                               "--set", "distributed.num_processes=2"]}  # fmt: skip
    adapters = lambda: {m["id"] for m in json.loads(urllib.request.urlopen(server + "/v1/models", timeout=30).read())["data"]  # noqa: E731
                        if m.get("parent")}  # fmt: skip
    before = adapters()  # another test's stopped run may have left its own
    for name, extra in runs.items():
        recipe = grpo_recipe(tmp_path, name, vllm={"server": server}, max_staleness=1)
        proc = liger("train", str(recipe), *extra)
        assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
        found = steps(tmp_path / name)
        assert [m["step"] for m in found] == [1, 2, 3]
        assert all(m["sampler/abs_logp_diff"] < 1e-5 and m["rollout/stale_dropped"] == 0 for m in found)
    rows = {n: [json.loads(line) for line in (tmp_path / n / "rollouts.jsonl").open()] for n in runs}
    assert [r["policy_version"] for r in rows["one"]] == [max(0, r["step"] - 2) for r in rows["one"]]
    key = lambda r: (r["step"], r["key"])  # noqa: E731
    assert [(key(r), r["completion_ids"]) for r in sorted(rows["two"], key=key)] == [
        (key(r), r["completion_ids"]) for r in sorted(rows["one"], key=key)
    ]
    got, want = (load_file(tmp_path / n / "final" / "adapter_model.safetensors") for n in ("two", "one"))
    assert got.keys() == want.keys() and all((got[k] - want[k]).abs().max() < 1e-5 for k in want)
    # Stopped after step 2 and resumed: the checkpoint's snapshot of version 1 is served again for step 3.
    stopped = grpo_recipe(tmp_path, "stopped", vllm={"server": server}, max_staleness=1)
    proc = liger("train", str(stopped), "--set", "training.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = liger("train", str(stopped), "--set", "output.resume=auto", "--set", "output.overwrite=false")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert all(m["sampler/abs_logp_diff"] < 1e-5 for m in steps(tmp_path / "stopped"))
    again = [json.loads(line) for line in (tmp_path / "stopped" / "rollouts.jsonl").open()]
    assert [(key(r), r["completion_ids"]) for r in again] == [
        (key(r), r["completion_ids"]) for r in rows["one"]
    ]
    got = load_file(tmp_path / "stopped" / "final" / "adapter_model.safetensors")
    assert all((got[k] - want[k]).abs().max() < 1e-6 for k in want)
    assert adapters() == before  # every adapter of every run unloaded


@pytest.mark.parametrize("fault", ["skip_update", "wrong_adapter"])
def test_a_stale_adapter_stops_the_run_at_its_first_step(server, tmp_path, fault):
    """The update after step 1 does not reach the server (its old weights served under the new name), or
    the wrong adapter is loaded: step 2 is the first sampled by it, and the run stops there, one line,
    exit 1, step 1's checkpoint kept."""
    env = {**os.environ, "PYTEST_LIGER_VLLM_FAULT": fault}
    proc = subprocess.run(
        [sys.executable, "-m", "liger_cli", "train", str(grpo_recipe(tmp_path, fault, vllm={"server": server}))],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: stale vLLM engine at step 2:"), proc.stderr[-2000:]
    assert [m["step"] for m in steps(tmp_path / fault)] == [1]
    assert (tmp_path / fault / "checkpoints" / "step-1").is_dir()


def full_recipe(tmp_path: Path, name: str, repeat: bool = False) -> Path:
    """Full fine-tuning of the quickstart model on its own server (rl.vllm.server null); `repeat`: one
    prompt every step (its blocks cached under the weights that sampled the step before)."""
    path = grpo_recipe(tmp_path, name)
    recipe = yaml.safe_load(path.read_text())
    recipe["adapter"] = {"type": "none"}
    recipe["training"].update(lr=1e-3, micro_batch_size=2)
    if repeat:
        row = json.loads((GRPO / "train.jsonl").read_text().splitlines()[0])
        row["prompt"] = row["prompt"] * 8  # about 210 tokens: past a whole KV block (128 positions on a CPU)
        (tmp_path / "one.jsonl").write_text((json.dumps(row) + "\n") * 8)
        recipe["data"].update(train=str(tmp_path / "one.jsonl"), max_seq_len=240)
        # a reward that differs between completions (exact_match gives this prompt 0 for all: no update)
        (tmp_path / "rewards.py").write_text(
            "def longer(completions, **kw):\n    return [len(c) / 10 for c in completions]\n"
        )
        recipe["rl"]["rewards"] = [{"function": str(tmp_path / "rewards.py") + ":longer"}]
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("fault", [None, "keep_prefix_cache", "kill_server"])
def test_full_finetuning_reloads_the_served_weights(tmp_path, fault):
    """Its own server, full weights reloaded after each step (without a fault: 2 processes, the weights
    gathered from ZeRO-3 shards): the trainer agrees with it every step and the server is gone after. A
    reload that keeps the prefix cache serves blocks of the old weights for a repeated prompt: caught at
    step 2. A server that dies between steps: one line, exit 1."""
    env = {**os.environ, **({"PYTEST_LIGER_VLLM_FAULT": fault} if fault else {})}
    recipe = full_recipe(tmp_path, "full", repeat=fault == "keep_prefix_cache")
    sharded = [] if fault else ["--set", "distributed.backend=deepspeed", "--set", "distributed.num_processes=2",
                                "--set", "training.micro_batch_size=1"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "liger_cli", "train", str(recipe), *sharded],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    out = tmp_path / "full"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (out / ".vllm").exists()  # the server's folder removed, its processes stopped
    if fault is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert all(m["sampler/abs_logp_diff"] < 1e-5 for m in steps(out)) and len(steps(out)) == 3
        return
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    want = (
        "error: stale vLLM engine at step 2:" if fault == "keep_prefix_cache" else "error: the vLLM server at"
    )
    assert len(error) == 1 and error[0].startswith(want), proc.stderr[-2000:]


# --- recipes it refuses -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["rl.top_p=0.9"], "rl.engine vllm reports log-probs renormalised over the tokens top_p/top_k keep"),
        (["rl.vllm.server=localhost:8000"], "give the server's URL, e.g. http://10.0.0.2:8000"),
        (["model.quantize=nf4"], "the server would sample from the unquantized base"),
        (["adapter.type=dora"], "vLLM serves LoRA adapters only (no DoRA magnitudes)"),
    ],
)
def test_what_the_vllm_engine_cannot_do_is_one_line(tmp_path, sets, message):
    args = [x for s in sets for x in ("--set", s)]
    line = one_line_error(liger("train", str(grpo_recipe(tmp_path, "bad")), *args, "--dry-run"))
    assert message in line, line


@pytest.mark.parametrize("fault", [None, "skip_update"])
def test_distillation_samples_on_vllm_with_every_update_proved(server, tmp_path, fault):
    """On-policy distillation on the server: the student scores its sampled tokens as the server did
    (within 1e-5) at every step; an update that never arrives stops the run at step 2, one line, exit 1."""
    out = tmp_path / "distill"
    env = {**os.environ, **({"PYTEST_LIGER_VLLM_FAULT": fault} if fault else {})}
    sets = ["rl.engine=vllm", f"rl.vllm.server={server}", "training.max_steps=2", "training.eval_every=100",
            "logging.every=1", f"output.dir={out}"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "liger_cli", "train", str(REPO / "recipes" / "distill.yaml"),
         *(x for s in sets for x in ("--set", s))], capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if fault is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = steps(out)
        assert [m["step"] for m in found] == [1, 2] and all(m["sampler/abs_logp_diff"] < 1e-5 for m in found)
        return
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and error[0].startswith("error: stale vLLM engine at step 2:"), proc.stderr[-2000:]


def test_without_vllm_installed_the_run_says_how_to_install_it(tmp_path):
    env = {**os.environ, "LIGER_VLLM_PYTHON": str(tmp_path / "no-python")}
    proc = subprocess.run([sys.executable, "-m", "liger_cli", "train", str(grpo_recipe(tmp_path, "none"))],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    line = one_line_error(proc)
    assert "vLLM is not installed" in line and "scripts/setup.sh" in line, line


def test_generate_with_the_vllm_engine_writes_what_liger_s_engine_writes(tmp_path):
    """`liger generate --engine vllm` on an adapter: a server of its own with the adapter loaded; greedy
    completions and their log-probs as liger's engine writes them (within 1e-4); refusals in one line."""
    rows = [{"prompt": f"Write the number in words.\n{n}"} for n in (347, 12, 905)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["generate", str(GRPO / "sft-start"), "--prompts", str(prompts), "--temperature", "0",
              "--max-new-tokens", "12", "--logprobs"]  # fmt: skip
    served = liger(*common, "--out", str(tmp_path / "v.jsonl"), "--engine", "vllm")
    assert served.returncode == 0 and "engine vllm" in served.stdout, served.stderr[-3000:]
    ours = liger(*common, "--out", str(tmp_path / "t.jsonl"))
    assert ours.returncode == 0, ours.stderr[-3000:]
    read = lambda name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]  # noqa: E731
    for v, t in zip(read("v.jsonl"), read("t.jsonl"), strict=True):
        assert v["completion_ids"] == t["completion_ids"] and v["completion"] == t["completion"]
        assert max(abs(a - b) for a, b in zip(v["logprobs"], t["logprobs"], strict=True)) < 1e-4
    line = one_line_error(liger(*common, "--out", str(tmp_path / "x.jsonl"), "--engine", "vllm", "--top-p", "0.9",
                                "--temperature", "1"))  # fmt: skip
    assert "--engine vllm reports log-probs over the tokens --top-p/--top-k keep" in line, line


def test_the_agent_recipe_runs_its_episodes_on_vllm(tmp_path):
    """Multi-turn episodes with a tool, token in and token out, on the run's own server: the greedy eval
    episodes score as liger's engine's do (the same trajectories), every step's sampled tokens agree with
    the trainer's, and the tool is called."""
    recipe = REPO / "recipes" / "agent.yaml"
    short = ["--set", "training.max_steps=1", "--set", "training.eval_every=100", "--set", "logging.every=1"]
    runs = {}
    for engine in ("vllm", "transformers"):
        out = tmp_path / engine
        proc = liger(
            "train", str(recipe), *short, "--set", f"rl.engine={engine}", "--set", f"output.dir={out}"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[engine] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first_eval = lambda rows: next(r["eval_reward"] for r in rows if "eval_reward" in r)  # noqa: E731
    assert first_eval(runs["vllm"]) == first_eval(runs["transformers"])
    step = next(r for r in runs["vllm"] if "loss" in r)
    assert step["sampler/abs_logp_diff"] < 1e-5 and step["tool/calls"] > 0.5


def test_generate_serves_the_dtype_liger_s_engine_loads(tmp_path):
    """--engine vllm's server gets the dtype liger's engine would load: a run's model.dtype (auto: float32),
    else the model's own config (an fp32 config stays fp32; vLLM's own auto would halve it)."""
    from liger_cli.generate.load import find_target
    from liger_cli.recipe import load_recipe
    from liger_cli.serve.generate import _served_dtype

    model = find_target(QUICKSTART_MODEL)
    assert json.loads((QUICKSTART_MODEL / "config.json").read_text()).get("dtype", "float32") == "float32"
    assert _served_dtype(model, QUICKSTART_MODEL) == "float32"
    bf16 = tmp_path / "bf16"
    shutil.copytree(QUICKSTART_MODEL, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert _served_dtype(find_target(bf16), bf16) == "bfloat16"
    for dtype, served in (("auto", "float32"), ("bfloat16", "bfloat16")):
        recipe = load_recipe(REPO / "recipes" / "grpo.yaml", [f"model.dtype={dtype}"])
        run = replace(model, kind="final", recipe=recipe)
        assert _served_dtype(run, QUICKSTART_MODEL) == served
