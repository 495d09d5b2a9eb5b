"""Tiny twins of causal language models: the same architecture, shrunk to build on CPU in well under a second.

`shrink_config(config)` returns a deep copy of any transformers causal-LM config (the user's own, a published
70B one, remote code) whose sizes are small but whose class, flags, multipliers, activations, rope type,
layer-type pattern and MoE routing style are unchanged. The rules go by attribute name, not by model family,
so that configs we have never seen shrink too:

* widths: hidden ~64, heads 4, kv heads 2 (1 stays 1: MQA; equal to the heads stays equal: MHA), head_dim 16,
  intermediate 96, MoE / shared-expert intermediate 32, MLA ranks 32, SSM / linear-attention dims small;
* depth: 2 layers, or one layer of each distinct kind where per-layer lists (`layer_types`, `mlp_layer_types`,
  index lists such as `mlp_only_layers`) or interval settings (`first_k_dense_replace`,
  `full_attention_interval`, `sliding_window_pattern`, `attn_layer_period`/`_offset`, ...) make layers differ:
  lists are cut to the chosen layers and intervals set so that the same layers get the same kind;
* vocab 256, with every special token id moved inside it; experts 4, top-k 2 (expert groups 2, top-k group 1);
  sliding windows 8; values that are already small stay; a size that is None stays None.

Every value that is not a size (multipliers, scales, softcaps, dropout, eps, flags, strings) is left alone.
`max_position_embeddings` is left alone too unless the model holds a table of that size (learned positions).

`tiny_causal_lm(config)` builds the twin with a seeded init, after checking its parameter count on the meta
device, and `tiny_batch(model)` gives a small padded batch with labels to run a training step on it.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, EXPERT_INTERMEDIATE = 64, 4, 2, 16, 96, 32
VOCAB, EXPERTS, TOP_K, RANK, WINDOW, MAX_POSITIONS = 256, 4, 2, 32, 8, 256
PARAM_LIMIT = 5_000_000  # tiny_causal_lm refuses to allocate a twin larger than this


class TinyModelError(ValueError):
    """The config could not be made into a tiny model; the message is one line saying why."""


# --- size rules, by attribute name -------------------------------------------------------------------------
# Each name maps to the largest value it keeps; smaller values (and None) stay as they are.
_CAPS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "dim", "emb_dim", "embedding_dim", "embedding_size", "lru_width",
              "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "router_hidden_size",
              "cross_attention_hidden_size", "projection_dim", "text_hidden_size", "hidden_dim",
              "hidden_size_global", "nemo_conv_channels", "ext_pw_out_channel", "depthwise_separable_out_channel",
              "output_channels")),
    (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "encoder_attention_heads",
             "decoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
             "swa_num_attention_heads", "index_n_heads", "indexer_n_heads", "linear_num_heads", "heads_per_ngram")),
    (HEAD_DIM, ("head_dim", "attention_head_dim", "d_head", "kv_channels", "dim_head", "attention_head_size",
                "swa_head_dim", "linear_head_dim", "linear_key_head_dim", "linear_value_head_dim", "index_head_dim",
                "indexer_head_dim", "v_head_dim", "qk_nope_head_dim", "d_rel", "global_head_dim")),
    (8, ("qk_rope_head_dim", "rotary_dim", "rotary_emb_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim")),
    (INTERMEDIATE, ("intermediate_size", "ffn_dim", "n_inner", "d_inner", "dff", "dim_ff", "feed_forward_size",
                    "ffn_hidden_size", "encoder_ffn_dim", "decoder_ffn_dim", "intermediate_size_mlp",
                    "dense_intermediate_size", "prefix_dense_intermediate_size", "attention_hidden_size",
                    "mlp_dim")),
    (EXPERT_INTERMEDIATE, ("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
                           "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size",
                           "shared_intermediate_size", "moe_latent_size")),
    (RANK, ("q_lora_rank", "kv_lora_rank", "o_lora_rank", "adapter_rank", "laurel_rank", "time_step_rank",
            "mamba_dt_rank", "gated_norm_rank", "hc_lowrank", "hidden_size_per_layer_input", "ple_embed_dim",
            "pronunciation_embed_dim", "shape_embed_dim", "prompt_mid_dim", "index_topk", "indexer_budget")),
    (16, ("state_size", "ssm_state_size", "mamba_d_state", "mamba_d_ssm")),
    (EXPERTS, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num")),
    (TOP_K, ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts", "moe_top_k",
             "num_selected_experts")),
    (1, ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "topk_group")),
    (2, ("n_group", "num_expert_group", "n_groups", "mamba_n_groups", "mamba_ngroups")),
    (WINDOW, ("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
              "attention_chunk_size", "local_attn_chunk_length", "lsh_attn_chunk_length", "window_size")),
    (32, ("chunk_size", "mamba_chunk_size", "block_size", "max_inference_chunksize")),
)
_CAP = {name: cap for cap, names in _CAPS for name in names}
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "num_query_groups",
             "indexer_kv_heads", "kv_n_heads", "linear_num_key_heads")
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "decoder_layers",
           "encoder_layers", "num_encoder_layers", "num_blocks")
_VOCAB_NAMES = ("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input", "audio_vocab_size",
                "unpadded_vocab_size", "ngram_vocab_size_base", "encoder_hash_byte_group_vocab",
                "pronunciation_vocab_size", "shape_vocab_size", "codebook_size")
_POSITION_NAMES = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "context_length")


# --- layer kinds -------------------------------------------------------------------------------------------
# Interval settings: name -> (is layer i "special" under value v, for a model of n layers).
_INTERVALS: dict[str, Callable[[int, int, int], bool]] = {
    "first_k_dense_replace": lambda i, v, n: i < v,
    "num_dense_layers": lambda i, v, n: i < v,
    "moe_layer_start_index": lambda i, v, n: i < v,
    "full_attention_interval": lambda i, v, n: (i + 1) % v == 0,
    "sliding_window_pattern": lambda i, v, n: (i + 1) % v == 0,
    "_sliding_window_pattern": lambda i, v, n: (i + 1) % v == 0,
    "global_attn_every_n_layers": lambda i, v, n: i % v == 0,
    "no_rope_layer_interval": lambda i, v, n: (i + 1) % v == 0,
    "decoder_sparse_step": lambda i, v, n: (i + 1) % v == 0,
    "interleave_moe_layer_step": lambda i, v, n: (i + 1) % v == 0,
    "moe_layer_interval": lambda i, v, n: (i + 1) % v == 0,
    "moe_layer_freq": lambda i, v, n: i % v == 0,
    "num_kv_shared_layers": lambda i, v, n: i >= n - v,
    "max_window_layers": lambda i, v, n: i < v,
    "n_layers_per_attn_res_block": lambda i, v, n: i % v == 0,
}
# Period/offset pairs: layer i is special when i % period == offset.
_PERIODS = (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset"))


def _get(cfg, name: str, default=None):
    """An attribute as stored (per-layer configs refuse a plain getattr of their varying attributes)."""
    return vars(cfg).get(name, default)


def _set(cfg, name: str, value) -> None:
    """Set an attribute; derived read-only ones (properties that refuse a value) are skipped."""
    try:
        setattr(cfg, name, value)
    except (AttributeError, NotImplementedError):
        pass


def _num_layers(cfg) -> tuple[str | None, int]:
    for name in _LAYERS:
        value = _get(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None, 0


def _layer_lists(cfg, n: int) -> tuple[dict[str, list], dict[str, list[int]], dict[str, dict]]:
    """Per-layer lists (length n), layer-index lists (increasing ints < n) and dicts keyed by layer index."""
    per_layer, indices, keyed = {}, {}, {}
    for name, value in vars(cfg).items():
        if name.startswith("__") or not value:
            continue
        if isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            if all(0 <= a < b < n for a, b in zip(value, value[1:], strict=False)) and value[-1] < n and (
                "layer" in name or "idx" in name or "ids" in name
            ):
                indices[name] = value
                continue
        if isinstance(value, list) and len(value) == n and name not in _VOCAB_NAMES:
            per_layer[name] = value
        elif isinstance(value, dict) and value and all(str(k).isdigit() and isinstance(v, dict)
                                                       for k, v in value.items()):
            keyed[name] = value
    return per_layer, indices, keyed


def _interval_settings(cfg) -> dict[str, int]:
    out = {}
    for name in _INTERVALS:
        value = _get(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = value
    return out


def _kinds(cfg, n: int, per_layer, indices, keyed, intervals) -> list[tuple]:
    periods = [(_get(cfg, p), _get(cfg, o)) for p, o in _PERIODS if isinstance(_get(cfg, p, None), int)
               and isinstance(_get(cfg, o, None), int) and _get(cfg, p) > 0]
    kinds = []
    for i in range(n):
        # per-layer sizes (a width per layer) are shrunk, not kinds; everything else per layer is a kind
        kind = [repr(values[i]) for name, values in per_layer.items() if name not in _CAP and name not in _KV_HEADS]
        kind += [i in values for values in indices.values()]
        kind += [repr(next((d[k] for k in d if int(k) == i), None)) for d in keyed.values()]
        kind += [_INTERVALS[name](i, v, n) for name, v in intervals.items()]
        kind += [i % p == o for p, o in periods]
        kinds.append(tuple(kind))
    return kinds


def _choose_layers(kinds: list[tuple], n: int, rounds: int = 1) -> list[int]:
    """Layer 0 (models often build their first layer differently), then the first layer after it of each
    distinct kind, in order (for `rounds` 2, then the next layer of each kind after those)."""
    chosen = [0] if n else []
    for _ in range(rounds):
        start, seen = max(chosen), set()
        for i in range(start + 1, n):
            if kinds[i] not in seen:
                seen.add(kinds[i])
                chosen.append(i)
    return chosen


def _refit_interval(name: str, value: int, wanted: list[bool]) -> int:
    """The smallest setting that marks exactly the `wanted` layers of the shrunk model (else the old value)."""
    n = len(wanted)
    for v in range(1, max(n, 1) + 2):
        if [_INTERVALS[name](i, v, n) for i in range(n)] == wanted:
            return v
    if name in ("num_kv_shared_layers", "first_k_dense_replace", "num_dense_layers", "max_window_layers",
                "moe_layer_start_index") and not any(wanted):
        return 0
    return value


def _shrink_layers(cfg, rounds: int = 1) -> None:
    layers_name, n = _num_layers(cfg)
    if n == 0:
        return
    per_layer, indices, keyed = _layer_lists(cfg, n)
    intervals = _interval_settings(cfg)
    kinds = _kinds(cfg, n, per_layer, indices, keyed, intervals)
    chosen = _choose_layers(kinds, n, rounds)
    # patterns shorter than the model (cycled block types) need one full cycle
    for name, value in vars(cfg).items():
        if name.endswith("types") and isinstance(value, list) and 1 < len(value) < n and name not in per_layer:
            while len(chosen) < len(value):
                chosen.append(next(i for i in range(n) if i not in chosen))
            chosen.sort()
    m = len(chosen)
    for name in _LAYERS:
        if _get(cfg, name, None) == n:
            _set(cfg, name, m)
    for name, values in per_layer.items():
        _set(cfg, name, [values[i] for i in chosen])
    for name, values in indices.items():
        _set(cfg, name, [j for j, i in enumerate(chosen) if i in values])
    for name, d in keyed.items():  # {"05": {...}} -> the same entries under the new layer numbers
        vars(cfg)[name] = {type(k)(str(chosen.index(int(k))).zfill(len(str(k)))) if isinstance(k, str)
                           else chosen.index(k): v for k, v in d.items() if int(k) in chosen}
    for name, v in intervals.items():
        wanted = [_INTERVALS[name](i, v, n) for i in chosen]
        _set(cfg, name, _refit_interval(name, v, wanted))
    if isinstance(_get(cfg, "moe_layer_end_index"), int) and cfg.moe_layer_end_index >= 0:
        cfg.moe_layer_end_index = m - 1
    for p_name, o_name in _PERIODS:
        p, o = _get(cfg, p_name, None), _get(cfg, o_name, None)
        if isinstance(p, int) and isinstance(o, int) and p > 0:
            wanted = [i % p == o for i in chosen]
            for period in range(1, m + 2):
                fits = [off for off in range(period) if [j % period == off for j in range(m)] == wanted]
                if fits:
                    _set(cfg, p_name, period)
                    _set(cfg, o_name, fits[0])
                    break
    # gpt-neo style [[pattern, repeat], ...]
    types = _get(cfg, "attention_types", None)
    if isinstance(types, list) and types and all(isinstance(t, list) and len(t) == 2 for t in types):
        pattern = types[0][0]
        cfg.attention_types = [[pattern, max(1, math.ceil(m / len(pattern)))]]
        _set(cfg, layers_name, len(pattern) * cfg.attention_types[0][1])
        if isinstance(_get(cfg, "attention_layers"), list):
            cfg.attention_layers = pattern * cfg.attention_types[0][1]


# --- widths ------------------------------------------------------------------------------------------------
def _cap(value, cap: int):
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return min(value, cap) if value > 0 else value
    if isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [min(x, cap) if x > 0 else x for x in value]
    return value


# Sizes that were equal must stay equal (MLA: head_dim is the rope part; rwkv: attention width is hidden).
_SAME = (
    _CAPS[2][1] + _CAPS[3][1],  # head dims
    _CAPS[0][1] + ("attention_hidden_size",),  # widths
)


def _fill_defaults(cfg) -> None:
    """Sizes some configs leave None for the model to derive; set the usual values (no effect on structure)."""
    heads = _get(cfg, "num_attention_heads")
    if isinstance(heads, int) and heads > 0:
        if "num_key_value_heads" in vars(cfg) and _get(cfg, "num_key_value_heads") is None:
            cfg.num_key_value_heads = heads
        if "head_dim" in vars(cfg) and _get(cfg, "head_dim") is None and isinstance(_get(cfg, "hidden_size"), int):
            cfg.head_dim = cfg.hidden_size // heads


def _shrink_widths(cfg, old: dict) -> None:
    for name, value in list(vars(cfg).items()):
        if name in _CAP:
            _set(cfg, name, _cap(value, _CAP[name]))
    for names in _SAME:
        present = [n for n in names if isinstance(old.get(n), int) and not isinstance(old.get(n), bool)]
        for value in {old[n] for n in present}:
            equal = [n for n in present if old[n] == value]
            if len(equal) > 1:
                smallest = min(_get(cfg, n) for n in equal)
                for n in equal:
                    _set(cfg, n, smallest)
    # a width that was a multiple of hidden stays one (zamba2: attention over concatenated streams)
    hidden, old_hidden = _get(cfg, "hidden_size"), old.get("hidden_size")
    for name, value in old.items():  # dims that split the hidden size (reformer's axial position dims)
        if "dim" in name and isinstance(value, (list, tuple)) and len(value) > 1 and old_hidden and hidden and all(
            isinstance(x, int) for x in value
        ) and sum(value) == old_hidden and hidden < old_hidden:
            new = [max(1, x * hidden // old_hidden) for x in value]
            new[-1] += hidden - sum(new)
            _set(cfg, name, type(value)(new))
    width = old.get("attention_hidden_size")
    if isinstance(width, int) and isinstance(old_hidden, int) and old_hidden and width % old_hidden == 0:
        cfg.attention_hidden_size = width // old_hidden * hidden
    heads = _get(cfg, "num_attention_heads") or _get(cfg, "n_head") or _get(cfg, "n_heads")
    old_heads = old.get("num_attention_heads") or old.get("n_head") or old.get("n_heads")
    for name in _KV_HEADS:
        kv = _get(cfg, name)
        if isinstance(kv, int) and not isinstance(kv, bool) and kv > 1:
            _set(cfg, name, heads if kv == old_heads and heads else min(kv, KV_HEADS))
    # heads x head dim = width, where it was so before
    w, h, d = old.get("attention_hidden_size"), old.get("num_attention_heads"), old.get("attention_head_dim")
    if isinstance(w, int) and isinstance(h, int) and isinstance(d, int) and w == h * d:
        cfg.attention_head_dim = cfg.attention_hidden_size // cfg.num_attention_heads
    # linear attention: value heads a multiple of key heads
    k, v = old.get("linear_num_key_heads"), old.get("linear_num_value_heads")
    if isinstance(k, int) and isinstance(v, int) and k > 0:
        cfg.linear_num_value_heads = _get(cfg, "linear_num_key_heads") * max(1, v // k)
    # the rotary part of head_dim is the MLA rope head (dots3: 256 x 0.25 = 64): keep it so
    head, rope, partial = old.get("head_dim"), old.get("qk_rope_head_dim"), _partial_rotary(old)
    if isinstance(head, int) and isinstance(rope, int) and partial < 1 and int(head * partial) == rope:
        cfg.head_dim = int(_get(cfg, "qk_rope_head_dim") / partial)
    # MLA: the query/key head is nope + rope
    if isinstance(old.get("qk_head_dim"), int) and isinstance(_get(cfg, "qk_nope_head_dim"), int):
        cfg.qk_head_dim = _get(cfg, "qk_nope_head_dim") + (_get(cfg, "qk_rope_head_dim") or 0)
    _fit_ssm_heads(cfg, old)


def _partial_rotary(values: dict) -> float:
    """partial_rotary_factor, from the config or its (possibly per-layer-type) rope parameters."""
    params = values.get("rope_parameters") or values.get("rope_scaling") or {}
    nested = [p for p in params.values() if isinstance(p, dict)] + [params]
    factors = [p.get("partial_rotary_factor") for p in nested if isinstance(p.get("partial_rotary_factor"), float)]
    return values.get("partial_rotary_factor") or (factors[0] if factors else 1.0)


def _fit_ssm_heads(cfg, old: dict) -> None:
    """SSM heads x head dim must still fill the SSM inner width (expand x hidden) when they did before."""
    hidden, old_hidden = _get(cfg, "hidden_size", None), old.get("hidden_size")
    expand = old.get("mamba_expand") or old.get("expand")
    for heads_name, dim_name in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
                                 ("n_mamba_heads", "mamba_headdim"), ("num_heads", "head_dim")):
        h, d = old.get(heads_name), old.get(dim_name)
        if not (isinstance(h, int) and isinstance(d, int) and isinstance(expand, (int, float)) and old_hidden):
            continue
        if h * d == int(expand * old_hidden):
            new_d = _get(cfg, dim_name)
            if dim_name == "mamba_headdim":  # zamba2 derives it from the heads
                new_d = int(expand * hidden) // _get(cfg, heads_name)
                _set(cfg, dim_name, new_d)
            _set(cfg, heads_name, max(1, int(expand * hidden) // new_d))
        elif old.get("mamba_d_ssm") == h * d:  # falcon-h1: an explicit SSM width
            cfg.mamba_d_ssm = _get(cfg, heads_name) * _get(cfg, dim_name)
    groups = next((g for g in ("mamba_n_groups", "n_groups", "mamba_ngroups") if hasattr(cfg, g)), None)
    heads = next((_get(cfg, h) for h in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
                  if isinstance(_get(cfg, h, None), int)), None)
    if groups and heads and isinstance(_get(cfg, groups), int) and heads % _get(cfg, groups):
        _set(cfg, groups, 1)


# --- vocab and special tokens ------------------------------------------------------------------------------
def _is_token_name(name: str) -> bool:
    return name.endswith(("token_id", "token_ids", "token_index", "_token")) or name in (
        "suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids")


def _move_token_ids(cfg, vocab: int, mapping: dict[int, int]) -> None:
    def move(x):
        if isinstance(x, bool) or not isinstance(x, int) or x < vocab:
            return x
        if x not in mapping:
            mapping[x] = vocab - 1 - len(mapping)
        return mapping[x]

    for name, value in list(vars(cfg).items()):
        if not _is_token_name(name):
            continue
        if isinstance(value, int):
            _set(cfg, name, move(value))
        elif isinstance(value, list) and all(isinstance(x, int) for x in value):
            _set(cfg, name, [move(x) for x in value])


# --- rope --------------------------------------------------------------------------------------------------
def _shrink_rope(cfg, old: dict) -> None:
    """Rope lists sized by the head (longrope factors, mrope sections) follow the new head size."""
    for name in ("rope_parameters", "rope_scaling"):
        params = _get(cfg, name, None)
        if not isinstance(params, dict):
            continue
        nested = params if all(isinstance(v, dict) for v in params.values()) and params else {None: params}
        for p in nested.values():
            heads = _get(cfg, "num_attention_heads") or 1
            head = _get(cfg, "head_dim") or (_get(cfg, "hidden_size") or 0) // heads
            rotary = int(head * p.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", 1.0) or 1.0))
            for key in ("short_factor", "long_factor"):
                if isinstance(p.get(key), list):
                    p[key] = p[key][: rotary // 2]
            for key in ("mrope_section",):
                section = p.get(key)
                if isinstance(section, list) and sum(section):
                    scale = (rotary // 2) / sum(section)
                    new = [max(1, int(s * scale)) for s in section]
                    new[0] += rotary // 2 - sum(new)
                    p[key] = new


# --- the whole config --------------------------------------------------------------------------------------
def _sub_configs(config) -> list:
    """The config and every config nested in it, outermost first."""
    from transformers import PretrainedConfig

    out, todo = [], [config]
    while todo:
        cfg = todo.pop(0)
        if any(cfg is seen for seen in out):
            continue
        out.append(cfg)
        todo += [v for v in vars(cfg).values() if isinstance(v, PretrainedConfig)]
    return out


def _shrink_one(cfg, rounds: int = 1) -> None:
    # heterogeneous configs (per-layer overrides) are shrunk as plain ones, then their overrides put back
    spec = vars(cfg).pop("_heterogeneity_spec", None)
    if spec is not None:
        vars(cfg)["per_layer_config"] = copy.deepcopy(spec.per_layer_overrides)
    _fill_defaults(cfg)
    old = copy.deepcopy(vars(cfg))
    _shrink_layers(cfg, rounds)
    _shrink_widths(cfg, old)
    for overrides in (vars(cfg).get("per_layer_config") or {}).values():
        layer = SimpleNamespace(**{**old, **overrides})
        _shrink_widths(layer, {**old, **overrides})
        overrides.update({key: vars(layer)[key] for key in overrides})
    if spec is not None:
        cfg.per_layer_config = vars(cfg).pop("per_layer_config")
    for name in _VOCAB_NAMES:
        value = _get(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > VOCAB:
            _set(cfg, name, VOCAB)
    _shrink_rope(cfg, old)


def shrink_config(config, rounds: int = 1):
    """A deep copy of `config` with every size shrunk and every other setting kept (see the module doc).

    Composite configs (a text config inside a vision-language one, attention/FFN sub-configs) shrink
    throughout; the returned object is of the same class as `config`, ready for
    `AutoModelForCausalLM.from_config`.
    """
    config = copy.deepcopy(config)
    configs = _sub_configs(config)
    for cfg in configs:
        _shrink_one(cfg, rounds)
    try:
        vocab = config.get_text_config(decoder=True).vocab_size
    except (ValueError, AttributeError):
        vocab = getattr(config, "vocab_size", VOCAB)
    vocab_ids: dict[int, int] = {}
    for cfg in configs:
        _move_token_ids(cfg, _get(cfg, "vocab_size", None) or vocab or VOCAB, vocab_ids)
    return config


# --- building and feeding ----------------------------------------------------------------------------------
def _count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _position_tables(model, config) -> bool:
    """Whether the model holds a parameter or buffer with a dimension of max_position_embeddings."""
    sizes = {getattr(c, n, None) for c in _sub_configs(config) for n in _POSITION_NAMES} - {None}
    sizes = {s for s in sizes if isinstance(s, int) and s > MAX_POSITIONS}
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(sizes) and any(dim in sizes for t in tensors for dim in t.shape)


def _from_config(config, **kwargs):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, **kwargs)


def tiny_causal_lm(
    config,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "eager",
    trust_remote_code: bool = False,
    max_params: int = PARAM_LIMIT,
):
    """`AutoModelForCausalLM.from_config(shrink_config(config))`, seeded, on CPU, in train mode.

    The twin is first built on the meta device (where a model refuses one layer of a kind, with two of
    each kind): above `max_params` parameters it raises `TinyModelError` without allocating anything.
    A learned position table of max_position_embeddings rows shrinks to 256 rows.
    """
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    tiny = shrink_config(config)
    try:
        try:
            with torch.device("meta"):
                meta = _from_config(tiny, **kwargs)
        except Exception:  # noqa: BLE001 - some models need two layers of a kind (weights shared between them)
            tiny = shrink_config(config, rounds=2)
            with torch.device("meta"):
                meta = _from_config(tiny, **kwargs)
        if _position_tables(meta, tiny):
            for cfg in _sub_configs(tiny):
                for name in _POSITION_NAMES:
                    if isinstance(_get(cfg, name, None), int) and _get(cfg, name) > MAX_POSITIONS:
                        _set(cfg, name, MAX_POSITIONS)
            with torch.device("meta"):
                meta = _from_config(tiny, **kwargs)
    except Exception as err:  # noqa: BLE001 - any failure to build is reported the same way
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise TinyModelError(f"{type(tiny).__name__}: cannot build a tiny twin: {first}") from None
    count = _count(meta)
    if count > max_params:
        raise TinyModelError(
            f"{type(tiny).__name__}: the shrunk model still has {count:,} parameters (limit {max_params:,})"
        )
    torch.manual_seed(seed)
    model = _from_config(tiny, **kwargs)
    model.config.use_cache = False
    return model.train()


def tiny_batch(config_or_model, seed: int = 0, batch: int = 2, length: int = 16) -> dict[str, torch.Tensor]:
    """input_ids (ids 3..vocab-1), attention_mask (row 1 right-padded) and labels (-100 on the prompt
    prefix and on padding), for a config or a model."""
    model = config_or_model if isinstance(config_or_model, torch.nn.Module) else None
    config = model.config if model is not None else config_or_model
    try:
        text = config.get_text_config(decoder=True)
    except (ValueError, AttributeError):
        text = config
    vocab = text.vocab_size
    if model is not None and model.get_input_embeddings() is not None:
        vocab = min(vocab, getattr(model.get_input_embeddings(), "num_embeddings", vocab))
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, length), generator=g)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        attention_mask[1, length - length // 4:] = 0
    pad = getattr(text, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    input_ids = input_ids.masked_fill(attention_mask == 0, pad)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : length // 4] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
