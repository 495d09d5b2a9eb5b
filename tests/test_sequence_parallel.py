"""Sequence parallelism (`distributed.sequence_parallel`): each sequence of a micro-batch split over the
processes of a group trains what one process trains on the whole sequences.

In this process: the shard and mask arithmetic against formulas written here, and every refusal (one
line, exit 2, before any weight loads). In the suite's ONE 2-process launch (tests/conftest.py
`two_process_launch`): SFT with packing and activation checkpointing under FSDP-2, padded SFT with an
eval set under ZeRO-3, DPO with full fine-tuning under FSDP-2 and a multi-turn GRPO run with a tool
(GSPO, off-policy, a KL term) under FSDP-2, each `sequence_parallel: 2` (one group of 2: both processes
hold the same micro-batch, each half of its positions) against the 1-process run with the same global
batch (per-step loss, eval loss, margins, KL and rewards within 1e-5, the same weights); and the twin
check, which passes, and stops a split whose second shard's positions are off by one.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_distributed import run_here
from test_preference_train import write_pairs
from test_train import liger_here

from liger_cli.data.encode import IGNORE_INDEX, collate, pack_examples
from liger_cli.run.sequence_parallel import SequenceParallel, whole_mask

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "recipes" / "quickstart" / "data"
STEPS = 3


# --- the arithmetic, in this process ---------------------------------------------------------------------------
def examples(lengths: list[tuple[int, int]]) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, unlearned in lengths:
        ids = torch.randint(4, 50, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * unlearned + ids[unlearned:],
                     "position_ids": list(range(n))})  # fmt: skip
    return rows


def reference_mask(positions: list[int], real: list[bool]) -> torch.Tensor:
    """Query i sees key j: j <= i, j is real, and no document starts in (j, i] (a position 0)."""
    n = len(positions)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            mask[i, j] = real[j] and all(positions[t] != 0 for t in range(j + 1, i + 1))
    return mask


def test_the_mask_over_the_whole_sequence_is_causal_per_document_and_never_attends_padding() -> None:
    batch = collate(pack_examples(examples([(7, 2), (5, 1), (6, 3), (3, 0)]), 12), 0)
    mask = whole_mask(batch["position_ids"], torch.ones_like(batch["input_ids"]).bool(), True)
    for row in range(2):
        want = reference_mask(batch["position_ids"][row].tolist(), [True] * 12)
        assert torch.equal(mask[row, 0], want)
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]).bool()  # a left-padded row
    positions = torch.tensor([[0, 1, 2, 3, 4]] * 2)
    mask = whole_mask(positions, left, True)
    assert torch.equal(mask[0, 0], reference_mask([0, 1, 2, 3, 4], [False, False, True, True, True]))
    # plain causal: None for sdpa (its own causal path), the full causal mask for eager
    assert whole_mask(positions, torch.ones(2, 5).bool(), True) is None
    assert torch.equal(
        whole_mask(positions, torch.ones(2, 5).bool(), False)[1, 0], torch.ones(5, 5).bool().tril()
    )


@pytest.mark.parametrize("degree", [2, 3])
def test_the_shards_put_together_are_the_padded_batch_with_its_targets_shifted(degree: int) -> None:
    batch = collate(examples([(11, 3), (5, 1), (8, 6)]), 0)  # length 11: padded to a multiple of degree
    shards = [SequenceParallel(degree, index, None).shard(batch) for index in range(degree)]
    length = -(-11 // degree) * degree
    joined = {k: torch.cat([s[k] for s in shards], 1) for k in ("input_ids", "shift_labels", "position_ids")}
    assert joined["input_ids"].shape == (3, length)
    assert torch.equal(joined["input_ids"][:, :11], batch["input_ids"])
    assert (joined["input_ids"][:, 11:] == 0).all()
    want = torch.full((3, length), IGNORE_INDEX)
    want[:, :10] = batch["labels"][:, 1:]  # position t's target is token t + 1, across the shards' border
    assert torch.equal(joined["shift_labels"], want)
    assert all(torch.equal(s["labels"], s["shift_labels"]) for s in shards)
    assert torch.equal(joined["position_ids"], torch.arange(length).expand(3, length))
    # right padding only: sdpa's own causal attention is the mask (a real query never sees a later pad);
    # eager gets the whole sequence's mask on every shard, the pads never a key
    assert all(s.mask is None for s in shards)
    eager = SequenceParallel(degree, 0, None, core="eager").shard(batch).mask
    real = torch.cat([batch["attention_mask"], torch.zeros(3, length - 11, dtype=torch.long)], 1).bool()
    assert torch.equal(eager[:, 0], torch.ones(length, length).bool().tril() & real[:, None, :])
    from liger_cli.model.objectives.causal_lm import label_units

    assert sum(int(label_units(s)) for s in shards) == int(label_units(batch))


# --- refusals, before any weight loads ---------------------------------------------------------------------------
def sp_recipe(folder: Path, model: Path, **distributed) -> Path:
    data = {
        "model": {"path": str(model)},
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"train": str(QUICK / "train.jsonl"), "format": "instruction", "max_seq_len": 48},
        "training": {"max_steps": 2, "micro_batch_size": 2},
        "output": {"dir": str(folder / "out")},
        "distributed": {"backend": "fsdp2", "num_processes": 2, "sequence_parallel": 2, **distributed},
    }
    path = folder / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["distributed.backend=ddp"], "distributed.sequence_parallel 2 needs backend fsdp2 or deepspeed with zero_stage 3"),
        (["distributed.backend=fsdp1"], "not fsdp1: set distributed.backend: fsdp2"),
        (["distributed.backend=deepspeed", "distributed.zero_stage=2"], "not deepspeed ZeRO-2"),
        (["distributed.num_processes=3"], "distributed.sequence_parallel 2 must divide the 3 processes"),
        (["distributed.num_processes=1", "distributed.num_machines=2", "distributed.main_process_ip=10.0.0.1"],
         "must divide the 1 processes of each machine"),
        (["training.objective=kto", "data.format=unpaired"], "training.objective kto is not split yet"),
        (["model.attn_implementation=flash_attention_2"], "cannot serve model.attn_implementation flash_attention_2"),
    ],
)  # fmt: skip
def test_what_the_split_cannot_serve_is_refused_by_name(sets, message, tmp_path, tiny_model_dir) -> None:
    recipe = sp_recipe(tmp_path, tiny_model_dir)
    proc = liger_here("train", str(recipe), "--dry-run", *(x for s in sets for x in ("--set", s)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_key_value_heads": 1}, "its 4 attention heads and 1 key-value heads must both be divisible by 2"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding-window or chunked attention"),
        ({"attention_dropout": 0.1}, "attention dropout"),
    ],
)  # fmt: skip
def test_a_model_whose_attention_cannot_be_split_is_refused_in_the_plan(overrides, message, tmp_path):
    from conftest import save_tiny_model

    model = save_tiny_model(tmp_path / "m", overrides.pop("model_type", "llama"), **overrides)
    proc = liger_here("train", str(sp_recipe(tmp_path, model)), "--dry-run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: distributed.sequence_parallel 2: "), proc.stderr
    assert message in lines[0] and lines[0].endswith("; remove distributed.sequence_parallel")


def test_the_plan_says_how_the_split_runs(tmp_path, tiny_model_dir) -> None:
    proc = liger_here("train", str(sp_recipe(tmp_path, tiny_model_dir)), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "sequence parallel: each sequence split over 2 processes (1 data-parallel group(s)); attention " \
           "over the whole sequence with 2 of 4 heads on each" in proc.stdout  # fmt: skip
    assert "2 sequences per optimizer step" in proc.stdout  # one group: micro-batch 2 x 1


# --- 2 processes vs 1 ---------------------------------------------------------------------------------------------
CASES = {  # name -> (backend, packing, activation checkpointing, eval, objective)
    "fsdp2-packed": ("fsdp2", True, "non_reentrant", False, "sft"),
    "zero3-padded": ("deepspeed", False, "off", True, "sft"),
    "fsdp2-dpo-full": ("fsdp2", False, "off", True, "dpo"),
    "fsdp2-agent-gspo": ("fsdp2", False, "off", False, "grpo"),
    "fsdp2-distill": ("fsdp2", False, "off", False, "distill"),
}
AGENT = REPO / "recipes" / "agent"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def cases() -> dict:
    """CASES this environment can run (the ZeRO-3 one needs DeepSpeed: scripts/setup.sh installs it)."""
    return {name: how for name, how in CASES.items() if how[0] != "deepspeed" or HAS_DEEPSPEED}


def run_recipe(
    root: Path, out: Path, backend: str, packing: bool, checkpointing: str, evaluate: bool, objective: str
) -> Path:
    """SFT (LoRA from a saved random adapter) on instruction rows, DPO with full fine-tuning on
    preference pairs (its reference log-probs precomputed, split as it trains), or GRPO's multi-turn
    agent run (GSPO, each batch trained twice, a KL term: the rollouts sampled whole, trained split)."""
    world = 1 if backend == "none" else 2
    data = {
        "model": {"path": str(root / "model")},
        "adapter": {"type": "lora", "init": str(root / "init")},
        "data": {"train": str(root / "train.jsonl"), "format": "instruction", "max_seq_len": 48,
                 "packing": packing, **({"eval": str(root / "eval.jsonl")} if evaluate else {})},
        "training": {"max_steps": STEPS, "micro_batch_size": 2, "grad_accum": 2, "lr": 5.0e-3,
                     "scheduler": "constant", "seed": 1, **({"eval_every": 2} if evaluate else {})},
        "kernels": {"rms_norm": True, "rope": True, "swiglu": True, "fused_linear_cross_entropy": True},
        "output": {"dir": str(out)}, "logging": {"every": 1, "tensorboard": False},
        "distributed": {"backend": backend, "num_processes": world, "activation_checkpointing": checkpointing,
                        **({"sequence_parallel": 2} if world == 2 else {})},
    }  # fmt: skip
    if objective == "grpo":  # multi-turn with a tool on the shipped agent model: GSPO, off-policy, KL
        data["model"] = {"path": str(AGENT / "model")}
        data["adapter"] = {"type": "lora", "r": 4, "alpha": 8}
        data["data"] = {"train": str(AGENT / "train.jsonl"), "format": "prompt", "max_seq_len": 256}
        data["training"] |= {"objective": "grpo", "max_steps": 2, "micro_batch_size": 1, "lr": 5.0e-3}
        data["rl"] = {"num_generations": 4, "max_new_tokens": 80, "max_turns": 2, "loss": "gspo", "beta": 0.05,
                      "num_iterations": 2, "epsilon": 3e-4, "epsilon_high": 4e-4,
                      "tools": [f"{AGENT / 'tools.py'}:lookup"],
                      "rewards": [{"function": f"{AGENT / 'rewards.py'}:correct"}]}  # fmt: skip
    if objective == "distill":  # the shipped distill recipe's student, teacher (sharded too) and prompts
        data["model"] = {"path": str(REPO / "recipes" / "quickstart" / "model")}
        data["adapter"] = {"type": "lora", "init": str(REPO / "recipes" / "grpo" / "sft-start")}
        data["data"] = {
            "train": str(REPO / "recipes" / "grpo" / "train.jsonl"),
            "format": "prompt",
            "max_seq_len": 64,
        }
        data["training"] |= {"objective": "distill", "max_steps": 2}
        data["distill"] = {"teacher": str(REPO / "recipes" / "distill" / "teacher")}
        data["rl"] = {"num_generations": 2, "max_new_tokens": 8}
    if objective == "dpo":
        data["adapter"] = {"type": "none"}
        data["data"] |= {"train": str(root / "pairs.jsonl"), "format": "preference", "max_seq_len": 24}
        data["data"] |= {"eval": str(root / "eval-pairs.jsonl")}
        data["training"] |= {"objective": "dpo", "lr": 1.0e-3}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def make_assets(root: Path) -> Path:
    """The tiny Llama with a saved random LoRA adapter (both runs start from it), rows with uneven lengths."""
    from conftest import save_tiny_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    save_tiny_model(root / "model")
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model"), lora).save_pretrained(root / "init")
    rows = (QUICK / "train.jsonl").read_text().splitlines(keepends=True)
    (root / "train.jsonl").write_text("".join(rows[:48]))
    write_pairs(root / "pairs.jsonl", n=24)
    write_pairs(root / "eval-pairs.jsonl", n=6)
    (root / "eval.jsonl").write_text(
        "".join((QUICK / "eval.jsonl").read_text().splitlines(keepends=True)[:6])
    )
    return root


def launch_part(root: Path) -> tuple[list[dict], dict[str, Path]]:
    """This file's cases of the shared 2-process launch: each CASES run, then the twin checks."""
    assets = make_assets(root / "assets")
    outs = {name: root / name for name in cases()}
    part = [{"recipe": str(run_recipe(assets, outs[name], *how))} for name, how in cases().items()]
    part.append({"check": "sequence_parallel", "recipe": part[0]["recipe"]})
    return part, outs


