"""What `RUN_OR_MODEL` names, and that model loaded exactly as its run loaded it.

| given | what is loaded |
|---|---|
| a run folder (it holds `recipe.yaml`) | its `final/`, else its newest complete checkpoint |
| `RUN/final` | the run's final adapter on its base, or its full model |
| `RUN/checkpoints/step-N` | the run's model with the checkpoint's weights |
| a model folder (`config.json`), e.g. `liger merge`'s output | that model; with `--adapter PATH`, the adapter on it |
| an adapter folder (`adapter_config.json`) | the adapter on the base it names |

A run's base is loaded by the model stage's own `load_base_model` from the run's resolved
`recipe.yaml`: the same dtype, 4-bit quantization, attention implementation, loading arguments and
`trust_remote_code` (only where the recipe said so), in one process. Everything is checked before
any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from liger_cli.errors import UserError
from liger_cli.generate.prompts import FORMATS
from liger_cli.recipe import Recipe

RECIPE_FILE = "recipe.yaml"
CHECKPOINT_STATE = "trainer_state.json"  # written last into a complete checkpoint (run/checkpoint.py)


@dataclass(frozen=True)
class Target:
    """What RUN_OR_MODEL names, found without loading anything."""

    kind: str
    """final (a run's), checkpoint (a run's), model (a full model folder), adapter (on `base`)."""
    weights: Path
    base: Path | None
    """The base model folder an adapter goes on (`adapter` kind)."""
    recipe: Recipe | None
    """The run's resolved recipe, for runs."""
    format: str
    """How prompts are rendered: `--format`, else as the run rendered its training prompts (`run_format`),
    else chat if the tokenizer has a chat template and text if not (decided once the tokenizer is loaded:
    `chat_or_text`)."""

    @property
    def describe(self) -> str:
        return f"{self.kind} {_shown(self.weights)}" + (f" on {_shown(self.base)}" if self.base else "")


def find_target(path: Path, adapter: Path | None = None, fmt: str | None = None) -> Target:
    """Resolve RUN_OR_MODEL (and --adapter); a one-line UserError when it names nothing loadable."""
    path = Path(path).expanduser().resolve()
    if fmt is not None and fmt not in FORMATS:
        raise UserError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    if not path.exists():
        raise UserError(f"{path}: no such run or model folder")
    if adapter is not None:
        adapter = Path(adapter).expanduser().resolve()
        if not (adapter / "adapter_config.json").is_file():
            raise UserError(f"--adapter {adapter}: no adapter_config.json there; give a peft adapter folder")
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: --adapter goes on a base model folder (with config.json)")
        return Target("adapter", adapter, path, None, fmt or "auto")
    run = _run_of(path)
    if run is not None:
        recipe = _run_recipe(run)
        weights = _run_weights(run, path)
        kind = "checkpoint" if (weights / CHECKPOINT_STATE).is_file() else "final"
        return Target(kind, weights, None, recipe, fmt or run_format(recipe))
    if (path / "adapter_config.json").is_file():
        return Target("adapter", path, _adapter_base(path), None, fmt or "auto")
    if (path / "config.json").is_file():
        return Target("model", path, None, None, fmt or "auto")
    raise UserError(
        f"{path} is not a run folder (no {RECIPE_FILE}), a model folder (no config.json) or an adapter "
        "folder (no adapter_config.json): give a liger run's output.dir, a model, or --adapter"
    )


def run_format(recipe: Recipe) -> str:
    """The Renderer format (FORMATS) that renders a prompt as the run rendered its training prompts."""
    # the preference objectives, a reward model's pairs and kto's labelled completions render alike
    if recipe.training.objective in ("dpo", "simpo", "orpo", "reward", "kto"):
        return "preference"
    return prompt_rendering(recipe) if recipe.data.format == "prompt" else recipe.data.format


