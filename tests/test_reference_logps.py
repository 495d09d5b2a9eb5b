"""DPO with full fine-tuning: the reference log-probs are computed once from the untrained model, stored
with the run, read back (never recomputed) on resume, and refused when they no longer fit the run."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_distributed import run_driver
from test_output_safety import one_line_error
from test_preference_train import write_pairs
from test_train import liger_in_one_process

from liger_cli.run.reference import REFERENCE_FILE


def write_recipe(folder: Path, model_dir: Path, data: Path, max_steps: int, save_every: int = 0) -> Path:
    """Full fine-tuning DPO, a constant schedule (a run made longer trains as an uninterrupted one)."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "dpo.yaml"
    recipe.write_text(
        f"model: {{path: {model_dir}}}\n"
        "adapter: {type: none}\n"
        f"data: {{train: {data}, format: preference, max_seq_len: 24, eval_fraction: 0.25}}\n"
        f"training: {{objective: dpo, max_steps: {max_steps}, micro_batch_size: 4, grad_accum: 2, lr: 1.0e-3, "
        "scheduler: constant, eval_every: 2, seed: 1}\n"
        f"output: {{dir: {folder / 'out'}, save_every: {save_every}}}\n"
        "logging: {every: 1}\n"
        "preference: {beta: 0.5}\n"
    )
    return recipe


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory) -> dict:
    """A 4-step run (checkpoints at 2 and 4) and a 2-step run, trained one after the other in ONE process
    (tests/dist_driver.py: `liger train`'s training, case after case); then, in one fresh process
    (test_train.liger_in_one_process), the 2-step run made 4 steps long by a resume as after a crash
    (its first command), and the 4-step run resumed from its step 2 into another folder."""
    root = tmp_path_factory.mktemp("reference")
    data = write_pairs(root / "pairs.jsonl")
    found: dict = {"data": data}
    for name, steps in (("long", 4), ("short", 2)):
        recipe = write_recipe(root / name, tiny_model_dir, data, steps, save_every=2)
        found[name] = {"recipe": recipe, "out": recipe.parent / "out"}
    cases = [{"recipe": str(found[name]["recipe"])} for name in ("long", "short")]
    found["fresh"] = run_driver({"cases": cases}, root, nproc=1, timeout=900)  # asserts exit 0
    short, long_out = found["short"]["out"], found["long"]["out"]
    found["mtime"] = os.stat(short / REFERENCE_FILE).st_mtime_ns
    found["long_mtime"] = os.stat(long_out / REFERENCE_FILE).st_mtime_ns
    found["elsewhere"] = root / "continued"
    found["continued"], found["resumed_elsewhere"] = liger_in_one_process(
        ["train", str(found["short"]["recipe"]), "--set", "training.max_steps=4", "--set", "output.resume=auto"],
        ["train", str(found["long"]["recipe"]), "--set", f"output.dir={found['elsewhere']}",
         "--set", f"output.resume={long_out / 'checkpoints' / 'step-2'}"],
    )  # fmt: skip
    assert found["continued"].returncode == 0, found["continued"].stderr[-3000:]
    return found


