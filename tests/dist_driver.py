"""Run several recipes in ONE set of processes (one process group), for the distributed tests.

Started by torchrun once for the whole suite (tests/conftest.py `two_process_launch`: every file that
compares backends with 1 process adds its cases), or plainly, in the test worker, for the 1-process
references (test_distributed.run_here): a 2-process launch costs 10-20 s of imports, so every case
shares one. Usage:
    python -m torch.distributed.run --nproc_per_node 2 tests/dist_driver.py SPEC.json
SPEC: {"cases": [CASE, ...]}, run in order. A training case is {"recipe": PATH, "env": {NAME: VALUE},
"uint8_storage": bool, "expect_error": bool}; a check is {"check": NAME, "recipe": PATH} with NAME one
of CHECKS (field_failure_1, zero3_load, generation, sequence_parallel), its result written beside its recipe by rank 0.
`uint8_storage` loads a QLoRA base the way other launchers do under a sharding backend (uint8 storage:
the 4-bit weights stay whole on every rank).
Each case trains through `liger_cli.run.train.run`, exactly as `liger train` does in each rank, and
writes `checks.json` beside its metrics: whether embedding and lm_head are still one parameter, and
how many elements of lm_head.weight this rank holds outside any forward (0 when ZeRO-3 partitions it).
Rank 0's output of each case is also written to RECIPE.stdout (beside the recipe), so a launch that
runs many files' cases can be checked case by case. A case with `"expect_error": true` must
stop with a RunFailed: its message goes to RECIPE.error.txt and the next case runs.
As in a `liger train` rank, bitsandbytes is hidden when no recipe of the spec quantizes its model, and
DeepSpeed when none runs the deepspeed backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import yaml
from check_memo import memoize_twin_checks

from liger_cli import process_state
from liger_cli.errors import RunFailed
from liger_cli.launch.rank import end_process_group, exit_now
from liger_cli.plan import build_plan
from liger_cli.recipe import load_recipe
from liger_cli.run import train

_real_save_final = train.save_final


def _save_final_with_checks(backend, model, tokenizer, out: Path) -> dict:
    """The real save, after recording what the tests need from the trained, still-wrapped model."""
    accelerator = backend.accelerator
    inner = accelerator.unwrap_model(model)
    if accelerator.is_main_process and inner.get_output_embeddings() is not None:  # a reward model has none
        lm_head = inner.get_output_embeddings().weight
        tied = inner.get_input_embeddings().weight is lm_head
        (out / "checks.json").write_text(json.dumps({"tied": tied, "lm_head_numel": lm_head.numel()}))
    return _real_save_final(backend, model, tokenizer, out)


def field_failure_1(recipe_path: str) -> str:
    """FSDP-1, lm_head in the root unit: read lm_head.weight AFTER the root forward, as the field's
    fused loss did. Returns the error text (the test expects a shape error)."""
    import torch

    from liger_cli.model import build_model
    from liger_cli.run.backends import backend_for

    recipe = load_recipe(recipe_path, ["kernels.fused_linear_cross_entropy=false"])
    plan = build_plan(recipe)
    accelerator = backend_for(recipe, plan).make_accelerator()
    model, _ = build_model(recipe, plan)
    model = accelerator.prepare(model)
    ids = torch.randint(0, 100, (2, 8))
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    weight = accelerator.unwrap_model(model).get_output_embeddings().weight
    try:
        torch.nn.functional.linear(hidden, weight).sum().backward()
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def zero3_load(recipe_path: str) -> dict:
    """Build the model as a DeepSpeed run does, before `prepare`: was every parameter created
    partitioned (under ZeRO-3's init context), and do the gathered weights equal the saved file?"""
    import deepspeed
    from safetensors.torch import load_file
    from transformers.integrations import is_deepspeed_zero3_enabled

    from liger_cli.model import build_model
    from liger_cli.run.backends import backend_for

    recipe = load_recipe(recipe_path)
    plan = build_plan(recipe)
    backend_for(recipe, plan).make_accelerator()
    model, _ = build_model(recipe, plan)
    saved = load_file(Path(recipe.model.path) / "model.safetensors")
    params = dict(model.named_parameters())
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in params.values())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        diff = max((params[name] - saved[name]).abs().max().item() for name in saved)
        shapes = all(params[name].shape == saved[name].shape for name in saved)
    return {
        "partitioned_at_load": partitioned,
        "same_names": sorted(params) == sorted(saved),
        "same_shapes": shapes,
        "max_abs_diff": diff,
        "rms_norm_eps": model.config.rms_norm_eps,
        "zero3_enabled": is_deepspeed_zero3_enabled(),
    }


