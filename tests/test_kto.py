"""KTO (`training.objective: kto`, `data.format: unpaired`): the loss against the formula written here,
8 x 1 = 4 x 2 = 2 x 4, fused == plain, the twin's checks, one `liger train` run (metrics, start check,
an exact resume), the unpaired rows' encoding and their errors, and the recipe's refusals."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch
from test_preference_train import grads, lora_model, write_pairs

from liger_cli.model.objectives.kto import Kto
from liger_cli.recipe.schema import KtoSection

OPTIONS = KtoSection(beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
CPU = torch.device("cpu")


def examples(n: int, seed: int = 0) -> list[dict]:
    """Completions of uneven lengths, labels mixed; each one's KL sequence (written here, not by the data
    stage): its prompt, then the next example's completion."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        prompt = [1] + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 6))]
        answer = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 7))] + [2]
        rows.append({"prompt": prompt, "answer": answer, "label": k % 3 != 1})
    for k, row in enumerate(rows):
        partner = rows[(k + 1) % n]["answer"]
        row |= {"input_ids": row["prompt"] + row["answer"], "labels": [-100] * len(row["prompt"]) + row["answer"],
                "kl_input_ids": row["prompt"] + partner, "kl_labels": [-100] * len(row["prompt"]) + partner}  # fmt: skip
    return rows


def summed_logp(model, ids: list[int], labels: list[int]) -> torch.Tensor:
    """log p of the learned tokens, summed: one unpadded row through the model's logits."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    target = torch.tensor(ids[1:])
    learned = torch.tensor(labels[1:]) != -100
    return torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0][learned].sum()


def kto_by_formula(model, rows: list[dict], o: KtoSection) -> tuple[torch.Tensor, float]:
    """The KTO paper's loss (TRL's KTOTrainer math) and z0, row by row; the reference is the base model
    (the adapter disabled)."""
    with torch.no_grad(), model.disable_adapter():
        ref = [summed_logp(model, r["input_ids"], r["labels"]) for r in rows]
        kl_ref = [summed_logp(model, r["kl_input_ids"], r["kl_labels"]) for r in rows]
    with torch.no_grad():
        kl_policy = [summed_logp(model, r["kl_input_ids"], r["kl_labels"]) for r in rows]
    z0 = max(0.0, sum(p.item() - q.item() for p, q in zip(kl_policy, kl_ref, strict=True)) / len(rows))
    total = 0
    for row, reference in zip(rows, ref, strict=True):
        r = summed_logp(model, row["input_ids"], row["labels"]) - reference
        if row["label"]:
            total = total + o.desirable_weight * (1 - torch.sigmoid(o.beta * (r - z0)))
        else:
            total = total + o.undesirable_weight * (1 - torch.sigmoid(o.beta * (z0 - r)))
    return total / len(rows), z0


def step(model, objective: Kto, rows: list[dict], micro: int):
    """One optimizer step the loop's way: the step's begin_step over all its micro-batches, then each
    micro-batch's loss over the step's count. (loss, metrics, gradients)."""
    model.zero_grad()
    batches = [objective.collate(rows[i : i + micro], 0) for i in range(0, len(rows), micro)]
    num_items = sum(objective.units(b) for b in batches)
    objective.begin_step(model, batches, CPU, lambda t: t)
    total, stats = 0.0, {}
    for batch in batches:
        loss, found = objective.loss(model, batch, num_items)
        loss.backward()
        total += loss.item()
        for k, v in found.items():
            stats[k] = stats.get(k, 0.0) + v.item()
    return total, stats, grads(model)


def test_the_loss_and_its_gradients_are_the_formula_with_a_positive_z0(tiny_model_dir):
    """A random adapter (policy != reference): liger's loss, z0 and metrics against the formula above."""
    rows = examples(6, seed=3)
    model = lora_model(tiny_model_dir, seed=3)
    want, z0 = kto_by_formula(model, rows, OPTIONS)
    assert z0 > 0.01  # the KL term is exercised, not clamped away
    model.zero_grad()
    want.backward()
    want_grads = grads(model)
    loss, stats, got_grads = step(model, Kto(OPTIONS), rows, micro=6)
    assert loss == pytest.approx(want.item(), rel=1e-5)
    assert stats["kl"] == pytest.approx(z0, rel=1e-5)
    with torch.no_grad(), model.disable_adapter():
        ref = [summed_logp(model, r["input_ids"], r["labels"]).item() for r in rows]
    with torch.no_grad():
        rewards = [OPTIONS.beta * (summed_logp(model, r["input_ids"], r["labels"]).item() - q)
                   for r, q in zip(rows, ref, strict=True)]  # fmt: skip
    desirable = [x for x, r in zip(rewards, rows, strict=True) if r["label"]]
    undesirable = [x for x, r in zip(rewards, rows, strict=True) if not r["label"]]
    assert stats["rewards/desirable"] == pytest.approx(sum(desirable) / len(desirable), rel=1e-4)
    assert stats["rewards/undesirable"] == pytest.approx(sum(undesirable) / len(undesirable), rel=1e-4)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for key in want_grads:
        torch.testing.assert_close(got_grads[key], want_grads[key], rtol=1e-4, atol=1e-6)


