"""The written GGUF checked in llama.cpp against what liger computes, before it counts as written.

On probe texts, probe conversations rendered with the run's template and the run's own eval prompts:
- tokens: llama.cpp's ids for each text equal the Hugging Face tokenizer's, with and without the
  tokenizer's own prefix (so the BOS flag is proved too);
- template: the file's chat template is the run's, and llama-cpp-python's renderer gives the same text;
- next tokens: liger's engine completes each prompt greedily on the merged model; llama.cpp evaluates
  prompt + completion and, at every completion position, its log-probs must lie within BOUNDS of the
  model's (f32/f16/bf16; for a token under TAIL_LOG_P, in proportion to its log-prob: rounding is relative)
  and its most likely token must be liger's (a near tie, the two within the bound,
  is counted, not failed); for quantized types the greedy agreement rate and the mean KL(model ||
  GGUF) are measured and an agreement under FLOORS fails;
- stops: llama.cpp ends a generation on every id liger's engine stops at; an id it also ends on (llama.cpp
  marks some by their text, e.g. `<|endoftext|>`) is reported, and refused only where a probe completion
  of liger's engine holds it (there the two would answer differently).
The first failure raises ExportMismatch naming the first differing token or text.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from liger_cli.errors import RunFailed

BOUNDS = {"f32": 1e-3, "f16": 5e-2, "bf16": 2.5e-1}
"""Largest |log p(GGUF) - log p(model)| over every token of the vocabulary, per plain type; the model
computes in f32, so f16 and bf16 carry their weights' rounding (measured: docs/export.md)."""
TAIL_LOG_P = -10.0
"""Under this log-prob a token's bound grows with |log p| / 10: a rounded type's error on a log-prob is
relative. Measured on SmolLM2-135M-Instruct's f16 file (30 layers, 49,152 tokens; the f32 file within 9e-5,
the conversion exact): the largest difference 0.015 for tokens above log p -5, 0.022 above -10, 0.046 above
-20 and 0.055 at -32, where f16 weights alone, computed in torch, already move it 0.035."""
GELU_F32_BOUND = 1e-2
"""f32's bound for a model whose MLP is a GELU (Gemma 3): llama.cpp's CPU GELU reads its input and writes
its output through a half-precision table, so its activations carry f16 rounding (measured on the tests'
tiny Gemma 3: 1.9e-3; 1.9e-4 against a reference whose GELU rounds the same way)."""
FLOORS = {"q8_0": 0.9, "q6_k": 0.85, "q5_k_m": 0.8, "q5_k_s": 0.8, "q5_0": 0.8, "q4_k_m": 0.7, "q4_k_s": 0.7,
          "q4_0": 0.7, "q3_k_m": 0.5, "q2_k": 0.3}  # fmt: skip
"""Least share of completion positions where a quantized GGUF's greedy token is the model's."""
PROBE_TEXTS = [
    "Hello world! It's 2026; we'll see what they've done.",
    "  two leading spaces,\ttabs\tand\n\nblank lines  \n",
    "numbers 1234567, 3.14159 and -42",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂👍",
    "DON'T shout; I'M here, you'LL see",
]
PROBE_CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one, please?"}],
]  # fmt: skip


class ExportMismatch(RunFailed):
    """llama.cpp does not compute what liger computes on the written file (exit 1, nothing kept)."""


@dataclass
class Report:
    texts: int = 0
    """Texts whose llama.cpp tokenization equals the tokenizer's."""
    template: str = "none"
    prompts: int = 0
    positions: int = 0
    """Completion positions compared."""
    largest_logprob_diff: float = 0.0
    near_ties: int = 0
    agreement: float = 1.0
    mean_kl: float = 0.0
    stops: tuple[int, ...] = ()
    extra_stops: tuple[int, ...] = ()
    """Ids llama.cpp also ends a generation on, where liger's engine goes on (none in a probe completion)."""
    image_embedding_diff: float | None = None
    """A vision-language model: largest difference of the probe image's embeddings, of their largest value."""
    image_logprob_diff: float | None = None
    """A vision-language model: largest |Δ log p| of the next token after an image prompt."""

    def as_dict(self) -> dict:
        return asdict(self)


def first_difference(want: list, got: list) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got))
    )


def shown(tokenizer, ids: list[int], i: int) -> str:
    return f"{ids[i]} {tokenizer.convert_ids_to_tokens(ids[i])!r}" if i < len(ids) else "nothing"


def check_tokens(runtime, tokenizer, texts: list[str], report: Report) -> None:
    for text in texts:
        bos = tokenizer.bos_token
        for prefix in (False, True) if not (bos and text.startswith(bos)) else (False,):  # no double BOS
            want = list(tokenizer(text, add_special_tokens=prefix)["input_ids"])
            got = runtime.tokenize(text, add_bos=prefix)
            if got != want:
                i = first_difference(want, got)
                raise ExportMismatch(
                    f"llama.cpp tokenizes {text[:60]!r}{' with its prefix' if prefix else ''} differently: at "
                    f"token {i} the tokenizer has {shown(tokenizer, want, i)}, llama.cpp {shown(tokenizer, got, i)}"
                )
        report.texts += 1