@pytest.fixture(scope="module")
def two_processes(two_process_launch) -> dict[str, Path]:
    return two_process_launch["test_sequence_parallel"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sp-one")
    assets = make_assets(root / "assets")
    outs = {name: root / name for name in cases()}
    run_here({"cases": [{"recipe": str(run_recipe(assets, outs[name], "none", *how[1:]))}
                        for name, how in cases().items()]})  # fmt: skip
    return outs


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(CASES))
def test_a_split_sequence_trains_what_one_process_trains(name, two_processes, one_process) -> None:
    if name not in cases():
        pytest.skip("DeepSpeed is not installed (scripts/setup.sh installs it)")
    out, ref = two_processes[name], one_process[name]
    said = (out.parent / f"{out.name}.stdout").read_text()
    assert (
        "micro-batch split over 2 processes vs whole on a tiny twin: the loss and every gradient agree"
        in said
    )
    got, want = metrics(out), metrics(ref)
    assert [m["step"] for m in got] == [m["step"] for m in want] and len(want) >= 2
    for mine, theirs in zip(got, want, strict=True):
        for key in (
            "loss",
            "eval_loss",
            "rewards/margins",
            "eval_rewards/margins",
            "kl",
            "reward",
            "reward_std",
        ):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], abs=1e-5), (mine, theirs)
    weights = "model" if CASES[name][-1] == "dpo" else "adapter_model"
    got_w, want_w = (load_file(p / "final" / f"{weights}.safetensors") for p in (out, ref))
    assert got_w.keys() == want_w.keys() and got_w
    for key in want_w:
        torch.testing.assert_close(got_w[key], want_w[key], atol=2e-5, rtol=1e-4, msg=key)
    if CASES[name][-1] in ("grpo", "distill"):  # a group samples once: each completion written once
        rows = [(out / "rollouts.jsonl").read_text().splitlines() for out in (out, ref)]
        fields = ("step", "completion_ids", "reward")
        rows = [sorted(json.dumps({k: json.loads(r).get(k) for k in fields}) for r in part) for part in rows]
        written = {"grpo": 4 * 2, "distill": 2 * 2 * 2 * 2}[CASES[name][-1]]  # once a data step and group
        assert rows[0] == rows[1] and len(rows[1]) == written
        assert "a rollout micro-batch split over 2 processes" in said
    if name.endswith("dpo-full"):  # the reference table, computed split, is the 1-process one
        assert "reference log-probs: computed for 24 train / 6 eval pairs" in said
        assert "a preference-pair micro-batch split over 2 processes" in said


