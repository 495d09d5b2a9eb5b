"""Shrink any causal-LM config to a tiny twin: the same architecture, sizes small enough to build at once.

`shrink_config(config)` returns a deep copy of any transformers causal-LM config (the user's own, a published
70B one, remote code) whose sizes are small but whose class, flags, multipliers, activations, rope type,
layer-type pattern and MoE routing style are unchanged. The rules go by attribute name, not by model family,
so that configs we have never seen shrink too:

* widths: hidden ~64, heads 4, kv heads 2 (1 stays 1: MQA; equal to the heads stays equal: MHA), head_dim 16,
  intermediate 96, MoE / shared-expert intermediate 32, MLA ranks 32, SSM / linear-attention dims small;
* depth: layer 0 (models often build it differently) and, after it, the first layer of each distinct kind,
  where per-layer lists (`layer_types`, `mlp_layer_types`, index lists such as `mlp_only_layers`, per-layer
  overrides) or interval settings (`first_k_dense_replace`, `full_attention_interval`,
  `sliding_window_pattern`, `attn_layer_period`/`_offset`, ...) make layers differ; 2 layers for a uniform
  model. Lists are cut to the chosen layers and intervals refit so that each layer keeps its kind;
* vocab 256, with every special token id moved inside it; experts 4, top-k 2 (expert groups 2, top-k group 1);
  sliding windows 8; values that are already small stay; a size that is None stays None.

Every value that is not a size (multipliers, scales, softcaps, dropout, eps, flags, strings) is left alone.
`max_position_embeddings` is left alone too unless the model holds a table of that size (learned positions).

`tiny_causal_lm(config)` builds the twin with a seeded init, after checking its parameter count on the meta
device, and `tiny_batch(model)` gives a small padded batch with labels to run a training step on it.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

from liger_cli.twin.shrink_layers import shrink_layers
from liger_cli.twin.shrink_rules import (
    _CAP,
    _CAPS,
    _HEAD_DIMS,
    _KV_HEADS,
    _VOCAB_NAMES,
    KV_HEADS,
    VOCAB,
    _get,
    _is_token_name,
    _set,
)


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
_SAME = (_HEAD_DIMS, set(_CAPS[0][1].split()) | {"attention_hidden_size"})


def _fill_defaults(cfg) -> None:
    """Sizes some configs leave None for the model to derive; set the usual values (no effect on structure)."""
    heads = _get(cfg, "num_attention_heads")
    if isinstance(heads, int) and heads > 0:
        if "num_key_value_heads" in vars(cfg) and _get(cfg, "num_key_value_heads") is None:
            cfg.num_key_value_heads = heads
        if (
            "head_dim" in vars(cfg)
            and _get(cfg, "head_dim") is None
            and isinstance(_get(cfg, "hidden_size"), int)
        ):
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
        if (
            "dim" in name
            and isinstance(value, (list, tuple))
            and len(value) > 1
            and old_hidden
            and hidden
            and all(isinstance(x, int) for x in value)
            and sum(value) == old_hidden
            and hidden < old_hidden
        ):
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
    factors = [
        p.get("partial_rotary_factor") for p in nested if isinstance(p.get("partial_rotary_factor"), float)
    ]
    return values.get("partial_rotary_factor") or (factors[0] if factors else 1.0)


def _fit_ssm_heads(cfg, old: dict) -> None:
    """SSM heads x head dim must still fill the SSM inner width (expand x hidden) when they did before."""
    hidden, old_hidden = _get(cfg, "hidden_size", None), old.get("hidden_size")
    expand = old.get("mamba_expand") or old.get("expand")
    for heads_name, dim_name in (
        ("mamba_n_heads", "mamba_d_head"),
        ("mamba_num_heads", "mamba_head_dim"),
        ("n_mamba_heads", "mamba_headdim"),
        ("num_heads", "head_dim"),
    ):
        h, d = old.get(heads_name), old.get(dim_name)
        if not (
            isinstance(h, int) and isinstance(d, int) and isinstance(expand, (int, float)) and old_hidden
        ):
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
    heads = next(
        (
            _get(cfg, h)
            for h in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
            if isinstance(_get(cfg, h, None), int)
        ),
        None,
    )
    if groups and heads and isinstance(_get(cfg, groups), int) and heads % _get(cfg, groups):
        _set(cfg, groups, 1)


# --- vocab and special tokens ------------------------------------------------------------------------------


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
            rotary = int(
                head * p.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", 1.0) or 1.0)
            )
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


def _shrink_overrides(overrides: dict, old: dict, cfg) -> None:
    """Shrink one layer's overrides as a config of its own; a size that differed from the global one still
    differs (twice or half the shrunk global value), so that the twin stays heterogeneous."""
    layer = SimpleNamespace(**{**old, **overrides})
    _shrink_widths(layer, {**old, **overrides})
    for key, before in overrides.items():
        new, shrunk_global = vars(layer)[key], _get(cfg, key)
        if _is_size(new) and _is_size(before) and _is_size(old.get(key)) and before != old[key]:
            if new == shrunk_global:
                new = new * 2 if before > old[key] else max(1, new // 2)
        overrides[key] = new


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink_one(cfg, rounds: int = 1) -> None:
    # heterogeneous configs (per-layer overrides) are shrunk as plain ones, then their overrides put back
    spec = vars(cfg).pop("_heterogeneity_spec", None)
    if spec is not None:
        vars(cfg)["per_layer_config"] = copy.deepcopy(spec.per_layer_overrides)
    _fill_defaults(cfg)
    old = copy.deepcopy(vars(cfg))
    shrink_layers(cfg, rounds)
    _shrink_widths(cfg, old)
    for overrides in (vars(cfg).get("per_layer_config") or {}).values():
        _shrink_overrides(overrides, old, cfg)
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
