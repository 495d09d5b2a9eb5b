"""What `inspect-wrap` reports: the FSDP units of a plan, their sizes, and the warnings (data only)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ROOT = "(root)"  # how reports name the root unit


@dataclass(frozen=True)
class WrapWarning:
    """A plan that will fail, or cost more than it must; `code` is stable, `message` says the fix."""

    code: str
    message: str


@dataclass
class Unit:
    """One FSDP unit: its parameters are gathered together and sharded together."""

    path: str  # module path; "a + b" for a group accelerate builds from several modules
    cls: str
    params: int
    trainable_params: int
    bytes: int
    bytes_per_rank: int
    reason: str  # "wrap_class" | "accelerate_embeddings" | "accelerate_output"


@dataclass
class Part:
    """One part of a vision-language model (vision tower, language model, ...) and how much of it trains."""

    name: str
    path: str
    params: int
    trainable_params: int


@dataclass
class WrapReport:
    """Everything `inspect-wrap` shows; `to_json()` is the machine-readable form, `render.py` the text."""

    model_type: str
    backend: str
    num_processes: int
    dtype: str
    wrap_classes: list[str]
    wrap_source: str
    units: list[Unit]
    root_params: int
    root_trainable_params: int
    root_bytes: int
    root_modules: list[str]
    total_params: int
    trainable_params: int
    total_bytes: int
    bytes_per_rank: int
    peak_bytes_per_rank: int
    lm_head_unit: str | None
    embed_unit: str | None
    final_norm_unit: str | None
    tied_embeddings: bool
    warnings: list[WrapWarning]
    parts: list[Part] = field(default_factory=list)  # a VLM's parts; empty for a text model
    mixed_units: list[str] = field(default_factory=list)  # units holding frozen and trainable parameters
    dropped_no_split: list[str] = field(default_factory=list)  # `_no_split_modules` names the model lacks
    added_vision: list[str] = field(default_factory=list)  # VLM classes liger added to the wrap classes
    kept_whole: list[str] = field(
        default_factory=list
    )  # classes not wrapped: they would split a shared weight

    def to_json(self) -> dict:
        data = asdict(self)
        for unit in data["units"]:
            unit["class"] = unit.pop("cls")
        return data


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def format_size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps the number at or above 1 (readable at any model size)."""
    size, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
