"""The one generation engine: batched sampling with a KV cache, left padding and a stop per sequence.

`liger generate`, `liger chat`, the run's evaluation samples and online RL all call `generate`.

Every sampled token carries two log-probabilities, because a trainer that recomputes them must know
which distribution it is comparing with:

- `full_logprobs`: log softmax(logits / T) over the whole vocabulary (the trainer's distribution at the
  same temperature T);
- `logprobs`: under the distribution actually sampled from: top-k and top-p applied to the above,
  then renormalised over the kept tokens. Equal to `full_logprobs` when nothing is cut.

Greedy (`temperature: 0`) picks the most likely token; its distributions are those of T = 1 (so
`logprobs` says how sure the model was, not a point mass's 0).

Randomness is one generator per sequence, seeded from (seed, the sequence's key): a completion
depends on its prompt, its key and the seed only, never on which other prompts share its batch
or on how the prompts are spread over processes. Each step draws one uniform number per sequence
and inverts the kept distribution's CDF with it.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from liger_cli.errors import UserError


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps every token."""
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens}: must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature}: must be 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k}: must be 0 (off) or more")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    ids: list[int] = field(default_factory=list)
    """The generated token ids, the stop token included when there was one."""
    finish_reason: str = "length"
    """"stop" (a stop token was generated) or "length" (max_new_tokens reached)."""
    logprobs: list[float] = field(default_factory=list)
    """Each token's log-probability under the distribution it was sampled from."""
    full_logprobs: list[float] = field(default_factory=list)
    """Each token's log-probability under the whole vocabulary at the sampling temperature."""
    version: int | None = None
    """The policy version that sampled it (optimizer steps taken), where a training run's engine says."""


