"""Tiny twins of causal language models, built and fed: the user's architecture at a size a CPU trains
in a fraction of a second (`liger_cli.twin.shrink` says how a config is shrunk).

`tiny_causal_lm(config)` builds the twin with a seeded init, after checking its parameter count on the
meta device, and `tiny_batch(model)` gives a small padded batch with labels to run a training step on it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable

import torch

from liger_cli.twin.shrink import position_sizes, shrink_config, shrink_positions
from liger_cli.twin.shrink_vision import shrink_vision

PARAM_LIMIT = 5_000_000  # tiny_causal_lm refuses to allocate a twin larger than this

__all__ = [
    "PARAM_LIMIT",
    "TinyModelError",
    "shrink_config",
    "tiny_batch",
    "tiny_causal_lm",
    "twin_builder",
    "twin_vocab",
    "twin_session",
]


class TinyModelError(ValueError):
    """The config could not be made into a tiny model; the message is one line saying why."""


# --- building and feeding ----------------------------------------------------------------------------------
def _count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _position_tables(model, config) -> bool:
    """Whether the model holds a parameter or buffer with (at least) max_position_embeddings rows."""
    sizes = position_sizes(config)
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(sizes) and any(dim >= min(sizes) for t in tensors for dim in t.shape)  # OPT adds 2 rows


def _from_config(config, image_text: bool = False, **kwargs):
    """The twin's class: a reward model's (a config naming a sequence-classification class) is built by
    its auto class too."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from liger_cli.model import is_reward_config, model_class

    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    if is_reward_config(config):
        auto = model_class(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_config(config, **kwargs)


def _meta_twin(config, kwargs: dict):
    """(shrunk config, its model on the meta device); the first error if no shrink builds."""
    tiny = shrink_config(config)
    smaller = copy.deepcopy(tiny)
    if shrink_vision(smaller, config):  # a vision tower and its picture small too, when that builds
        try:
            with torch.device("meta"):
                return smaller, _from_config(smaller, **kwargs)
        except Exception:  # noqa: BLE001 - the settings shrink_config left build (or fail) below
            pass
    try:
        with torch.device("meta"):
            return tiny, _from_config(tiny, **kwargs)
    except Exception as first:
        # some models need two layers of a kind (zamba: weights shared between its hybrid layers)
        try:
            tiny = shrink_config(config, rounds=2)
            with torch.device("meta"):
                return tiny, _from_config(tiny, **kwargs)
        except Exception:
            raise first from None


def tiny_causal_lm(
    config,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "eager",
    trust_remote_code: bool = False,
    max_params: int = PARAM_LIMIT,
    image_text: bool | None = None,
):
    """`AutoModelForCausalLM.from_config(shrink_config(config))`, seeded, on CPU, in train mode; the class
    the run builds, `AutoModelForImageTextToText`, for a vision-language config (`image_text` None: as
    `liger_cli.model.vision.is_vision_language` says; the causal-LM sweep asks for its own class).

    The twin is first built on the meta device: if that fails, or it has more than `max_params`
    parameters, `TinyModelError` says why in one line and nothing is allocated. A learned position table
    of max_position_embeddings rows (GPT-2, OPT) shrinks to 256 rows.
    """
    from liger_cli.model import is_reward_config
    from liger_cli.model.vision import is_vision_language

    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    kwargs["image_text"] = is_vision_language(config) if image_text is None else image_text
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    name = type(config).__name__
    try:
        tiny, meta = _meta_twin(config, kwargs)
        if _position_tables(meta, tiny):
            shrink_positions(tiny)
            with torch.device("meta"):
                meta = _from_config(tiny, **kwargs)
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TinyModelError(f"{name}: cannot build a tiny twin: {first}") from None
    count = _count(meta)
    if count > max_params:
        raise TinyModelError(
            f"{name}: the shrunk model still has {count:,} parameters (limit {max_params:,})"
        )
    torch.manual_seed(seed)
    model = _from_config(tiny, **kwargs)
    model.config.use_cache = False
    if is_reward_config(model.config):  # it scores the last token that is not the pad the batches pad with
        model.config.pad_token_id = twin_vocab(model)[1]
    return model.train()


def twin_vocab(config_or_model) -> tuple[int, int]:
    """(vocabulary size a batch may draw from, padding id inside it) for a config or a model."""
    model = config_or_model if isinstance(config_or_model, torch.nn.Module) else None
    config = model.config if model is not None else config_or_model
    try:
        text = config.get_text_config(decoder=True)
    except (ValueError, AttributeError):
        text = config
    vocab = text.vocab_size
    if model is not None and model.get_input_embeddings() is not None:
        vocab = min(vocab, getattr(model.get_input_embeddings(), "num_embeddings", vocab))
    pad = getattr(text, "pad_token_id", None)
    return vocab, pad if isinstance(pad, int) and 0 <= pad < vocab else 0


def tiny_batch(config_or_model, seed: int = 0, batch: int = 2, length: int = 16) -> dict[str, torch.Tensor]:
    """input_ids (ids 3..vocab-1), attention_mask (row 1 right-padded) and labels (-100 on the prompt
    prefix and on padding), for a config or a model."""
    vocab, pad = twin_vocab(config_or_model)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, length), generator=g)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        attention_mask[1, length - length // 4 :] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, pad)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : length // 4] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def tiny_pairs(
    config_or_model, seed: int = 0, spec=((4, 5, 2), (2, 1, 6), (6, 3, 3), (1, 2, 1))
) -> list[dict]:
    """Preference pairs as the data stage makes them (one shared prompt, two answers, prompt labels -100):
    each (prompt, chosen, rejected) length in `spec`, uneven so that padding and counts differ."""
    vocab, _ = twin_vocab(config_or_model)
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for prompt_len, *answer_lens in spec:
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        pair = {}
        for side, n in zip(("chosen", "rejected"), answer_lens, strict=True):
            answer = torch.randint(3, vocab, (n,), generator=g).tolist()
            pair[f"{side}_input_ids"] = prompt + answer
            pair[f"{side}_labels"] = [-100] * prompt_len + answer
        pairs.append(pair)
    return pairs


