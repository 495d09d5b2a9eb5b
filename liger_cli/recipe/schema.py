"""The recipe's schema: every section and key, its type, default and limits (pydantic models).

Every key is checked (`extra="forbid"`); `recipe.py` reads the YAML file, applies `--set`
overrides and turns validation errors into one line naming the key and its line.

Relative paths resolve against the recipe file's folder, so a recipe works from any directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from liger_cli.recipe.base import RelPath, _Section
from liger_cli.recipe.data_section import DataSection
from liger_cli.recipe.distributed_section import SPLIT_OBJECTIVES, DistributedSection, split_names
from liger_cli.recipe.kto_section import KtoSection, check_kto
from liger_cli.recipe.logging_section import LoggingSection
from liger_cli.recipe.preference_section import PreferenceSection
from liger_cli.recipe.reward_section import RewardSection, check_reward
from liger_cli.recipe.rl_section import DistillSection, RLSection, check_rl, dump_online


class ModelSection(_Section):
    """The base model: where it is, how it loads, and whether its linear layers load in 4 bits (QLoRA)."""

    path: RelPath | None = None
    """A local Hugging Face model folder (config.json + weights)."""
    config: RelPath | None = None
    """A config.json to build the model from scratch (random initialisation)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The weights' dtype (and a 4-bit base's compute dtype); auto: float32, mixed precision is training.precision."""
    attn_implementation: str | None = None
    """The attention implementation passed to transformers, e.g. sdpa or eager (default: transformers' choice)."""
    trust_remote_code: bool = False
    """Run the model's own code from its folder (off unless you say so)."""
    tokenizer: RelPath | None = None
    """A tokenizer folder (default: model.path; required with model.config)."""
    load_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to from_pretrained untouched (see docs/field-failures.md#zero-3-loading-drops-an-argument)."""
    quantize: Literal["none", "nf4", "fp4"] = "none"
    """QLoRA: load the base's linear layers in 4 bits through bitsandbytes (compute in model.dtype)."""
    quantize_double: bool = True
    """Quantize the 4-bit blocks' scales too (double quantization); only with quantize nf4/fp4."""
    vision: Literal["frozen", "lora", "full"] = "frozen"
    """A vision-language model's vision tower: frozen, lora (the adapter goes into its linear layers too;
    needs adapter.type lora or dora) or full (all its weights train). Only for a vision-language model."""
    train_projector: bool | None = None
    """A vision-language model's multimodal projector (between vision tower and language model) trains
    in full; default: true under full fine-tuning (adapter.type none), false with an adapter."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        twice = sorted(
            set(self.load_kwargs) & {"dtype", "torch_dtype", "trust_remote_code", "attn_implementation"}
        )
        if twice:
            raise ValueError(
                f"model.load_kwargs sets {', '.join(twice)}, which the model section already passes: "
                "set it in the model section (model.dtype, model.trust_remote_code, model.attn_implementation)"
            )
        if (self.path is None) == (self.config is None):
            raise ValueError(
                "set exactly one of model.path (a local model folder) or model.config (a config.json)"
            )
        if "quantization_config" in self.load_kwargs:
            raise ValueError(
                "model.load_kwargs sets quantization_config: set model.quantize (nf4 or fp4) and "
                "model.quantize_double instead"
            )
        if self.quantize == "none" and "quantize_double" in self.model_fields_set:
            raise ValueError("model.quantize_double applies with model.quantize nf4 or fp4; remove it")
        if self.quantize != "none" and self.config is not None:
            raise ValueError(
                f"model.quantize {self.quantize} quantizes pretrained weights: set model.path to a model "
                "folder (model.config builds random weights), or set model.quantize: none"
            )
        if self.config is not None and self.tokenizer is None:
            raise ValueError(
                "model.config builds a model from scratch and has no tokenizer: set model.tokenizer"
            )
        return self


class AdapterSection(_Section):
    """What trains: a LoRA or DoRA adapter on the frozen base, or the whole model (type none)."""

    type: Literal["lora", "dora", "none"] = "lora"
    """lora or dora adapters on a frozen base, or none: full fine-tuning."""
    r: int = Field(16, ge=1)
    """The adapter's rank."""
    alpha: float = Field(32.0, gt=0)
    """The adapter's scale numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    target_modules: str | list[str] = "all-linear"
    """The modules that get an adapter: all-linear, or a list of names such as [q_proj, v_proj]."""
    init: RelPath | None = None
    """Start from this peft adapter folder (e.g. an SFT run's final/), trainable; its own r, alpha,
    dropout and target modules apply (SFT -> DPO -> GRPO chains)."""

    @model_validator(mode="after")
    def _init(self) -> AdapterSection:
        if self.init is None:
            return self
        if self.type == "none":
            raise ValueError(
                "adapter.init starts from an adapter: set adapter.type lora or dora, or remove it"
            )
        if not (self.init / "adapter_config.json").is_file():
            raise ValueError(
                f"adapter.init {self.init}: no adapter_config.json there; give a peft adapter folder"
            )
        set_here = sorted(self.model_fields_set & {"r", "alpha", "dropout", "target_modules"})
        if set_here:
            raise ValueError(
                f"adapter.init takes r, alpha, dropout and target modules from {self.init}; remove adapter."
                f"{', adapter.'.join(set_here)}"
            )
        return self

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, value: Any) -> Any:
        if value == "all-linear":
            return value
        names = split_names(value)
        if not isinstance(names, list):
            raise ValueError(
                f"got {value!r}; use all-linear or a list of module names, for example [q_proj, v_proj]"
            )
        return names


class TrainingSection(_Section):
    """The objective, the run's length, batch, optimizer, schedule, evaluation and precision."""

    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to train (or set epochs; one epoch when neither is set)."""
    epochs: float | None = Field(None, gt=0)
    """Passes over the training data (instead of max_steps)."""
    micro_batch_size: int = Field(1, ge=1)
    """Examples (pairs, prompts) per forward on each process."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches accumulated into one optimizer step."""
    lr: float = Field(2e-4, gt=0)
    """AdamW's peak learning rate."""
    scheduler: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
    ] = "cosine"
    """The learning-rate schedule (transformers' get_scheduler names)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up before the schedule."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's weight decay."""
    max_grad_norm: float | None = Field(1.0, ge=0)
    """Clip the gradient's global norm to this (null: no clipping)."""
    seed: int = 42
    """Seeds the initialisation, the data order, the mixture's draws and sampling."""
    eval_every: int | None = Field(None, ge=1)
    """Evaluate every N steps (and always at the end)."""
    eval_samples: int = Field(0, ge=0)
    """At each evaluation, greedy completions of the first N eval prompts, written to samples.jsonl;
    the share equal to their reference answer is logged as eval_sample_match."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Mixed precision; auto: bf16/fp16 on a GPU, fp32 on a CPU."""
    objective: Literal["sft", "dpo", "simpo", "orpo", "kto", "reward", "grpo", "distill"] = "sft"
    """sft: the causal-LM loss on the learned tokens; dpo, simpo, orpo and reward (a score head): preference
    pairs (data.format preference); kto: labelled completions (data.format unpaired); grpo: online RL on
    prompts (data.format prompt) with the rl section's rewards; distill: on-policy distillation on
    prompts toward the distill section's teacher."""

    @model_validator(mode="after")
    def _one_length(self) -> TrainingSection:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("set only one of training.max_steps and training.epochs")
        return self


class KernelsSection(_Section):
    """Our kernels to patch into the model; each is checked on a tiny twin of it first (check)."""

    rms_norm: bool = True
    """Patch in our RMSNorm kernel."""
    rope: bool = True
    """Patch in our rotary-embedding kernel."""
    swiglu: bool = True
    """Patch in our SwiGLU MLP kernel."""
    cross_entropy: bool = False
    """Our cross-entropy on the logits (mutually exclusive with fused_linear_cross_entropy)."""
    fused_linear_cross_entropy: bool = True
    """The loss computed from lm_head's input, a block at a time: never the full logits."""
    check: bool = True
    """Before training, compare each kernel on a tiny twin of the model and switch off any that disagrees."""

    def requested(self) -> dict[str, bool]:
        """The kernels asked for: name -> on (the `check` switch is not a kernel)."""
        return {name: on for name, on in self.model_dump().items() if name != "check"}

    @model_validator(mode="after")
    def _one_loss(self) -> KernelsSection:
        if self.cross_entropy and self.fused_linear_cross_entropy:
            raise ValueError(
                "kernels.cross_entropy and kernels.fused_linear_cross_entropy are mutually exclusive: "
                "keep fused_linear_cross_entropy (it never builds the full logits) or set it to false"
            )
        return self


class OutputSection(_Section):
    """Where the run writes, how often it checkpoints, and whether it resumes or replaces a previous run."""

    dir: RelPath = Path("runs/default")
    """The run's output folder: final/, checkpoints/, metrics and logs."""
    save_every: int | None = Field(None, ge=1)
    """Save a checkpoint every N steps (and always at the last step)."""
    resume: str = "never"
    """auto (latest complete checkpoint in dir), never, or a checkpoint folder."""
    overwrite: bool = False
    """Replace a previous liger run in dir once the new run starts (otherwise a non-empty dir is an error)."""
    verify: bool = True
    """Reload the final output from disk after the save and compare it with the trained model."""

    @field_validator("resume")
    @classmethod
    def _resume(cls, value: str, info: ValidationInfo) -> str:
        if value in ("auto", "never"):
            return value
        path = Path(value).expanduser()
        base = (info.context or {}).get("base_dir")
        if not path.is_absolute() and base is not None:
            path = Path(base) / path
        return str(path.resolve())


class Recipe(_Section):
    model: ModelSection
    adapter: AdapterSection = Field(default_factory=AdapterSection)
    data: DataSection
    training: TrainingSection = Field(default_factory=TrainingSection)
    kernels: KernelsSection = Field(default_factory=KernelsSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    output: OutputSection = Field(default_factory=OutputSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    preference: PreferenceSection = Field(default_factory=PreferenceSection)
    reward: RewardSection | None = None
    kto: KtoSection = Field(default_factory=KtoSection)
    rl: RLSection | None = None
    distill: DistillSection | None = None

    @model_validator(mode="after")
    def _objective_and_data(self) -> Recipe:
        objective, fmt = self.training.objective, self.data.format
        self._vision_needs()
        online = objective in ("grpo", "distill")
        if online or fmt == "prompt" or self.rl is not None or self.distill is not None:
            check_rl(self)
            return self
        if objective == "kto" or fmt == "unpaired" or "kto" in self.model_fields_set:
            check_kto(self)
        elif objective != "sft" and fmt != "preference":
            raise ValueError(f"training.objective {objective} trains on preference pairs: set data.format: "
                             "preference")  # fmt: skip
        if objective == "sft" and fmt == "preference":
            raise ValueError("data.format preference needs a preference objective: set training.objective to dpo, "
                             "simpo, orpo or reward")  # fmt: skip
        check_reward(self)
        if objective == "sft" and "preference" in self.model_fields_set:
            raise ValueError("the preference section applies to training.objective dpo, simpo or orpo; "
                             "remove it")  # fmt: skip
        if objective not in ("sft", "kto", "reward"):
            self.preference.check(objective)
        self._quantized_needs()
        if self.training.eval_samples:
            self._samples_need()
        d = self.distributed
        if d.backend == "fsdp1" and d.fsdp.sharding == "no_shard" and self.adapter.type != "none":
            raise ValueError(
                "distributed.fsdp.sharding no_shard with an adapter fails at FSDP-1's final save (its full "
                "state dict misses the base's weights): use distributed.backend ddp, which shards nothing "
                "either, or sharding full"
            )
        if d.sequence_parallel > 1:
            self._sequence_parallel_needs()
        if self.data.streaming and self.training.max_steps is None:
            raise ValueError(
                "data.streaming needs training.max_steps (a stream has no known length, so no epochs): "
                "set training.max_steps and remove training.epochs"
            )
        return self

    def _sequence_parallel_needs(self) -> None:
        """What the split serves so far (docs/distributed.md#long-sequences): the training passes of
        SPLIT_OBJECTIVES, with attention that takes a mask over the whole sequence (eager or sdpa)."""
        n, objective = self.distributed.sequence_parallel, self.training.objective
        attention = self.model.attn_implementation
        if objective not in SPLIT_OBJECTIVES:
            raise ValueError(
                f"distributed.sequence_parallel {n}: training.objective {objective} is not split yet "
                f"({', '.join(SPLIT_OBJECTIVES)} are); remove distributed.sequence_parallel"
            )
        if attention not in (None, "eager", "sdpa"):
            raise ValueError(
                f"distributed.sequence_parallel {n} cannot serve model.attn_implementation {attention} (the "
                "split attends over the whole sequence with a mask it builds): set it to sdpa or eager"
            )

    def _samples_need(self) -> None:
        """Samples complete eval prompts: an eval set whose rows have a prompt before the answer."""
        if self.data.eval is None and self.data.eval_fraction is None:
            raise ValueError(
                "training.eval_samples completes eval prompts: set data.eval or data.eval_fraction"
            )
        if self.data.format == "text":
            raise ValueError(
                "training.eval_samples needs prompts, and format text rows have none (everything is learned): "
                "use data.format instruction or chat, or remove training.eval_samples"
            )

    def _vision_needs(self) -> None:
        """`model.vision: lora` needs an adapter; 4-bit weights train through it only; an adapter.init brings
        its own targets and trained modules."""
        m, a = self.model, self.adapter
        if m.vision == "lora" and a.type == "none":
            raise ValueError("model.vision lora puts the adapter into the vision tower, but adapter.type is none: "
                             "set adapter.type lora (or dora), or model.vision full")  # fmt: skip
        if m.quantize != "none" and (m.vision == "full" or m.train_projector):
            raise ValueError(f"model.quantize {m.quantize} loads the linear layers in 4 bits, which cannot train in "
                             "full: set model.vision frozen or lora and model.train_projector false")  # fmt: skip
        if a.init is not None and (m.vision != "frozen" or m.train_projector is not None):
            raise ValueError("adapter.init brings its own targets and trained modules: remove model.vision "
                             "and model.train_projector")  # fmt: skip

    def _quantized_needs(self) -> None:
        """A 4-bit base trains only through an adapter, and only where its weights can be placed."""
        q, backend = self.model.quantize, self.distributed.backend  # every backend: tests/test_qlora.py
        if q == "none":
            return
        if self.adapter.type == "none":
            raise ValueError(
                f"model.quantize {q} freezes the base in 4 bits, so full fine-tuning (adapter.type none) "
                "cannot train it: set adapter.type lora (QLoRA) or dora, or set model.quantize: none"
            )
        if backend in ("fsdp1", "fsdp2") and self.distributed.fsdp.cpu_offload:
            raise ValueError(
                f"model.quantize {q} with distributed.fsdp.cpu_offload is not supported: offloading 4-bit "
                "weights is untested (it needs a GPU); set distributed.fsdp.cpu_offload: false (the 4-bit "
                "base is already about a quarter of bf16), or model.quantize: none"
            )

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json")
        dump_online(self, data)
        if data["reward"] is None:  # optional, left out when not given
            del data["reward"]
        if self.training.objective != "kto":  # only kto's recipes hold it
            del data["kto"]
        if self.training.objective in ("sft", "grpo", "distill", "kto", "reward"):
            del data["preference"]  # sft recipes read as they always did
        else:  # the options the objective honours, resolved; the others would be refused on reload
            applies = self.preference.applies(self.training.objective)
            data["preference"] = {k: v for k, v in data["preference"].items() if applies[k]}
        if self.adapter.init is not None:  # the starting adapter's own settings apply: not repeated here
            data["adapter"] = {k: v for k, v in data["adapter"].items() if k in ("type", "init")}
        if self.model.quantize == "none":
            del data["model"]["quantize_double"]  # it applies to a 4-bit base only: the file must load again
        return yaml.safe_dump(data, sort_keys=False)
