"""The recipe's `rl` section: online RL (`training.objective: grpo`) and its variants (DAPO, Dr. GRPO,
GSPO, CISPO); and the `distill` section: on-policy distillation (`training.objective: distill`), which
samples with the rl section's sampling keys and nothing else of it.

The names are fixed by what users of other RL trainers know; the math of each option is one line in
docs/rl.md and in `liger_kernels.grpo`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationInfo, field_validator, model_validator

from liger_cli.recipe.base import RelPath, _resolve, _Section
from liger_cli.recipe.vllm_section import VllmSection, check_vllm

IMPORTANCE_CAP = 2.0
"""importance_sampling_cap's default: a weight is cut only where the trainer finds a token (or sequence)
twice as likely as the sampler did, far past what a sampler with the same weights produces."""


class RewardSpec(_Section):
    """One reward: a function or a trained reward model, and its weight."""

    function: str | None = None
    """`file.py:name` (a file beside the recipe, or a path) or `package.module:name`."""
    model: RelPath | None = None
    """A reward model: the output.dir of a run with training.objective reward; it scores prompt + completion."""
    weight: float = 1.0
    """The reward's weight in the summed reward."""

    @field_validator("function")
    @classmethod
    def _spec(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else code_spec(value, info, "function")

    @model_validator(mode="after")
    def _one(self) -> RewardSpec:
        if (self.function is None) == (self.model is None):
            raise ValueError(
                "each rl.rewards entry gives one of function (file.py:name) or model (a reward run's output.dir)"
            )
        if self.model is not None:
            reward_run_final(self.model, "rl.rewards model")
        return self


def reward_run_final(path: Path, what: str) -> Path:
    """The final/ folder of a finished reward-model run (`path` the run folder or its final/), found by
    reading its recipe.yaml, never its weights; a one-line ValueError naming `what` and the fix otherwise."""
    path = Path(path).expanduser().resolve()
    run = path.parent if path.name == "final" else path
    fix = "give the output.dir of a finished run with training.objective: reward"
    if not (run / "recipe.yaml").is_file():
        raise ValueError(f"{what} {path}: not a liger run folder (no recipe.yaml); {fix}")
    try:
        recipe = yaml.safe_load((run / "recipe.yaml").read_text()) or {}
        objective = (recipe.get("training") or {}).get("objective", "sft")
    except (yaml.YAMLError, AttributeError) as err:
        raise ValueError(
            f"{what} {run / 'recipe.yaml'} is not a liger run's recipe ({type(err).__name__}); {fix}"
        ) from None
    if objective != "reward":
        raise ValueError(f"{what} {run}: a {objective} run, not a reward model; {fix}")
    final = run / "final"
    if not any((final / name).is_file() for name in ("adapter_config.json", "config.json")):
        raise ValueError(f"{what} {run}: no final model in {final} (the run has not finished); {fix}")
    return final


def code_spec(value: str, info: ValidationInfo, what: str) -> str:
    """`file.py:name` or `package.module:name`; a file is anchored at the recipe's folder, like every path."""
    where, _, name = value.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(
            f"{value!r}: write file.py:{what} (a file beside the recipe) or package.module:{what}"
        )
    if where.endswith(".py"):
        where = str(_resolve(Path(where), info))
    return f"{where}:{name}"


class RLSection(_Section):
    """Online RL (training.objective grpo): sampling, the loss variant and the reward functions; distill
    uses its sampling keys only."""

    num_generations: int = Field(8, ge=1)
    """G completions sampled per prompt (grpo: a group of at least 2, its rewards compared with each other)."""
    max_new_tokens: int = Field(256, ge=1)
    """Most tokens sampled per completion."""
    temperature: float = Field(1.0, gt=0)
    """The sampling temperature; the trainer's log-probs are taken at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Sample from the smallest set of tokens holding this much probability."""
    top_k: int = Field(0, ge=0)
    """Sample from the K most likely tokens (0: all)."""
    beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference (k3 estimator); 0 runs no reference pass at all."""
    epsilon: float = Field(0.2, gt=0, lt=1)
    """Clip range below 1 for the importance ratio (gspo: of the sequence ratio, e.g. 3e-4; cispo has none)."""
    epsilon_high: float | None = Field(None, gt=0)
    """Clip range above 1 (DAPO: 0.28; gspo e.g. 4e-4; cispo: the weight is at most 1 + epsilon_high);
    default epsilon."""
    loss: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"] = "grpo"
    """grpo: per-completion token mean, then mean over completions; dapo: one mean over the step's
    completion tokens; dr_grpo: token sum / (completions x max_new_tokens); gspo: one clipped ratio per
    completion (the geometric mean of its token ratios), averaged as grpo; cispo: each token's weight
    min(ratio, 1 + epsilon_high), detached, times its log-prob, averaged as dapo."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's std (group), the step's (batch), or not at all (none: Dr. GRPO)."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer steps on each batch of completions."""
    max_staleness: int = Field(0, ge=0)
    """0: each step samples with the weights it trains (synchronous). K > 0: step s trains on completions
    sampled with the weights of step s - K (the first K steps: the starting weights), sampled in the
    background while the steps between train; every row names its `policy_version` (docs/rl.md)."""
    importance_sampling: (
        Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] | None
    ) = None
    """How the loss corrects for a sampler that is not exactly the trainer: each token's loss weighed by
    its ratio p_trainer / p_sampler (token_*) or its sequence's (sequence_*), capped at
    importance_sampling_cap (*_truncate) or dropped above it (*_mask); formulas in docs/rl.md. Default:
    none with the transformers engine (it samples with the trainer's own weights and forward: the ratios
    are 1 up to rounding); token_truncate with the vllm engine (another forward, its own kernels and
    precision) or when importance_sampling_cap is given."""
    importance_sampling_cap: float | None = Field(None, gt=0)
    """The cap C of importance_sampling (default 2.0 once a mode is chosen)."""
    engine: Literal["transformers", "vllm"] = "transformers"
    """What samples: liger's engine on the model being trained, or a vLLM server given every weight update
    (docs/rl.md: its own, started and stopped by the run, or rl.vllm.server's)."""
    vllm: VllmSection = Field(default_factory=lambda: VllmSection())
    """rl.engine vllm: where the server is and what it may take."""
    rewards: list[RewardSpec] = Field(default_factory=list)
    """The reward functions, each {function, weight}; rewards are their weighted sum (grpo: at least one)."""
    tools: list[str] = Field(default_factory=list)
    """Functions the model may call, each `file.py:name` or `package.module:name` (typed arguments and a
    docstring describing each: their JSON schemas go to the chat template's `tools=`)."""
    environment: str | None = None
    """A class `file.py:Name`: one instance per trajectory, built from its prompt row's other fields;
    its public methods are the tools (instead of rl.tools)."""
    max_turns: int = Field(4, ge=1)
    """Most model turns per trajectory (with tools or an environment)."""
    mask_truncated: bool = False
    """Leave a trajectory cut by a limit (finish_reason length or max_turns) out of the loss."""
    tool_workers: int = Field(4, ge=1)
    """Processes that run tool calls (each trajectory in one of them); results are placed in a fixed order,
    never by timing."""
    tool_timeout: float = Field(60.0, gt=0)
    """Seconds a tool call may take; past it the call is stopped, its result is a timeout error for the
    model (`tool/timeouts`). 60: a real tool (a search, a test run) finishes well within it, and a stuck
    call holds its trajectory for a minute, not the run."""
    tool_memory_mb: int = Field(4096, ge=64)
    """Address space of each tool process (MiB); a call that exhausts it ends its process, and its result
    is an error for the model (`tool/crashes`)."""
    reward_timeout: float = Field(300.0, gt=0)
    """Seconds one call of a reward function may take (it scores a process's completions of a step); past
    it the run stops with an error naming the function and the row. 300: a reward that calls a judge
    model or runs tests has time; a stuck one costs five minutes, never a silent stall."""

    @field_validator("tools")
    @classmethod
    def _tool_specs(cls, value: list[str], info: ValidationInfo) -> list[str]:
        return [code_spec(v, info, "function") for v in value]

    @field_validator("environment")
    @classmethod
    def _environment_spec(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else code_spec(value, info, "Class")

    @model_validator(mode="after")
    def _ranges(self) -> RLSection:
        if self.loss == "cispo" and self.epsilon != type(self).model_fields["epsilon"].default:
            raise ValueError(
                "rl.epsilon is a lower clip, and cispo has none (its weights are only capped above, at "
                "1 + rl.epsilon_high): remove rl.epsilon"
            )
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
            self.__pydantic_fields_set__.discard("epsilon_high")  # a default, not the recipe's
        if self.tools and self.environment:
            raise ValueError("rl.tools and rl.environment: give one (an environment's methods are its tools)")
        self._importance_sampling()
        if self.engine == "vllm" and (self.top_p < 1 or self.top_k > 0):
            raise ValueError(
                "rl.engine vllm reports log-probs renormalised over the tokens top_p/top_k keep, and the trainer's "
                "are over the whole vocabulary: use top_p 1 and top_k 0 with it (or rl.engine transformers)"
            )
        default = type(self).model_fields["max_turns"].default  # what a run's saved recipe.yaml holds
        if self.max_turns != default and not self.agentic:
            raise ValueError("rl.max_turns applies to runs with rl.tools or rl.environment; remove it")
        return self

    def _importance_sampling(self) -> None:
        """Resolve the mode and its cap (a cap alone keeps its old meaning: token_truncate)."""
        if self.importance_sampling is None:
            corrected = self.importance_sampling_cap is not None or self.engine == "vllm"
            self.importance_sampling = "token_truncate" if corrected else "none"
            self.__pydantic_fields_set__.discard("importance_sampling")  # a default, not the recipe's
        if self.importance_sampling == "none":
            if self.importance_sampling_cap is not None:
                raise ValueError(
                    "rl.importance_sampling_cap with rl.importance_sampling none: remove the cap, or choose a mode"
                )
        elif self.importance_sampling_cap is None:
            self.importance_sampling_cap = IMPORTANCE_CAP
            self.__pydantic_fields_set__.discard("importance_sampling_cap")

    @property
    def agentic(self) -> bool:
        """Multi-turn: the model may call tools between its turns."""
        return bool(self.tools or self.environment)


SAMPLING = ("num_generations", "max_new_tokens", "temperature", "top_p", "top_k", "engine", "vllm")
"""The rl keys that say how completions are sampled: all that a distill run's rl section holds."""


class DistillSection(_Section):
    """On-policy distillation (training.objective distill): the frozen teacher and the divergence to it."""

    teacher: RelPath
    """The teacher: a local Hugging Face model folder with the student's tokenizer (ids and special tokens)."""
    loss: Literal["reverse_kl", "jsd"] = "reverse_kl"
    """reverse_kl: KL(student || teacher) per completion token; jsd: TRL GKD's generalized JSD (see beta)."""
    beta: float = Field(0.5, ge=0, le=1)
    """jsd only: TRL GKD's beta, the teacher's weight in the mixture (0: forward KL, 1: reverse KL)."""
    temperature: float = Field(1.0, gt=0)
    """Both models' distributions are softmax(logits / temperature) in the divergence."""
    quantize: Literal["none", "nf4", "fp4"] | None = None
    """The teacher's linear layers in 4 bits (bitsandbytes, double quantization; lm_head and embeddings
    unquantized), computed in the run's precision; default: as model.quantize."""

    @model_validator(mode="after")
    def _applies(self) -> DistillSection:
        if self.loss == "reverse_kl" and "beta" in self.model_fields_set:
            raise ValueError("distill.beta applies to distill.loss jsd only; remove it")
        if not (self.teacher / "config.json").is_file():
            raise ValueError(
                f"distill.teacher {self.teacher}: no config.json there; give a local model folder "
                "(e.g. one written by liger merge)"
            )
        return self


def check_rl(recipe) -> None:
    """A recipe that trains online (grpo, distill), or names part of it: prompts in, the rl section's
    rewards (grpo) or its sampling keys only (distill); what liger cannot do yet is refused (the
    Recipe's validator calls this)."""
    objective = recipe.training.objective
    if objective not in ("grpo", "distill"):
        what = "data.format prompt" if recipe.data.format == "prompt" else "the rl section"
        what = "the distill section" if recipe.distill is not None else what
        raise ValueError(f"{what} goes with training.objective grpo or distill: set it, or remove {what}")
    if recipe.data.format != "prompt":
        raise ValueError(f"training.objective {objective} samples from prompts: set data.format: prompt")
    if objective == "distill":
        check_distill(recipe)
    elif recipe.distill is not None:
        raise ValueError("the distill section applies to training.objective distill; remove it")
    elif recipe.rl is None:
        raise ValueError(
            "training.objective grpo needs an rl section with rewards, e.g. "
            "rl: {rewards: [{function: liger_cli.rewards:exact_match}]}"
        )
    elif not recipe.rl.rewards:
        raise ValueError(
            "training.objective grpo needs rl.rewards, at least one, e.g. "
            "rl: {rewards: [{function: liger_cli.rewards:exact_match}]}"
        )
    elif recipe.rl.num_generations < 2:
        raise ValueError(
            "rl.num_generations 1: grpo compares the completions of a prompt with each other; set at least 2"
        )
    if "preference" in recipe.model_fields_set:
        raise ValueError("the preference section applies to dpo, simpo and orpo; remove it")
    if recipe.reward is not None:
        raise ValueError("the reward section applies to training.objective reward; remove it")
    if "kto" in recipe.model_fields_set:
        raise ValueError("the kto section applies to training.objective kto; remove it")
    if recipe.data.packing or recipe.data.streaming:
        raise ValueError("data.packing and data.streaming do not apply to prompts; set them to false")
    if recipe.training.eval_samples:
        raise ValueError(
            "training.eval_samples: a grpo or distill run evaluates greedy completions of every eval prompt "
            "(eval_reward, eval_kl), and writes every completion to rollouts.jsonl; remove training.eval_samples"
        )
    if recipe.rl.engine == "vllm":
        check_vllm(recipe)
    if recipe.rl.max_staleness:
        check_staleness(recipe)
    if recipe.rl.max_new_tokens >= recipe.data.max_seq_len:
        raise ValueError(
            f"rl.max_new_tokens {recipe.rl.max_new_tokens} leaves no room for the prompt in data.max_seq_len "
            f"{recipe.data.max_seq_len}: raise data.max_seq_len or lower rl.max_new_tokens"
        )


def check_staleness(recipe) -> None:
    """What sampling ahead (rl.max_staleness > 0) cannot do yet is refused before anything loads."""
    rl, k = recipe.rl, recipe.rl.max_staleness
    if rl.num_iterations > 1:
        raise ValueError(
            f"rl.num_iterations {rl.num_iterations} with rl.max_staleness {k}: both reuse old completions; "
            "choose one (set rl.num_iterations: 1 or rl.max_staleness: 0)"
        )
    if recipe.distributed.sequence_parallel > 1:
        raise ValueError(
            "rl.max_staleness with distributed.sequence_parallel: the background sampler samples whole "
            "sequences on each process; set rl.max_staleness: 0 or distributed.sequence_parallel: 1"
        )
    if rl.engine == "vllm" and recipe.adapter.type == "none":
        raise ValueError(
            "rl.max_staleness with rl.engine vllm and full fine-tuning: the server holds one set of weights, and "
            "sampling ahead needs the last max_staleness + 1 policies at once; use an adapter, or max_staleness 0"
        )
    if rl.engine == "transformers" and recipe.distributed.shards_weights:
        raise ValueError(
            f"rl.max_staleness with rl.engine transformers under {recipe.distributed.backend}: the background "
            "sampler keeps a whole copy of the policy, which a sharded model has nowhere; use rl.engine vllm, "
            "distributed.backend ddp, or max_staleness 0"
        )
    if rl.engine == "transformers" and recipe.model.quantize != "none":
        raise ValueError(
            f"rl.max_staleness with model.quantize {recipe.model.quantize}: the background sampler's copy of a "
            "4-bit model is not supported yet; set rl.max_staleness: 0"
        )


def check_distill(recipe) -> None:
    """training.objective distill: a teacher, and the rl section's sampling keys only."""
    if recipe.distill is None:
        raise ValueError(
            "training.objective distill needs a distill section with the teacher, e.g. "
            "distill: {teacher: path/to/teacher_model}"
        )
    if recipe.rl is None:
        raise ValueError(
            "training.objective distill samples with the rl section's keys: add one, e.g. "
            "rl: {num_generations: 1, max_new_tokens: 64}"
        )
    other = sorted(recipe.rl.model_fields_set - set(SAMPLING))
    if other:
        raise ValueError(
            f"rl.{', rl.'.join(other)} {'does' if len(other) == 1 else 'do'} not apply to training.objective "
            "distill (its rl section holds the "
            f"sampling keys only: {', '.join(SAMPLING)}); remove them"
        )


def teacher_quantize(recipe) -> str:
    """How the teacher's linear layers load: distill.quantize, else as the student's (model.quantize)."""
    chosen = recipe.distill.quantize
    return recipe.model.quantize if chosen is None else chosen


def dump_online(recipe, data: dict) -> None:
    """The rl and distill sections as a run's recipe.yaml holds them (Recipe.to_yaml): absent when not
    given; a distill run's rl section with its sampling keys only and distill.beta with jsd only (the
    others are refused when the file is read again)."""
    if data["rl"] is None:
        del data["rl"]
    elif recipe.training.objective == "distill":
        data["rl"] = {k: v for k, v in data["rl"].items() if k in SAMPLING}
    if data["distill"] is None:
        del data["distill"]
    elif recipe.distill.loss == "reverse_kl":
        del data["distill"]["beta"]