def sequence_seed(seed: int, key: object) -> int:
    """A 63-bit seed for one sequence: the same (seed, key) always gives the same stream."""
    digest = hashlib.sha256(f"liger-sample:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    stop_ids: Sequence[int],
    pad_id: int,
    keys: Sequence[object] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    any_running: Callable[[bool], bool] | None = None,
    device: torch.device | None = None,
    inputs: dict[str, torch.Tensor] | None = None,
) -> list[Completion]:
    """Complete every prompt (token ids) in one batch; one Completion per prompt, in order.

    keys: each sequence's sampling key (default its index here); give the global index of the
    prompt (and return sequence) so that results do not depend on the batch. on_token(row, id) is
    called as each token is chosen (for streaming). any_running(local) says whether any process is
    still generating: with several processes every one keeps stepping until all are done, so a
    forward that runs collectives never waits on a process that stopped. inputs: further keywords of
    the prompts' forward only, e.g. a vision-language model's image tensors (joined along dim 0, per-token
    ones padded on the left like the prompts); the generated tokens are text.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if inputs and places_its_own_positions(model):
        raise UserError(
            f"image prompts on {type(model).__name__}: it computes its image tokens' rotary positions "
            "itself (multimodal RoPE), which liger's generation does not do yet; give text-only prompts, "
            "or generate with transformers' model.generate"
        )
    device = device or next(model.parameters()).device
    keys = list(range(len(prompts))) if keys is None else list(keys)
    generators = [torch.Generator().manual_seed(sequence_seed(sampling.seed, k)) for k in keys]
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    any_running = any_running or (lambda local: local)

    ids, mask = left_pad(prompts, pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    try:
        extra = {k: v.to(device) for k, v in (inputs or {}).items()}
        logits, cache = _forward(model, ids, mask, positions, None, **extra)
        completions = [Completion() for _ in prompts]
        running = torch.ones(len(prompts), dtype=torch.bool, device=device)
        for _ in range(sampling.max_new_tokens):
            uniforms = (
                None if sampling.greedy else torch.stack([torch.rand((), generator=g) for g in generators])
            )
            token, sampled_lp, full_lp = choose(logits, sampling, uniforms)
            token = torch.where(running, token, torch.full_like(token, pad_id))
            for row, (t, lp, flp, live) in enumerate(
                zip(token.tolist(), sampled_lp.tolist(), full_lp.tolist(), running.tolist(), strict=True)
            ):
                if live:
                    completions[row].ids.append(t)
                    completions[row].logprobs.append(lp)
                    completions[row].full_logprobs.append(flp)
                    if on_token is not None:
                        on_token(row, t)
            stopped = running & torch.isin(token, stops)
            for row in stopped.nonzero().flatten().tolist():
                completions[row].finish_reason = "stop"
            running &= ~stopped
            if not any_running(bool(running.any())):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            logits, cache = _forward(model, token[:, None], mask, positions, cache)
    finally:
        model.train(was_training)
    return completions


def places_its_own_positions(model: nn.Module) -> bool:
    """Multimodal rotary models (Qwen2-VL's M-RoPE and the like) place each image token from the image
    grid (`get_rope_index`); the engine's text positions would be silently wrong for their images."""
    return any(hasattr(m, "get_rope_index") for m in model.modules())


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts padded on the left (every row's last token is its last prompt token) and their mask."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, length - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def choose(
    logits: torch.Tensor, sampling: Sampling, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row, its log-prob under the kept (renormalised) distribution and under the whole
    vocabulary at the temperature. `uniforms` are one number in [0, 1) per row (None when greedy)."""
    scale = 1.0 if sampling.greedy else sampling.temperature
    full = torch.log_softmax(logits.float() / scale, dim=-1)
    kept = truncated(full, sampling.top_k, sampling.top_p)
    if sampling.greedy:
        token = kept.argmax(dim=-1)
    else:
        # Inverse CDF in the vocabulary's order: the first token whose cumulative mass exceeds u.
        cdf = kept.exp().cumsum(dim=-1)
        target = (uniforms.to(cdf.device, cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
        token = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        last_kept = torch.where(kept > -torch.inf, torch.arange(kept.size(-1), device=kept.device), -1)
        token = torch.minimum(token, last_kept.max(dim=-1).values)  # rounding at the top end
    pick = token.unsqueeze(-1)
    return token, kept.gather(-1, pick).squeeze(-1), full.gather(-1, pick).squeeze(-1)


def truncated(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k, then top-p (the smallest set of most likely tokens whose mass reaches top_p), then
    renormalised: log-probs of the distribution sampled from, -inf outside it. Ties keep the lower id."""
    if top_k <= 0 and top_p >= 1:
        return logprobs
    ordered, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k > 0:
        keep[:, top_k:] = False
    if top_p < 1:  # over what top-k kept, renormalised (the order transformers applies them in)
        probs = ordered.exp().masked_fill(~keep, 0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        keep &= probs.cumsum(dim=-1) - probs < top_p
    kept_sorted = ordered.masked_fill(~keep, -torch.inf)
    kept = torch.full_like(logprobs, -torch.inf).scatter(-1, order, kept_sorted)
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def _forward(model: nn.Module, ids, mask, positions, cache, **inputs):
    """One forward with the KV cache on (the run keeps it off in its config), last position's logits only
    where the model can skip the others. Returns (logits of the last position, the cache)."""
    params = _forward_parameters(model)
    # transformers 5.24 renamed `past_key_values` to `cache` (the old name still works, with a warning).
    name = "cache" if "cache" in params else "past_key_values"
    kwargs = {"attention_mask": mask, "position_ids": positions, "use_cache": True, name: cache, **inputs}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=ids, **kwargs)
    found = getattr(out, name, None)
    return out.logits[:, -1, :], found if found is not None else getattr(out, "past_key_values", None)


def _forward_parameters(model: nn.Module) -> set[str]:
    """The causal-LM forward's parameter names, looked up through peft, DDP and DeepSpeed wrappers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(base, "module", base)
    try:
        return set(inspect.signature(type(base).forward).parameters)
    except (TypeError, ValueError):
        return set()
