"""On-policy distillation (training.objective distill): the loss of a real run's first step against the
full-logits KL written here from both models, the loss and its gradients against TRL GKD's generalized
JSD written here, micro-batches and processes adding up to one batch's update (fused and plain), an
exact resume, the recipe's refusals, and a teacher with another tokenizer refused before any weight loads.

Train once, assert many: one in-process run (test_train.liger_here) of 2 steps with 2 micro-batches
each is what the run tests read; a run stopped after step 1 and resumed is the resume check."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import save_tiny_model
from safetensors.torch import load_file
from test_grpo_train import write_prompts
from test_output_safety import one_line_error
from test_train import QUICK_DATA, REPO, liger_here

from liger_cli.errors import UserError
from liger_cli.model.objectives.distill import Distill


def distill_recipe(root: Path, student: Path, teacher: Path, out: Path, **over) -> Path:
    recipe = {
        "model": {"path": str(student)},
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "data": {"train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"), "format": "prompt",
                 "max_seq_len": 48},
        "training": {"objective": "distill", "max_steps": 2, "micro_batch_size": 2, "grad_accum": 2,
                     "lr": 1.0e-2, "scheduler": "constant", "seed": 3, "eval_every": 1},
        "distill": {"teacher": str(teacher)},
        "rl": {"num_generations": 2, "max_new_tokens": 6},
        "output": {"dir": str(out), "overwrite": True, "save_every": 1},
        "logging": {"every": 1, "tensorboard": False},
    }  # fmt: skip
    for key, value in over.items():
        section, _, name = key.partition("__")
        recipe[section][name] = value
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory) -> dict:
    """A teacher (the tiny Llama's shape, other weights), prompts with answers, the 2-step run, and the
    same run stopped after step 1 and resumed (each `liger train` in this process)."""
    root = tmp_path_factory.mktemp("distill")
    teacher = save_tiny_model(root / "teacher", seed=1, initializer_range=0.3)  # peaked: far from the student
    write_prompts(root / "train.jsonl", QUICK_DATA / "train.jsonl", 16)
    write_prompts(root / "eval.jsonl", QUICK_DATA / "eval.jsonl", 3)
    found = {
        "root": root,
        "student": tiny_model_dir,
        "teacher": teacher,
        "run": root / "run",
        "stopped": root / "stopped",
    }
    found["proc"] = liger_here("train", str(distill_recipe(root, tiny_model_dir, teacher, found["run"])))
    stopped = distill_recipe(root, tiny_model_dir, teacher, found["stopped"], training__eval_every=None)
    first = liger_here("train", str(stopped), "--set", "training.max_steps=1", "--set", "kernels.check=false")
    assert first.returncode == 0, first.stderr[-3000:]
    found["resumed"] = liger_here("train", str(stopped), "--set", "output.resume=auto", "--set",
                                  "output.overwrite=false", "--set", "kernels.check=false")  # fmt: skip
    found["shipped"] = root / "shipped"
    found["shipped_proc"] = liger_here("train", str(REPO / "recipes" / "distill.yaml"), "--set", f"output.dir={found['shipped']}",
                                       "--set", "training.max_steps=2", "--set", "kernels.check=false")  # fmt: skip
    return found


@pytest.fixture(scope="module")
def run(setup) -> Path:
    proc = setup["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final model verified" in proc.stdout
    assert "distill: teacher" in proc.stdout and "the distill loss (reverse_kl) on rollouts" in proc.stdout
    return setup["run"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_s || p_t) per position, in float64, from full logits."""
    log_ps = torch.log_softmax(student_logits.double(), -1)
    log_pt = torch.log_softmax(teacher_logits.double(), -1)
    return (log_ps.exp() * (log_ps - log_pt)).sum(-1)


def test_the_first_step_is_the_mean_kl_to_the_teacher_over_every_sampled_token(run: Path, setup) -> None:
    """Step 1's loss, recomputed here from the rollouts: both models' full logits on prompt + completion
    (the student is the base before its first update: LoRA starts at zero), KL(student || teacher) at
    each position that predicts a completion token, summed, over the step's completion tokens."""
    from transformers import AutoModelForCausalLM

    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8  # 2 micro-batches x 2 prompts x 2 completions
    assert all(1 <= len(r["completion_ids"]) <= 6 and r["finish_reason"] in ("stop", "length") for r in rows)
    student, teacher = (AutoModelForCausalLM.from_pretrained(setup[k]).eval() for k in ("student", "teacher"))
    total, tokens = 0.0, 0
    with torch.no_grad():
        for r in rows[:8]:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            start, n = len(r["prompt_ids"]) - 1, len(r["completion_ids"])
            kl = reverse_kl(student(input_ids=ids).logits, teacher(input_ids=ids).logits)[
                0, start : start + n
            ]
            total, tokens = total + kl.sum().item(), tokens + n
    first = next(m for m in metrics(run) if m["step"] == 1 and "loss" in m)
    assert first["loss"] == pytest.approx(total / tokens, rel=1e-4)
    assert first["kl"] == pytest.approx(first["loss"], rel=1e-6)  # reverse_kl: the loss is the KL
    lengths = [len(r["completion_ids"]) for r in rows[:8]]
    assert first["completion_length"] == pytest.approx(sum(lengths) / 8)
    assert (first["completion_length_min"], first["completion_length_max"]) == (min(lengths), max(lengths))


def test_eval_kl_and_exact_answers_are_logged_at_every_evaluation(run: Path) -> None:
    evals = [m for m in metrics(run) if "eval_kl" in m]
    assert [m["step"] for m in evals] == [0, 1, 2]
    assert all(m["eval_kl"] > 0 and 0 <= m["eval_exact_match"] <= 1 for m in evals)
    assert len({m["eval_kl"] for m in evals}) == 3  # the student moves; the teacher does not
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert saved["rl"].keys() == {
        "num_generations",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "engine",
        "vllm",
    }
    assert "beta" not in saved["distill"]  # reverse_kl: the resolved recipe loads again


def test_a_stopped_run_resumes_to_the_same_weights(run: Path, setup) -> None:
    proc = setup["resumed"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (setup["stopped"], run))
    assert got.keys() == want.keys()
    for key in want:
        assert (got[key] - want[key]).abs().max() < 1e-6, key
    resumed, whole = ([json.loads(x)["completion_ids"] for x in (p / "rollouts.jsonl").read_text().splitlines()]
                      for p in (setup["stopped"], run))  # fmt: skip
    assert resumed == whole


def test_the_shipped_recipe_starts_where_its_docs_say(setup) -> None:
    """recipes/distill.yaml for 2 steps: at step 0 the student (the half-trained adapter) answers 0.47 of
    the held-out numbers and is 0.44 from its teacher (docs/distillation.md); both are measured after."""
    proc = setup["shipped_proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [m for m in metrics(setup["shipped"]) if "eval_kl" in m]
    assert [m["step"] for m in evals] == [0, 2]
    assert evals[0]["eval_exact_match"] == pytest.approx(0.47) and evals[0]["eval_kl"] == pytest.approx(
        0.44, abs=0.005
    )


def test_the_memory_plan_counts_the_teacher(setup, tmp_path) -> None:
    """--dry-run's `teacher` row: its fp32 weights (counted from its safetensors file) and its final
    hidden states (width 32) for the step's 2 micro-batches x 2 prompts x 2 completions x 48 tokens."""
    recipe = distill_recipe(setup["root"], setup["student"], setup["teacher"], tmp_path / "dry")
    proc = liger_here("train", str(recipe), "--dry-run", "--json", "--set", "kernels.check=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    components = json.loads(proc.stdout)["memory"]["components"]
    tensors = load_file(setup["teacher"] / "model.safetensors")
    weights = sum(t.numel() for t in tensors.values()) * 4
    assert components["teacher"] == weights + 8 * 48 * 32 * 4
    # 2 processes: half of the decoder layers' bytes, one layer gathered at a time, the rest whole, where
    # the trained model is sharded (FSDP-1, FSDP-2, ZeRO-3); all of it under DDP and ZeRO-2
    layer = [sum(t.numel() * 4 for k, t in tensors.items() if f".layers.{i}." in k) for i in (0, 1)]
    sharded = weights - sum(layer) // 2 + max(layer) + 4 * 48 * 32 * 4
    for backend, teacher in [("fsdp2", sharded), ("fsdp1", sharded), ("deepspeed", sharded),
                             ("ddp", weights + 4 * 48 * 32 * 4), ("deepspeed:2", weights + 4 * 48 * 32 * 4)]:  # fmt: skip
        name, _, stage = backend.partition(":")
        overrides = [f"distributed.backend={name}", "distributed.num_processes=2", "training.grad_accum=1",
                     f"distributed.zero_stage={stage or 3}"]  # fmt: skip
        proc = liger_here("train", str(recipe), "--dry-run", "--json", "--set", "kernels.check=false",
                          *(x for o in overrides for x in ("--set", o)))  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout)["memory"]["components"]["teacher"] == teacher, backend


def test_a_4bit_teacher_and_a_qlora_student_train_on_their_4bit_forwards(setup, tmp_path) -> None:
    """model.quantize nf4: the student's base and (by default, as the student) the teacher load with
    4-bit linear layers. Step 1's loss is the KL between the two models as transformers loads them in
    4 bits (recomputed here from the rollouts), and the memory plan counts the teacher's 4-bit bytes
    as bitsandbytes stores them (within 1%). Hidden 64: whole 64-weight blocks per row."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    student = save_tiny_model(tmp_path / "s64", hidden_size=64, intermediate_size=128)
    teacher = save_tiny_model(
        tmp_path / "t64", seed=1, hidden_size=64, intermediate_size=128, initializer_range=0.3
    )
    out = tmp_path / "q"
    recipe = distill_recipe(setup["root"], student, teacher, out, model__quantize="nf4", training__max_steps=1,
                            training__eval_every=None, training__grad_accum=1)  # fmt: skip
    proc = liger_here("train", str(recipe), "--set", "kernels.check=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nf4 4-bit linear layers, frozen" in proc.stdout
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    models = [
        AutoModelForCausalLM.from_pretrained(m, quantization_config=config).eval() for m in (student, teacher)
    ]
    for layer in (x for m in models for x in m.modules() if hasattr(x, "support_avx512bf16_for_cpu")):
        # bitsandbytes repacks 4-bit weights for bf16 inference on CPUs with AVX512-BF16 (eval, no
        # gradient): other numbers. The run computes as training does (liger_cli.model.quantize).
        layer.support_avx512bf16_for_cpu = False
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # 2 prompts x 2 completions
    total, tokens = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            start, n = len(r["prompt_ids"]) - 1, len(r["completion_ids"])
            kl = reverse_kl(*(m(input_ids=ids).logits for m in models))[0, start : start + n]
            total, tokens = total + kl.sum().item(), tokens + n
    first = next(m for m in metrics(out) if m["step"] == 1 and "loss" in m)
    assert first["loss"] == pytest.approx(total / tokens, rel=1e-4)

    dry = liger_here("train", str(recipe), "--dry-run", "--json", "--set", "kernels.check=false")
    planned = (
        json.loads(dry.stdout)["memory"]["components"]["teacher"] - 2 * 2 * 48 * 64 * 4
    )  # - hidden states
    stored = {t.data_ptr(): t.numel() * t.element_size() for t in models[1].state_dict().values()}
    assert planned == pytest.approx(sum(stored.values()), rel=0.01)
    full = sum(t.numel() * 4 for t in load_file(teacher / "model.safetensors").values())
    assert planned < 0.7 * full  # the unquantized embeddings and lm_head are most of a tiny model
    # FSDP-2 on 2 processes: its layers' packed 4-bit bytes halved (one layer gathered), everything
    # else (statistics, embeddings, norms, head) whole on each process
    packed = [sum(p.numel() * p.element_size() for n, p in models[1].named_parameters()
                  if f".layers.{i}." in n and p.dtype == torch.uint8) for i in (0, 1)]  # fmt: skip
    overrides = ["distributed.backend=fsdp2", "distributed.num_processes=2", "training.grad_accum=1"]
    dry = liger_here("train", str(recipe), "--dry-run", "--json", "--set", "kernels.check=false",
                     *(x for o in overrides for x in ("--set", o)))  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    sharded = json.loads(dry.stdout)["memory"]["components"]["teacher"] - 2 * 2 * 48 * 64 * 4
    assert sharded == pytest.approx(planned - sum(packed) + sum(packed) / 2 + max(packed), abs=64)


# --- the loss on hand-made rollouts ------------------------------------------------------------------------


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float) -> torch.Tensor:
    """TRL GKDTrainer.generalized_jsd_loss per position (reduction none, summed over the vocabulary)."""
    s = torch.log_softmax(student_logits.double() / temperature, -1)
    t = torch.log_softmax(teacher_logits.double() / temperature, -1)
    mixture = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    kl_teacher = (t.exp() * (t - mixture)).sum(-1)
    kl_student = (s.exp() * (s - mixture)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


def settings(**over):
    from liger_cli.recipe.rl_section import DistillSection

    return DistillSection.model_construct(
        **{"teacher": Path("."), "loss": "jsd", "beta": 0.3, "temperature": 2.0, **over}
    )


def objective(**over) -> Distill:
    found = Distill.__new__(Distill)
    found.settings = settings(**over)
    return found


@pytest.fixture(scope="module")
def policies(tiny_model_dir):
    """The tiny Llama with a LoRA adapter (non-zero), plain and with our fused loss patched in."""
    from liger_kernels import patch_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    found = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        if fused:
            patch_model(model, rms_norm=False, rope=False, swiglu=False, fused_linear_cross_entropy=True)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        found[fused] = get_peft_model(model, config).train()
    return found


def step(model, distill: Distill, batch: dict, splits: list[list[int]]):
    model.zero_grad(set_to_none=True)
    parts = [{k: v[s] for k, v in batch.items()} for s in splits]
    num_items = sum(distill.units(p) for p in parts)
    total = 0.0
    for p in parts:
        value, _ = distill.loss(model, p, num_items)
        value.backward()
        total += value.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fused", [False, True])
def test_the_loss_is_trls_generalized_jsd_and_adds_up_over_micro_batches(policies, fused):
    """8 completions as 1 x 8, 2 x 4 and 4 x 2 micro-batches: the same loss and gradients; that loss
    is TRL GKD's generalized JSD (beta 0.3, temperature 2) written here, per completion token over the
    batch's completion tokens; fused and plain agree."""
    model, distill = policies[fused], objective()
    batch = distill.twin_batch(826, 0, rows=8, seed=1)
    one, grads = step(model, distill, batch, [list(range(8))])
    for splits in ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]):
        total, split_grads = step(model, distill, batch, splits)
        assert total == pytest.approx(one, abs=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(split_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    weight = distill._head[0]
    per_token = generalized_jsd(logits, batch["teacher_hidden"] @ weight.T, 0.3, 2.0)
    mask = batch["completion_mask"]
    assert one == pytest.approx((per_token * mask).sum().item() / mask.sum().item(), rel=1e-5)


def test_fused_and_plain_give_the_same_divergences(policies):
    """reverse KL at temperature 1 and the forward KL end of jsd (beta 0), per position: the fused kernel
    in the student's own forward equals the plain formula on the model's logits."""
    batch = objective().twin_batch(826, 0, rows=4, seed=2)
    for over in ({"loss": "reverse_kl", "temperature": 1.0}, {"beta": 0.0}):
        found = []
        for fused in (False, True):
            distill = objective(**over)
            distill.twin_batch(826, 0, rows=4, seed=2)  # the same teacher stand-in: the same seed
            with torch.no_grad():
                found.append(distill.divergences(policies[fused], batch))
        for got, want in zip(found[1], found[0], strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


# --- refusals ----------------------------------------------------------------------------------------------


def test_the_recipe_refuses_what_distill_does_not_do(tmp_path, tiny_model_dir):
    from liger_cli.recipe.load import validate_recipe
    from liger_cli.recipe.rl_section import teacher_quantize

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "answer": "x"}\n')
    base = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train": str(prompts), "format": "prompt", "max_seq_len": 64},
        "training": {"objective": "distill", "max_steps": 1},
        "distill": {"teacher": str(tiny_model_dir)},
        "rl": {"num_generations": 1, "max_new_tokens": 8},
    }
    recipe = validate_recipe(base, tmp_path)
    assert (recipe.distill.loss, recipe.distill.beta, recipe.rl.num_generations) == ("reverse_kl", 0.5, 1)
    cases = [
        ({"distill": None}, "needs a distill section with the teacher"),
        ({"rl": None}, "samples with the rl section's keys"),
        ({"rl": {"beta": 0.1, "rewards": [{"function": "m:f"}]}}, r"rl.beta, rl.rewards do not apply to training.objective distill"),
        ({"distill": {"teacher": str(tmp_path)}}, "no config.json there"),
        ({"distill": {"teacher": str(tiny_model_dir), "beta": 0.2}}, "distill.beta applies to distill.loss jsd only"),
        ({"training": {"max_steps": 1}}, "the distill section goes with training.objective grpo or distill"),
        ({"training": {"objective": "grpo", "max_steps": 1}, "rl": {"rewards": [{"function": "m:f"}]}},
         "the distill section applies to training.objective distill"),
        ({"distill": {"teacher": str(tiny_model_dir), "quantize": "int8"}}, "distill.quantize.*'none', 'nf4' or 'fp4'"),
    ]  # fmt: skip
    for over, message in cases:
        data = {**base, **over}
        for key in ("distill", "rl"):
            if data.get(key) is None:
                data.pop(key)
        with pytest.raises(UserError, match=message):
            validate_recipe(data, tmp_path)
    four_bit = {
        **base,
        "model": {**base["model"], "quantize": "nf4"},
    }  # the teacher as the student, or its own
    assert teacher_quantize(validate_recipe(four_bit, tmp_path)) == "nf4"
    four_bit["distill"] = {**base["distill"], "quantize": "none"}
    assert teacher_quantize(validate_recipe(four_bit, tmp_path)) == "none"
    grpo = {**base, "training": {"objective": "grpo", "max_steps": 1}}
    grpo.pop("distill")
    with pytest.raises(UserError, match="needs rl.rewards, at least one"):
        validate_recipe(grpo, tmp_path)
    grpo["rl"] = {"num_generations": 1, "rewards": [{"function": "m:f"}]}
    with pytest.raises(UserError, match="grpo compares the completions of a prompt"):
        validate_recipe(grpo, tmp_path)


def test_a_teacher_with_another_tokenizer_is_refused_before_any_weight_loads(setup, tmp_path):
    """One more special token in the teacher's tokenizer: a one-line exit 2 naming the difference, before
    the plan's checks load anything (the teacher's weights are not even readable) and before the output
    folder is made."""
    from transformers import AutoTokenizer

    teacher = tmp_path / "teacher"
    shutil.copytree(setup["teacher"], teacher)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    tokenizer.save_pretrained(teacher)
    (teacher / "model.safetensors").write_bytes(b"not weights")
    out = tmp_path / "out"
    recipe = distill_recipe(setup["root"], setup["student"], teacher, out)
    error = one_line_error(liger_here("train", str(recipe)))
    assert "its tokenizer is not the student's (827 ids, the student's 826)" in error
    assert not out.exists()