def test_8x1_4x2_and_2x4_give_the_same_loss_metrics_and_gradients(tiny_model_dir):
    """z0 is the step's, not a micro-batch's: however the 8 completions are cut, the same step."""
    rows = examples(8, seed=3)
    model = lora_model(tiny_model_dir, seed=3)
    whole = step(model, Kto(OPTIONS), rows, micro=8)
    assert whole[1]["kl"] > 0.01
    for micro in (4, 2):
        parts = step(model, Kto(OPTIONS), rows, micro=micro)
        assert parts[0] == pytest.approx(whole[0], rel=1e-5)
        assert parts[1] == pytest.approx(whole[1], rel=1e-4, abs=1e-6)
        for key in whole[2]:
            torch.testing.assert_close(parts[2][key], whole[2][key], rtol=1e-4, atol=1e-7)


def test_fused_and_plain_log_probs_give_the_same_loss_metrics_and_gradients(tiny_model_dir):
    rows = examples(4, seed=5)
    plain = step(lora_model(tiny_model_dir, seed=5), Kto(OPTIONS), rows, micro=4)
    fused = step(lora_model(tiny_model_dir, seed=5, fused=True), Kto(OPTIONS), rows, micro=4)
    assert fused[0] == pytest.approx(plain[0], rel=1e-5, abs=1e-6)
    assert fused[1] == pytest.approx(plain[1], rel=1e-4, abs=1e-5)
    assert fused[2].keys() == plain[2].keys() and fused[2]
    for key in plain[2]:
        torch.testing.assert_close(fused[2][key], plain[2][key], rtol=1e-4, atol=1e-6)


# --- the twin's checks run the kto loss -------------------------------------------------------------------
def test_the_twin_checks_run_the_kto_loss_and_catch_a_mean_per_micro_batch(monkeypatch):
    from test_preference_train import _twin_adapter, accumulation_checks
    from transformers import AutoConfig

    from liger_cli.twin.kernel_check import check_kernels

    objective = Kto(OPTIONS)
    kernels = check_kernels(AutoConfig.for_model("llama"), {"fused_linear_cross_entropy": True},
                            add_adapter=_twin_adapter(), objective=objective)  # fmt: skip
    assert kernels.lines() == [
        "kernel check: one step on a tiny twin (the kto loss on completions), patched vs unpatched: "
        "loss, every gradient and greedy generation agree"
    ]
    good, bad = accumulation_checks(objective, monkeypatch)
    assert good.error is None and good.line.endswith(
        "(padding, kto loss on labelled completions): loss and every gradient agree"
    )
    assert bad.error and "the mean over its completions" in bad.error


