"""Rows -> token ids and labels (text and instruction formats), truncation, packing and batching.

Labels are aligned with input_ids, not shifted: transformers' causal-LM loss shifts them itself.
A label of -100 (IGNORE_INDEX) is not learned. The chat format lives in liger_cli.data.chat.

Packing and attention: a packed row holds several examples whose `position_ids` restart at 0. The
collator then sends no attention mask, and transformers (>= 4.52 `masking_utils`, checked on 5.23:
`find_packed_sequence_indices`) turns restarting position_ids into a block-diagonal causal mask for
the `sdpa`, `eager` and `flex_attention` implementations; `flash_attention_2/3` use the same
position_ids as variable-length sequence boundaries. So attention does not leak across packed
examples for models built on `masking_utils.create_causal_mask` (Llama, Mistral, Qwen2/3, Gemma and
the other current families; tests/test_data.py checks the logits for Llama with sdpa and eager).
Two conditions: no attention_mask, and no KV cache (run with `use_cache=False`, as training does):
with a cache, transformers does not look for packed rows and each row gets one causal mask.
A model that builds its own mask without looking at position_ids (old or remote-code models) would
let each packed example attend to the ones before it in the row: no error, just a subtly different
model. Use `packing: false` there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from liger_cli.data.images import IMAGES_COLUMN, batch_images

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100  # the label value transformers' cross-entropy skips

# The instruction prompt (Alpaca-style). The "### Input" block is left out when input is empty.
INSTRUCTION_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
INSTRUCTION_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


@dataclass
class Encoded:
    """One example as training receives it before packing, plus what the data report needs.

    turns: (field, first token, end token) of each learned answer; warnings: (code, field, message).
    """

    input_ids: list[int]
    labels: list[int]
    turns: list[tuple[str, int, int]] = field(default_factory=list)
    warnings: list[tuple[str, str, str]] = field(default_factory=list)


def render_instruction_prompt(instruction: str, input: str | None = None) -> str:
    """The prompt for an instruction row; the model's answer follows it directly."""
    if input:
        return INSTRUCTION_TEMPLATE.format(instruction=instruction, input=input)
    return INSTRUCTION_TEMPLATE_NO_INPUT.format(instruction=instruction)


def encode_text(row: dict, tokenizer) -> Encoded:
    """Text row -> Encoded: everything is learned except the tokenizer's own prefix (bos)."""
    ids, special = _encode_with_prefix(tokenizer, row["text"])
    labels = [IGNORE_INDEX if is_special else i for i, is_special in zip(ids, special, strict=True)]
    ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
    first = next(t for t, label in enumerate(labels) if label != IGNORE_INDEX)
    return Encoded(ids, labels, [("text", first, len(ids))])


def encode_instruction(row: dict, tokenizer) -> Encoded:
    """Instruction row -> Encoded: only the output and the eos after it are learned.

    Prompt and output are tokenized separately and joined, so the boundary is exact for any tokenizer.
    """
    prompt_ids, _ = _encode_with_prefix(
        tokenizer, render_instruction_prompt(row["instruction"], row.get("input"))
    )
    answer_ids = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids, n = prompt_ids + answer_ids, len(prompt_ids)
    return Encoded(ids, [IGNORE_INDEX] * n + answer_ids, [("output", n, len(ids))])


def truncate(ids: list[int], labels: list[int], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Keep the first max_seq_len tokens (the prompt is at the start and is needed for what follows)."""
    return ids[:max_seq_len], labels[:max_seq_len]


def pack_examples(examples: Sequence[dict], max_seq_len: int) -> list[dict]:
    """Greedily join consecutive examples into rows of at most max_seq_len tokens.

    Examples are never split. position_ids restart at 0 for each example (that is how attention
    learns the boundaries, see the module docstring), and the first label of each example is -100 so
    no loss is computed for predicting one example's first token from the end of the previous one.
    """
    packed: list[dict] = []
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ex in examples:
        n = len(ex["input_ids"])
        if row["input_ids"] and len(row["input_ids"]) + n > max_seq_len:
            packed.append(row)
            row = {"input_ids": [], "labels": [], "position_ids": []}
        row["input_ids"] += ex["input_ids"]
        row["labels"] += [IGNORE_INDEX] + list(ex["labels"][1:])
        row["position_ids"] += list(range(n))
    if row["input_ids"]:
        packed.append(row)
    return packed


class Collator:
    """Pads a batch of examples on the right into tensors for a causal LM.

    Unpacked batches get an attention_mask. Packed batches (some row's position_ids restart at 0)
    get none, so transformers derives the block-diagonal mask from position_ids; their padding gets
    position_ids 0, 1, ... of its own, so it forms a separate (ignored) sequence.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        """Rows with images (an IMAGES_COLUMN) add the processor's image tensors, joined along dim 0
        (liger_cli.data.images.batch_images), and carry no position_ids."""
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = any(0 in list(f["position_ids"])[1:] for f in features)
        batch: dict[str, list[list[int]]] = {
            "input_ids": [],
            "labels": [],
            "position_ids": [],
            "attention_mask": [],
        }
        for f in features:
            n, pad = len(f["input_ids"]), length - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * pad)
            tail = list(range(pad)) if packed else list(range(n, n + pad))
            batch["position_ids"].append(list(f["position_ids"]) + tail)
            batch["attention_mask"].append([1] * n + [0] * pad)
        if packed:
            del batch["attention_mask"]
        import torch  # here, not at the top: `liger data` reads a cached table without it

        out = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
        if any(f.get(IMAGES_COLUMN) for f in features):
            # An image batch (never packed) lets the model place its own positions: M-RoPE models
            # (Qwen-VL) derive them from the image grid, and text positions would silently replace them.
            del out["position_ids"]
            lengths = [len(f["input_ids"]) for f in features]
            out.update(batch_images([f.get(IMAGES_COLUMN) for f in features], lengths, length))
        return out


def collate(features: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Functional form of `Collator`: pad right, -100 labels on padding, mask only when unpacked."""
    return Collator(pad_token_id)(features)


def collate_pairs(examples: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Preference examples as 2B rows, chosen then rejected, padded together (one forward for both)."""
    rows = [
        {"input_ids": ex[f"{side}_input_ids"], "labels": ex[f"{side}_labels"],
         "position_ids": list(range(len(ex[f"{side}_input_ids"])))}
        for side in ("chosen", "rejected")
        for ex in examples
    ]  # fmt: skip
    return collate(rows, pad_token_id)


def _encode_with_prefix(tokenizer, text: str) -> tuple[list[int], list[bool]]:
    """Tokenize with the tokenizer's own leading special tokens (bos, if it adds one), none at the end.

    Returns the ids and which of them are added special tokens. Trailing added tokens (a tokenizer
    set to append eos) are dropped here because we append eos ourselves after the part to learn.
    """
    enc = tokenizer(text, add_special_tokens=True, return_special_tokens_mask=True)
    ids, special = list(enc["input_ids"]), [bool(s) for s in enc["special_tokens_mask"]]
    last_text_token = max((i for i, is_special in enumerate(special) if not is_special), default=len(ids) - 1)
    return ids[: last_text_token + 1], special[: last_text_token + 1]
