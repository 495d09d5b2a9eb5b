"""Shrink any causal-LM config to a tiny twin: the same architecture, sizes small enough to build at once.

`shrink_config(config)` returns a deep copy of any transformers causal-LM config (the user's own, a published
70B one, remote code) whose sizes are small but whose class, flags, multipliers, activations, rope type,
layer-type pattern and MoE routing style are unchanged. It applies the rules of `shrink_rules.py` (data
only, by attribute name) to every config nested in it, in this order (`_shrink_one`):

* depth: layer 0 (models often build it differently), then the first later layer of each distinct kind
  (per-layer lists, index lists, per-layer overrides, interval and period settings); lists are cut to the
  kept layers and intervals refit so that each layer keeps its kind; 2 layers for a uniform model;
* widths: each size capped; sizes that were equal, or fit together (heads x head dim = width), still do;
* vocab 256, every special token id moved inside it; rope lists sized by the head follow it.

Every value that is not a size is left alone, and so is `max_position_embeddings` unless the model holds a
table of that size (`shrink_positions`, which `tiny.py` calls once it has seen the model).
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

from liger_cli.twin import shrink_rules as rules


def shrink_config(config, rounds: int = 1):
    """A deep copy of `config` with every size shrunk and every other setting kept (see the module doc).

    Composite configs (a text config inside a vision-language one, attention/FFN sub-configs) shrink
    throughout; the returned object is of the same class as `config`, ready for
    `AutoModelForCausalLM.from_config`. `rounds` 2 keeps two layers of each kind.
    """
    config = copy.deepcopy(config)
    configs = sub_configs(config)
    for cfg in configs:
        _shrink_one(cfg, rounds)
    try:
        vocab = config.get_text_config(decoder=True).vocab_size
    except (ValueError, AttributeError):
        vocab = getattr(config, "vocab_size", rules.VOCAB)
    vocab_ids: dict[int, int] = {}
    for cfg in configs:
        _move_token_ids(cfg, stored(cfg, "vocab_size") or vocab or rules.VOCAB, vocab_ids)
    return config


def position_sizes(config) -> set[int]:
    """The position-table sizes (`max_position_embeddings` and its synonyms) above `MAX_POSITIONS`."""
    sizes = {getattr(c, n, None) for c in sub_configs(config) for n in rules.POSITION_NAMES} - {None}
    return {s for s in sizes if isinstance(s, int) and s > rules.MAX_POSITIONS}


def shrink_positions(config) -> None:
    """Cap the position sizes at `MAX_POSITIONS`, in place: for a model that holds a table of that size."""
    for cfg in sub_configs(config):
        for key in rules.POSITION_NAMES:
            if isinstance(stored(cfg, key), int) and stored(cfg, key) > rules.MAX_POSITIONS:
                _set(cfg, key, rules.MAX_POSITIONS)


def sub_configs(config) -> list:
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


def stored(cfg, name: str, default=None):
    """An attribute as stored (per-layer configs refuse a plain getattr of their varying attributes)."""
    return vars(cfg).get(name, default)


def _set(cfg, name: str, value) -> None:
    """Set an attribute; derived read-only ones (properties that refuse a value) are skipped."""
    try:
        setattr(cfg, name, value)
    except (AttributeError, NotImplementedError):
        pass


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink_one(cfg, rounds: int) -> None:
    # heterogeneous configs (per-layer overrides) are shrunk as plain ones, then their overrides put back
    spec = vars(cfg).pop("_heterogeneity_spec", None)
    if spec is not None:
        vars(cfg)["per_layer_config"] = copy.deepcopy(spec.per_layer_overrides)
    _fill_defaults(cfg)
    old = copy.deepcopy(vars(cfg))
    _shrink_layers(cfg, rounds)
    _shrink_widths(cfg, old)
    for overrides in (vars(cfg).get("per_layer_config") or {}).values():
        _shrink_overrides(overrides, old, cfg)
    if spec is not None:
        cfg.per_layer_config = vars(cfg).pop("per_layer_config")
    for name in rules.VOCAB_NAMES:
        value = stored(cfg, name)
        if _is_size(value) and value > rules.VOCAB:
            _set(cfg, name, rules.VOCAB)
    _shrink_rope(cfg, old)


def _fill_defaults(cfg) -> None:
    """Sizes some configs leave None for the model to derive; set the usual values (no effect on structure)."""
    heads = stored(cfg, "num_attention_heads")
    if isinstance(heads, int) and heads > 0:
        if "num_key_value_heads" in vars(cfg) and stored(cfg, "num_key_value_heads") is None:
            cfg.num_key_value_heads = heads
        hidden = stored(cfg, "hidden_size")
        if "head_dim" in vars(cfg) and stored(cfg, "head_dim") is None and isinstance(hidden, int):
            cfg.head_dim = cfg.hidden_size // heads


# --- depth: one layer of each kind, each kind where it was ------------------------------------------------
def _shrink_layers(cfg, rounds: int) -> None:
    layers_name, n = next(
        ((k, v) for k in rules.LAYER_NAMES if _is_size(v := stored(cfg, k)) and v > 0), (None, 0)
    )
    if n == 0:
        return
    per_layer, indices, keyed = _layer_lists(cfg, n)
    intervals = {k: v for k in rules.INTERVALS if _is_size(v := stored(cfg, k)) and v > 0}
    periods = {names: (stored(cfg, names[0]), stored(cfg, names[1])) for names in rules.PERIODS}
    periods = {
        k: (p, o) for k, (p, o) in periods.items() if isinstance(p, int) and isinstance(o, int) and p > 0
    }
    kinds = _kinds(n, per_layer, indices, keyed, intervals, list(periods.values()))
    chosen = _choose_layers(kinds, n, rounds)
    for name, value in vars(cfg).items():  # patterns shorter than the model (cycled block types): a cycle
        shorter = isinstance(value, list) and 1 < len(value) < n
        if shorter and name.endswith("types") and name not in per_layer:
            while len(chosen) < len(value):
                chosen.append(next(i for i in range(n) if i not in chosen))
            chosen.sort()
    m = len(chosen)
    for name in rules.LAYER_NAMES:
        if stored(cfg, name) == n:
            _set(cfg, name, m)
    for name, values in per_layer.items():
        _set(cfg, name, [values[i] for i in chosen])
    for name, values in indices.items():
        _set(cfg, name, [j for j, i in enumerate(chosen) if i in values])
    renumber = {i: j for j, i in enumerate(chosen)}
    for name, d in keyed.items():  # {"05": {...}}: the same entries under the new layer numbers
        vars(cfg)[name] = {
            str(renumber[int(k)]).zfill(len(k)) if isinstance(k, str) else renumber[k]: v
            for k, v in d.items()
            if int(k) in renumber
        }
    for name, v in intervals.items():
        _set(cfg, name, _refit_interval(name, v, [rules.INTERVALS[name](i, v, n) for i in chosen]))
    if isinstance(stored(cfg, "moe_layer_end_index"), int) and cfg.moe_layer_end_index >= 0:
        cfg.moe_layer_end_index = m - 1
    for (p_name, o_name), (p, o) in periods.items():
        wanted = [i % p == o for i in chosen]
        for period in range(1, m + 2):
            fits = [off for off in range(period) if [j % period == off for j in range(m)] == wanted]
            if fits:
                _set(cfg, p_name, period)
                _set(cfg, o_name, fits[0])
                break
    # gpt-neo style [[pattern, repeat], ...]
    types = stored(cfg, "attention_types")
    if isinstance(types, list) and types and all(isinstance(t, list) and len(t) == 2 for t in types):
        pattern = types[0][0]
        cfg.attention_types = [[pattern, max(1, math.ceil(m / len(pattern)))]]
        _set(cfg, layers_name, len(pattern) * cfg.attention_types[0][1])
        if isinstance(stored(cfg, "attention_layers"), list):
            cfg.attention_layers = pattern * cfg.attention_types[0][1]


def _layer_lists(cfg, n: int) -> tuple[dict[str, list], dict[str, list[int]], dict[str, dict]]:
    """Per-layer lists (length n), layer-index lists (increasing ints < n) and dicts keyed by layer index."""
    per_layer, indices, keyed = {}, {}, {}
    for name, value in vars(cfg).items():
        if name.startswith("__") or not value:
            continue
        if isinstance(value, list) and all(_is_size(x) for x in value):
            if (
                all(0 <= a < b < n for a, b in zip(value, value[1:], strict=False))
                and value[-1] < n
                and ("layer" in name or "idx" in name or "ids" in name)
            ):
                indices[name] = value
                continue
        if isinstance(value, list) and len(value) == n and not _is_token_name(name):
            per_layer[name] = value
        elif isinstance(value, dict) and all(
            str(k).isdigit() and isinstance(v, dict) for k, v in value.items()
        ):
            keyed[name] = value
    return per_layer, indices, keyed


def _kinds(n: int, per_layer, indices, keyed, intervals, periods) -> list[tuple]:
    """Each layer's kind: what the per-layer lists, index lists, interval and period settings say of it."""
    kinds = []
    for i in range(n):
        # per-layer sizes (a width per layer) are shrunk, not kinds; everything else per layer is a kind
        kind = [
            repr(values[i])
            for name, values in per_layer.items()
            if name not in rules.CAP and name not in rules.KV_HEAD_NAMES
        ]
        kind += [i in values for values in indices.values()]
        kind += [repr(next((d[k] for k in d if int(k) == i), None)) for d in keyed.values()]
        kind += [rules.INTERVALS[name](i, v, n) for name, v in intervals.items()]
        kind += [i % p == o for p, o in periods]
        kinds.append(tuple(kind))
    return kinds