def tiny_unpaired(config_or_model, seed: int = 0) -> list[dict]:
    """Unpaired completions as the data stage makes them (KTO): the first two of `tiny_pairs`' pairs as
    four rows, each chosen answer labelled true and each rejected one false, with their KL sequences."""
    from liger_cli.data.unpaired import kl_sequences

    rows = [
        {"input_ids": pair[f"{side}_input_ids"], "labels": pair[f"{side}_labels"], "label": side == "chosen"}
        for pair in tiny_pairs(config_or_model, seed)[:2]
        for side in ("chosen", "rejected")
    ]
    ids, labels = [row["input_ids"] for row in rows], [row["labels"] for row in rows]
    for row, kl in zip(rows, kl_sequences(ids, labels, seed, 64, None), strict=True):
        row |= {"kl_input_ids": kl.input_ids, "kl_labels": kl.labels}
    return rows


# --- what every twin check shares -------------------------------------------------------------------------
def twin_builder(
    config,
    trust_remote_code: bool = False,
    add_adapter: Callable | None = None,
    attn_implementation: str | None = "eager",
    **overrides,
) -> Callable[[], torch.nn.Module]:
    """A function that builds the same twin of `config` (same seeded weights) every call, with the
    adapter when given: a fresh build rather than a deep copy, since some models cannot be deep-copied.
    `overrides` are set on a copy of the config first (e.g. output_router_logits=True)."""
    config = copy.deepcopy(config)
    for key, value in overrides.items():
        setattr(config, key, value)

    def build() -> torch.nn.Module:
        twin = tiny_causal_lm(
            config, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
        )
        return add_adapter(twin) if add_adapter is not None else twin

    return build


@contextlib.contextmanager
def twin_session():
    """Where a twin check runs: one thread (tiny tensors: more only add synchronisation), the run's own
    RNG kept as it was, and no library warnings or notices (they are not about the run)."""
    from transformers.utils import logging

    threads, verbosity = torch.get_num_threads(), logging.get_verbosity()
    torch.set_num_threads(1)
    logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)
