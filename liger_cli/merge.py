"""`liger merge`: a run's adapter merged into its base model, written as a full model folder.

The merged model is written into a fresh temporary folder beside OUT (a unique name, so it never
collides with a folder liger did not make) and renamed to OUT only when complete. `--overwrite`
replaces only a merge folder liger made (it carries MERGE_MARKER), never the run folder, a parent
of it, or the base model's folder.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from liger_cli import process_state
from liger_cli.errors import UserError
from liger_cli.run import verify

MERGE_MARKER = ".liger-merge"


def check_output_folder(out: Path, precious: dict[Path, str], marker: str, overwrite: bool, flag: str,
                        command: str) -> Path:  # fmt: skip
    """OUT for a command that writes a folder, checked before any work: not a file, not one of the
    `precious` folders (what each is) or a parent of it, and, if not empty, replaced only with
    `overwrite` and only when `command` wrote it (it holds `marker`). Returns OUT resolved."""
    resolved = Path(out).expanduser().resolve()
    for folder, what in precious.items():
        if Path(folder).resolve().is_relative_to(resolved):
            raise UserError(f"{flag} {out} is {what} or a parent of it: choose another folder")
    if resolved.exists() and not resolved.is_dir():
        raise UserError(f"{flag} {out} is a file: choose a folder")
    if resolved.is_dir() and any(resolved.iterdir()):
        if not overwrite:
            raise UserError(f"{flag} {out} is not empty: choose another folder or pass --overwrite")
        if not (resolved / marker).is_file():
            raise UserError(
                f"refusing to replace {out}: {command} did not write it (no {marker}); "
                "choose another folder or remove it yourself"
            )
    return resolved


def check_merge(run_dir: Path, out_dir: Path, overwrite: bool) -> tuple[Path, str]:
    """Every check before anything is loaded or written; the adapter folder and its base model."""
    adapter_dir = run_dir / "final"
    if not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(
            f"no adapter in {adapter_dir}: give the output.dir of a finished LoRA/DoRA run "
            "(full fine-tuning runs already hold the full model in final/)"
        )
    try:
        base = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(
            f"{adapter_dir / 'adapter_config.json'} is not a peft adapter config: {err}"
        ) from None
    if not Path(base).is_dir():
        raise UserError(f"the adapter's base model folder is gone: {base}")
    check_output_folder(out_dir, {run_dir: "the run folder", Path(base): "the base model folder"}, MERGE_MARKER,
                        overwrite, "OUT_DIR", "liger merge")  # fmt: skip
    return adapter_dir, base


def merge_adapter(run_dir: Path, out_dir: Path, overwrite: bool = False) -> MergeResult:
    """Merge a finished run's adapter into its base model and save the full model. The merged model,
    reloaded from disk, must give base + adapter's logits on a probe batch (`run/verify.py`) before
    OUT_DIR is written; returns the largest logit difference.

    A QLoRA run (model.quantize in its recipe.yaml) merges into the full-precision base from disk, never
    into its 4-bit weights (re-quantizing the merge loses the adapter's update); the same check holds,
    and the largest logit difference between the adapter on the 4-bit base (what was trained) and the
    merged model is reported: the base's quantization error, which a full-precision merge cannot have."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    adapter_dir, base = check_merge(run_dir, out_dir, overwrite)
    quantized = quantization_of(run_dir)
    process_state.hide_bitsandbytes_unless_quantized(quantized or "none", Path(base))
    from peft import PeftModel
    from transformers import AutoTokenizer

    from liger_cli.model import model_class

    # Always the full-precision base as it is on disk (a QLoRA run's too: never its 4-bit weights),
    # built by its auto class (a vision-language model's too).
    config = base_config(Path(base), adapter_dir)
    auto = model_class(config)
    adapted = PeftModel.from_pretrained(auto.from_pretrained(base, config=config, dtype="auto"), adapter_dir)
    probes, no_image_probe = merge_probes(adapted)
    expected = [verify.logits_of(adapted, p) for p in probes]
    probe = probes[0]  # token ids: the 4-bit comparison's
    on_4bit = adapter_on_4bit_logits(adapter_dir, base, quantized, probe) if quantized else None
    model = adapted.merge_and_unload()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / MERGE_MARKER).touch()
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(tmp)
        if len(probes) > 1 or no_image_probe:  # a VLM: its processor's files, for image prompts
            copy_processor(Path(base), tmp)
        merged = auto.from_pretrained(tmp, dtype="auto")
        rtol = verify.logit_rtol(merged.dtype)
        diff = 0.0
        for what, probe_inputs, want in zip(("token", "image")[: len(probes)], probes, expected, strict=True):
            found, relative = verify.logit_difference(want, verify.logits_of(merged, probe_inputs))
            diff = max(diff, found)
            if relative > rtol:
                raise verify.NotVerified(
                    f"the merged model does not compute what base + adapter computes on the {what} probe: largest "
                    f"logit difference {found:.3g} ({relative:.2g} of the largest logit, tolerance {rtol:g}); "
                    f"nothing written to {out_dir}"
                )
        if out_dir.exists():  # checked above: empty, or a merge folder liger made
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if on_4bit is None:
        return MergeResult(diff, images=len(probes) > 1, no_image_probe=no_image_probe)
    on_4bit_diff = verify.logit_difference(on_4bit, verify.logits_of(merged, probe))[0]
    return MergeResult(diff, on_4bit_diff, quantized, len(probes) > 1, no_image_probe)


