"""The recipe: a YAML file validated into typed objects (the schema is in `recipe_schema.py`).

Why this module is strict: a typo in a training recipe costs hours of GPU time when it is silently
ignored. Every key is checked (unknown keys get a "did you mean"), every error names the key path
and the line, and nothing is created on disk until the whole recipe is valid.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from liger_cli.errors import UserError
from liger_cli.recipe.distributed_section import FsdpSection
from liger_cli.recipe.schema import (
    AdapterSection,
    DataSection,
    DistributedSection,
    KernelsSection,
    LoggingSection,
    ModelSection,
    OutputSection,
    Recipe,
    TrainingSection,
)

__all__ = [
    "AdapterSection",
    "DataSection",
    "DistributedSection",
    "FsdpSection",
    "KernelsSection",
    "LoggingSection",
    "ModelSection",
    "OutputSection",
    "Recipe",
    "TrainingSection",
    "apply_override",
    "load_recipe",
    "validate_recipe",
]


# ---------------------------------------------------------------- reading YAML


class _Loader(yaml.SafeLoader):
    """safe_load, plus duplicate-key detection (PyYAML silently keeps the last one), and a value
    PyYAML cannot build (`2024-13-45`, `!!int abc`) as a YAML error at that value, not a traceback."""

    def construct_object(self, node, deep=False):  # noqa: ANN001
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError) as err:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value ({err})", node.start_mark
            ) from None

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # SafeLoader's own check says "found unhashable key" at its line
            if key in seen:
                raise UserError(
                    f"duplicate key `{key}` at line {line} (first at line {seen[key]}): keep only one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# The characters PyYAML refuses anywhere in a document (its reader's own check).
_NOT_IN_YAML = yaml.reader.Reader.NON_PRINTABLE


def _printable(text: str) -> str:
    """`text` on one line: control characters and line breaks written as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _key_lines(node: yaml.Node | None, prefix: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """Map each key path, e.g. ("training", "lr"), to its 1-based line in the file."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = (*prefix, key_node.value)
            out[path] = key_node.start_mark.line + 1
            _key_lines(value_node, path, out)
    return out


def _read_yaml(path: Path) -> tuple[dict, dict[tuple, int]]:
    if not path.exists():
        raise UserError(f"recipe file not found: {path}")
    if not path.is_file():
        raise UserError(f"recipe path is not a file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(
            f"{path}: not UTF-8 text (byte {err.start}): a recipe is a YAML file saved as UTF-8"
        ) from None
    except OSError as err:
        raise UserError(f"cannot read recipe {path}: {err.strerror}") from None
    if bad := _NOT_IN_YAML.search(text):
        line, column = text.count("\n", 0, bad.start()) + 1, bad.start() - text.rfind("\n", 0, bad.start())
        raise UserError(
            f"{path}: line {line}, column {column}: control character U+{ord(bad.group()):04X} "
            f"({_printable(bad.group())}), which YAML does not allow; delete it (a recipe is plain UTF-8 text)"
        )
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except UserError as err:
        raise UserError(f"{path}: {err}") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise UserError(f"{path}: invalid YAML at {where}: {_printable(err.problem or str(err))}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: invalid YAML: {_printable(str(err))}") from None
    finally:
        loader.dispose()
    if data is None:
        raise UserError(f"{path}: the recipe is empty; start from recipes/quickstart.yaml")
    if not isinstance(data, dict):
        raise UserError(
            f"{path}: the top level must be a mapping of sections (model:, data:, training:, ...), "
            f"not a {type(data).__name__}"
        )
    return data, _key_lines(node)


# ---------------------------------------------------------------- overrides


def _section_fields(loc: tuple) -> dict[str, Any]:
    """The fields of the section at `loc` (for "did you mean" suggestions)."""
    model: type[BaseModel] | None = Recipe
    for part in loc:
        field = model.model_fields.get(part) if model else None
        annotation = field.annotation if field else None
        # An optional section (`rl: RLSection | None`) is looked up through its union.
        options = [annotation, *typing.get_args(annotation)]
        model = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return dict(model.model_fields) if model else {}


# Names other launchers use (axolotl, torchtune, HF Trainer) for our keys: they make better suggestions.
_ALIASES = {
    "learning_rate": "lr",
    "lr_scheduler": "scheduler",
    "lr_scheduler_type": "scheduler",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "batch_size": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "warmup": "warmup_steps",
    "lora_r": "r",
    "rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "sequence_len": "max_seq_len",
    "max_length": "max_seq_len",
    "output_dir": "dir",
    "gradient_checkpointing": "activation_checkpointing",
    "torch_dtype": "dtype",
}


def _suggest(loc: tuple) -> str:
    options = list(_section_fields(loc[:-1]))
    aliases = {alias: name for alias, name in _ALIASES.items() if name in options}
    close = difflib.get_close_matches(str(loc[-1]), options + list(aliases), n=1, cutoff=0.6)
    if close:
        name = aliases.get(close[0], close[0])
        return f"did you mean `{'.'.join(map(str, (*loc[:-1], name)))}`?"
    return "allowed keys: " + ", ".join(options) if options else "this section takes no keys"


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `--set a.b=c`; the value is parsed as a YAML scalar or flow list."""
    if bad := re.search(r"[\n\r]", assignment) or _NOT_IN_YAML.search(assignment):
        raise UserError(
            f"--set {_printable(assignment)}: control character U+{ord(bad.group()):04X} at position "
            f"{bad.start() + 1}; delete it (a stray byte pasted into the command line?)"
        )
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set {assignment!r}: expected KEY=VALUE, for example --set training.lr=1e-4")
    loc = tuple(key.split("."))
    if any(not part for part in loc):
        raise UserError(f"--set {assignment!r}: empty part in key `{key}`")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    for depth, part in enumerate(loc[:-1]):
        if part not in _section_fields(loc[:depth]):
            raise UserError(
                f"--set: unknown key `{'.'.join(loc[: depth + 1])}`; {_suggest(loc[: depth + 1])}"
            )
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set: `{'.'.join(loc[: depth + 1])}` is not a section, cannot set `{key}`")
        node = child
    if loc[-1] not in _section_fields(loc[:-1]):
        raise UserError(f"--set: unknown key `{key}`; {_suggest(loc)}")
    node[loc[-1]] = value


# ---------------------------------------------------------------- validation


def _describe(error: dict, lines: dict[tuple, int], source: str) -> str:
    # pydantic puts validator and union-branch names (e.g. "function-after[...]", "list[str]") into loc.
    loc = tuple(str(p) for p in error["loc"])
    loc = tuple(p for p in loc if "[" not in p and p not in ("list", "str", "int", "float", "bool"))
    dotted = ".".join(loc) if loc else "(top level)"
    line = None
    for n in range(len(loc), 0, -1):
        line = lines.get(loc[:n])
        if line:
            break
    if isinstance(line, str):  # the value came from a --set override
        where = f"{line}: "
    else:
        where = f"{source}:{line}: " if line else f"{source}: "
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{where}unknown key `{dotted}`; {_suggest(loc)}"
    if kind == "missing":
        return f"{where}missing required key `{dotted}`"
    message = error["msg"].removeprefix("Value error, ")
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"{where}`{dotted}` must be a section (a mapping of keys), got {error.get('input')!r}"
    if kind == "value_error" or not loc or kind.startswith("model_"):
        section = f"`{dotted}`: " if loc else ""
        return f"{where}{section}{message}"
    value = error.get("input")
    return f"{where}`{dotted}` = {value!r} is not allowed: {message}"


def validate_recipe(data: dict, base_dir: Path, source: str = "recipe", lines: dict | None = None) -> Recipe:
    try:
        recipe = Recipe.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as err:
        errors = err.errors(include_url=False)
        more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
        raise UserError(_describe(errors[0], lines or {}, source) + more) from None
    _check_paths(recipe, source)
    return recipe


def _check_paths(recipe: Recipe, source: str) -> None:
    """Missing inputs are reported now, before any model or data is touched."""
    model = recipe.model
    if model.path is not None:
        if not model.path.is_dir():
            raise UserError(
                f"{source}: model.path {model.path} is not a folder; point it at a local model folder"
            )
        if not (model.path / "config.json").is_file():
            raise UserError(
                f"{source}: model.path {model.path} has no config.json; is it a Hugging Face model folder?"
            )
    if model.config is not None and not model.config.is_file():
        raise UserError(f"{source}: model.config file not found: {model.config}")
    if model.tokenizer is not None and not model.tokenizer.exists():
        raise UserError(f"{source}: model.tokenizer not found: {model.tokenizer}")
    for key in ("train", "eval"):
        for entry in recipe.data.entries(key):  # Hub names (str) are looked up when the data is read
            if isinstance(entry.path, Path) and not entry.path.exists():
                raise UserError(f"{source}: data.{key} file not found: {entry.path}")
    if (
        recipe.distributed.accelerate_config is not None
        and not recipe.distributed.accelerate_config.is_file()
    ):
        raise UserError(
            f"{source}: distributed.accelerate_config not found: {recipe.distributed.accelerate_config}"
        )
    resume = recipe.output.resume
    if resume not in ("auto", "never") and not Path(resume).is_dir():
        raise UserError(f"{source}: output.resume checkpoint folder not found: {resume}")


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override and validate a recipe file; raises UserError on any problem."""
    path = Path(path).expanduser()
    data, lines = _read_yaml(path)
    for assignment in overrides:
        apply_override(data, assignment)
        lines[tuple(assignment.partition("=")[0].strip().split("."))] = f"--set {assignment}"
    return validate_recipe(data, path.resolve().parent, source=str(path), lines=lines)
