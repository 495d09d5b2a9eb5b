"""The user's own Python named by a recipe (`file.py:name` or `package.module:name`): reward functions,
tools and environments are loaded here, and each failure is a one-line UserError naming the spec."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from liger_cli.errors import UserError


def load_object(spec: str, key: str, error: type[UserError] = UserError, kind: str = "function"):
    """The object `spec` names. `key` is the recipe key it came from (`rl.rewards`, `rl.tools`), for errors."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise error(f"{key}: {spec}: no such file {path} (paths are relative to the recipe)")
        module_name = "liger_user_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        module = sys.modules.get(module_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            try:
                sys.modules[module_name] = module
                loader.loader.exec_module(module)
            except Exception as err:  # noqa: BLE001 - the user's file: any failure is theirs to fix
                sys.modules.pop(module_name, None)
                raise error(f"{key}: {spec}: importing {path} failed: {said(err)}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as err:  # noqa: BLE001
            raise error(f"{key}: {spec}: cannot import {where}: {said(err)}") from None
    found = getattr(module, name, None)
    if found is None:
        raise error(f"{key}: {spec}: {where} has no {kind} {name}")
    return found


def said(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
