"""Depth rules for tiny twins: keep one layer of each distinct kind, and keep each kind where it was.

Layers differ through per-layer lists (`layer_types`, `mlp_layer_types`), layer-index lists
(`mlp_only_layers`), per-layer overrides and interval settings (`first_k_dense_replace`,
`full_attention_interval`, `sliding_window_pattern`, `attn_layer_period`/`_offset`, ...). The twin keeps
layer 0 (models often build it differently) and the first later layer of each kind; lists are cut to
those layers and intervals refit so that every kept layer keeps its kind. A uniform model gets 2 layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from liger_cli.twin.shrink_rules import _CAP, _KV_HEADS, _LAYERS, _get, _is_token_name, _set

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
            if (
                all(0 <= a < b < n for a, b in zip(value, value[1:], strict=False))
                and value[-1] < n
                and ("layer" in name or "idx" in name or "ids" in name)
            ):
                indices[name] = value
                continue
        if isinstance(value, list) and len(value) == n and not _is_token_name(name):
            per_layer[name] = value
        elif (
            isinstance(value, dict)
            and value
            and all(str(k).isdigit() and isinstance(v, dict) for k, v in value.items())
        ):
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
    periods = [
        (_get(cfg, p), _get(cfg, o))
        for p, o in _PERIODS
        if isinstance(_get(cfg, p, None), int) and isinstance(_get(cfg, o, None), int) and _get(cfg, p) > 0
    ]
    kinds = []
    for i in range(n):
        # per-layer sizes (a width per layer) are shrunk, not kinds; everything else per layer is a kind
        kind = [
            repr(values[i])
            for name, values in per_layer.items()
            if name not in _CAP and name not in _KV_HEADS
        ]
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
    if name in (
        "num_kv_shared_layers",
        "first_k_dense_replace",
        "num_dense_layers",
        "max_window_layers",
        "moe_layer_start_index",
    ) and not any(wanted):
        return 0
    return value


def shrink_layers(cfg, rounds: int = 1) -> None:
    layers_name, n = _num_layers(cfg)
    if n == 0:
        return
    per_layer, indices, keyed = _layer_lists(cfg, n)
    intervals = _interval_settings(cfg)
    kinds = _kinds(cfg, n, per_layer, indices, keyed, intervals)
    chosen = _choose_layers(kinds, n, rounds)
    # patterns shorter than the model (cycled block types) need one full cycle
    for name, value in vars(cfg).items():
        if (
            name.endswith("types")
            and isinstance(value, list)
            and 1 < len(value) < n
            and name not in per_layer
        ):
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
    for name, d in keyed.items():  # {"05": {...}}: the same entries under the new layer numbers
        renumber = {i: j for j, i in enumerate(chosen)}
        vars(cfg)[name] = {
            str(renumber[int(k)]).zfill(len(k)) if isinstance(k, str) else renumber[k]: v
            for k, v in d.items()
            if int(k) in renumber
        }
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
