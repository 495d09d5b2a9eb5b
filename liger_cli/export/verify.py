"""The written GGUF checked in llama.cpp against what liger computes, before it counts as written.

On probe texts, probe conversations rendered with the run's template and the run's own eval prompts:
- tokens: llama.cpp's ids for each text equal the Hugging Face tokenizer's, with and without the
  tokenizer's own prefix (so the BOS flag is proved too);
- template: the file's chat template is the run's, and llama-cpp-python's renderer gives the same text;
- next tokens: liger's engine completes each prompt greedily on the merged model; llama.cpp evaluates
  prompt + completion and, at every completion position, its log-probs must lie within BOUNDS of the
  model's (f32/f16/bf16) and its most likely token must be liger's (a near tie, the two within the bound,
  is counted, not failed); for quantized types the greedy agreement rate and the mean KL(model ||
  GGUF) are measured and an agreement under FLOORS fails;
- stops: llama.cpp ends a generation on exactly the ids liger's engine stops at.
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
GELU_F32_BOUND = 1e-2
"""f32's bound for a model whose MLP is a GELU (Gemma 3): llama.cpp's CPU GELU reads its input and writes
its output through a half-precision table, so its activations carry f16 rounding (measured on the tests'
tiny Gemma 3: 1.9e-3; 1.9e-4 against a reference whose GELU rounds the same way)."""
IMAGE_BOUNDS = {**BOUNDS, "f32": 1e-2}
"""The image probe's: its embeddings' largest difference (relative to their largest value) and the next
token's |Δ log p|. f32's is looser than the text's: llama.cpp computes the projector's GELU through a
half-precision table, and its qwen2vl language model ignores the RMSNorm epsilon (docs/export.md)."""
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
    for k, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        ids = list(prompt) + list(completion)
        rows = slice(len(prompt) - 1, len(ids) - 1)
        want, got = reference_log_probs(model, ids)[rows], runtime.log_probs(ids)[rows]
        want, got = want[:, : got.shape[-1]], got[:, : want.shape[-1]]
        kl_sum += float((want.exp() * (want - got)).sum(-1).sum())
        diff = float((want - got).abs().max())
        report.largest_logprob_diff = max(report.largest_logprob_diff, diff, key=nan_first)  # NaN fails below
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
    if bound is not None and not report.largest_logprob_diff <= bound:
        raise ExportMismatch(
            f"llama.cpp's next-token log-probs differ from the model's by up to {report.largest_logprob_diff:.3g} "
            f"(bound for {out_type}: {bound:g})"
        )
    if floor is not None and report.agreement < floor:
        raise ExportMismatch(
            f"{out_type}: llama.cpp's greedy token is the model's at {report.agreement:.1%} of {total} positions, "
            f"under the floor of {floor:.0%} (mean KL {report.mean_kl:.3g}); choose a larger type (q8_0, q6_k) "
            "or lower the floor with --min-agreement"
        )


def check_stops(runtime, stops: list[int], report: Report) -> None:
    ends = runtime.end_of_generation()
    for token in sorted(set(stops) ^ ends):
        said = "liger's engine stops at" if token in stops else "llama.cpp stops at"
        other = "llama.cpp does not" if token in stops else "liger's engine goes on"
        raise ExportMismatch(f"{said} {token} {runtime.piece(token)!r}; {other}")
    report.stops = tuple(sorted(stops))


def probe_image(width: int = 224, height: int = 112):
    """A colour gradient, width x height RGB. A Qwen-VL's is 8 x 4 merged patches (224 x 112 for Qwen2-VL,
    256 x 128 for Qwen3-VL's 16-pixel patches): a size both llama.cpp's preprocessing and the processor take
    as it is (32 image tokens; two of Qwen2.5-VL's 112-pixel attention windows); Gemma 3's is its fixed
    image size. Both sides encode the same pixels."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(x * 2) % 256, (y * 4) % 256, ((x + y) * 3) % 256], axis=-1).astype(np.uint8)


def image_prompt(model, tokenizer, image_processor, before: str, after: str):
    """The probe image, the model's inputs for `before` + the image + `after` as its processor lays the
    image out (llama.cpp's mtmd lays it out its own way: the ids must agree), and its image features."""
    from PIL import Image

    config, vision = model.config, model.config.vision_config
    gemma3 = config.model_type == "gemma3"
    if gemma3:
        rgb = probe_image(vision.image_size, vision.image_size)
    else:
        merged = vision.patch_size * vision.spatial_merge_size
        rgb = probe_image(8 * merged, 4 * merged)
    pixels = image_processor(images=[Image.fromarray(rgb)], return_tensors="pt")
    if gemma3:  # <start_of_image>, the pooled image tokens, <end_of_image>; image tokens attend both ways
        marks, count = (
            (config.boi_token_index, config.image_token_index, config.eoi_token_index),
            config.mm_tokens_per_image,
        )
        grid, kinds_name = {}, "token_type_ids"
    else:  # <|vision_start|>, the merged patches' tokens, <|vision_end|>; M-RoPE positions from the grid
        marks = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
        count = int(pixels["image_grid_thw"].prod()) // vision.spatial_merge_size**2
        grid, kinds_name = {"image_grid_thw": pixels["image_grid_thw"]}, "mm_token_type_ids"
    start, pad, end = tokenizer.convert_ids_to_tokens(list(marks))
    ids = tokenizer(before + start + pad * count + end + after, add_special_tokens=False, return_tensors="pt")
    kinds = (ids["input_ids"] == config.image_token_id).long()  # the processor's marks: 1 for an image token
    with torch.no_grad():
        found = model.model.get_image_features(pixels["pixel_values"], **grid)
    deepstack = [layer[0] for layer in getattr(found, "deepstack_features", None) or []]
    features = torch.cat(
        [found.pooler_output[0], *deepstack], dim=-1
    )  # Qwen3-VL's as llama.cpp lays them out
    inputs = {
        "input_ids": ids["input_ids"],
        "pixel_values": pixels["pixel_values"],
        kinds_name: kinds,
        **grid,
    }
    return rgb, inputs, features


def check_image(runtime, projector, model, tokenizer, image_processor, out_type: str, report: Report) -> None:
    """A probe image through both: its embeddings (the model's tower and projector on its image processor's
    pixels, against llama.cpp's mtmd on the projector file with its own preprocessing), then the next token
    after a prompt holding it (the language model file, M-RoPE positions included)."""
    from liger_cli.export.runtime import MEDIA

    before, after = "Look at this picture: ", " What colour is it?"
    rgb, inputs, embedded = image_prompt(model, tokenizer, image_processor, before, after)
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    want = torch.log_softmax(logits.double(), dim=-1)
    embeddings, got = runtime.image_log_probs(projector, before + MEDIA + after, rgb, embedded.shape[-1])
    got = got[: want.shape[-1]]
    bound = IMAGE_BOUNDS.get(out_type)
    tower_bound = IMAGE_BOUNDS.get(out_type, IMAGE_BOUNDS["f16"])  # a quantized model's projector file is f16
    if embeddings.shape != embedded.shape:
        raise ExportMismatch(
            f"llama.cpp makes {tuple(embeddings.shape)} embeddings of the probe image, the model {tuple(embedded.shape)}"
        )
    report.image_embedding_diff = float((embeddings - embedded).abs().max() / embedded.abs().max())
    report.image_logprob_diff = float((want - got).abs().max())
    if not report.image_embedding_diff <= tower_bound:  # NaN fails too
        raise ExportMismatch(
            f"llama.cpp encodes the probe image differently: its embeddings differ from the model's by up to "
            f"{report.image_embedding_diff:.3g} of their largest value (bound: {tower_bound:g})"
        )
    if bound is not None and not report.image_logprob_diff <= bound:
        raise ExportMismatch(
            f"after an image prompt llama.cpp's next-token log-probs differ from the model's by up to "
            f"{report.image_logprob_diff:.3g} (bound for {out_type}: {bound:g})"
        )
    top, token = int(got.argmax()), int(want.argmax())
    if bound is not None and top != token and float(want[token] - want[top]) > 2 * bound:
        raise ExportMismatch(
            f"after an image prompt the greedy tokens differ: the model {token} {runtime.piece(token)!r}, "
            f"llama.cpp {top} {runtime.piece(top)!r}"
        )
