"""The recipe's `rl.vllm` section (rl.engine vllm: the server, its own or another's) and what a run's
server must serve: the run's base model, dtype, length and adapters; what it cannot serve is refused."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from liger_cli.recipe.base import _Section


class VllmSection(_Section):
    """rl.engine vllm's server."""

    server: str | None = None
    """URL of a running `liger vllm-serve` (another GPU, another node); null: the run starts its own on
    127.0.0.1 and stops it when it ends."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """The share of a GPU's memory vLLM may take beside training (its own server)."""
    max_logp_diff: float | None = Field(None, gt=0)
    """The bound on the mean |sampler log-prob - trainer log-prob| of a step's sampled tokens past which
    the run stops, naming a stale engine: default 1e-3 for an fp32 model (a correct update measures about
    1e-5), 5e-2 otherwise."""
    timeout: float = Field(300.0, gt=0)
    """Seconds the server may take to answer one request (a whole completion, or loading an update) before
    the run stops, naming a hung server; also how long a run waits for rl.vllm.server to come up."""

    @field_validator("server")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r}: give the server's URL, e.g. http://10.0.0.2:8000")
        return value


def check_vllm(recipe) -> None:
    """What the vllm engine cannot serve yet is refused before anything loads."""
    if recipe.model.path is None:
        raise ValueError(
            "rl.engine vllm serves a model folder: set model.path (model.config builds random weights)"
        )
    if recipe.model.quantize != "none":
        raise ValueError(
            f"rl.engine vllm with model.quantize {recipe.model.quantize}: the server would sample from the "
            "unquantized base, not the policy being trained; use rl.engine transformers for a 4-bit base"
        )
    if recipe.adapter.type == "dora":
        raise ValueError(
            "rl.engine vllm with adapter.type dora: vLLM serves LoRA adapters only (no DoRA magnitudes), so it "
            "would sample from another policy; use adapter.type lora, or rl.engine transformers"
        )


def served_dtype(recipe) -> str:
    """The dtype a vLLM server of the run's model serves: model.dtype as liger loads it (auto: float32)."""
    return "float32" if recipe.model.dtype == "auto" else recipe.model.dtype


def vllm_server_options(recipe) -> dict:
    """What a server for this run serves (`liger vllm-serve`'s options): the run's base model, its dtype
    (auto: float32, as liger loads it), data.max_seq_len positions and adapters up to adapter.r."""
    lora = recipe.adapter.type != "none"
    return {"model": Path(recipe.model.path).resolve(), "dtype": served_dtype(recipe), "max_model_len": recipe.data.max_seq_len,
            "max_lora_rank": recipe.adapter.r if lora else 0}  # fmt: skip
