"""`liger init`: a commented starter recipe that `liger train --dry-run` accepts as written.

Every key of every section that applies is written at its default, with the schema's own description
above it (`describe.py`), so the file is a reference to edit rather than a blank page. A key that the
chosen objective refuses even at its default (`preference.gamma` with dpo, `model.quantize_double`
without a 4-bit base) is written commented out, saying so. The text is validated as `liger train`
would before anything is written, and an existing file is never replaced.
"""

from __future__ import annotations

import copy
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from liger_cli.errors import UserError
from liger_cli.recipe import describe
from liger_cli.recipe.data_section import _HUB_NAME
from liger_cli.recipe.load import validate_recipe
from liger_cli.recipe.schema import Recipe

OBJECTIVE_FORMAT = {
    "dpo": "preference",
    "simpo": "preference",
    "orpo": "preference",
    "reward": "preference",
    "kto": "unpaired",
    "grpo": "prompt",
    "distill": "prompt",
}
FIRST_ROW_FORMAT = (("messages", "chat"), ("instruction", "instruction"), ("text", "text"))
SKIPPED = {
    "preference": ("dpo", "simpo", "orpo"),
    "kto": ("kto",),
    "reward": ("reward",),
    "rl": ("grpo", "distill"),
    "distill": ("distill",),
}  # sections only some objectives take


def _choices(section: type[BaseModel], key: str) -> tuple[Any, ...]:
    return next(k.allowed for k in describe.keys(section) if k.name == key)


def _relative(path: Path, folder: Path) -> str:
    """A path as the recipe holds it: relative to the recipe's folder when it lies inside it, else absolute."""
    path, folder = path.resolve(), folder.resolve()
    return os.path.relpath(path, folder) if path.is_relative_to(folder) else str(path)


def _data_source(data: str, folder: Path) -> str:
    if Path(data).expanduser().exists():
        return _relative(Path(data).expanduser(), folder)
    if _HUB_NAME.fullmatch(data):
        return data  # a Hub dataset name, looked up when the data is read
    raise UserError(
        f"--data {data}: no such file or folder; give a local data file, folder or Hub dataset name"
    )


def _sft_format(data: str) -> str:
    """An SFT recipe's data.format, read off the first row of a local JSON-lines file (else `text`)."""
    path = Path(data).expanduser()
    if path.suffix != ".jsonl" or not path.is_file():
        return "text"
    with path.open() as lines:
        first = next((line for line in lines if line.strip()), "{}")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return "text"  # `liger data` names the line
    return next((fmt for key, fmt in FIRST_ROW_FORMAT if isinstance(row, dict) and key in row), "text")


def _chosen(file: Path, model: Path, data: str, objective: str, quantize: str, backend: str) -> dict:
    """The values `liger init` sets; every other key keeps its default."""
    folder = file.parent
    chosen: dict[str, dict[str, Any]] = {
        "model": {"path": _relative(model.expanduser(), folder)},
        "data": {
            "train": _data_source(data, folder),
            "format": OBJECTIVE_FORMAT.get(objective) or _sft_format(data),
        },
        "training": {"objective": objective},
        "output": {"dir": f"runs/{file.stem}"},
    }
    if quantize != "none":
        chosen["model"]["quantize"] = quantize
    if backend != "none":
        chosen["distributed"] = {"backend": backend}
    if objective == "grpo":
        chosen["rl"] = {"rewards": [{"function": "liger_cli.rewards:exact_match"}]}
    if objective == "distill":  # a stand-in that loads: the student itself (set your teacher)
        chosen["distill"] = {"teacher": chosen["model"]["path"]}
        chosen["rl"] = {}
    return chosen


def _accepts(data: dict, folder: Path) -> str | None:
    """None when the schema accepts `data`, else its first complaint."""
    try:
        Recipe.model_validate(data, context={"base_dir": folder})
    except ValidationError as err:
        return err.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
    return None


