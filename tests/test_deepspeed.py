"""DeepSpeed ZeRO with 2 real processes on gloo (DS_ACCELERATOR=cpu), a tiny Llama, kernels on.

DeepSpeed must train the model a 1-process run trains: LoRA and full fine-tuning with grad_accum 2
(ZeRO-3, with and without activation checkpointing; ZeRO-2) give the same per-step losses and
gradient norms (fp32, 1e-5) and the same saved weights, and so do DPO and KTO with full fine-tuning
and a reward model (`objectives`); under ZeRO-3 the model is loaded
partitioned through transformers' own path with the saved weights; a checkpoint resumes on two
"machines" (`liger launch --nodes 2`'s commands), and two machines of two processes each train what 1
process trains. The training cases and the loading check are this file's part of the suite's
ONE 2-process launch (tests/conftest.py `two_process_launch`: each launch costs 15-20 s of imports);
no DeepSpeed op may be compiled at run time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import (  # noqa: F401 - `assets` is a fixture
    assert_same_reward_run,
    assert_same_run,
    assets,
    dpo_full,
    free_port,
    kto_full,
    losses,
    reward,
    run_here,
    two_machines,
    write_recipe,
)

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/setup.sh installs it)")

CASES = {  # name -> (adapter type, activation checkpointing, ZeRO stage); each compared with the 1-process run
    "lora": ("lora", "off", 3),
    "full": ("none", "off", 3),
    "lora-ac": ("lora", "auto", 3),  # auto: reentrant under sharding
    "full-ac": ("none", "auto", 3),
    "full-zero2": ("none", "off", 2),
}


def objectives(files: dict) -> dict[str, dict]:
    """The other objectives under ZeRO-3, each compared with its 1-process run: DPO with full fine-tuning
    (both ranks compute the reference log-probs through ZeRO-3's collective forwards), KTO with full
    fine-tuning (its reference table and z0 over the step, from both ranks), a reward model (LoRA beside
    its score head, trained in full)."""
    return {"dpo-full": dpo_full(files), "kto-full": kto_full(files),
            "reward": reward(files)}  # fmt: skip


TRACKED = "deepspeed-lora"
"""The ZeRO-3 LoRA case's trackio project (the session's tracker store)."""


def launch_part(root: Path) -> tuple[list[dict], dict]:
    """This file's cases of the shared 2-process launch (tests/conftest.py `two_process_launch`): the
    CASES, DPO with full fine-tuning, then the loading check. Returns the outputs, the LoRA case's
    recipe (resumed below), the loading check's result file and the recipes (each one's rank-0 output
    is written beside it)."""
    from test_distributed import make_assets

    files = make_assets(root / "files")
    outs = {name: root / name for name in (*objectives(files), *CASES)}
    recipes = {
        name: write_recipe(files, outs[name], "deepspeed", adapter, ac, distributed__zero_stage=stage)
        for name, (adapter, ac, stage) in CASES.items()
    }
    recipes["lora"] = write_recipe(files, outs["lora"], "deepspeed", output__save_every=2,  # resumed below
                                   logging__report_to=["trackio"], logging__project=TRACKED)  # fmt: skip
    for name, over in objectives(files).items():
        recipes[name] = write_recipe(files, outs[name], "deepspeed", **over)
    # DeepSpeed would compile a CPU communication op here on first use (~95 s): it must not build anything.
    cases = [
        {"recipe": str(r), "env": {"TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")}}
        for r in recipes.values()
    ]
    # A loading argument with a visible effect: every one must reach from_pretrained (docs/field-failures.md#zero-3-loading-drops-an-argument).
    load = write_recipe(
        files, root / "load", "deepspeed", adapter="none", model__load_kwargs={"rms_norm_eps": 1e-3}
    )
    cases.append({"check": "zero3_load", "recipe": str(load)})
    found = {"outs": outs, "lora-recipe": recipes["lora"], "load": root / "load.zero3.json",
             "recipes": list(recipes.values()), "root": root}  # fmt: skip
    return cases, found


@pytest.fixture(scope="module")
def runs(assets, two_process_launch, tmp_path_factory) -> dict[str, Path]:  # noqa: F811 - the imported fixture
    """1-process references (in this worker: what each printed is read below), and the 2-process cases
    of the shared launch, with what rank 0 printed for them and what the whole launch printed."""
    root = tmp_path_factory.mktemp("deepspeed")
    outs = {name: root / name for name in ("ref-lora", "ref-full", "one-process")}
    refs = [write_recipe(assets, outs["ref-lora"]), write_recipe(assets, outs["ref-full"], adapter="none")]
    # backend deepspeed with ONE process on a CPU: no engine, a plain run that must equal the reference.
    refs.append(write_recipe(assets, outs["one-process"], "deepspeed", adapter="none", training__grad_accum=4,
                             distributed__num_processes=1))  # fmt: skip
    for name, over in objectives(assets).items():
        outs[f"ref-{name}"] = root / f"ref-{name}"
        refs.append(write_recipe(assets, outs[f"ref-{name}"], **over))
    run_here({"cases": [{"recipe": str(r)} for r in refs]})
    two = two_process_launch["test_deepspeed"]
    return (
        outs
        | two["outs"]
        | {
            "one-process-stdout": "".join(r.with_suffix(".stdout").read_text() for r in refs),
            "stdout": "".join(r.with_suffix(".stdout").read_text() for r in two["recipes"]),
            "launch-stdout": two_process_launch["stdout"],
            "torch_extensions": two["root"] / "torch_extensions",
            "lora-recipe": two["lora-recipe"],
            "load": two["load"],
        }
    )


def grad_norms(out: Path) -> list[float]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r["grad_norm"] for r in records if "grad_norm" in r]


def test_deepspeed_with_one_cpu_process_trains_plainly(runs) -> None:
    assert "sharding: single process" in runs["one-process-stdout"]
    assert losses(runs["one-process"]) == pytest.approx(losses(runs["ref-full"]), abs=1e-5, rel=0)
    assert grad_norms(runs["one-process"]) == pytest.approx(grad_norms(runs["ref-full"]), rel=1e-5)


def test_zero3_makes_one_tracker_run(runs) -> None:
    """The ZeRO-3 LoRA case reports to trackio: one run, every value of its metrics.jsonl at its step, once."""
    from test_trackers import assert_one_run_each

    assert_one_run_each(runs["lora"], TRACKED, ["trackio"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CASES)
def test_deepspeed_trains_the_one_process_model(name: str, runs, assets) -> None:  # noqa: F811
    adapter, ac, stage = CASES[name]
    out, ref = runs[name], runs["ref-lora" if adapter == "lora" else "ref-full"]
    assert_same_run(out, ref)  # per-step losses within 1e-5, same saved weights, the adapter loads in peft
    # The engine clipped with the same global norm (full fine-tuning's norms exceed max_grad_norm 1.0).
    assert grad_norms(out) == pytest.approx(grad_norms(ref), rel=1e-5)
    if adapter == "none":  # the model rank 0 gathered and saved loads through transformers
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out / "final")
        saved = load_file(out / "final" / "model.safetensors")
        assert model.lm_head.weight.shape == saved["lm_head.weight"].shape == (model.config.vocab_size, 32)
        torch.testing.assert_close(model.lm_head.weight.detach(), saved["lm_head.weight"], atol=0, rtol=0)
    plan = (out / "plan.txt").read_text()
    assert "(deepspeed)" in plan and "2 on 1 machine(s)" in plan
    assert "fused_linear_cross_entropy: patched" in plan
    if ac == "auto":
        assert "activation ckpt     reentrant" in plan
    stdout = runs["stdout"]  # rank 0's output of this file's cases; the launch's whole output below
    assert not runs["torch_extensions"].exists() and "built successfully" not in runs["launch-stdout"]
    sharding = [line for line in stdout.splitlines() if line.startswith("sharding:")]
    others = len(objectives(assets))  # dpo-full, kto-full, reward: ZeRO-3 as well
    assert len(sharding) == len(CASES) + others
    verified = [line for line in stdout.splitlines() if line.startswith("final model verified")]
    assert len(verified) == len(CASES) + others, stdout[-3000:]  # every ZeRO save reloaded and compared
    lm_head_numel = json.loads((out / "checks.json").read_text())["lm_head_numel"]
    if stage == 3:
        # lm_head.weight is partitioned away outside a forward: the fused loss really needed the gather.
        assert lm_head_numel == 0
        assert "fused loss: lm_head.weight registered with ZeRO-3" in stdout
        zero3_cases = sum(case[2] == 3 for case in CASES.values()) + others
        assert sum("ZeRO-3" in s and "(1/2)" in s for s in sharding) == zero3_cases, sharding
    else:
        assert lm_head_numel > 0 and any("ZeRO-2: parameters replicated" in s for s in sharding), sharding


@pytest.mark.timeout(900)
def test_zero3_precomputes_the_dpo_reference_of_the_one_process_run(runs) -> None:
    """Full fine-tuning DPO: the reference log-probs computed by both ranks (every rank the same number
    of ZeRO-3 forwards) equal one process's, and so does the training that reads them."""
    out, ref = runs["dpo-full"], runs["ref-dpo-full"]
    assert_same_run(out, ref)
    got, want = (load_file(p / "reference_logps.safetensors") for p in (out, ref))
    assert got.keys() == want.keys() == {"train", "eval"}
    for split in got:  # 17 and 3 micro-batches over 2 ranks: the second pads its last share
        torch.testing.assert_close(got[split], want[split], atol=1e-5, rtol=1e-6, msg=split)
    stdout = runs["stdout"]
    assert "under deepspeed; stored in" in stdout and "start check: step 1 has policy == reference" in stdout


