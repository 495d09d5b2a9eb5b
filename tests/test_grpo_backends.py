"""GRPO with 2 real processes on gloo trains what 1 process trains, under DDP, FSDP-1, FSDP-2 and ZeRO-3
(GSPO with LoRA and CISPO with full fine-tuning, each trained twice per batch: LOSSES; the full runs
also scored by a reward model):
the same completions (sampling keyed by step, prompt row and completion, not by process), the same
rewards and losses per step, and the same adapter (or, with full fine-tuning, the same weights: the
KL term's reference is then each rank's stored share of the starting weights, swapped in); and a
multi-turn run with a tool on the shipped agent model, the same trajectories and adapter. The 1-process
run takes the same global batch (2 prompts x 2 micro-batches x 2 processes = 2 x 4 x 1), each prompt
with its 4 completions. Every backend's runs are this file's part of the suite's ONE 2-process launch
(tests/conftest.py `two_process_launch`: a launch costs 10-20 s of imports per process), ZeRO-3 last."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_distributed import run_here

QUICK = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "data"
AGENT = Path(__file__).resolve().parents[1] / "recipes" / "agent"
DPO = Path(__file__).resolve().parents[1] / "recipes" / "dpo"
TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
BACKENDS = {"ddp": {}, "fsdp1": {}, "fsdp2": {}, "deepspeed": {"zero_stage": 3}}  # DeepSpeed last (below)
# Each backend's LoRA run takes GSPO and its full run CISPO, each trained twice on each batch
# (`num_iterations` 2: step 2 is off-policy, its ratios and clipping from the old log-probs each rank
# kept). GSPO normalises per completion as the grpo loss does, CISPO per token as the multi-turn runs'
# dapo does: every normaliser under every backend.
LOSSES = {
    "lora": {"loss": "gspo", "epsilon": 3e-4, "epsilon_high": 4e-4, "num_iterations": 2},
    "full": {"loss": "cispo", "epsilon_high": 4.0, "num_iterations": 2},
}  # fmt: skip
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return make_assets(tmp_path_factory.mktemp("grpo-dist"))


def make_assets(root: Path) -> dict:
    """A tiny model, a LoRA adapter to start from (random B, so the policy is not the base), prompts,
    and a reward with spread (a random model never answers exactly), under `root`."""
    from conftest import save_tiny_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    model_dir = save_tiny_model(root / "llama")
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                          LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))  # fmt: skip
    peft.save_pretrained(root / "init")
    rows = [json.loads(line) for line in (QUICK / "train.jsonl").read_text().splitlines()[:16]]
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": TEMPLATE.format(**r), "answer": r["output"]}) + "\n" for r in rows)
    )
    (root / "rewards.py").write_text(
        "def spread(completion_ids, **kwargs):\n    return [sum(i % 7 for i in ids) / 20 for ids in completion_ids]\n"
    )
    return {"root": root, "model": model_dir, "init": root / "init", "prompts": prompts,
            "reward_model": reward_run(root, model_dir)}  # fmt: skip


def reward_run(root: Path, model_dir: Path) -> Path:
    """A reward model (`training.objective: reward`, one step on the shipped DPO pairs, full fine-tuning of
    the tiny model), trained in this process: the full runs' second reward, scored on every rank."""
    from test_train import liger_here

    pairs = root / "pairs.jsonl"
    pairs.write_text("".join((DPO / "train.jsonl").read_text().splitlines(keepends=True)[:8]))
    out = root / "reward-model"
    recipe = {
        "model": {"path": str(model_dir)}, "adapter": {"type": "none"},
        "data": {"train": str(pairs), "format": "preference", "max_seq_len": 64},
        "training": {"objective": "reward", "max_steps": 1, "micro_batch_size": 4, "lr": 1.0e-3, "seed": 0},
        "output": {"dir": str(out)}, "logging": {"every": 1, "tensorboard": False},
    }  # fmt: skip
    (root / "reward-model.yaml").write_text(yaml.safe_dump(recipe))
    proc = liger_here("train", str(root / "reward-model.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def recipe(assets: dict, out: Path, backend: str = "none", tuning: str = "lora", **distributed) -> Path:
    world = 1 if backend == "none" else 2
    data = {
        "model": {"path": str(assets["model"])},
        "adapter": {"type": "lora", "init": str(assets["init"])} if tuning == "lora" else {"type": "none"},
        "data": {"train": str(assets["prompts"]), "format": "prompt", "max_seq_len": 40},
        "training": {"objective": "grpo", "max_steps": 2, "micro_batch_size": 2, "grad_accum": 4 // world,
                     "lr": 5.0e-3, "scheduler": "constant", "seed": 3},
        "rl": {"num_generations": 4, "max_new_tokens": 6, "loss": "grpo", "beta": 0.05,
               "rewards": [{"function": f"{assets['root'] / 'rewards.py'}:spread"}]},
    }  # fmt: skip
    data["rl"] |= LOSSES[tuning]
    if tuning == "full":  # and a reward model, scored by each rank for its own completions
        data["rl"]["rewards"].append({"model": str(assets["reward_model"]), "weight": 0.5})
    return written(data, out, backend, world, distributed)


def written(data: dict, out: Path, backend: str, world: int, distributed: dict) -> Path:
    """The recipe with its output, logging and backend, written beside its output folder."""
    data |= {"output": {"dir": str(out)}, "logging": {"every": 1, "tensorboard": False},
             "distributed": {"backend": backend, "num_processes": world, **distributed}}  # fmt: skip
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def agent_recipe(assets: dict, out: Path, backend: str = "none", **distributed) -> Path:
    """A multi-turn run on the shipped agent model (recipes/agent): tool calls, results appended."""
    world = 1 if backend == "none" else 2
    root = assets["root"]
    prompts = root / "agent-prompts.jsonl"
    prompts.write_text("".join((AGENT / "train.jsonl").read_text().splitlines(keepends=True)[:8]))
    data = {
        "model": {"path": str(AGENT / "model")},
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"train": str(prompts), "format": "prompt", "max_seq_len": 256},
        "training": {"objective": "grpo", "max_steps": 2, "micro_batch_size": 1, "grad_accum": 2 // world,
                     "lr": 5.0e-3, "scheduler": "constant", "seed": 3},
        "rl": {"num_generations": 4, "max_new_tokens": 80, "max_turns": 2, "loss": "dapo",
               "tools": [f"{AGENT / 'tools.py'}:lookup"], "rewards": [{"function": f"{AGENT / 'rewards.py'}:correct"}]},
    }  # fmt: skip
    return written(data, out, backend, world, distributed)


def ahead(path: Path) -> Path:
    """The recipe at `path` sampling one step ahead (rl.max_staleness 1), 3 steps, each batch trained once."""
    data = yaml.safe_load(path.read_text())
    data["rl"] |= {"max_staleness": 1, "num_iterations": 1}
    data["training"]["max_steps"] = 3
    path.write_text(yaml.safe_dump(data))
    return path


def steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rollouts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(assets) -> dict[str, Path]:
    """The 1-process runs, LoRA (GSPO) and full fine-tuning (CISPO), the multi-turn agent run and the
    distill run, that every 2-process run must reproduce (by name: "lora", "full", "agent", "distill")."""
    outs, cases = {}, []
    for tuning in ("lora", "full"):
        outs[tuning] = assets["root"] / f"ref-{tuning}"
        cases.append({"recipe": str(recipe(assets, outs[tuning], tuning=tuning))})
    outs["agent"] = assets["root"] / "ref-agent"
    cases.append({"recipe": str(agent_recipe(assets, outs["agent"]))})
    outs["lora-ahead"], outs["agent-ahead"] = (
        assets["root"] / "ref-lora-ahead",
        assets["root"] / "ref-agent-ahead",
    )
    cases.append({"recipe": str(ahead(recipe(assets, outs["lora-ahead"])))})
    cases.append({"recipe": str(ahead(agent_recipe(assets, outs["agent-ahead"])))})
    outs["distill"] = assets["root"] / "ref-distill"
    cases.append({"recipe": str(distill_recipe(assets, outs["distill"]))})
    outs["distill-4bit"] = assets["root"] / "ref-distill-4bit"
    cases.append({"recipe": str(distill_recipe(assets, outs["distill-4bit"], quantize="nf4"))})
    run_here({"cases": cases})
    return outs


def launch_part(root: Path) -> tuple[list[dict], dict[str, dict[str, Path]]]:
    """This file's cases of the shared 2-process launch (tests/conftest.py `two_process_launch`): every
    backend's LoRA, full-fine-tuning and multi-turn agent runs. Per backend: its outputs by tuning
    ("agent" included)."""
    assets = make_assets(root / "assets")
    outs: dict[str, dict[str, Path]] = {}
    cases = []
    for backend, distributed in BACKENDS.items():
        if backend == "deepspeed" and not HAS_DEEPSPEED:
            continue
        outs[backend] = {tuning: root / f"{backend}-{tuning}" for tuning in ("lora", "full")}
        cases += [{"recipe": str(recipe(assets, out, backend, tuning, **distributed))}
                  for tuning, out in outs[backend].items()]  # fmt: skip
        outs[backend]["agent"] = root / f"{backend}-agent"
        cases.append({"recipe": str(agent_recipe(assets, outs[backend]["agent"], backend, **distributed))})
    outs["ahead"] = {"lora": root / "ddp-lora-ahead", "agent": root / "ddp-agent-ahead"}  # rl.max_staleness 1
    cases.append({"recipe": str(ahead(recipe(assets, outs["ahead"]["lora"], "ddp")))})
    cases.append({"recipe": str(ahead(agent_recipe(assets, outs["ahead"]["agent"], "ddp")))})
    outs[
        "distill"
    ] = {}  # on-policy distillation under each backend (the teacher's layers sharded but by DDP)
    for backend, distributed in BACKENDS.items():
        if backend == "deepspeed" and not HAS_DEEPSPEED:
            continue
        outs["distill"][backend] = root / f"distill-{backend}"
        cases.append(
            {"recipe": str(distill_recipe(assets, outs["distill"][backend], backend, **distributed))}
        )
    outs["distill-4bit"] = root / "distill-fsdp2-4bit"  # a 4-bit teacher, its packed layers sharded too
    cases.append({"recipe": str(distill_recipe(assets, outs["distill-4bit"], "fsdp2", quantize="nf4"))})
    return cases, outs


@pytest.fixture(scope="module")
def backend_runs(two_process_launch) -> dict[str, dict[str, Path]]:
    return two_process_launch["test_grpo_backends"]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_processes_train_the_one_process_grpo_run(backend, one_process, backend_runs) -> None:
    if backend == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed (scripts/setup.sh installs it)")
    for tuning, out in backend_runs[backend].items():
        if tuning == "agent":  # multi-turn: the same trajectories (ids, mask, messages) and adapter
            same_trajectories(out, one_process[tuning])
            continue
        same_run(out, one_process[tuning], "adapter_model" if tuning == "lora" else "model")


def test_two_processes_sample_ahead_as_one_process_does(one_process, backend_runs) -> None:
    """rl.max_staleness 1 under DDP: each rank samples its prompts in its own background thread (a
    multi-turn rank's episodes without waiting on the other's), and the run equals the 1-process run:
    the same completions from the same versions, losses and adapter."""
    for kind, out in backend_runs["ahead"].items():
        reference = one_process[f"{kind}-ahead"]
        key = lambda r: (r["step"], r["key"])  # noqa: E731
        got, want = sorted(rollouts(out), key=key), sorted(rollouts(reference), key=key)
        assert len(got) == len(want) == 3 * (8 if kind == "lora" else 2) * 4
        for mine, theirs in zip(got, want, strict=True):
            assert mine["policy_version"] == theirs["policy_version"] == max(0, mine["step"] - 2)
            if kind == "agent":  # every model turn's version
                assert mine["turn_versions"] == [mine["policy_version"]] * mine["turns"]
            for name in ("completion_ids", "completion_mask", "sampler_logprobs", "reward"):
                assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name  # batches differ by rank
        for mine, theirs in zip(steps(out), steps(reference), strict=True):
            for name in ("loss", "reward", "clip_fraction", "sampler/abs_logp_diff"):
                assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name
        same_weights(out, reference, "adapter_model")


def same_trajectories(out: Path, reference: Path) -> None:
    key = lambda r: (r["step"], r["prompt"], r["completion_ids"])  # noqa: E731 - order within a step
    got, want = sorted(rollouts(out), key=key), sorted(rollouts(reference), key=key)
    assert len(got) == len(want) == 2 * 2 * 4
    for mine, theirs in zip(got, want, strict=True):
        for name in ("completion_ids", "completion_mask", "messages", "turns", "finish_reason", "reward"):
            assert mine[name] == theirs[name], name
        assert mine["advantage"] == pytest.approx(theirs["advantage"], abs=1e-5)
    assert sum(r["tool_calls"] for r in got) > 0  # the trajectories call the tool
    for mine, theirs in zip(steps(out), steps(reference), strict=True):
        for name in ("loss", "reward", "turns", "tool/calls"):
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name
    same_weights(out, reference, "adapter_model")


def same_run(out: Path, reference: Path, weights: str) -> None:
    got, want = rollouts(out), rollouts(reference)
    iterations = yaml.safe_load((out / "recipe.yaml").read_text())["rl"]["num_iterations"]
    assert len(got) == len(want) == 2 * 8 * 4 // iterations  # completions sampled once per `iterations` steps
    key = lambda r: (r["step"], json.dumps(r["prompt"]), r["completion_ids"])  # noqa: E731 - order within a step
    assert sorted(map(key, got)) == sorted(map(key, want))  # the same completions
    for mine, theirs in zip(sorted(got, key=key), sorted(want, key=key), strict=True):
        assert mine["reward"] == pytest.approx(theirs["reward"], abs=1e-9)
        assert mine["advantage"] == pytest.approx(theirs["advantage"], abs=1e-5)
    for mine, theirs in zip(steps(out), steps(reference), strict=True):
        for name in ("loss", "reward", "kl", "clip_fraction", "sampler/abs_logp_diff"):
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name
    assert all(m["reward_std"] > 0 for m in steps(out))  # the test has something to learn from
    same_weights(out, reference, weights)


def same_weights(out: Path, reference: Path, weights: str) -> None:
    """Both runs' final `weights`.safetensors hold the same tensors, equal within fp32 noise."""
    got_w, want_w = (load_file(p / "final" / f"{weights}.safetensors") for p in (out, reference))
    assert got_w.keys() == want_w.keys() and got_w
    for name in want_w:
        torch.testing.assert_close(got_w[name], want_w[name], atol=2e-5, rtol=1e-4, msg=name)


def distill_recipe(
    assets: dict, out: Path, backend: str = "none", quantize: str = "none", **distributed
) -> Path:
    """On-policy distillation toward a second tiny model (other weights, the same tokenizer), in fp32 or
    with its linear layers in 4 bits (`quantize`)."""
    from conftest import save_tiny_model

    teacher = assets["root"] / "teacher"
    if not teacher.exists():
        save_tiny_model(teacher, seed=1, initializer_range=0.3)
    world = 1 if backend == "none" else 2
    data = {
        "model": {"path": str(assets["model"])},
        "adapter": {"type": "lora", "init": str(assets["init"])},
        "data": {"train": str(assets["prompts"]), "format": "prompt", "max_seq_len": 40},
        "training": {"objective": "distill", "max_steps": 2, "micro_batch_size": 2, "grad_accum": 4 // world,
                     "lr": 5.0e-3, "scheduler": "constant", "seed": 3},
        "distill": {"teacher": str(teacher), "quantize": quantize},
        "rl": {"num_generations": 2, "max_new_tokens": 6},
    }  # fmt: skip
    return written(data, out, backend, world, distributed)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_processes_distill_as_one_under_each_backend(backend, one_process, backend_runs) -> None:
    """The same completions, the same loss and KL per step, the same adapter: the student sharded by the
    backend, the teacher's decoder layers too where the student's are sharded (FSDP-1, FSDP-2, ZeRO-3: each
    rank holds its share of them, counted from the DTensors' local shards) and whole on each rank under
    DDP, the divergence divided by
    the step's completion tokens over both."""
    if backend == "deepspeed" and not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed (scripts/setup.sh installs it)")
    out, reference = backend_runs["distill"][backend], one_process["distill"]
    said = (out.parent / f"{out.name}.stdout").read_text()
    held, whole = (
        int(n.replace(",", "")) for n in re.search(r"teacher holds ([\d,]+) of its ([\d,]+)", said).groups()
    )
    teacher = Path(yaml.safe_load((out.parent / f"{out.name}.yaml").read_text())["distill"]["teacher"])
    layers = sum(t.numel() for k, t in load_file(teacher / "model.safetensors").items() if ".layers." in k)
    assert held == (whole if backend == "ddp" else whole - layers // 2), said
    key = lambda r: (r["step"], json.dumps(r["prompt"]), r["completion_ids"])  # noqa: E731 - order within a step
    got, want = sorted(map(key, rollouts(out))), sorted(map(key, rollouts(reference)))
    assert got == want and len(got) == 2 * 8 * 2
    for mine, theirs in zip(steps(out), steps(reference), strict=True):
        for name in ("loss", "kl", "completion_length"):
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name
    same_weights(out, reference, "adapter_model")


def test_a_4bit_teacher_sharded_by_fsdp2_distills_as_one_process(one_process, backend_runs) -> None:
    """The teacher's linear layers in 4 bits (packed in fp32 storage so that they shard), each decoder
    layer a fully_shard unit: each rank holds less than all of it, and the run equals 1 process with the
    same 4-bit teacher whole (completions, loss and KL per step, adapter)."""
    out, reference = backend_runs["distill-4bit"], one_process["distill-4bit"]
    said = (out.parent / f"{out.name}.stdout").read_text()
    held, whole = (
        int(n.replace(",", "")) for n in re.search(r"teacher holds ([\d,]+) of its ([\d,]+)", said).groups()
    )
    assert held < whole and "sharded over 2 processes by FSDP-2" in said, said
    assert "nf4 4-bit linear layers, its decoder layers sharded over the processes" in said
    key = lambda r: (r["step"], json.dumps(r["prompt"]), r["completion_ids"])  # noqa: E731 - order within a step
    assert sorted(map(key, rollouts(out))) == sorted(map(key, rollouts(reference)))
    for mine, theirs in zip(steps(out), steps(reference), strict=True):
        for name in ("loss", "kl"):
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name
    got_w, want_w = (load_file(p / "final" / "adapter_model.safetensors") for p in (out, reference))
    for name in want_w:
        torch.testing.assert_close(got_w[name], want_w[name], atol=2e-5, rtol=1e-4, msg=name)