def prompt_rendering(recipe: Recipe) -> str:
    """An online run's prompts (`format: prompt`) went through the chat template when they were message
    lists or the run had tools, else as text: read off its first training prompt, so that `liger chat`
    on a run trained on conversations talks through the template, and one trained on text does not."""
    if recipe.rl.tools or recipe.rl.environment:
        return "chat"
    from liger_cli.data.sources import read_rows, sources_of

    try:
        first = read_rows(sources_of(recipe.data.train, "prompt")[0])[0]["prompt"]
    except (UserError, OSError, ValueError, IndexError) as err:
        raise UserError(
            f"cannot tell whether the run's prompts were chat or text: its data.train could not be read ({err}); "
            "pass --format chat or --format text"
        ) from None
    return "text" if isinstance(first, str) else "chat"


def chat_or_text(target: Target, tokenizer) -> str:
    if target.format != "auto":
        return target.format
    return "chat" if getattr(tokenizer, "chat_template", None) else "text"


def model_folder(target: Target) -> Path:
    """The folder of the model the weights go on: its processor is the one training used for images."""
    if target.recipe is not None:
        return target.recipe.model.path or target.weights
    return target.base if target.kind == "adapter" else target.weights


def config_source(target: Target) -> Path:
    """Where the model's config is: a run's as it built it (model.path or model.config), else the folder."""
    m = target.recipe.model if target.recipe is not None else None
    return (m.path or m.config) if m is not None else model_folder(target)


def is_vision_model(target: Target) -> bool:
    """Whether the model takes images (a vision-language config), read without loading weights."""
    from liger_cli.model import read_config
    from liger_cli.model.vision import is_vision_language

    trust = target.recipe is not None and target.recipe.model.trust_remote_code
    return is_vision_language(read_config(config_source(target), trust))


