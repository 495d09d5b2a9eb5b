"""What the model may call in a multi-turn run: `rl.tools` (plain functions) or `rl.environment` (a class,
one instance per trajectory, built from its prompt row's other fields; its public methods are the tools).

They run in processes of their own (`liger_cli.generate.tool_pool`); here they are loaded once to be
described and checked. The model learns of the tools through the chat template's own `tools=` argument, with JSON schemas
made by transformers' `get_json_schema` from each function's signature and docstring, so the
prompts a run trains on are the prompts `liger chat --tools` shows. Everything that is the user's
code going wrong (a file that does not import, a function without a describable signature, a
constructor that raises) is a ToolError (exit 2) naming the function or class and, for an
environment, the prompt row.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

from liger_cli.errors import UserError
from liger_cli.user_code import load_object, said


class ToolError(UserError):
    """The user's tools or environment cannot be loaded, described or built."""


@dataclass(frozen=True)
class ToolSet:
    schemas: list[dict]
    """Each tool's JSON schema, in the order given (an environment's: its methods' order)."""
    functions: dict[str, Callable]
    """Plain tools by name (empty with an environment)."""
    environment: type | None = None
    sources: tuple[str, ...] = ()
    """What the recipe named: the environment's spec, or each tool's (the tool processes load these)."""

    @property
    def spec(self) -> str:
        return ", ".join(self.sources)


def load_tools(rl) -> ToolSet | None:
    """The recipe's tools, loaded and described; None for a run without tools."""
    if rl is None or not (rl.tools or rl.environment):
        return None
    if rl.environment:
        cls = load_object(rl.environment, "rl.environment", ToolError, kind="class")
        if not isinstance(cls, type):
            raise ToolError(
                f"rl.environment: {rl.environment}: not a class (its public methods are the tools)"
            )
        names = public_methods(cls)
        if not names:
            raise ToolError(f"rl.environment: {rl.environment}: {cls.__name__} has no public method to call")
        bound = {name: types.MethodType(getattr(cls, name), object()) for name in names}  # self left out
        return ToolSet(
            [_schema(f, rl.environment, name) for name, f in bound.items()], {}, cls, (rl.environment,)
        )
    functions: dict[str, Callable] = {}
    for spec in rl.tools:
        function = load_object(spec, "rl.tools", ToolError)
        if not callable(function) or isinstance(function, type):
            raise ToolError(f"rl.tools: {spec}: not a function")
        name = getattr(function, "__name__", spec.rpartition(":")[2])
        if name in functions:
            raise ToolError(f"rl.tools: {spec}: a second tool named {name}; tool names must differ")
        functions[name] = function
    schemas = [_schema(f, spec, name) for spec, (name, f) in zip(rl.tools, functions.items(), strict=True)]
    return ToolSet(schemas, functions, None, tuple(rl.tools))


def tool_schemas(rl) -> list[dict] | None:
    """The schemas a run's prompts are rendered with (None without tools)."""
    tools = load_tools(rl)
    return tools.schemas if tools is not None else None


def public_methods(cls: type) -> list[str]:
    """The methods a class defines or inherits (below `object`) whose names do not start with _."""
    return [
        name
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and inspect.isfunction(member) and not hasattr(object, name)
    ]


def _schema(function: Callable, spec: str, name: str) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as err:  # noqa: BLE001 - transformers' own reason, passed on
        raise ToolError(
            f"{spec}: tool {name} cannot be described to the model: {said(err)} (give every argument a type "
            "hint and the docstring an Args: section describing each)"
        ) from None


def check_template_takes_tools(tokenizer, schemas: list[dict]) -> None:
    """A chat template that ignores `tools=` would train a model that cannot know its tools: refused."""
    from liger_cli.data.chat import render

    if not getattr(tokenizer, "chat_template", None):
        raise ToolError("rl.tools: the tokenizer has no chat template; tools are described through one")
    probe = [{"role": "user", "content": "hi"}]
    try:
        with_tools = render(tokenizer, probe, schemas, generation_prompt=True)
    except ValueError as err:
        raise ToolError(f"rl.tools: the chat template fails when given tools: {err}") from None
    if with_tools == render(tokenizer, probe, None, generation_prompt=True):
        raise ToolError(
            "rl.tools: the chat template takes no tools (it renders the same with and without tools=): use a "
            "model or model.tokenizer whose template describes tools (Qwen2.5, Qwen3, SmolLM3, Hermes, ...)"
        )