def _choose_layers(kinds: list[tuple], n: int, rounds: int) -> list[int]:
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
        if [rules.INTERVALS[name](i, v, n) for i in range(n)] == wanted:
            return v
    return 0 if name in rules.OFF_AT_ZERO and not any(wanted) else value


# --- widths -------------------------------------------------------------------------------------------------
def _shrink_widths(cfg, old: dict) -> None:
    for name, value in list(vars(cfg).items()):
        if name in rules.CAP:
            _set(cfg, name, _cap(value, rules.CAP[name]))
    for names in rules.TIED:
        present = [n for n in names if _is_size(old.get(n))]
        for value in {old[n] for n in present}:
            equal = [n for n in present if old[n] == value]
            if len(equal) > 1:
                smallest = min(stored(cfg, n) for n in equal)
                for n in equal:
                    _set(cfg, n, smallest)
    hidden, old_hidden = stored(cfg, "hidden_size"), old.get("hidden_size")
    for name, value in old.items():  # dims that split the hidden size (reformer's axial position dims)
        split = isinstance(value, (list, tuple)) and len(value) > 1 and all(isinstance(x, int) for x in value)
        if split and "dim" in name and old_hidden and hidden and sum(value) == old_hidden > hidden:
            new = [max(1, x * hidden // old_hidden) for x in value]
            new[-1] += hidden - sum(new)
            _set(cfg, name, type(value)(new))
    # a width that was a multiple of hidden stays one (zamba2: attention over concatenated streams)
    width = old.get("attention_hidden_size")
    if isinstance(width, int) and isinstance(old_hidden, int) and old_hidden and width % old_hidden == 0:
        cfg.attention_hidden_size = width // old_hidden * hidden
    heads = next((h for h in (stored(cfg, k) for k in rules.HEAD_NAMES) if h), None)
    old_heads = next((h for h in (old.get(k) for k in rules.HEAD_NAMES) if h), None)
    for name in rules.KV_HEAD_NAMES:
        kv = stored(cfg, name)
        if _is_size(kv) and kv > 1:
            _set(cfg, name, heads if kv == old_heads and heads else min(kv, rules.KV_HEADS))
    # heads x head dim = width, where it was so before
    w, h, d = old.get("attention_hidden_size"), old.get("num_attention_heads"), old.get("attention_head_dim")
    if isinstance(w, int) and isinstance(h, int) and isinstance(d, int) and w == h * d:
        cfg.attention_head_dim = cfg.attention_hidden_size // cfg.num_attention_heads
    # linear attention: value heads a multiple of key heads
    k, v = old.get("linear_num_key_heads"), old.get("linear_num_value_heads")
    if isinstance(k, int) and isinstance(v, int) and k > 0:
        cfg.linear_num_value_heads = stored(cfg, "linear_num_key_heads") * max(1, v // k)
    # the rotary part of head_dim is the MLA rope head (dots3: 256 x 0.25 = 64): keep it so
    head, rope, partial = old.get("head_dim"), old.get("qk_rope_head_dim"), _partial_rotary(old)
    if isinstance(head, int) and isinstance(rope, int) and partial < 1 and int(head * partial) == rope:
        cfg.head_dim = int(stored(cfg, "qk_rope_head_dim") / partial)
    # MLA: the query/key head is nope + rope
    if isinstance(old.get("qk_head_dim"), int) and isinstance(stored(cfg, "qk_nope_head_dim"), int):
        cfg.qk_head_dim = stored(cfg, "qk_nope_head_dim") + (stored(cfg, "qk_rope_head_dim") or 0)
    _fit_ssm_heads(cfg, old)


def _cap(value, cap: int):
    if _is_size(value):
        return min(value, cap) if value > 0 else value
    if isinstance(value, list) and all(_is_size(x) for x in value):
        return [min(x, cap) if x > 0 else x for x in value]
    return value


def _partial_rotary(values: dict) -> float:
    """partial_rotary_factor, from the config or its (possibly per-layer-type) rope parameters."""
    params = values.get("rope_parameters") or values.get("rope_scaling") or {}
    nested = [p for p in params.values() if isinstance(p, dict)] + [params]
    factors = [
        p["partial_rotary_factor"] for p in nested if isinstance(p.get("partial_rotary_factor"), float)
    ]
    return values.get("partial_rotary_factor") or (factors[0] if factors else 1.0)


def _fit_ssm_heads(cfg, old: dict) -> None:
    """SSM heads x head dim must still fill the SSM inner width (expand x hidden) when they did before."""
    hidden, old_hidden = stored(cfg, "hidden_size"), old.get("hidden_size")
    expand = old.get("mamba_expand") or old.get("expand")
    known = isinstance(expand, (int, float)) and old_hidden
    for heads_name, dim_name in rules.SSM_HEADS:
        h, d = old.get(heads_name), old.get(dim_name)
        if not (isinstance(h, int) and isinstance(d, int) and known):
            continue
        if h * d == int(expand * old_hidden):
            new_d = stored(cfg, dim_name)
            if dim_name == "mamba_headdim":  # zamba2 derives it from the heads
                new_d = int(expand * hidden) // stored(cfg, heads_name)
                _set(cfg, dim_name, new_d)
            _set(cfg, heads_name, max(1, int(expand * hidden) // new_d))
        elif old.get("mamba_d_ssm") == h * d:  # falcon-h1: an explicit SSM width
            cfg.mamba_d_ssm = stored(cfg, heads_name) * stored(cfg, dim_name)
    groups = next((g for g in rules.SSM_GROUPS if hasattr(cfg, g)), None)
    heads = next((stored(cfg, h) for h, _ in rules.SSM_HEADS if isinstance(stored(cfg, h), int)), None)
    if groups and heads and isinstance(stored(cfg, groups), int) and heads % stored(cfg, groups):
        _set(cfg, groups, 1)


def _shrink_overrides(overrides: dict, old: dict, cfg) -> None:
    """Shrink one layer's overrides as a config of its own; a size that differed from the global one still
    differs (twice or half the shrunk global value), so that the twin stays heterogeneous."""
    layer = SimpleNamespace(**{**old, **overrides})
    _shrink_widths(layer, {**old, **overrides})
    for key, before in overrides.items():
        new, shrunk_global = vars(layer)[key], stored(cfg, key)
        if _is_size(new) and _is_size(before) and _is_size(old.get(key)) and before != old[key]:
            if new == shrunk_global:
                new = new * 2 if before > old[key] else max(1, new // 2)
        overrides[key] = new


# --- rope and token ids ---------------------------------------------------------------------------------
def _shrink_rope(cfg, old: dict) -> None:
    """Rope lists sized by the head (longrope factors, mrope sections) follow the new head size."""
    for name in rules.ROPE_SETTINGS:
        params = stored(cfg, name)
        if not isinstance(params, dict):
            continue
        nested = params if all(isinstance(v, dict) for v in params.values()) and params else {None: params}
        for p in nested.values():
            heads = stored(cfg, "num_attention_heads") or 1
            head = stored(cfg, "head_dim") or (stored(cfg, "hidden_size") or 0) // heads
            factor = p.get("partial_rotary_factor", stored(cfg, "partial_rotary_factor", 1.0) or 1.0)
            rotary = int(head * factor)
            for key in ("short_factor", "long_factor"):
                if isinstance(p.get(key), list):
                    p[key] = p[key][: rotary // 2]
            section = p.get("mrope_section")
            if isinstance(section, list) and sum(section):
                scale = (rotary // 2) / sum(section)
                new = [max(1, int(s * scale)) for s in section]
                new[0] += rotary // 2 - sum(new)
                p["mrope_section"] = new


def _is_token_name(name: str) -> bool:
    return name.endswith(rules.TOKEN_SUFFIXES) or name in rules.TOKEN_NAMES


def _move_token_ids(cfg, vocab: int, mapping: dict[int, int]) -> None:
    """Ids at or above `vocab` move to its top; `mapping` keeps one id in one place across sub-configs."""

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