def base_config(base: Path, adapter_dir: Path):
    """The base's config as the run built it: a reward model's adapter (peft's SEQ_CLS task) goes on the
    family's sequence-classification class, padded as the run's tokenizer pads (`model.reward_config`)."""
    from transformers import AutoTokenizer

    from liger_cli.model import read_config, reward_config

    config = read_config(base)
    if json.loads((adapter_dir / "adapter_config.json").read_text()).get("task_type") != "SEQ_CLS":
        return config
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return reward_config(config, pad)


def merge_probes(adapted) -> tuple[list[dict[str, torch.Tensor]], str | None]:
    """The probes base + adapter and the merged model must agree on: token ids; for a vision-language
    model also a batch with an image in each row (pixels through the tower and the projector, which an
    adapter may train), made as the twin makes its image batch (the model's own feature count). Second:
    why a vision-language model has no image probe (said, not a failure), else None."""
    from liger_cli.model.vision import is_vision_language, unwrapped

    probes = [verify.random_probe(adapted.config)]
    if not is_vision_language(adapted.config):
        return probes, None
    from liger_cli.twin.vision_batch import ImageBatchError, tiny_image_batch

    try:
        batch = tiny_image_batch(unwrapped(adapted))
    except ImageBatchError as err:
        return probes, str(err)
    return [*probes, {k: v for k, v in batch.items() if k != "labels"}], None


def copy_processor(base: Path, out: Path) -> None:
    """The base's processor files (image sizes, template) beside the merged model, as they are."""
    from liger_cli.data.images import PROCESSOR_FILES

    for name in PROCESSOR_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)


@dataclass(frozen=True)
class MergeResult:
    diff: float
    """Largest logit difference, merged (reloaded) against the full-precision base + adapter."""
    quantized_diff: float | None = None
    """QLoRA: largest logit difference, merged against the adapter on the 4-bit base it was trained on
    (the base's quantization error: reported, not a failure)."""
    quantized: str | None = None
    images: bool = False
    """The probe carried images (a vision-language model)."""
    no_image_probe: str | None = None
    """Why a vision-language model was checked on token ids only."""

    def report(self, out_dir: Path) -> list[str]:
        """What `liger merge` prints: where, what was verified against what, and QLoRA's base error."""
        base = "the full-precision base + adapter" if self.quantized else "base + adapter"
        probe = "probe batches of token ids and of images" if self.images else "a probe batch"
        lines = [f"merged model written to {out_dir}",
                 f"merge verified: the merged model reloaded gives {base}'s logits on {probe} (largest "
                 f"difference {self.diff:.2g})"]  # fmt: skip
        if self.no_image_probe:
            lines.append(
                f"no image probe for this vision-language model ({self.no_image_probe}): token ids only"
            )
        if self.quantized:
            lines.append(
                f"QLoRA: the run trained on a {self.quantized} 4-bit base; the merge is into the full-precision "
                f"base. Largest logit difference, adapter on the 4-bit base vs merged: {self.quantized_diff:.3g} "
                "(the base's quantization error, not checked)"
            )
        return lines


def quantization_of(run_dir: Path) -> str | None:
    """The 4-bit quantization the run trained on ("nf4" / "fp4", from its recipe.yaml), or None."""
    recipe = run_dir / "recipe.yaml"
    if not recipe.is_file():
        return None
    try:
        model = (yaml.safe_load(recipe.read_text()) or {}).get("model") or {}
    except yaml.YAMLError:
        return None
    found = model.get("quantize", "none")
    return None if found in (None, "none") else found


def adapter_on_4bit_logits(adapter_dir: Path, base: str, quantized: str, probe) -> torch.Tensor:
    """The adapter on the 4-bit base, loaded as the run loaded it: what was trained, on the probe."""
    from peft import PeftModel

    from liger_cli.model import model_class, read_config
    from liger_cli.model import quantize as q
    from liger_cli.model.build import DTYPES

    settings = yaml.safe_load((adapter_dir.parent / "recipe.yaml").read_text())["model"]
    dtype = DTYPES.get(settings.get("dtype"), torch.float32)
    config = q.quantization_config(quantized, settings.get("quantize_double", True), dtype)
    kwargs = {k: settings[k] for k in ("trust_remote_code", "attn_implementation") if settings.get(k)}
    auto = model_class(read_config(Path(base), bool(kwargs.get("trust_remote_code"))))
    model = auto.from_pretrained(base, quantization_config=config, dtype=dtype, **kwargs)
    q.after_loading(model)
    return verify.logits_of(PeftModel.from_pretrained(model, adapter_dir), probe)