def load_tokenizer_for(target: Target):
    from transformers import AutoTokenizer

    from liger_cli.data.images import remember_model

    if target.kind == "checkpoint":
        from liger_cli.data.tokenizer import load_tokenizer

        return load_tokenizer(target.recipe)
    has_own = (target.weights / "tokenizer_config.json").is_file()
    source = target.weights if has_own or target.base is None else target.base
    trust = bool(target.recipe and target.recipe.model.trust_remote_code)
    if not any((source / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        raise UserError(
            f"{source} has no tokenizer (no tokenizer_config.json or tokenizer.json): save the tokenizer "
            "beside the model (tokenizer.save_pretrained), or give the folder that has both"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load a tokenizer from {source}: {str(err).splitlines()[0]}") from None
    remember_model(tokenizer, model_folder(target), trust)  # image prompts: the processor training used
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(target: Target, device: torch.device | None = None):
    """The model as its run built it (no activation checkpointing: nothing is trained; no kernels:
    those are the commands' choice, proved on a twin first), in eval mode."""
    from liger_cli import process_state

    process_state.quiet_libraries()
    recipe = target.recipe
    quantize = (
        recipe.model.quantize if recipe is not None else "none"
    )  # a pre-quantized base: its config says
    process_state.hide_bitsandbytes_unless_quantized(quantize, config_source(target))
    if recipe is not None:
        model = _load_run_model(target, _one_process(recipe))
    else:
        model = _load_plain(target)
    if device is not None and not _quantized(model):
        model.to(device)
    return model.eval()


# --- finding things ----------------------------------------------------------------------------------------


def _run_of(path: Path) -> Path | None:
    """The run folder `path` is, or lies in (final/, checkpoints/step-N)."""
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / RECIPE_FILE).is_file() and (candidate / "plan.txt").is_file():
            return candidate
    return None


def _run_recipe(run: Path) -> Recipe:
    from pydantic import ValidationError

    try:
        data = yaml.safe_load((run / RECIPE_FILE).read_text())
        recipe = Recipe.model_validate(data, context={"base_dir": run})
    except (yaml.YAMLError, ValidationError) as err:
        raise UserError(
            f"{run / RECIPE_FILE} is not a liger run's recipe: {str(err).splitlines()[0]}"
        ) from None
    base = recipe.model.path
    if base is not None and not (base / "config.json").is_file():
        raise UserError(f"the run's base model folder is gone: {base} (model.path in {run / RECIPE_FILE})")
    return recipe


def _run_weights(run: Path, path: Path) -> Path:
    if path != run:
        if not _complete(path):
            raise UserError(
                f"{path} holds no saved model (no adapter, model or {CHECKPOINT_STATE}): give the run folder, "
                "its final/ or a complete checkpoints/step-N"
            )
        return path
    if _complete(run / "final"):
        return run / "final"
    steps = sorted(
        (p for p in (run / "checkpoints").glob("step-*") if (p / CHECKPOINT_STATE).is_file()),
        key=lambda p: int(p.name.split("-")[1]),
    )
    if not steps:
        raise UserError(
            f"{run} has no final model and no complete checkpoint (the run stopped before saving): resume it "
            "with liger train (output.resume: auto), or give another run"
        )
    return steps[-1]


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the working folder when it lies inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _complete(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("adapter_config.json", "config.json", CHECKPOINT_STATE))


def _adapter_base(adapter: Path) -> Path:
    try:
        base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{adapter / 'adapter_config.json'} is not a peft adapter config: {err}") from None
    if not base or not (Path(base) / "config.json").is_file():
        raise UserError(
            f"the adapter's base model {base!r} is not a local model folder: give it as RUN_OR_MODEL with "
            f"--adapter {adapter}"
        )
    return Path(base)


# --- loading -----------------------------------------------------------------------------------------------


def _one_process(recipe: Recipe) -> Recipe:
    """The recipe as one process loads it (4-bit weights in uint8 storage, peft's usual preparation)."""
    from liger_cli.recipe.schema import DistributedSection

    return recipe.model_copy(update={"distributed": DistributedSection()})


def _load_run_model(target: Target, recipe: Recipe):
    from liger_cli.model import add_adapter, load_base_model, model_class, model_dtype, read_config

    weights = target.weights
    if (weights / "config.json").is_file():  # a full fine-tune's final model (a VLM's: its own class)
        m = recipe.model
        kwargs = {"attn_implementation": m.attn_implementation} if m.attn_implementation else {}
        return model_class(read_config(weights, m.trust_remote_code)).from_pretrained(
            weights, dtype=model_dtype(recipe), trust_remote_code=m.trust_remote_code, **kwargs
        )
    base = load_base_model(recipe)
    if (weights / "adapter_config.json").is_file():
        from peft import PeftModel

        return PeftModel.from_pretrained(base, weights)
    model = add_adapter(base, recipe)
    _load_checkpoint_weights(model, weights, adapter=recipe.adapter.type != "none")
    return model


def _load_checkpoint_weights(model, checkpoint: Path, adapter: bool) -> None:
    """A checkpoint's `model.safetensors` (single process and DDP write it): with an adapter exactly
    the trainable weights, without one every weight (a tied one once)."""
    weights = checkpoint / "model.safetensors"
    if not weights.is_file():
        raise UserError(
            f"{checkpoint} was written by a sharding backend (FSDP or DeepSpeed keep their own formats): "
            "generate from the run's final/ instead, or from a checkpoint of a single-process or DDP run"
        )
    from safetensors.torch import load_file

    state = load_file(weights)
    result = model.load_state_dict(state, strict=False)
    expected = {n for n, p in model.named_parameters() if p.requires_grad} if adapter else set()
    missing = expected - set(state)
    if result.unexpected_keys or missing or (not adapter and len(state) < len(model.state_dict()) // 2):
        raise UserError(
            f"{weights} does not fit the run's model ({len(result.unexpected_keys)} unexpected, {len(missing)} "
            "missing weights): it was written by another recipe"
        )


def _load_plain(target: Target):
    from transformers import AutoModelForCausalLM

    model_dir = target.base if target.kind == "adapter" else target.weights
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load a causal LM from {model_dir}: {str(err).splitlines()[0]}") from None
    if target.kind == "adapter":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, target.weights)
    return model


def _quantized(model) -> bool:
    return getattr(model, "is_loaded_in_4bit", False) or bool(getattr(model, "quantization_method", None))
