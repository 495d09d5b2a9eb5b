"""The tokenizer as llama.cpp reads it: every token with its type, the merges (or, for a SentencePiece-
style tokenizer, each token's score), the pre-tokenizer's name, the special ids, whether BOS is added, the
end-of-turn token and the chat template the run trained with.

Two kinds of tokenizer.json are exported. Byte-level BPE (llama.cpp's `gpt2` model): llama.cpp does not
run the tokenizer.json's pre-tokenizer, it runs one of its own, chosen by name (`tokenizer.ggml.pre`);
the name is read off the tokenizer.json here (the regexes each name stands for are llama.cpp's,
src/llama-vocab.cpp), and one this table does not know is refused. SentencePiece-style BPE with byte
fallback (llama.cpp's `llama` model: Llama 2, Mistral): no pre-tokenizer, "▁" for space, <0xXX> byte
tokens, merges chosen by score. Either way the choice is proved by tokenizing probe texts in llama.cpp
(`verify.py`).
"""

from __future__ import annotations

import json
import re
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
            f"{folder} has no tokenizer.json: liger exports models with a fast (tokenizers) BPE tokenizer; "
            "save the tokenizer with save_pretrained from a fast tokenizer"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def tokenizer_model(tokenizer_json: dict) -> str:
    """llama.cpp's tokenizer model for the tokenizer.json: `gpt2` (byte-level BPE: Llama 3, Qwen, SmolLM)
    or `llama` (SentencePiece's BPE with byte fallback, as transformers converts it: Llama 2, Mistral,
    TinyLlama); a UserError for any other."""
    model, decoder = tokenizer_json.get("model") or {}, tokenizer_json.get("decoder") or {}
    if model.get("type") == "BPE" and not model.get("byte_fallback") and decoder.get("type") == "ByteLevel":
        return "gpt2"
    decoders = [d.get("type") for d in decoder.get("decoders", [])]
    if model.get("type") == "BPE" and model.get("byte_fallback") and "ByteFallback" in decoders:
        return "llama"
    raise UserError(
        f"a {model.get('type')} tokenizer{' with byte fallback' if model.get('byte_fallback') else ''} "
        f"(decoder {decoder.get('type')}): liger exports byte-level BPE (Llama 3, Qwen, SmolLM, GPT-2 style) and "
        "SentencePiece-style BPE with byte fallback (Llama 2, Mistral, TinyLlama) tokenizers only so far"
    )


def space_prefix(tokenizer_json: dict) -> bool:
    """Whether a SentencePiece-style tokenizer puts "▁" before each text (llama.cpp's add_space_prefix):
    a `Prepend` normalizer (transformers' legacy Llama conversion) or a `Metaspace` pre-tokenizer that
    prepends. llama.cpp prefixes the text after every special token, as the legacy normalizer does; a
    Metaspace that prepends only to the first text ("first") differs there, which the token check names."""
    normalizer = tokenizer_json.get("normalizer") or {}
    steps = (
        normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    )
    if any(step.get("type") == "Prepend" and step.get("prepend") == SPACE for step in steps):
        return True
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(
        step.get("type") == "Metaspace"
        and step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never") != "never"
        for step in steps
    )


def describe(found: dict) -> tuple[str, str]:
    """(llama.cpp's tokenizer model, its pre-tokenizer name) for a tokenizer.json, or a UserError:
    checked before any work."""
    kind = tokenizer_model(found)
    return kind, pre_tokenizer_name(found) if kind == "gpt2" else "default"


SPACE = "\u2581"  # SentencePiece's visible space
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def merge_scores(tokenizer_json: dict) -> dict[str, float]:
    """llama.cpp's SentencePiece tokenizer merges the adjacent pair whose joined token scores highest,
    Hugging Face's BPE the pair with the lowest merge rank: a token's score is minus the rank of the first
    merge that makes it (transformers converts SentencePiece models to merges in that order)."""
    scores: dict[str, float] = {}
    for rank, merge in enumerate(tokenizer_json["model"].get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        scores.setdefault(left + right, -float(rank))
    return scores


def token_table(tokenizer, vocab_size: int, byte_tokens: bool = False) -> tuple[list[str], list[int]]:
    """Every id up to the model's vocab size: its text and llama.cpp type. Special added tokens are
    CONTROL (parsed only when special tokens are), other added tokens USER_DEFINED (always matched
    whole), a byte-fallback tokenizer's <0xXX> tokens BYTE, ids the tokenizer lacks UNUSED placeholders
    (a model's embedding may be padded)."""
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
            byte = byte_tokens and BYTE_TOKEN.fullmatch(by_id[i])
            types.append(gguf.TokenType.BYTE if byte else gguf.TokenType.NORMAL)
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
    found = read_tokenizer_json(folder)
    kind, pre = describe(found)
    texts, types = token_table(tokenizer, vocab_size, byte_tokens=kind == "llama")
    writer.add_tokenizer_model(kind)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(texts)
    writer.add_token_types(types)
    if kind == "llama":  # SentencePiece: merged by score, not by a merge list
        scores = merge_scores(found)
        writer.add_token_scores([scores.get(text, 0.0) for text in texts])
        writer.add_add_space_prefix(space_prefix(found))
    special = gguf.SpecialVocab(folder, load_merges=kind == "gpt2", n_vocab=vocab_size)
    special.chat_template = getattr(tokenizer, "chat_template", None) or special.chat_template
    special.add_to_gguf(writer, quiet=True)
    if turn_end is not None and turn_end != tokenizer.eos_token_id:
        writer.add_eot_token_id(turn_end)
    return pre