def test_the_twin_check_stops_a_split_whose_positions_are_off_by_one(two_processes) -> None:
    recipe = two_processes["fsdp2-packed"].parent / "fsdp2-packed.yaml"
    found = json.loads(recipe.with_suffix(".split.json").read_text())
    assert found["good"].endswith("the loss and every gradient agree")
    # RoPE is relative: only a query of the second part whose keys lie in the first sees the shift
    assert found["broken"].startswith("distributed.sequence_parallel 2: on a tiny twin of the model, a "), (
        found
    )
    assert "micro-batch split over 2 processes and whole disagree (the " in found["broken"]


def test_the_memory_plan_counts_one_part_of_each_sequence_and_offers_the_split(
    tmp_path, tiny_model_dir
) -> None:
    """--dry-run: with sequence_parallel 2, the activations and the loss are those of half of each
    sequence, plus the whole sequence's mask where packing needs it; a length that does not fit is
    offered the split (with the processes it needs)."""

    def plan(*sets: str, memory: str | None = None) -> dict:
        proc = liger_here("train", str(sp_recipe(tmp_path, tiny_model_dir)), "--dry-run", "--json",
                          "--set", "kernels.check=false", "--set", "data.max_seq_len=256",
                          *(x for s in sets for x in ("--set", s)),
                          *(("--device-memory", memory) if memory else ()))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["memory"]

    whole, split = plan("distributed.sequence_parallel=1"), plan()
    assert split["components"]["activations"] == whole["components"]["activations"] // 2
    assert split["components"]["loss"] < whole["components"]["loss"]
    assert "split mask" not in split["components"]  # unpacked, sdpa: causal needs no mask
    packed = plan("data.packing=true")
    assert packed["components"]["split mask"] == 2 * 256 * 256  # 2 rows x S x S booleans
    tight = whole["total_bytes"] - whole["components"]["activations"] // 4
    short = plan("distributed.sequence_parallel=1", memory=f"{tight / 2**20:.4f}MB")
    assert short["fits"] is False
    offered = [s["set"] for s in short["suggestions"]]
    assert ["distributed.sequence_parallel=2"] in offered, offered
