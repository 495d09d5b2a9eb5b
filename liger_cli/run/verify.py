"""What is saved is what was trained: the final output, loaded back from disk the way a user loads it,
must hold every tensor of the trained model and give its logits on a probe batch.

Launchers have shipped adapters that were empty or partial (ZeRO-3's `[0]`-shaped gathers, FSDP
wrapper names in peft's keys), a `modules_to_save` layer or a trained embedding left out of the file,
and adapter configs that load a different model than the one trained. Two comparisons find each of
these: every tensor of the trained state dict against the reloaded model's (exact, after the dtype
the loader gives it; a difference names the tensors), and the logits of both models on the same
probe batch (within a tolerance: the trained model runs our kernels and the run's mixed precision,
the reloaded one runs plain). `liger merge` uses the same probe and tolerance between base +
adapter and the merged model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from liger_cli import process_state
from liger_cli.errors import RunFailed
from liger_cli.model import quantize

if TYPE_CHECKING:
    from liger_cli.recipe import Recipe
    from liger_cli.run.backends import Backend
    from liger_cli.run.inputs import Data

PROBE_ROWS, PROBE_TOKENS = 2, 64
# The largest logit difference accepted, relative to the largest logit (fp32: kernels and summation
# order; half precision: its rounding, and a merge that rounds W + BA into the base's dtype).
LOGIT_RTOL = {"fp32": 1e-3, "half": 5e-2}
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
BATCH_ONLY = ("pair", "margin")  # an objective's per-pair values in its batches, never model inputs


class NotVerified(RunFailed):
    """The output on disk does not reproduce the model in memory (exit 1; the output is left for a look)."""


def probe_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model inputs of a collated batch's first rows and tokens (labels dropped). A batch with image
    inputs (any key beyond the text ones: `pixel_values`, `image_grid_thw`, ...) is kept whole, its rows
    uncut: those tensors are per image, not per row, and cutting tokens could cut an image's tokens."""
    batch = {k: v for k, v in batch.items() if k not in BATCH_ONLY}
    if set(batch) - {*MODEL_INPUTS, "labels"}:
        return {k: v for k, v in batch.items() if k != "labels"}
    return {k: v[:PROBE_ROWS, :PROBE_TOKENS] for k, v in batch.items() if k in MODEL_INPUTS}