def _comment(key: describe.Key, indent: str) -> list[str]:
    said = key.description
    if key.allowed is not None and len(key.allowed) > 1:
        said += " One of: " + ", ".join(str(a) for a in key.allowed) + "."
    elif key.limits:
        said += f" ({key.limits})"
    return textwrap.wrap(
        said,
        100,
        initial_indent=f"{indent}# ",
        subsequent_indent=f"{indent}# ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _section(section, chosen: dict, data: dict, path: list[str], folder: Path) -> list[str]:
    """The YAML lines of one section, filling `data` (the recipe so far) as it goes."""
    indent = "  " * len(path)
    lines = []
    node = data
    for part in path:
        node = node.setdefault(part, {})
    for key in describe.keys(section):
        if key.type == "section":  # a nested section (distributed.fsdp): its own keys, indented
            lines += [f"{indent}# {describe.section_doc(key.section)}", f"{indent}{key.name}:"]
            lines += _section(key.section, chosen.get(key.name, {}), data, [*path, key.name], folder)
            continue
        value = chosen.get(key.name, key.default)
        lines += _comment(key, indent)
        node[key.name] = value
        refused = _accepts(data, folder)
        if refused is None:
            lines.append(f"{indent}{key.name}: {describe.as_yaml(value)}")
        else:  # this objective refuses the key even at its default: shown, not set
            del node[key.name]
            lines.append(f"{indent}# {key.name}: {describe.as_yaml(value)}    # not set here: {refused}")
    return lines


def starter_text(file: Path, model: Path, data: str, objective: str, quantize: str, backend: str) -> str:
    """The recipe `liger init` writes, validated as `liger train` validates it."""
    training = Recipe.model_fields["training"].annotation
    model_section = Recipe.model_fields["model"].annotation
    distributed = Recipe.model_fields["distributed"].annotation
    for option, value, choices in (
        ("--objective", objective, _choices(training, "objective")),
        ("--quantize", quantize, _choices(model_section, "quantize")),
        ("--backend", backend, _choices(distributed, "backend")),
    ):
        if value not in choices:
            raise UserError(f"{option} {value}: choose one of {', '.join(map(str, choices))}")
    chosen = _chosen(file, model, data, objective, quantize, backend)
    folder = file.parent
    lines = [
        f"# A starter recipe written by `liger init` ({objective}). Every key is at its default unless",
        "# liger init set it; each comment is the key's description from the schema",
        "# (docs/recipe-reference.md). Check it with: liger train " + file.name + " --dry-run",
    ]
    if objective == "grpo":
        lines.append(
            "# rl.rewards: exact_match gives 1.0 where a completion equals the row's `answer` field."
        )
    if objective == "distill":
        lines.append(
            "# distill.teacher: the student's own folder stands in; set your teacher (same tokenizer)."
        )
    recipe = copy.deepcopy(chosen)  # what is set so far: each default is added only where it is accepted
    refused = _accepts(recipe, folder)
    if refused is not None:
        raise UserError(f"liger init: {refused}")
    for key in describe.keys(Recipe):
        if objective not in SKIPPED.get(key.name, (objective,)):
            continue
        lines += ["", f"# {describe.section_doc(key.section)}", f"{key.name}:"]
        lines += _section(key.section, chosen.get(key.name, {}), recipe, [key.name], folder)
    text = "\n".join(lines) + "\n"
    validate_recipe(yaml.safe_load(text), folder.resolve(), source=str(file))
    return text


def write_starter(file: Path, model: Path, data: str, objective: str, quantize: str, backend: str) -> None:
    """Write the starter recipe to `file`; an existing file is refused, never replaced."""
    if file.exists():
        raise UserError(f"{file} exists; liger init never overwrites: give another FILE, or move it away")
    if not file.parent.is_dir():
        raise UserError(f"{file.parent} is not a folder; create it first, or give FILE in an existing folder")
    text = starter_text(file, model, data, objective, quantize, backend)
    with file.open("x") as out:  # "x": fails rather than replace a file made in the meantime
        out.write(text)