def test_a_fresh_run_computes_the_table_and_starts_at_policy_equals_reference(runs) -> None:
    proc, out = runs["fresh"], runs["long"]["out"]
    for line in ("reference log-probs: computed for 36 train / 12 eval pairs",  # each of the 2 fresh runs
                "start check: step 1 has policy == reference (rewards 0, loss 0.6931"):  # fmt: skip
        assert proc.stdout.count(line) == 2, proc.stdout[-3000:]
    assert (out / REFERENCE_FILE).is_file()
    lines = metrics(out)
    first_eval = next(x for x in lines if "eval_loss" in x)
    assert first_eval["step"] == 0 and first_eval["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(first_eval["eval_rewards/chosen"]) < 1e-5 and abs(first_eval["eval_rewards/rejected"]) < 1e-5
    train_lines = [x for x in lines if "loss" in x]
    assert train_lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(train_lines[0]["rewards/chosen"]) < 1e-5 and abs(train_lines[0]["rewards/rejected"]) < 1e-5
    # The reference is the table, not the moving model: later steps leave ln 2 and reward 0 behind.
    assert abs(train_lines[-1]["loss"] - math.log(2)) > 1e-3
    assert abs(train_lines[-1]["rewards/chosen"]) > 1e-3 and abs(train_lines[-1]["rewards/rejected"]) > 1e-3
    last_eval = [x for x in lines if "eval_loss" in x][-1]
    assert abs(last_eval["eval_loss"] - math.log(2)) > 1e-3
    assert (out / "final" / "model.safetensors").is_file()
    plan = (out / "plan.txt").read_text()  # the twin's checks ran the dpo loss (its reference on the fly)
    assert "(padding, dpo loss on pairs): loss and every gradient agree" in plan


def summed_logps(model, ids: list[int], labels: list[int]) -> float:
    """The summed log-probability of the learned tokens, from the model's logits (one sequence)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    targets = torch.tensor(labels[1:])
    learned = targets != -100
    logp = torch.log_softmax(logits, dim=-1)[learned, targets[learned]]
    return logp.sum().item()


def test_the_table_holds_the_base_models_logprobs_of_every_pair(runs, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from liger_cli.data import build_datasets
    from liger_cli.data.tokenizer import load_tokenizer
    from liger_cli.recipe import load_recipe

    recipe = load_recipe(runs["long"]["recipe"], [])
    train, evald = build_datasets(recipe.data, load_tokenizer(recipe), recipe.training.seed)
    tables = load_file(runs["long"]["out"] / REFERENCE_FILE)
    assert tables["train"].shape == (len(train), 2) == (36, 2) and tables["eval"].shape == (12, 2)
    assert tables["train"].dtype == torch.float32
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for name, dataset in (("train", train), ("eval", evald)):
        for i in range(len(dataset)):
            pair = dataset[i]
            want = [
                summed_logps(base, pair[f"{s}_input_ids"], pair[f"{s}_labels"])
                for s in ("chosen", "rejected")
            ]
            torch.testing.assert_close(
                tables[name][i].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-4
            )


def test_a_resume_reads_the_table_and_trains_as_the_uninterrupted_run(runs) -> None:
    proc, out = runs["continued"], runs["short"]["out"]
    assert (
        f"reference log-probs: read from {out / REFERENCE_FILE} (36 train / 12 eval pairs), not recomputed"
        in (proc.stdout)
    )
    assert "computed for" not in proc.stdout and "start check" not in proc.stdout
    assert os.stat(out / REFERENCE_FILE).st_mtime_ns == runs["mtime"]
    long_out = runs["long"]["out"]
    losses = {
        name: [x["loss"] for x in metrics(o) if "loss" in x]
        for name, o in (("short", out), ("long", long_out))
    }
    assert losses["short"] == pytest.approx(losses["long"], abs=1e-6)
    got, want = (load_file(o / "final" / "model.safetensors") for o in (out, long_out))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


def test_a_resume_into_another_folder_reads_the_writing_runs_table(runs) -> None:
    long_out = runs["long"]["out"]
    out, proc = runs["elsewhere"], runs["resumed_elsewhere"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"reference log-probs: read from {long_out / REFERENCE_FILE}" in proc.stdout
    assert os.stat(long_out / REFERENCE_FILE).st_mtime_ns == runs["long_mtime"]
    assert (out / REFERENCE_FILE).read_bytes() == (long_out / REFERENCE_FILE).read_bytes()  # it resumes too
    got, want = (load_file(o / "final" / "model.safetensors") for o in (out, long_out))
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


def copied_run(runs, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the 4-step run (recipe and folder) to break without touching the shared one."""
    folder = tmp_path / "copy"
    shutil.copytree(runs["long"]["out"], folder / "out")
    recipe = folder / "dpo.yaml"
    recipe.write_text(
        runs["long"]["recipe"].read_text().replace(str(runs["long"]["out"]), str(folder / "out"))
    )
    return recipe, folder / "out"


def resume_step2(recipe: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """A resume from step 2 that must be refused, in this process (test_train.liger_here: the command's
    exit code and one-line error); the resumes that train are real processes."""
    from test_train import liger_here

    return liger_here(
        "train", str(recipe), "--set", f"output.resume={out / 'checkpoints' / 'step-2'}", *extra
    )


def test_a_changed_data_file_is_refused_on_resume(runs, tmp_path: Path) -> None:
    recipe, out = copied_run(runs, tmp_path)
    data = tmp_path / "pairs.jsonl"
    write_pairs(data, n=44)
    message = one_line_error(resume_step2(recipe, out, "--set", f"data.train={data}"))
    assert "data" in message and "differs" in message, message  # the run's fingerprint refuses first


def test_a_reference_table_computed_for_other_data_is_refused_on_resume(runs, tmp_path: Path) -> None:
    recipe, out = copied_run(runs, tmp_path)
    path = out / REFERENCE_FILE
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tables = load_file(path)
    save_file(tables, str(path), metadata={**metadata, "data.train sha256": json.dumps("0" * 64)})
    message = one_line_error(resume_step2(recipe, out))
    assert str(path) in message and "computed for another data.train sha256" in message, message
    assert "0000000000" in message


def test_a_missing_reference_table_is_refused_on_resume_never_recomputed(runs, tmp_path: Path) -> None:
    recipe, out = copied_run(runs, tmp_path)
    (out / REFERENCE_FILE).unlink()
    message = one_line_error(resume_step2(recipe, out))
    assert (
        f"{out / REFERENCE_FILE}" in message and "is missing" in message and "cannot be recomputed" in message
    )
    assert not (out / REFERENCE_FILE).exists()


def test_the_memory_plan_says_the_reference_is_a_table(runs) -> None:
    from liger_cli.plan.dry_run import dry_run
    from liger_cli.recipe import load_recipe

    text = dry_run(load_recipe(runs["long"]["recipe"], []))
    assert "(4 pairs; reference log-probs precomputed before training, 8 bytes a pair)" in text, text


def test_the_twins_checks_run_full_fine_tuning_dpo_with_the_twin_as_its_own_reference() -> None:
    """No adapter, no table: the twin's loss takes the untrained twin as its reference (ln 2 at zero)."""
    from transformers import AutoConfig

    from liger_cli.model.objectives.preference import Preference
    from liger_cli.recipe.schema import PreferenceSection
    from liger_cli.twin.kernel_check import check_kernels
    from liger_cli.twin.pipeline_check import check_pipeline

    config = AutoConfig.for_model("llama")
    objective = Preference("dpo", PreferenceSection(beta=0.2), adapter=False)
    kernels = check_kernels(config, {"fused_linear_cross_entropy": True}, objective=objective)
    assert kernels.lines() == [
        "kernel check: one step on a tiny twin (the dpo loss on pairs), patched vs unpatched: "
        "loss, every gradient and greedy generation agree"
    ]
    _, accumulated = check_pipeline(config, {}, packing=False, grad_accum=2, objective=objective)
    assert accumulated.error is None and "dpo loss on pairs" in accumulated.line, accumulated.line


def test_the_loss_reads_each_pairs_row_and_the_row_never_reaches_the_model(tiny_model_dir: Path) -> None:
    from test_preference_train import pairs_examples
    from transformers import AutoModelForCausalLM

    from liger_cli.model.objectives.preference import PAIR_INDEX, Preference
    from liger_cli.recipe.schema import PreferenceSection

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
    objective = Preference("dpo", PreferenceSection(beta=0.2), adapter=False)
    examples = [{**ex, PAIR_INDEX: i} for i, ex in enumerate(pairs_examples(6, seed=4))]
    objective.prepare(lambda values: torch.cat([values(model, objective.collate(examples[i : i + 2], 0))
                                                for i in range(0, 6, 2)]))  # fmt: skip
    assert model.training and objective.reference.shape == (6, 2)
    seen = []
    real_forward = model.forward
    model.forward = lambda **kwargs: seen.append(set(kwargs)) or real_forward(**kwargs)
    shuffled = objective.collate([examples[i] for i in (5, 0, 3)], 0)  # rows follow the batch's pairs
    loss, stats = objective.loss(model, shuffled, torch.tensor(3))
    assert seen and all(PAIR_INDEX not in keys for keys in seen)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5)
    assert abs(stats["rewards/chosen"].item()) < 1e-5 and abs(stats["rewards/rejected"].item()) < 1e-5
    objective.reference = objective.reference + 1.0  # another reference: every reward moves by -beta
    _, moved = objective.loss(model, shuffled, torch.tensor(3))
    assert moved["rewards/chosen"].item() == pytest.approx(-0.2, abs=1e-5)


def test_every_rank_gets_as_many_micro_batches_and_a_batch_the_same_pairs_at_any_world_size() -> None:
    from liger_cli.data.batches import even_shares

    assert even_shares(5, 2, 1, 0) == [(range(0, 2), True), (range(2, 4), True), (range(4, 5), True)]
    assert even_shares(5, 2, 2, 0) == [(range(0, 2), True), (range(4, 5), True)]
    assert even_shares(5, 2, 2, 1) == [(range(2, 4), True), (range(0, 2), False)]  # a padding forward