@pytest.mark.timeout(900)
def test_zero3_loads_the_saved_weights_partitioned(runs) -> None:
    """from_pretrained ran under ZeRO-3's init context with every loading argument passed through."""
    result = json.loads(runs["load"].read_text())
    assert result["zero3_enabled"] and result["partitioned_at_load"], result  # every parameter (0,) at load
    assert result["same_names"] and result["same_shapes"], result
    assert result["max_abs_diff"] == 0.0, result  # gathered weights equal the safetensors file exactly
    assert result["rms_norm_eps"] == 1e-3


@pytest.mark.timeout(900)
def test_zero3_checkpoint_resumes_on_two_machines(runs, tmp_path: Path) -> None:
    """The one launch's step-2 checkpoint resumed by two "machines" of one process each (`liger launch
    --nodes 2 --procs 1`'s commands, tests/test_distributed.py `two_machines`; the same world size, so
    each rank reads its own ZeRO shard): the same steps 3-4 and adapter, written once."""
    checkpoint = runs["lora"] / "checkpoints" / "step-2"
    assert (checkpoint / "trainer_state.json").is_file()
    resumed = tmp_path / "resumed"
    machines = two_machines(
        runs["lora-recipe"], free_port(), f"output.dir={resumed}", f"output.resume={checkpoint}"
    )
    for machine in machines:
        assert machine.returncode == 0, machine.stdout[-5000:]
    assert f"resumed from {checkpoint} at step 2" in machines[0].stdout
    assert "2 on 2 machine(s)" in (resumed / "plan.txt").read_text()
    assert losses(resumed) == pytest.approx(losses(runs["lora"])[2:], abs=1e-5, rel=0)
    assert len((resumed / "metrics.jsonl").read_text().splitlines()) == len(losses(resumed)) + (
        len((runs["lora"] / "metrics.jsonl").read_text().splitlines()) - len(losses(runs["lora"]))
    )  # each step's line once, not once per machine
    got, want = (load_file(p / "final" / "adapter_model.safetensors") for p in (resumed, runs["lora"]))
    assert got.keys() == want.keys() and got
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.timeout(900)
def test_zero3_on_two_machines_of_two_processes_each(runs, assets, tmp_path) -> None:  # noqa: F811
    """ZeRO-3 on two "machines" of two processes each (world 4, micro-batch 2, no accumulation: the
    1-process run's global batch of 8): the same losses and adapter as 1 process; the checkpoint holds
    each of the 4 ranks' ZeRO shards once, the output is written once."""
    out = tmp_path / "zero3-2x2"
    recipe = write_recipe(assets, out, "deepspeed", training__grad_accum=1, output__save_every=4)
    for machine in two_machines(recipe, free_port(), procs=2):
        assert machine.returncode == 0, machine.stdout[-5000:]
    assert_same_run(out, runs["ref-lora"])
    plan = (out / "plan.txt").read_text()
    assert "4 on 2 machine(s)" in plan and "(deepspeed)" in plan, plan
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4"]
    shards = sorted(p.name for p in (out / "checkpoints" / "step-4").rglob("*optim_states.pt"))
    assert len(shards) == 4 and len(set(shards)) == 4, shards


def test_deepspeed_backend_without_deepspeed_is_a_user_error(assets, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    import importlib.util

    from liger_cli.errors import UserError
    from liger_cli.plan import build_plan
    from liger_cli.recipe import load_recipe
    from liger_cli.run.backends import backend_for

    recipe = load_recipe(write_recipe(assets, tmp_path / "out", "deepspeed"))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a)
    )
    with pytest.raises(UserError, match="needs the deepspeed package.*pip install"):
        backend_for(recipe, build_plan(recipe)).make_accelerator()


@pytest.mark.timeout(900)
def test_zero3_trains_kto_and_a_reward_model_as_one_process_does(runs) -> None:
    """KTO with full fine-tuning, and a reward model (its LoRA adapter and the score head trained in full):
    the same per-step losses and saved weights as one process; the KTO reference table and z0 computed
    by both ranks through ZeRO-3's collective forwards."""
    assert_same_run(runs["kto-full"], runs["ref-kto-full"])
    assert_same_reward_run(runs["reward"], runs["ref-reward"])