def check_template(runtime, tokenizer, conversations: list[list[dict]], report: Report) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from liger_cli.data.chat import render

    want = getattr(tokenizer, "chat_template", None)
    stored = runtime.metadata.get("tokenizer.chat_template")
    if want is None or stored is None:
        if want != stored:
            raise ExportMismatch(
                "the file's chat template is "
                + ("missing" if stored is None else "there, but the run has none")
            )
        return
    if stored != want:
        i = first_difference(want, stored)
        raise ExportMismatch(
            f"the file's chat template differs from the run's at character {i}: {stored[i : i + 40]!r}"
        )
    formatter = Jinja2ChatFormatter(stored, tokenizer.eos_token or "", tokenizer.bos_token or "")
    for messages in conversations:
        ours = render(tokenizer, messages, generation_prompt=True)
        theirs = formatter(messages=messages).prompt
        if ours != theirs:
            i = first_difference(ours, theirs)
            raise ExportMismatch(
                f"llama-cpp-python renders the file's chat template differently at character {i}: "
                f"{ours[i : i + 30]!r} (the run) vs {theirs[i : i + 30]!r}"
            )
    report.template = "same"


def reference_log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def text_bound(out_type: str, config) -> float | None:
    """BOUNDS' figure for a plain type (a GELU model's f32: GELU_F32_BOUND), None for a quantized one."""
    text = config.get_text_config()
    activation = str(getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", ""))
    if out_type == "f32" and "gelu" in activation:
        return GELU_F32_BOUND
    return BOUNDS.get(out_type)


def nan_first(value: float) -> float:
    return math.inf if math.isnan(value) else value


def check_next_tokens(runtime, model, prompts, completions, out_type: str, floor: float | None,
                      report: Report) -> None:  # fmt: skip
    """Teacher-forced on liger's greedy completions: at each completion position llama.cpp saw the
    prefix liger's engine saw, so equal argmaxes there mean equal free-running greedy generations."""
    bound = text_bound(out_type, model.config)
    agree = total = 0
    kl_sum = 0.0
    worst = None  # (difference / its token's bound factor, difference, the token's log p) at the largest
    for k, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids = list(prompt) + list(completion)
        rows = slice(len(prompt) - 1, len(ids) - 1)
        want, got = reference_log_probs(model, ids)[rows], runtime.log_probs(ids)[rows]
        want, got = want[:, : got.shape[-1]], got[:, : want.shape[-1]]
        kl_sum += float((want.exp() * (want - got)).sum(-1).sum())
        gap = (want - got).abs()
        diff = float(gap.max())
        report.largest_logprob_diff = max(report.largest_logprob_diff, diff, key=nan_first)  # NaN fails below
        scaled = gap / (want / TAIL_LOG_P).clamp(min=1.0)  # the bound's share, in the tail per |log p| / 10
        at = divmod(int(scaled.argmax()), scaled.shape[-1])
        if worst is None or not float(scaled.max()) <= worst[0]:
            worst = (nan_first(float(scaled.max())), float(gap[at]), float(want[at]))
        for j, token in enumerate(completion):
            top = int(got[j].argmax())
            total += 1
            if top == token:
                agree += 1
                continue
            margin = float(want[j, token] - want[j, top])
            if bound is not None and margin <= 2 * bound:
                report.near_ties += 1
            elif bound is not None:
                raise ExportMismatch(
                    f"greedy tokens differ on prompt {k} at completion token {j}: liger's engine "
                    f"{token} {runtime.piece(token)!r}, llama.cpp {top} {runtime.piece(top)!r}"
                )
    report.prompts, report.positions = len(prompts), total
    report.agreement = agree / max(total, 1)
    report.mean_kl = kl_sum / max(total, 1)
    if bound is not None and worst is not None and not worst[0] <= bound:
        raise ExportMismatch(
            f"llama.cpp's next-token log-probs differ from the model's by {worst[1]:.3g} at a token of log-prob "
            f"{worst[2]:.3g} (bound for {out_type}: {bound:g}, times |log p| / 10 under log p {TAIL_LOG_P:g})"
        )
    if floor is not None and report.agreement < floor:
        raise ExportMismatch(
            f"{out_type}: llama.cpp's greedy token is the model's at {report.agreement:.1%} of {total} positions, "
            f"under the floor of {floor:.0%} (mean KL {report.mean_kl:.3g}); choose a larger type (q8_0, q6_k) "
            "or lower the floor with --min-agreement"
        )


def check_stops(runtime, stops: list[int], completions: list[list[int]], report: Report) -> None:
    """llama.cpp must end a generation wherever liger's engine does. It may end at more: llama.cpp marks
    tokens end-of-generation by their text too (`<|endoftext|>`, `<|eot_id|>`, ...), as it does for the
    GGUFs model authors publish. Such an id is accepted and reported when none of liger's probe
    completions holds it (on them the served model ends where liger's does), refused where one does."""
    ends = runtime.end_of_generation()
    for token in sorted(set(stops) - ends):
        raise ExportMismatch(f"liger's engine stops at {token} {runtime.piece(token)!r}; llama.cpp does not")
    extra = sorted(ends - set(stops))
    for k, ids in enumerate(completions, start=1):
        for token in (t for t in ids if t in extra):
            raise ExportMismatch(
                f"llama.cpp ends generation at {token} {runtime.piece(token)!r} (it marks it end-of-generation by its "
                f"text), which liger's engine generates in probe completion {k} and goes on after: add {token} to "
                "the model's generation_config.json eos_token_id (liger then stops there too) and export again"
            )
    report.stops, report.extra_stops = tuple(sorted(stops)), tuple(extra)