def generation_gathers(recipe_path: str) -> dict:
    """The recipe's model prepared by its backend, then the engine through `Backend.generation` with 2
    and with 8 new tokens: how many all-gathers each call made (equal when parameters are gathered
    once per call, not per token) and the completions (this rank's prompts, then every rank's)."""
    import torch
    import torch.distributed as dist

    from liger_cli.data.tokenizer import load_tokenizer
    from liger_cli.generate.engine import Sampling, generate
    from liger_cli.model import build_model
    from liger_cli.run.backends import backend_for

    recipe = load_recipe(recipe_path)
    plan = build_plan(recipe)
    backend = backend_for(recipe, plan)
    accelerator = backend.make_accelerator()
    model, _ = build_model(recipe, plan)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, optimizer = backend.prepare(model, optimizer)
    tokenizer = load_tokenizer(recipe)
    texts = ["one two three", "seven", "a b c d e f g", "forty-two and", "9 8 7"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    world, rank = accelerator.num_processes, accelerator.process_index
    share = -(-len(prompts) // world)
    mine = [i % len(prompts) for i in range(rank * share, (rank + 1) * share)]
    calls = [0]
    # torch's all-gathers (FSDP) and DeepSpeed's own (ZeRO-3 keeps references to torch's).
    modules = [dist] + ([sys.modules["deepspeed.comm"]] if "deepspeed.comm" in sys.modules else [])
    names = ("all_gather_into_tensor", "all_gather_single", "all_gather", "_all_gather_base", "allgather_fn")
    real = {(m, n): getattr(m, n) for m in modules for n in names if hasattr(m, n)}

    def counting(key):
        def call(*args, **kwargs):
            calls[0] += 1
            return real[key](*args, **kwargs)

        return call

    result: dict = {"gathers": [], "completions": []}
    for new_tokens in (2, 8):
        calls[0] = 0
        for module, name in real:
            setattr(module, name, counting((module, name)))
        with backend.generation(model) as (module, any_running):
            found = generate(module, [prompts[i] for i in mine], Sampling(new_tokens, temperature=1.0, seed=5),
                             stop_ids=[], pad_id=tokenizer.pad_token_id, keys=mine, any_running=any_running,
                             device=accelerator.device)  # fmt: skip
        for (module, name), function in real.items():
            setattr(module, name, function)
        result["gathers"].append(calls[0])
        parts: list = [{i: c.ids for i, c in zip(mine, found, strict=True)}] * world
        if world > 1:
            dist.all_gather_object(parts, parts[0])
        every = {i: ids for part in parts for i, ids in part.items()}
        result["completions"].append([every[i] for i in range(len(prompts))])
    # The model still trains after generating (sharding and hooks restored): one step.
    batch = tokenizer(texts[:2], return_tensors="pt", padding=True)
    out = model(**{k: v.to(accelerator.device) for k, v in batch.items()}, labels=batch["input_ids"])
    accelerator.backward(out.loss)
    optimizer.step()
    result["loss_after"] = out.loss.item()
    return result


class _Tee:
    """Writes to the real stdout and to one case's log."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def isatty(self) -> bool:  # asked by what prints in colour (transformers' loading report)
        return False


@contextlib.contextmanager
def case_log(recipe_path: str):
    """Rank 0's stdout during one case, also into RECIPE.stdout."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    with Path(recipe_path).with_suffix(".stdout").open("w") as log:
        with contextlib.redirect_stdout(_Tee(sys.stdout, log)):
            yield


def _recipes(spec: dict) -> list[dict]:
    """Every recipe of the spec, read plainly (a resume's checkpoint does not exist yet when it starts)."""
    return [yaml.safe_load(Path(case["recipe"]).read_text()) for case in spec["cases"]]


def quantizes(spec: dict) -> bool:
    """Whether any recipe of the spec sets model.quantize."""
    return any(r["model"].get("quantize", "none") != "none" for r in _recipes(spec))


def uses_deepspeed(spec: dict) -> bool:
    """Whether any recipe of the spec runs the deepspeed backend."""
    return any(r.get("distributed", {}).get("backend") == "deepspeed" for r in _recipes(spec))


def run_cases(spec: dict) -> None:
    """The spec's cases, one after the other: each training case as `liger train` trains in a rank,
    each check as CHECKS says."""
    hide = not quantizes(spec)
    for case in spec["cases"]:
        # As in a fresh `liger train` process: nothing registered by the case before, on every rank alike
        # (a finished ZeRO-3 run's config stays registered until its engine is collected, which need not
        # happen on both ranks at once, and the next Plan would build its meta model under ZeRO-3's init).
        process_state.reset_for_new_run()
        if "check" in case:
            run_check(case["check"], case["recipe"])
            continue
        saved = {name: os.environ.get(name) for name in case.get("env", {})}
        os.environ.update(case.get("env", {}))
        recipe = load_recipe(case["recipe"])
        if hide:  # as `liger train` does before anything imports peft (about 3 s of imports per process)
            process_state.hide_bitsandbytes_unless_quantized("none", recipe.model.path or recipe.model.config)
        from liger_cli.model import quantize

        shards_weights = quantize.shards_weights
        if case.get("uint8_storage"):
            quantize.shards_weights = lambda recipe: False
        with case_log(case["recipe"]):
            try:
                train.run(recipe, build_plan(recipe))
            except RunFailed as err:
                if not case.get("expect_error"):
                    raise
                if os.environ.get("RANK", "0") == "0":
                    Path(case["recipe"]).with_suffix(".error.txt").write_text(f"{type(err).__name__}: {err}")
            else:
                if case.get("expect_error"):
                    raise SystemExit(f"{case['recipe']}: trained, but the test expects it to stop")
            finally:
                quantize.shards_weights = shards_weights
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value


def sequence_parallel_checks(recipe_path: str) -> dict:
    """The run's twin check of its split, as it is ("good") and with the second shard's positions off by
    one ("broken": the error it stops the run with)."""
    from liger_cli.errors import UserError
    from liger_cli.run.sequence_parallel import SequenceParallel

    recipe = load_recipe(recipe_path)
    split = SequenceParallel.start(recipe.distributed.sequence_parallel)
    kernels = build_plan(recipe).kernels
    found = {"good": split.check_on_twin(recipe, kernels)}
    shard = SequenceParallel.shard

    def off_by_one(self, batch):
        part = shard(self, batch)
        if self.index == 1:
            part["position_ids"] = part["position_ids"] + 1
        return part

    SequenceParallel.shard = off_by_one
    try:
        split.check_on_twin(recipe, kernels)
    except UserError as err:
        found["broken"] = str(err)
    finally:
        SequenceParallel.shard = shard
    return found


CHECKS = {"field_failure_1": (field_failure_1, ".ff1.txt"), "zero3_load": (zero3_load, ".zero3.json"),
          "generation": (generation_gathers, ".generation.json"),
          "sequence_parallel": (sequence_parallel_checks, ".split.json")}  # fmt: skip
"""A check's name -> (what it runs on its recipe, the suffix of the file its result goes to)."""


def run_check(name: str, recipe_path: str) -> None:
    """One check on its recipe; rank 0 writes the result beside the recipe."""
    check, suffix = CHECKS[name]
    result = check(recipe_path)
    if os.environ.get("RANK", "0") == "0":
        text = result if isinstance(result, str) else json.dumps(result)
        Path(recipe_path).with_suffix(suffix).write_text(text)
    sys.stdout.flush()


@contextlib.contextmanager
def checks_recorded():
    """`train.save_final` records checks.json first (see the module docstring), until the block ends."""
    train.save_final = _save_final_with_checks
    try:
        yield
    finally:
        train.save_final = _real_save_final


def run_spec(spec: dict) -> None:
    """The spec's cases and checks in order, checks.json recorded for each training case."""
    with checks_recorded():
        run_cases(spec)


def main() -> None:
    from liger_cli.launch.start import _return_freed_memory_to_the_os

    spec = json.loads(Path(sys.argv[1]).read_text())
    _return_freed_memory_to_the_os()  # as every `liger train` process on a CPU does
    if not uses_deepspeed(spec):  # as `liger train` does for a backend other than deepspeed
        process_state.hide_deepspeed_unless_used("none")
    memoize_twin_checks()  # the cases share the twin checks of equal inputs (tests/check_memo.py)
    run_spec(spec)
    end_process_group()
    exit_now(0)  # as a `liger train` rank ends: no C++ teardown that could abort a finished rank


if __name__ == "__main__":
    main()
