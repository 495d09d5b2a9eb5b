"""Prompts rendered the way the run's data format rendered them for training, and where a reply stops.

What the model saw in training is what it sees here, through the data stage's own code:

| the run's format | `{"prompt": "text"}` | `{"messages": [...]}` |
|---|---|---|
| text | the text, with the tokenizer's prefix (bos) | refused |
| instruction | the instruction template; the first line is the instruction, the rest the input (`{"instruction", "input"}` rows too) | refused |
| chat | one user message, through the chat template with its generation prompt | the conversation, through the chat template with its generation prompt |
| preference | as text (preference string prompts are rendered so) | as chat |

A reply stops at the tokenizer's eos, at the token the chat template closes an assistant turn with
(`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...; found by rendering a probe conversation), and at
the model's own `generation_config` eos ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from liger_cli.data.chat import render
from liger_cli.data.encode import _encode_with_prefix, render_instruction_prompt
from liger_cli.data.image_rows import encode_image_prompt
from liger_cli.data.images import batch_images, image_parts
from liger_cli.errors import UserError

FORMATS = ("text", "instruction", "chat", "preference")
PROBE_ANSWER = "Zq7xW"


class PromptError(ValueError):
    """A prompt row this renderer cannot render; the message names the field and the fix."""


@dataclass
class Renderer:
    tokenizer: object
    format: str
    """The run's data format (FORMATS)."""
    system: str | None = None
    """A system message put first in chat prompts that have none (`liger chat`'s /system)."""

    def messages(self, row: dict) -> list[dict] | None:
        """The conversation a chat-rendered row stands for; None for rows rendered as plain text."""
        prompt = row.get("prompt")
        if "messages" in row or isinstance(prompt, list):
            messages = row["messages"] if "messages" in row else prompt
            if self.format in ("text", "instruction"):
                raise PromptError(
                    f"a messages prompt, but the run trained on format {self.format} (no chat template): "
                    'give {"prompt": "text"} rows instead'
                )
            return _check_messages(messages)
        if self.format == "chat":
            return [{"role": "user", "content": _text(row)}]
        return None

    def text(self, row: dict) -> str:
        """The prompt's text before tokenization: the rendered conversation, or the instruction prompt or
        text that the tokenizer's own prefix (bos) goes before."""
        messages = self.messages(row)
        if messages is not None:
            if self.system is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.system}, *messages]
            return render(self.tokenizer, messages, generation_prompt=True)
        if self.format == "instruction":
            return render_instruction_prompt(*_instruction(row))
        return _text(row)

    def ids(self, row: dict) -> list[int]:
        """The prompt's token ids, exactly as training put them before the answer."""
        if self.messages(row) is not None:  # the template writes its own special tokens
            return list(self.tokenizer(self.text(row), add_special_tokens=False)["input_ids"])
        return _encode_with_prefix(self.tokenizer, self.text(row))[0]

    def encode(self, row: dict, base: Path | None) -> tuple[list[int], bytes]:
        """The prompt's token ids and its image tensors (b"" for a row without images). A user turn's
        image parts (`{"type": "image", "path": ...}` relative to `base`, or a data: URI) go through
        the model's processor as training's image rows did (liger_cli.data.image_rows)."""
        messages = self.messages(row)
        if messages is None or not image_parts(messages):
            return self.ids(row), b""
        if self.system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        return encode_image_prompt(messages, self.tokenizer, base)

    def stop_ids(self, generation_config=None) -> list[int]:
        """eos, the template's end-of-turn token (chat-capable formats), the model's own eos ids."""
        stops = [self.tokenizer.eos_token_id]
        if self.format in ("chat", "preference"):
            stops += turn_end_ids(self.tokenizer)
        configured = getattr(generation_config, "eos_token_id", None)
        stops += configured if isinstance(configured, list) else [configured]
        return sorted({s for s in stops if s is not None})


def turn_end_ids(tokenizer) -> list[int]:
    """The special token the chat template writes right after an assistant turn's content; [] when
    the tokenizer has no template or it writes none."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE_ANSWER}]
    try:
        text = render(tokenizer, probe)
    except ValueError:
        return []
    after = text[text.rfind(PROBE_ANSWER) + len(PROBE_ANSWER) :]
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    return [next(i for i in ids if i in special)] if any(i in special for i in ids) else []


def read_jsonl_rows(path: Path, shapes: str, fits) -> list[tuple[int, dict]]:
    """(line number, row) of each non-blank line of a --prompts file, every row a JSON object that
    `fits(row)`; the first problem (no file, bad JSON, a row of another shape, no row) is a UserError
    that names the line and `shapes`, the rows it expects."""
    if not path.is_file():
        raise UserError(f"--prompts {path}: no such file; give a .jsonl file of {shapes} rows")
    rows = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"{path} line {line_number}: not JSON ({err.msg}); write one JSON object per line"
            ) from None
        if not isinstance(row, dict) or not fits(row):
            raise UserError(f"{path} line {line_number}: a row needs {shapes}; got {str(row)[:60]}")
        rows.append((line_number, row))
    if not rows:
        raise UserError(f"{path} holds no rows: write one JSON object per line, {shapes}")
    return rows


def read_prompts(path: Path) -> list[dict]:
    """The JSONL rows of a prompts file, each checked to be an object with a prompt."""
    shapes = '"prompt" (text or messages) or "messages"'
    return [
        row
        for _, row in read_jsonl_rows(path, shapes, lambda r: {"prompt", "messages", "instruction"} & set(r))
    ]


def image_row(row: dict) -> bool:
    """Whether a prompt row's messages hold an image part."""
    messages = row.get("messages", row.get("prompt"))
    return isinstance(messages, list) and bool(image_parts(messages))


def image_inputs(images: Sequence[bytes], prompts: Sequence[Sequence[int]]) -> dict | None:
    """The image tensors of a batch of prompts (each prompt's blob, b"" for none) as the engine's
    `inputs`: per-token ones padded on the left as the engine pads the prompts; None without images."""
    if not any(images):
        return None
    return batch_images(list(images), [len(p) for p in prompts], max(len(p) for p in prompts), left=True)


def max_length(config) -> int | None:
    """The model's longest sequence (positions), where its config says."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _text(row: dict) -> str:
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise PromptError('field "prompt": must be a text or a list of messages')
    return prompt


def _instruction(row: dict) -> tuple[str, str | None]:
    if "instruction" in row:
        instruction, inputs = row["instruction"], row.get("input")
        if not isinstance(instruction, str) or not isinstance(inputs, str | None):
            raise PromptError('fields "instruction" and "input" must be texts')
        return instruction, inputs
    first, _, rest = _text(row).partition("\n")
    return first.strip(), rest.strip() or None


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise PromptError('field "messages": must be a non-empty list of {"role", "content"} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise PromptError(f'field "messages[{i}]": must be an object with "role" and "content"')
    if messages[-1]["role"] == "assistant":
        raise PromptError(
            f'field "messages[{len(messages) - 1}]": the conversation ends with an assistant turn; end it '
            "with the user turn to answer"
        )
    return [{k: v for k, v in m.items() if v is not None} for m in messages]
