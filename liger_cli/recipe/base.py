"""What every recipe section shares: no unknown keys, and paths anchored at the recipe's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo


def _resolve(value: Path | None, info: ValidationInfo) -> Path | None:
    """Anchor a relative path at the recipe's folder (passed as validation context)."""
    if value is None:
        return None
    value = value.expanduser()
    base = (info.context or {}).get("base_dir")
    if not value.is_absolute() and base is not None:
        value = Path(base) / value
    return Path(value).resolve() if value.is_absolute() else value


RelPath = Annotated[Path, AfterValidator(_resolve)]


class _Section(BaseModel):
    # A field's docstring is its description: docs/recipe-reference.md and `liger init` print it.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
