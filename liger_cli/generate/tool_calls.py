"""A model turn's tool calls: found in what it sampled, run, and their results put in a fixed order.

Parsing uses the tokenizer's own response schema (`parse_response`, transformers' `response_template`)
where it has one, else the Hermes convention most open tool-calling models share (Qwen2.5, Qwen3,
SmolLM3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

The model's mistakes are data, never errors: a call that is not JSON, names no tool or an unknown
one, gives arguments the function does not take, or a tool that raises, all become an error text
that goes back to the model as that call's result (and count in `tool/errors`). The calls run in
processes of their own (`tool_pool.py`), which also turn a tool that hangs or crashes into such a result.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

from liger_cli.user_code import said

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict
    error: str | None = None
    """Why the call cannot be made as written (the model's mistake), or None."""


@dataclass(frozen=True)
class Result:
    name: str
    content: str
    error: bool
    failure: str | None = None
    """"timeout" or "crash" when the tool's process had to be stopped or died (`tool_pool`)."""


def parse_turn(text: str, tokenizer=None, prefix: str = "") -> tuple[str, list[Call]]:
    """(the turn's text before its calls, its calls); no calls is a final answer."""
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            parsed = tokenizer.parse_response(text, prefix=prefix)
        except Exception as err:  # noqa: BLE001 - output the schema does not fit: the model's mistake
            return text, [Call("", {}, f"the reply could not be parsed: {said(err)}")]
        return parsed.get("content") or "", [_call(c) for c in parsed.get("tool_calls") or []]
    if OPEN not in text:
        return text, []
    content, *parts = text.split(OPEN)
    calls = []
    for part in parts:
        if CLOSE not in part:
            calls.append(Call("", {}, f"a {OPEN} without its {CLOSE}"))
            continue
        body = part.split(CLOSE, 1)[0].strip()
        try:
            found = json.loads(body)
        except ValueError as err:
            calls.append(Call("", {}, f"the call is not JSON ({err})"))
            continue
        calls.append(_call(found))
    return content, calls


def _call(found) -> Call:
    """A parsed call ({"name", "arguments"} or OpenAI's {"function": {...}}) checked for shape."""
    if isinstance(found, dict) and isinstance(found.get("function"), dict):
        found = found["function"]
    if not isinstance(found, dict) or not isinstance(found.get("name"), str) or not found["name"]:
        return Call("", {}, 'a call needs {"name": "tool", "arguments": {...}}')
    arguments = found.get("arguments", {})
    if isinstance(arguments, str):  # some templates and models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return Call(found["name"], {}, "its arguments are not a JSON object")
    if not isinstance(arguments, dict):
        return Call(found["name"], {}, "its arguments are not a JSON object")
    return Call(found["name"], arguments)


def run_one(call: Call, tools: dict[str, Callable]) -> Result:
    """One call's result: the tool's return value as text, or an error text for the model to read."""
    if call.error is not None:
        return Result(call.name, f"error: {call.error}", True)
    function = tools.get(call.name)
    if function is None:
        return Result(
            call.name, f"error: unknown tool {call.name!r}; the tools are: {', '.join(tools)}", True
        )
    try:
        inspect.signature(function).bind(**call.arguments)
    except TypeError as err:
        return Result(call.name, f"error: {call.name}: {err}", True)
    try:
        value = function(**call.arguments)
    except MemoryError:  # out of its process's memory cap: the process ends (tool_worker)
        raise
    except Exception as err:  # noqa: BLE001 - a tool failing on the model's arguments: the model reads why
        return Result(call.name, f"error: {call.name} raised {said(err)}", True)
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, default=str)
    return Result(call.name, value, False)
