"""Preference training: the objective on a real (tiny) model, fused vs eager, accumulation, the reference
as the adapter disabled, and `liger train` runs of DPO, SimPO and ORPO."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from liger_cli.model.objectives.preference import Preference, reference_mode, sequence_logprobs
from liger_cli.recipe.schema import PreferenceSection

OPTIONS = {
    "dpo": PreferenceSection(beta=0.2),
    "dpo-robust": PreferenceSection(beta=0.2, loss_type="robust", label_smoothing=0.1),
    "dpo-ipo": PreferenceSection(beta=0.2, loss_type="ipo"),
    "simpo": PreferenceSection(beta=2.0, gamma=0.5, sft_weight=0.3),
    "orpo": PreferenceSection(beta=0.2),
}


def pairs_examples(n: int, seed: int = 0) -> list[dict]:
    """Pairs with prompts and answers of uneven lengths (padding and unequal learned-token counts)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 6))]
        sides = {}
        for side in ("chosen", "rejected"):
            answer = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 7))] + [2]
            sides[f"{side}_input_ids"] = prompt + answer
            sides[f"{side}_labels"] = [-100] * len(prompt) + answer
        examples.append(sides)
    return examples


def lora_model(model_dir: Path, seed: int = 0, fused: bool = False, modules_to_save=None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                        modules_to_save=modules_to_save)  # fmt: skip
    model = get_peft_model(base, config)
    if fused:
        from liger_kernels import patch_model

        patch_model(model, rms_norm=False, rope=False, swiglu=False, fused_linear_cross_entropy=True)
    model.train()
    return model


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def step(model, objective, examples, micro: int):
    """One optimizer step's loss and gradients, `micro` pairs per micro-batch (the loop's arithmetic)."""
    model.zero_grad()
    batches = [objective.collate(examples[i : i + micro], 0) for i in range(0, len(examples), micro)]
    num_items = sum(objective.units(b) for b in batches)
    total, stats = 0.0, {}
    for batch in batches:
        loss, found = objective.loss(model, batch, num_items)
        loss.backward()
        total += loss.item()
        for k, v in found.items():
            stats[k] = stats.get(k, 0.0) + v.item()
    return total, stats, grads(model)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_fused_and_eager_give_the_same_loss_metrics_and_gradients(tiny_model_dir, name):
    objective = Preference(name.split("-")[0], OPTIONS[name])
    examples = pairs_examples(4)
    eager = step(lora_model(tiny_model_dir), objective, examples, micro=4)
    fused = step(lora_model(tiny_model_dir, fused=True), objective, examples, micro=4)
    assert fused[0] == pytest.approx(eager[0], rel=1e-5, abs=1e-6)
    assert fused[1] == pytest.approx(eager[1], rel=1e-4, abs=1e-5)
    assert fused[2].keys() == eager[2].keys() and fused[2]
    for key in eager[2]:
        torch.testing.assert_close(fused[2][key], eager[2][key], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_accumulation_does_not_change_the_math(tiny_model_dir, name):
    """4 pairs in one micro-batch, 2 x 2 and 1 x 4: one loss per pair over the step's pair count."""
    objective = Preference(name, OPTIONS[name])
    examples = pairs_examples(4, seed=1)
    model = lora_model(tiny_model_dir, seed=1)
    whole = step(model, objective, examples, micro=4)
    for micro in (2, 1):
        parts = step(model, objective, examples, micro=micro)
        assert parts[0] == pytest.approx(whole[0], rel=1e-5)
        assert parts[1] == pytest.approx(whole[1], rel=1e-4, abs=1e-6)
        for key in whole[2]:
            torch.testing.assert_close(parts[2][key], whole[2][key], rtol=1e-4, atol=1e-7)


def test_the_reference_is_the_model_without_its_adapter_and_leaves_every_flag_as_it_was(tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = lora_model(tiny_model_dir, seed=2, modules_to_save=["lm_head"])
    for name, p in model.named_parameters():  # an unusual but legal mix of frozen and trainable
        if "lora_A" in name and "layers.0." in name:
            p.requires_grad_(False)
    model.base_model.model.model.layers[1].eval()
    before_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    before_mode = {n: m.training for n, m in model.named_modules()}
    batch = Preference("dpo", OPTIONS["dpo"]).collate(pairs_examples(2, seed=2), 0)

    def leaky_disable_adapter(self):  # what peft has done: leave frozen adapter weights trainable
        import contextlib

        @contextlib.contextmanager
        def context():
            with PeftModel.disable_adapter(self):
                yield
            for p in self.parameters():
                p.requires_grad_(True)

        return context()

    model.disable_adapter = leaky_disable_adapter.__get__(model)
    with torch.no_grad(), reference_mode(model):
        reference = sequence_logprobs(model, batch)[0]
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before_grad
    assert {n: m.training for n, m in model.named_modules()} == before_mode

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base.train()
    base.lm_head.weight.data.copy_(model.base_model.model.lm_head.original_module.weight)
    base.model.layers[1].eval()
    with torch.no_grad():
        expected = sequence_logprobs(base, batch)[0]
        policy = sequence_logprobs(model, batch)[0]
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(policy, expected, atol=1e-3)  # the adapter (random B) does change them


# --- `liger train` ---------------------------------------------------------------------------------------


def write_pairs(path: Path, n: int = 48) -> Path:
    rng = random.Random(0)
    words = "zero one two three four five six seven eight nine".split()
    rows = []
    for _ in range(n):
        a = rng.randrange(10, 99)
        rows.append({"prompt": str(a), "chosen": " ".join(words[int(c)] for c in str(a)),
                     "rejected": " ".join(words[int(c)] for c in str(a + 1))})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_train_recipe(tmp_path: Path, model_dir: Path, objective: str) -> tuple[Path, Path]:
    """The recipe `train` runs (a LoRA run of `objective` on 48 pairs, 3 steps) and its output folder."""
    data = write_pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / f"out-{objective}"
    recipe = tmp_path / f"{objective}.yaml"
    recipe.write_text(
        f"model: {{path: {model_dir}}}\n"
        "adapter: {type: lora, r: 4, alpha: 8}\n"
        f"data: {{train: {data}, format: preference, max_seq_len: 24, eval_fraction: 0.25}}\n"
        f"training: {{objective: {objective}, max_steps: 3, micro_batch_size: 4, grad_accum: 2, lr: 5.0e-3, "
        "eval_every: 2, seed: 1}\n"
        f"output: {{dir: {out}}}\n"
        "logging: {every: 1}\n"
    )
    return recipe, out


def train(
    tmp_path: Path, model_dir: Path, objective: str, *extra: str
) -> tuple[subprocess.CompletedProcess, Path]:
    """`liger train` in this process (test_train.liger_here: what a real process returns): the run is not
    what the tests are about, and `liger train`'s real process is other files' tests'."""
    from test_train import liger_here

    recipe, out = write_train_recipe(tmp_path, model_dir, objective)
    return liger_here("train", str(recipe), *extra), out


@pytest.fixture(scope="module")
def dpo_run(tiny_model_dir, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One `liger train` of the DPO recipe, 4 steps with checkpoints at 2 and 4: the run whose metrics
    and adapter the tests read, and the uninterrupted run a resume must reproduce (the resume is in
    later_runs' fresh process)."""
    tmp_path = tmp_path_factory.mktemp("dpo-run")
    proc, out = train(
        tmp_path, tiny_model_dir, "dpo", "--set", "training.max_steps=4", "--set", "output.save_every=2"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, out


def test_dpo_run_logs_every_metric_starts_at_ln2_and_saves_an_adapter(dpo_run):
    proc, out = dpo_run
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first_eval = next(x for x in lines if "eval_loss" in x)
    assert first_eval["step"] == 0
    assert first_eval["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first_eval["eval_rewards/chosen"] == first_eval["eval_rewards/rejected"] == 0
    train_lines = [x for x in lines if "loss" in x]
    assert train_lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected"):  # fmt: skip
        assert key in train_lines[-1] and f"eval_{key}" in first_eval
    assert "start check: step 1 has policy == reference" in proc.stdout
    assert (out / "final" / "adapter_model.safetensors").is_file()


REFERENCE_FREE = ["simpo", "orpo"]


@pytest.fixture(scope="module")
def later_runs(dpo_run, tiny_model_dir, tmp_path_factory) -> dict:
    """In ONE process (test_train.liger_in_one_process: each command its own exit code and output):
    the DPO run resumed from its step-2 checkpoint, a DoRA DPO run and `liger merge` of it, then SimPO
    and ORPO with full fine-tuning."""
    from test_train import liger_in_one_process

    _, out = dpo_run
    recipe = out.parent / "dpo.yaml"  # dpo_run's recipe
    root = tmp_path_factory.mktemp("later")
    dora_recipe, dora_out = write_train_recipe(root, tiny_model_dir, "dpo")
    outs = {"resumed": root / "resumed", "dora": dora_out, "merged": root / "merged"}
    commands = [
        ["train", str(recipe), "--set", "training.max_steps=4", "--set", "output.save_every=2",
         "--set", f"output.dir={outs['resumed']}", "--set", f"output.resume={out / 'checkpoints' / 'step-2'}"],
        ["train", str(dora_recipe), "--set", "adapter.type=dora"],
        ["merge", str(dora_out), str(outs["merged"])],
    ]  # fmt: skip
    for objective in REFERENCE_FREE:
        free_recipe, outs[objective] = write_train_recipe(root, tiny_model_dir, objective)
        commands.append(["train", str(free_recipe), "--set", "adapter.type=none"])
    procs = liger_in_one_process(*commands)
    return {"resumed": procs[0], "dora": procs[1], "merge": procs[2], "outs": outs,
            **dict(zip(REFERENCE_FREE, procs[3:], strict=True))}  # fmt: skip


# DPO with full fine-tuning (no adapter to disable: a reference table computed before step 1) is proved
# end to end by tests/test_reference_logps.py: the table's values, its storage and its resume.
@pytest.mark.parametrize("objective", REFERENCE_FREE)
def test_reference_free_objectives_train_and_need_no_reference(later_runs, objective):
    proc, out = later_runs[objective], later_runs["outs"][objective]
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(x["loss"]) for x in lines if "loss" in x)
    assert "start check" not in proc.stdout  # the run checks no reference
    assert (out / "final" / "model.safetensors").is_file()


def test_dry_run_plans_two_sequences_per_pair(tmp_path):
    """The same recipe as SFT on single sequences: twice the activations (chosen and rejected rows)."""
    from liger_cli.plan.dry_run import dry_run
    from liger_cli.recipe import load_recipe

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    text = (recipes / "dpo.yaml").read_text()
    sft = tmp_path / "sft.yaml"
    sft.write_text(
        text.replace("objective: dpo", "objective: sft")
        .replace("format: preference", "format: instruction")
        .replace("dpo/train.jsonl", str(recipes / "quickstart/data/train.jsonl"))
        .replace("dpo/eval.jsonl", str(recipes / "quickstart/data/eval.jsonl"))
        .replace("quickstart/model", str(recipes / "quickstart/model"))
        .replace("preference: {beta: 0.3, loss_type: sigmoid}", "")
    )
    pairs_plan = json.loads(dry_run(load_recipe(recipes / "dpo.yaml", []), as_json=True))["memory"][
        "components"
    ]
    sft_plan = json.loads(dry_run(load_recipe(sft, []), as_json=True))["memory"]["components"]
    assert pairs_plan["activations"] == pytest.approx(2 * sft_plan["activations"], rel=0.01)
    assert pairs_plan["parameters"] == sft_plan["parameters"]


# --- the twin's checks with a preference objective ----------------------------------------------------------
def _twin_adapter():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    return lambda model: get_peft_model(model, config)


def test_the_kernel_check_compares_the_preference_loss_and_catches_a_wrong_fused_logprob(monkeypatch):
    from transformers import AutoConfig

    from liger_cli.twin.kernel_check import check_kernels

    kernels = {"fused_linear_cross_entropy": True}
    config = AutoConfig.for_model("llama")
    objective = Preference("dpo", OPTIONS["dpo"])
    good = check_kernels(config, kernels, add_adapter=_twin_adapter(), objective=objective)
    assert good.lines() == [
        "kernel check: one step on a tiny twin (the dpo loss on pairs), patched vs unpatched: "
        "loss, every gradient and greedy generation agree"
    ]
    fused_module = sys.modules["liger_kernels.fused_linear_logprob"]
    real = fused_module.fused_linear_logprob

    def off_by_a_little(*args, **kwargs):  # what only the preference path computes, 0.1% off
        logp, count = real(*args, **kwargs)
        return logp * 1.001, count

    monkeypatch.setattr(fused_module, "fused_linear_logprob", off_by_a_little)
    bad = check_kernels(config, kernels, add_adapter=_twin_adapter(), objective=objective)
    assert "fused_linear_cross_entropy" in bad.switched_off, bad.lines()
    assert not bad.kernels["fused_linear_cross_entropy"]


def accumulation_checks(objective, monkeypatch) -> tuple:
    """The twin's accumulation check of `objective` (a tiny Llama twin with a LoRA adapter, 2 micro-batches),
    then again with the objective's loss made each micro-batch's own mean: (good, bad) results."""
    from transformers import AutoConfig

    from liger_cli.twin.pipeline_check import check_pipeline

    run = dict(packing=False, grad_accum=2, add_adapter=_twin_adapter(), objective=objective)
    _, good = check_pipeline(AutoConfig.for_model("llama"), {}, **run)
    real = type(objective).loss

    def mean_per_micro_batch(self, model, batch, num_items):
        loss, stats = real(self, model, batch, num_items)
        return loss * num_items / self.units(batch), stats  # each micro-batch's own mean

    monkeypatch.setattr(type(objective), "loss", mean_per_micro_batch)
    _, bad = check_pipeline(AutoConfig.for_model("llama"), {}, **run)
    return good, bad


def test_the_accumulation_check_proves_the_pair_loss_and_catches_a_mean_per_micro_batch(monkeypatch):
    good, bad = accumulation_checks(Preference("orpo", OPTIONS["orpo"]), monkeypatch)
    assert good.error is None and good.line.endswith(
        "(padding, orpo loss on pairs): loss and every gradient agree"
    )
    assert bad.error and "the mean over its pairs" in bad.error


# --- everything else keeps working with a preference objective --------------------------------------------


def metrics(out: Path, key: str = "loss") -> list[float]:
    return [x[key] for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in x]


def test_dpo_resume_is_bit_identical(dpo_run, later_runs):
    """A DPO run resumed from its step-2 checkpoint (adapter, optimizer, schedule, RNG) logs the same
    steps 3-4 and saves the same adapter as the run that went through."""
    from safetensors.torch import load_file

    _, out = dpo_run
    resumed, resumed_out = later_runs["resumed"], later_runs["outs"]["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "start check" not in resumed.stdout
    for key in ("loss", "rewards/margins", "logps/chosen"):
        assert metrics(resumed_out, key) == metrics(out, key)[2:], key
    got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (resumed_out, out))
    assert got.keys() == want.keys() and got
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_dora_dpo_merges_into_a_model_that_gives_the_adapters_logits(later_runs):
    proc = later_runs["dora"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "start check: step 1 has policy == reference" in proc.stdout  # DoRA's magnitude starts at |W|
    assert "final model verified" in proc.stdout
    merged = later_runs["merge"]
    assert merged.returncode == 0, merged.stderr[-2000:]
    merged_dir = later_runs["outs"]["merged"]
    assert "merge verified" in merged.stdout and (merged_dir / "model.safetensors").is_file()


def test_bench_on_a_dpo_recipe_compares_kernels_on_and_off(tmp_path, tiny_model_dir):
    """`liger bench` trains the preference recipe twice (fused log-probs on, then every kernel off);
    both start from policy == reference, so their first losses agree (ln 2). The bench's parent runs
    in this process (each run is its own process, as always); its command line is test_bench.py's."""
    from liger_cli.bench import bench
    from liger_cli.plan.dry_run import dry_run
    from liger_cli.recipe import load_recipe

    recipe, _ = write_train_recipe(tmp_path, tiny_model_dir, "dpo")
    loaded = load_recipe(recipe, [])  # what `liger train --dry-run` prints, in-process: it plans
    assert loaded.to_yaml() and dry_run(loaded)
    out = tmp_path / "bench"
    printed: list[str] = []
    code = bench(recipe, [], steps=1, warmup=1, out_dir=out, echo=printed.append)
    assert code == 0, "\n".join(printed)[-4000:]
    report = json.loads((out / "bench.json").read_text())
    assert set(report["runs"]) == {"kernels_on", "kernels_off"}
    for variant in report["runs"]:
        assert metrics(out / variant)[0] == pytest.approx(math.log(2), abs=1e-5), variant
