"""Reward models (`training.objective: reward`), `liger score` and a reward model as a GRPO reward.

Train once, assert many: one module fixture runs, in this process (`liger_here`), a 2-step reward run
on the shipped DPO pairs with a margin field and a centring term, `liger merge` of it, `liger score`
and a 2-step GRPO run rewarded by it. Every number is checked against transformers and peft directly
(`AutoModelForSequenceClassification`, `PeftModel`) and the Bradley-Terry formula written here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from test_train import liger_here

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SEED, CENTER = 3, 0.1


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-800:], proc.stderr[-800:])
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def reward_recipe(root: Path, model: Path, out: Path, **over) -> Path:
    recipe = {
        "model": {"path": str(model)},
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"train": str(root / "pairs.jsonl"), "eval": str(root / "eval.jsonl"), "format": "preference",
                 "max_seq_len": 64},
        "training": {"objective": "reward", "max_steps": 2, "micro_batch_size": 4, "grad_accum": 2,
                     "lr": 5.0e-3, "seed": SEED},
        "reward": {"margin_field": "margin", "center_coefficient": CENTER},
        "output": {"dir": str(out), "overwrite": True},
        "logging": {"every": 1, "tensorboard": False},
    }  # fmt: skip
    for key, value in over.items():
        section, name = key.split("__")
        recipe[section][name] = value
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def rm(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reward")
    rng = random.Random(0)
    rows = [json.loads(line) for line in (RECIPES / "dpo" / "train.jsonl").read_text().splitlines()[:12]]
    for row in rows:
        row["margin"] = round(rng.uniform(0, 0.5), 3)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[8:]))
    scored_in = root / "rows.jsonl"
    score_rows = [
        {"prompt": r["prompt"], "completion": r[side]} for r in rows[:6] for side in ("chosen", "rejected")
    ]
    score_rows.append({"messages": [{"role": "user", "content": "Write 12 in words."},
                                    {"role": "assistant", "content": "twelve"}]})  # fmt: skip
    scored_in.write_text("".join(json.dumps(r) + "\n" for r in score_rows))
    out = root / "rm"
    found = {"root": root, "out": out, "pairs": rows[:8], "eval": rows[8:], "score_rows": score_rows}
    found["train"] = liger_here("train", str(reward_recipe(root, tiny_model_dir, out)))
    assert found["train"].returncode == 0, found["train"].stderr[-3000:]
    found["merge"] = liger_here("merge", str(out), str(root / "merged"))
    found["score"] = liger_here(
        "score", str(out), "--prompts", str(scored_in), "--out", str(root / "scored.jsonl")
    )
    found["grpo_out"] = root / "grpo"
    rewards = f"[{{function: liger_cli.rewards:exact_match}}, {{model: {out}, weight: 1.0}}]"
    found["grpo"] = liger_here("train", str(RECIPES / "grpo-rm.yaml"), "--set", f"rl.rewards={rewards}",
                               "--set", f"output.dir={found['grpo_out']}", "--set", "training.max_steps=2",
                               "--set", "training.micro_batch_size=2", "--set", "rl.num_generations=4",
                               "--set", "data.eval=null", "--set", "logging.every=1")  # fmt: skip
    return found


def grpo_rm_recipe(root: Path, model: Path, rm_run: Path, out: Path) -> Path:
    prompts = [json.loads(line) for line in (RECIPES / "grpo" / "train.jsonl").read_text().splitlines()[:4]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    recipe = {
        "model": {"path": str(model)},
        "data": {"train": str(root / "prompts.jsonl"), "format": "prompt", "max_seq_len": 48},
        "training": {"objective": "grpo", "max_steps": 2, "micro_batch_size": 2, "lr": 1.0e-3, "seed": 1},
        "rl": {"num_generations": 4, "max_new_tokens": 6, "loss": "dapo",
               "rewards": [{"function": "liger_cli.rewards:exact_match"}, {"model": str(rm_run), "weight": 1.0}]},
        "output": {"dir": str(out), "overwrite": True},
        "logging": {"every": 1, "tensorboard": False},
    }  # fmt: skip
    path = root / "grpo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


# --- an independent reference: transformers' own class, the text rendered here ------------------------------
def hf_reward_model(model_dir: Path, seed: int | None = None):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32
    )
    return model.eval(), tokenizer


def rendered(tokenizer, prompt: str, answer: str) -> list[int]:
    """The prompt with the tokenizer's BOS, then the answer and eos."""
    return (
        tokenizer(prompt)["input_ids"]
        + tokenizer(answer, add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
    )


@torch.no_grad()
def hf_scores(model, ids: list[list[int]]) -> torch.Tensor:
    return torch.tensor([model(input_ids=torch.tensor([row])).logits[0, 0].item() for row in ids])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_step_1_loss_is_the_bradley_terry_loss_of_the_untrained_scores(rm, tiny_model_dir):
    """Step 1 takes all 8 pairs (4 x accumulation 2): its loss is the mean over them of
    -log σ(r_c - r_r - margin) + c (r_c + r_r)², with the scores of the base + the seeded score head
    (LoRA starts at zero), computed here by transformers on ids rendered here."""
    model, tokenizer = hf_reward_model(tiny_model_dir, seed=SEED)
    pairs = rm["pairs"]
    chosen = hf_scores(model, [rendered(tokenizer, p["prompt"], p["chosen"]) for p in pairs])
    rejected = hf_scores(model, [rendered(tokenizer, p["prompt"], p["rejected"]) for p in pairs])
    margin = torch.tensor([p["margin"] for p in pairs])
    want = (-F.logsigmoid(chosen - rejected - margin) + CENTER * (chosen + rejected) ** 2).mean()
    first = next(m for m in metrics(rm["out"]) if m.get("step") == 1 and "loss" in m)
    assert first["loss"] == pytest.approx(want.item(), rel=1e-4, abs=1e-6)
    assert first["accuracy"] == pytest.approx((chosen > rejected).float().mean().item())
    assert first["score_gap"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-4, abs=1e-6)
    step0 = next(m for m in metrics(rm["out"]) if m.get("step") == 0)
    assert {"eval_loss", "eval_accuracy", "eval_score_gap"} <= set(step0)
    plan = (rm["out"] / "plan.txt").read_text()
    assert "fused_linear_cross_entropy: a reward model's score head has no cross-entropy" in plan
    assert "the reward loss on pairs" in plan and "final model verified" in rm["train"].stdout


def test_accumulation_8x1_4x2_2x4_give_the_same_loss_and_gradients(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    from liger_cli.model.objectives.reward import Reward
    from liger_cli.recipe.schema import RewardSection

    model, _ = hf_reward_model(tiny_model_dir, seed=0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="SEQ_CLS",
                                             init_lora_weights=False)).train()  # fmt: skip
    rng = random.Random(1)
    examples = []
    for _ in range(8):
        prompt = [1] + [rng.randrange(4, 200) for _ in range(rng.randrange(1, 6))]
        ex = {"fields": json.dumps({"m": rng.uniform(0, 1)})}
        for side in ("chosen", "rejected"):
            ids = prompt + [rng.randrange(4, 200) for _ in range(rng.randrange(1, 7))] + [2]
            ex[f"{side}_input_ids"], ex[f"{side}_labels"] = ids, ids
        examples.append(ex)
    objective = Reward(RewardSection(margin_field="m", center_coefficient=0.05))
    found = []
    for micro in (8, 4, 2):
        model.zero_grad()
        batches = [objective.collate(examples[i : i + micro], 3) for i in range(0, 8, micro)]
        num_items = sum(objective.units(b) for b in batches)
        total = 0.0
        for batch in batches:
            loss, _ = objective.loss(model, batch, num_items)
            loss.backward()
            total += loss.item()
        found.append((total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss8, grads8), *others = found
    assert any("score" in n for n in grads8) and any("lora_" in n for n in grads8)
    for loss, grads in others:
        assert loss == pytest.approx(loss8, rel=1e-5)
        for name, grad in grads8.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7)


def test_merged_output_and_adapter_load_with_transformers_and_peft_and_give_the_run_scores(
    rm, tiny_model_dir
):
    """`liger score` (the run's model) vs the merged folder through AutoModelForSequenceClassification
    and the adapter through peft on the base: the same score for every row."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    assert rm["merge"].returncode == 0, rm["merge"].stderr[-2000:]
    assert rm["score"].returncode == 0, rm["score"].stderr[-2000:]
    scored = [json.loads(line) for line in (rm["root"] / "scored.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in row.items() if k != "score"} for row in scored] == rm["score_rows"]
    assert all(isinstance(row["score"], float) for row in scored)
    base, tokenizer = hf_reward_model(tiny_model_dir)
    pairs = scored[:-1]
    ids = [rendered(tokenizer, r["prompt"], r["completion"]) for r in pairs]
    merged = AutoModelForSequenceClassification.from_pretrained(rm["root"] / "merged").eval()
    adapter = PeftModel.from_pretrained(base, rm["out"] / "final").eval()
    want = torch.tensor([r["score"] for r in pairs])
    torch.testing.assert_close(hf_scores(merged, ids), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hf_scores(adapter, ids), want, rtol=1e-4, atol=1e-5)
    conversation = tokenizer.apply_chat_template(scored[-1]["messages"], tokenize=True, return_dict=False)
    assert hf_scores(merged, [list(conversation)])[0].item() == pytest.approx(
        scored[-1]["score"], rel=1e-4, abs=1e-5
    )


def test_liger_score_refuses_bad_input_in_one_line_and_writes_nothing(rm, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "x"}\n')
    out = tmp_path / "out.jsonl"
    line = one_line_error(liger_here("score", str(rm["out"]), "--prompts", str(rows), "--out", str(out)))
    assert "line 1: a row needs" in line and not out.exists()
    line = one_line_error(
        liger_here("score", str(rm["out"]), "--prompts", str(tmp_path / "none.jsonl"), "--out", str(out))
    )
    assert "no such file" in line and not out.exists()
    sft = tmp_path / "sft"
    (sft / "final").mkdir(parents=True)
    (sft / "recipe.yaml").write_text("training: {objective: dpo}\n")
    line = one_line_error(
        liger_here("score", str(sft), "--prompts", str(rm["root"] / "rows.jsonl"), "--out", str(out))
    )
    assert "a dpo run, not a reward model" in line and not out.exists()


def test_grpo_with_a_reward_model_logs_its_score_and_scores_as_transformers_does(rm, tiny_model_dir):
    """recipes/grpo-rm.yaml for 2 steps (2 prompts x 4 completions), its reward model the fixture's: the RM's
    reward is logged on its own, and
    each rollout's RM value is AutoModelForSequenceClassification's score (the adapter loaded by peft) of
    its prompt + completion rendered as the reward model trained."""
    from peft import PeftModel

    proc, out = rm["grpo"], rm["grpo_out"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = rm["out"].name
    logged = [m for m in metrics(out) if "loss" in m]
    assert len(logged) == 2 and all(f"rewards/{name}" in m for m in logged)
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 2 * 4
    base, tokenizer = hf_reward_model(tiny_model_dir)
    model = PeftModel.from_pretrained(base, rm["out"] / "final").eval()
    want = hf_scores(model, [rendered(tokenizer, r["prompt"], r["completion"]) for r in rollouts[:8]])
    torch.testing.assert_close(
        torch.tensor([r["rewards"][name] for r in rollouts[:8]]), want, rtol=1e-4, atol=1e-5
    )
    assert logged[0][f"rewards/{name}"] == pytest.approx(want.mean().item(), rel=1e-4, abs=1e-5)
    # The resolved recipe the run wrote (the shipped recipe's, test_recipe.NEEDS_A_RUN) loads back unchanged.
    from liger_cli.recipe import load_recipe

    recipe = load_recipe(out / "recipe.yaml", [])
    again = out.parent / "grpo-rm-again.yaml"
    again.write_text(recipe.to_yaml())
    assert load_recipe(again, []).model_dump() == recipe.model_dump()


def test_recipe_errors_name_the_problem_and_the_fix(rm, tiny_model_dir, tmp_path):
    from liger_cli.recipe import load_recipe

    grpo = grpo_rm_recipe(tmp_path, tiny_model_dir, tmp_path / "missing", tmp_path / "g")
    line = one_line_error(liger_here("train", str(grpo), "--dry-run"))
    assert (
        "rl.rewards model" in line
        and "not a liger run folder" in line
        and "training.objective: reward" in line
    )
    recipe = reward_recipe(rm["root"], tiny_model_dir, tmp_path / "r", training__objective="dpo")
    line = one_line_error(liger_here("train", str(recipe)))
    assert "the reward section applies to training.objective reward" in line
    pairs = [*rm["pairs"][:3], {k: v for k, v in rm["pairs"][3].items() if k != "margin"}, *rm["pairs"][4:]]
    (tmp_path / "nomargin.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    recipe = reward_recipe(rm["root"], tiny_model_dir, tmp_path / "m")
    text = recipe.read_text().replace(str(rm["root"] / "pairs.jsonl"), str(tmp_path / "nomargin.jsonl"))
    recipe.write_text(text)
    line = one_line_error(liger_here("train", str(recipe)))
    assert "reward.margin_field margin" in line and "not a finite number" in line
    assert not (tmp_path / "m" / "final").exists()
    assert load_recipe(RECIPES / "reward.yaml", []).training.objective == "reward"


def test_the_shipped_reward_recipe_runs_two_steps(tmp_path):
    out = tmp_path / "reward"
    proc = liger_here("train", str(RECIPES / "reward.yaml"), "--set", f"output.dir={out}",
                      "--set", "training.max_steps=2", "--set", "training.eval_every=null")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [m for m in metrics(out) if "eval_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2]
    assert evals[0]["eval_accuracy"] == pytest.approx(0.52, abs=0.011)  # the documented start: chance