def random_probe(config) -> dict[str, torch.Tensor]:
    """A fixed probe of token ids where there is no data (merge): the same ids on every call, drawn from
    the text vocabulary, never a special id the config names (`image_token_id`, `vision_start_token_id`:
    a VLM would look for the image they stand for)."""
    text = config.get_text_config(decoder=True)
    special = [
        v for k, v in vars(config).items() if k.endswith(("token_id", "token_index")) and type(v) is int
    ]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(text.vocab_size, (PROBE_ROWS, PROBE_TOKENS // 2), generator=generator)
    plain = next(i for i in range(text.vocab_size) if i not in special)
    return {"input_ids": ids.masked_fill(torch.isin(ids, torch.tensor(special, dtype=ids.dtype)), plain)}


@torch.no_grad()
def logits_of(model: nn.Module, probe: dict[str, torch.Tensor], device=None) -> torch.Tensor:
    """fp32 logits on the CPU, dropout off; every module's training flag as it was afterwards. A sharded
    model's forward is collective: call it on every rank."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        inputs = {k: v.to(device) if device is not None else v for k, v in probe.items()}
        return model(**inputs, use_cache=False).logits.float().cpu()
    finally:
        for m, flag in flags:
            m.training = flag


def logit_rtol(*dtypes: torch.dtype | str) -> float:
    """The tolerance for the least precise of the dtypes (torch dtypes or the Plan's precision names)."""
    half = any(d in (torch.bfloat16, torch.float16, "bf16", "fp16") for d in dtypes)
    return LOGIT_RTOL["half" if half else "fp32"]


def logit_difference(expected: torch.Tensor, found: torch.Tensor) -> tuple[float, float]:
    """(largest absolute difference, that relative to the largest |logit| expected)."""
    diff = (expected - found).abs().max().item()
    return diff, diff / max(expected.abs().max().item(), 1e-6)


def differing_tensors(trained: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> list[str]:
    """Names of the trained tensors the loaded model lacks, or holds with another shape or value."""
    differ = []
    for name, tensor in trained.items():
        found = loaded.get(name)
        if (
            found is None
            or found.shape != tensor.shape
            or not quantize.same_bits(tensor.to(device=found.device, dtype=found.dtype), found)
        ):
            differ.append(name if found is not None else f"{name} (missing)")
    return differ


def verify_final(
    final: Path, load, trained_state: dict, trained_logits: torch.Tensor, probe: dict, rtol: float
) -> str:
    """Load `final` with `load(final)` (the user's way) and compare it with the trained model; the
    verdict line, or NotVerified naming what differs."""
    try:
        with process_state.loading_alone():
            loaded = load(final)
    except Exception as err:  # any loader error means the output does not load: say which
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise NotVerified(f"the final model in {final} does not load back: {first}") from None
    differ = differing_tensors(trained_state, loaded.state_dict())
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        raise NotVerified(
            f"the final model in {final} does not hold what was trained: {len(differ)} of "
            f"{len(trained_state)} tensors differ ({shown})"
        )
    diff, relative = logit_difference(trained_logits, logits_of(loaded, probe))
    if relative > rtol:
        raise NotVerified(
            f"the final model in {final} holds the trained tensors but computes other logits: largest "
            f"difference {diff:.3g} ({relative:.2g} of the largest logit, tolerance {rtol:g}); its config "
            "(adapter_config.json / config.json) does not describe the trained model"
        )
    return f"final model verified: reloaded from {final.name}/, every tensor equal, largest logit difference {diff:.2g}"


def load_final(recipe, final: Path) -> nn.Module:
    """The final output as a user loads it: transformers for a full model (its auto class); the recipe's base (the same
    dtype and loading arguments as the run's) with peft's `PeftModel.from_pretrained` for an adapter."""
    from liger_cli.model import load_base_model, model_dtype

    m = recipe.model
    if recipe.adapter.type == "none":
        from liger_cli.model import model_class, read_config

        kwargs = {"dtype": model_dtype(recipe), "trust_remote_code": m.trust_remote_code}
        if m.attn_implementation:
            kwargs["attn_implementation"] = m.attn_implementation
        return model_class(read_config(final, m.trust_remote_code)).from_pretrained(final, **kwargs)
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base_model(recipe), final)


def check_final(
    recipe: Recipe,
    backend: Backend,
    model: nn.Module,
    data: Data,
    collate: Callable,
    say: Callable[[str], object],
    state_dict: dict,
) -> None:
    """The run's final check: every rank runs the trained (prepared) `model` on a probe batch of the
    run's own data, made with the objective's `collate` (a sharded forward is collective), then rank 0
    reloads `final/` from disk and compares with `state_dict`. Rank 0 alone fails if they differ; the
    others have nothing left to wait for."""
    if not recipe.output.verify:
        say("final model not verified (output.verify: false)")
        return
    train, pad_id = data.train, data.tokenizer.pad_token_id
    if train is None:  # streaming: the stream's first examples
        examples = data.batches.probe(PROBE_ROWS)
    else:
        examples = [train[i] for i in range(min(PROBE_ROWS, len(train)))]
    probe = probe_batch(collate(examples, pad_id))
    logits = logits_of(model, probe, backend.accelerator.device)
    if backend.accelerator.is_main_process:
        from liger_cli.model import model_dtype

        rtol = logit_rtol(backend.plan.precision, model_dtype(recipe))
        load = functools.partial(load_final, recipe)
        say(verify_final(recipe.output.dir / "final", load, state_dict, logits, probe, rtol))