# --- `liger train` -----------------------------------------------------------------------------------------
def write_unpaired(path: Path, n_pairs: int = 24, only: bool | None = None) -> Path:
    """Thumbs from write_pairs' pairs: each chosen answer labelled true, each rejected one false (or only
    one kind)."""
    pairs = [
        json.loads(line)
        for line in write_pairs(path.with_suffix(".pairs.jsonl"), n_pairs).read_text().splitlines()
    ]
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected") if only is None or (side == "chosen") == only]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "kto.yaml"


@pytest.fixture(scope="module")
def kto_runs(tmp_path_factory) -> dict:
    """In this process (test_train.liger_here): the shipped recipes/kto.yaml (its model, its train rows)
    for 4 steps of 3 x 2 completions with checkpoints at 2 and 4 and 32 of its eval rows, then the same
    run resumed from its step-2 checkpoint into another folder."""
    from test_train import liger_here

    root = tmp_path_factory.mktemp("kto")
    eval_rows = root / "eval.jsonl"
    eval_rows.write_text(
        "".join((RECIPE.parent / "kto" / "eval.jsonl").read_text().splitlines(keepends=True)[:32])
    )
    out, resumed = root / "run", root / "resumed"
    settings = {"training.max_steps": 4, "training.micro_batch_size": 3, "training.grad_accum": 2,
                "training.lr": 2e-2, "training.eval_every": 2, "kto.beta": 0.5, "kto.undesirable_weight": 1.5,
                "data.eval": eval_rows, "output.save_every": 2, "logging.every": 1}  # fmt: skip
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    first = liger_here("train", str(RECIPE), *overrides, "--set", f"output.dir={out}")
    assert first.returncode == 0, first.stderr[-3000:]
    again = liger_here("train", str(RECIPE), *overrides, "--set", f"output.dir={resumed}",
                       "--set", f"output.resume={out / 'checkpoints' / 'step-2'}")  # fmt: skip
    return {"run": first, "out": out, "resumed": again, "resumed_out": resumed}


def metrics(out: Path, key: str) -> list[float]:
    return [x[key] for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if key in x]


def test_a_kto_run_starts_at_the_reference_logs_its_metrics_and_its_kl(kto_runs):
    proc, out = kto_runs["run"], kto_runs["out"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first_eval = next(x for x in lines if "eval_loss" in x)
    assert first_eval["step"] == 0 and first_eval["eval_kl"] == 0
    assert first_eval["eval_rewards/desirable"] == first_eval["eval_rewards/undesirable"] == 0
    # policy == reference: each completion's loss is half its weight (true 1.0, false 1.5), both kinds held out
    assert 0.5 < first_eval["eval_loss"] < 0.75
    assert "start check: step 1 has policy == reference" in proc.stdout
    for key in ("loss", "rewards/desirable", "rewards/undesirable", "rewards/margins", "kl"):
        assert len(metrics(out, key)) == 4 and len(metrics(out, f"eval_{key}")) == 3, key
    margins = metrics(out, "eval_rewards/margins")
    assert margins[-1] > margins[0] == 0  # desirable rises above undesirable on the held-out rows
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert (
        "kernel check: one step on a tiny twin (the kto loss on completions)"
        in (out / "plan.txt").read_text()
    )


def test_a_kto_resume_is_bit_identical(kto_runs):
    from safetensors.torch import load_file

    resumed, out, resumed_out = kto_runs["resumed"], kto_runs["out"], kto_runs["resumed_out"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "start check" not in resumed.stdout
    for key in ("loss", "kl", "rewards/margins", "eval_loss"):
        assert metrics(resumed_out, key) == metrics(out, key)[-len(metrics(resumed_out, key)) :], key
    assert len(metrics(resumed_out, "loss")) == 2
    got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (resumed_out, out))
    assert got.keys() == want.keys() and got
    for key in want:
        assert torch.equal(got[key], want[key]), key


# --- data --------------------------------------------------------------------------------------------------
MODEL = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "model"


def data_recipe(tmp_path: Path, rows: list[dict]) -> Path:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "model": {"path": str(MODEL)}, "output": {"dir": "out"},
        "data": {"train": "rows.jsonl", "format": "unpaired", "max_seq_len": 64, "cache": False},
        "training": {"max_steps": 1, "objective": "kto"},
    }))  # fmt: skip
    return recipe


