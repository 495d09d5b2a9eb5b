"""The schema read as data: every key of every section with its type, default, limits and description.

One walk over the pydantic models, so the recipe reference (`scripts/make_docs.py` writes
docs/recipe-reference.md) and the starter recipe (`liger init`) say what the schema says, never prose
kept beside it. A key's description is its field's docstring (`use_attribute_docstrings`, base.py).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

_LIMITS = {  # constraint -> (its attribute, how to say it)
    annotated_types.Ge: ("ge", ">= {}"),
    annotated_types.Gt: ("gt", "> {}"),
    annotated_types.Le: ("le", "<= {}"),
    annotated_types.Lt: ("lt", "< {}"),
    annotated_types.MinLen: ("min_length", "at least {} item(s)"),
}


@dataclass(frozen=True)
class Key:
    """One key of a section, as the schema defines it."""

    name: str
    type: str
    """The type in words: `int`, `float or null`, one of the allowed values, a section."""
    allowed: tuple[Any, ...] | None
    """The allowed values when the type is a fixed set (a Literal), else None."""
    limits: str
    """Bounds such as `>= 1`, joined by commas; empty when there are none."""
    default: Any
    """The default value; `REQUIRED` when the key must be given; a section's own defaults for a section."""
    description: str
    """The field's description on one line ('' when it has none)."""
    section: type[BaseModel] | None
    """The section model when the key is a section (or a list of entries) of its own."""


REQUIRED = object()


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel a key holds, directly, optionally or as a list of entries."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_of(arg)
        if found is not None:
            return found
    return None


def type_name(annotation: Any) -> str:
    """A type as a recipe author reads it."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = []
        for arg in args:
            name = "null" if arg is type(None) else type_name(arg)
            if name not in names:
                names.append(name)
        return " or ".join(names)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is Path:
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "entry"  # a section of its own where it is the whole type (keys() says so)
    return getattr(annotation, "__name__", str(annotation))


def _allowed(annotation: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _allowed(arg)
            if found is not None:
                return found
    return None


def _limits(metadata: list[Any]) -> str:
    said = []
    for item in metadata:
        for kind, (attribute, words) in _LIMITS.items():
            if isinstance(item, kind):
                said.append(words.format(getattr(item, attribute)))
    return ", ".join(said)


def keys(section: type[BaseModel]) -> list[Key]:
    """Every key of a section, in the schema's order."""
    found = []
    for name, field in section.model_fields.items():
        inner = _section_of(field.annotation)
        if field.default_factory is not None:
            default = field.default_factory()
        elif field.default is PydanticUndefined:
            default = REQUIRED
        else:
            default = field.default
        found.append(
            Key(
                name=name,
                type="section" if inner is field.annotation else type_name(field.annotation),
                allowed=_allowed(field.annotation),
                limits=_limits(field.metadata),
                default=default,
                description=_one_line(field.description),
                section=inner,
            )
        )
    return found


def section_doc(section: type[BaseModel]) -> str:
    """A section's own docstring, on one line."""
    return _one_line(section.__doc__)


def as_yaml(value: Any) -> str:
    """A value written as a recipe writes it, on one line: `null`, `auto`, `[q_proj, v_proj]`, `{}`."""
    if isinstance(value, Path):
        value = str(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()
