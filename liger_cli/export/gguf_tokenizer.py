"""The tokenizer as llama.cpp reads it: every token with its type, the merges, the pre-tokenizer's name,
the special ids, whether BOS is added, the end-of-turn token and the chat template the run trained with.

llama.cpp does not run the tokenizer.json's pre-tokenizer: it runs one of its own, chosen by name
(`tokenizer.ggml.pre`). The name is read off the tokenizer.json's pre-tokenizer here (the regexes each
name stands for are llama.cpp's, src/llama-vocab.cpp); one this table does not know is refused, and the
choice is then proved by tokenizing probe texts in llama.cpp (`verify.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

from liger_cli.errors import UserError

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
SPLIT_NAMES = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name for the tokenizer.json's pre-tokenizer; a UserError for one it has no twin of."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"  # each digit alone, then GPT-2's regex
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if steps[0].get("behavior") == "Isolated" and pattern in SPLIT_NAMES:
            return SPLIT_NAMES[pattern]
    raise UserError(
        f"the tokenizer's pre-tokenizer ({json.dumps(pre)[:200]}) has no llama.cpp counterpart liger knows "
        "(it knows GPT-2's, SmolLM's, Llama 3's and Qwen2's): a GGUF would split text differently"
    )


def read_tokenizer_json(folder: Path) -> dict:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"{folder} has no tokenizer.json: liger exports models with a fast (tokenizers) byte-level BPE "
            "tokenizer; save the tokenizer with save_pretrained from a fast tokenizer"
        )
    found = json.loads(path.read_text(encoding="utf-8"))
    model, decoder = found.get("model") or {}, found.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise UserError(
            f"{path}: a {model.get('type')} tokenizer{' with byte fallback' if model.get('byte_fallback') else ''}; "
            "liger exports byte-level BPE tokenizers (Llama 3, Qwen, SmolLM, GPT-2 style) only so far"
        )
    return found


def token_table(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id up to the model's vocab size: its text and llama.cpp type. Special added tokens are
    CONTROL (parsed only when special tokens are), other added tokens USER_DEFINED (always matched
    whole), ids the tokenizer lacks UNUSED placeholders (a model's embedding may be padded)."""
    import gguf

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    texts, types = [], []
    for i in range(vocab_size):
        if i in added:
            texts.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            texts.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            texts.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    if len(by_id) > vocab_size:
        raise UserError(
            f"the tokenizer has {len(by_id)} tokens but the model's vocab_size is {vocab_size}: ids past it "
            "have no embedding; save the tokenizer the model was trained with"
        )
    return texts, types


def write_tokenizer(writer, folder: Path, tokenizer, vocab_size: int, turn_end: int | None) -> str:
    """The tokenizer's whole llama.cpp description into `writer`; returns the pre-tokenizer's name."""
    import logging

    import gguf

    logging.getLogger("gguf").setLevel(logging.ERROR)  # its notes on template parsing are not the user's
    pre = pre_tokenizer_name(read_tokenizer_json(folder))
    texts, types = token_table(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(texts)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    special.chat_template = getattr(tokenizer, "chat_template", None) or special.chat_template
    special.add_to_gguf(writer, quiet=True)
    if turn_end is not None and turn_end != tokenizer.eos_token_id:
        writer.add_eot_token_id(turn_end)
    return pre