def test_each_row_learns_its_completion_and_reads_a_partners_completion_after_its_own_prompt(tmp_path):
    from liger_cli.data import prepare_data
    from liger_cli.data.tokenizer import load_tokenizer
    from liger_cli.recipe import load_recipe

    rows = [{"prompt": f"Say {n}.", "completion": f"number {n}", "label": n % 2 == 0} for n in range(5)]
    recipe = load_recipe(data_recipe(tmp_path, rows), [])
    tok = load_tokenizer(recipe)
    train, _ = prepare_data(recipe.data, tok, recipe.training.seed)
    dataset = train.dataset
    assert dataset["label"] == [True, False, True, False, True]
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    answers = [tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    partners = set()
    for k, ex in enumerate(dataset):
        assert ex["input_ids"] == prompts[k] + answers[k]
        assert ex["labels"] == [-100] * len(prompts[k]) + answers[k]
        kl_prompt, kl_answer = ex["kl_input_ids"][: len(prompts[k])], ex["kl_input_ids"][len(prompts[k]) :]
        assert kl_prompt == prompts[k] and ex["kl_labels"] == [-100] * len(prompts[k]) + kl_answer
        j = answers.index(kl_answer)
        assert j != k  # a mismatched pair: another row's completion
        partners.add(j)
    assert partners == set(range(5))  # every completion is some row's partner


def test_bad_and_missing_labels_are_one_line_errors_naming_the_row(tmp_path):
    from test_train import liger_here

    good = {"prompt": "Say 1.", "completion": "one", "label": True}
    for bad, said in (("yes", "found str 'yes'"), (None, "it is missing")):
        recipe = data_recipe(tmp_path, [good, good, {**good, "label": bad}])
        proc = liger_here("data", str(recipe))
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "row 3" in proc.stderr and 'field "label" must be true' in proc.stderr and said in proc.stderr


def test_rows_of_one_label_are_a_warning_that_names_the_fix(tmp_path, caplog):
    from liger_cli.data import prepare_data
    from liger_cli.data.tokenizer import load_tokenizer
    from liger_cli.recipe import load_recipe

    rows = [{"prompt": f"Say {n}.", "completion": f"number {n}", "label": True} for n in range(4)]
    recipe = load_recipe(data_recipe(tmp_path, rows), [])
    with caplog.at_level(logging.WARNING, logger="liger_cli.data"):
        prepare_data(recipe.data, load_tokenizer(recipe), 0)
    assert "every one of its 4 examples has label true (desirable)" in caplog.text
    assert "add rows labelled false" in caplog.text


@pytest.mark.parametrize(
    ("recipe", "overrides", "said"),
    [
        ("dpo.yaml", ["kto.beta=0.2"], "the kto section applies to training.objective kto, not dpo"),
        ("kto.yaml", ["preference.beta=0.2"], "kto's options are the kto section"),
        ("dpo.yaml", ["training.objective=kto"], "set data.format: unpaired"),
        ("dpo.yaml", ["data.format=unpaired"], "goes with training.objective kto"),
    ],
)
def test_options_that_do_not_apply_are_refused(recipe, overrides, said):
    from liger_cli.errors import UserError
    from liger_cli.recipe import load_recipe

    with pytest.raises(UserError) as err:
        load_recipe(Path(__file__).resolve().parents[1] / "recipes" / recipe, overrides)
    assert said in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_the_memory_plan_counts_kto_as_dpo(tmp_path):
    """Two sequences per example (the completion, and its mismatched one), as DPO's pair."""
    from liger_cli.plan.dry_run import dry_run
    from liger_cli.recipe import load_recipe

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    plans = [
        json.loads(dry_run(load_recipe(recipes / name, over), as_json=True))["memory"]["components"]
        for name, over in (("kto.yaml", ["training.micro_batch_size=16"]), ("dpo.yaml", []))
    ]
    assert plans[0]["activations"] == plans[1]["activations"] and plans[0]["activations"] > 0
