"""Several sources into one split: the eval_fraction hold-out of each source, and the weighted mixture.

The mixture's epoch: with N kept examples over all sources and weight w_i normalised to p_i = w_i / sum w,
source i gives k_i = p_i x N examples (rounded so they add up to N; largest remainders first). A source
with k_i <= n_i (its kept examples) gives k_i of them drawn without replacement; one with k_i > n_i gives
each of its examples k_i // n_i times plus k_i % n_i drawn without replacement. Equal weights therefore
mean equal shares of examples, not "every example once". The draws and the order of the mixed examples
are seeded by training.seed (and the source's position), so the same recipe gives the same mixture. An
eval list is not mixed: each eval source is read whole, once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from liger_cli.data.images import IMAGE_COLUMNS, IMAGES_COLUMN
from liger_cli.data.split import Share, Split
from liger_cli.errors import UserError


def fraction_orders(n: int, fraction: float, seed: int, path: Path) -> tuple[list[int], list[int]]:
    """The rows kept for training and the rows held out for eval, in the order `datasets`'
    train_test_split gives them for a file of n rows (the split liger has always made)."""
    import datasets

    if not 0 < fraction < 1:
        raise UserError(f"data error: data.eval_fraction must be between 0 and 1 (exclusive), got {fraction}")
    n_eval = round(n * fraction)
    if n_eval < 1 or n_eval >= n:
        raise UserError(
            f"data error: {path}: eval_fraction {fraction} of {n} rows leaves "
            f"{n_eval} eval rows; use a larger file, another fraction, or data.eval"
        )
    index = datasets.Dataset.from_dict({"i": list(range(n))})
    split = index.train_test_split(test_size=n_eval, seed=seed, shuffle=True, keep_in_memory=True)
    return split["train"]["i"][:], split["test"]["i"][:]


def counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Examples per source in one epoch of the mixture (see the module docstring)."""
    total, wsum = sum(sizes), sum(weights)
    exact = [total * w / wsum for w in weights]
    found = [int(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (found[i] - exact[i], i))
    for i in by_remainder[: total - sum(found)]:
        found[i] += 1
    return found


def draw(n: int, k: int, seed: int, position: int) -> list[int]:
    """k indices into n examples: each example k // n times, then k % n of them without replacement."""
    rng = np.random.default_rng([seed, position])
    repeats, rest = divmod(k, n)
    return list(range(n)) * repeats + sorted(rng.choice(n, size=rest, replace=False).tolist())


def same_columns(tables: list) -> list:
    """Sources with images beside sources without: the latter get the image columns, empty (no image)."""
    with_images = [t for t in tables if IMAGES_COLUMN in t.column_names]
    if not with_images or len(with_images) == len(tables):
        return tables
    features, out = with_images[0].features, []
    for table in tables:
        for name in IMAGE_COLUMNS if IMAGES_COLUMN not in table.column_names else ():
            empty = b"" if name == IMAGES_COLUMN else []
            table = table.add_column(name, [empty] * len(table), feature=features[name])
        out.append(table)
    return out


def mixture(parts: list[Split], weights: list[float] | None, seed: int) -> Split:
    """One split from several: by weight (train; a seeded order), or each part whole, in order (eval)."""
    import datasets

    sizes = [len(part.examples) for part in parts]
    wanted = counts(sizes, weights) if weights is not None else sizes
    taken = [
        draw(n, k, seed, i) if weights is not None else list(range(n))
        for i, (n, k) in enumerate(zip(sizes, wanted, strict=True))
    ]
    offsets = np.cumsum([0, *sizes[:-1]])
    picked = [(i, offsets[i] + j) for i, indices in enumerate(taken) for j in indices]
    if weights is not None:
        order = np.random.default_rng(seed).permutation(len(picked))
        picked = [picked[k] for k in order]
    together = datasets.concatenate_datasets(same_columns([part.examples for part in parts]))
    split = Split(
        Path(" + ".join(str(part.path) for part in parts)),
        sum(part.rows for part in parts),
        together.select([int(j) for _, j in picked], keep_in_memory=True),
        None,
        parts[0].max_seq_len,
        parts[0].packing,
        truncated=sum(part.truncated for part in parts),
        warnings=[w for part in parts for w in part.warnings],
        cache="",
        shares=[
            Share(part, weights[i] if weights is not None else 1.0, taken[i]) for i, part in enumerate(parts)
        ],
        source_of=[i for i, _ in picked],
    )
    for part in parts:
        for reason, n in part.dropped.items():
            split.dropped[reason] = split.dropped.get(reason, 0) + n
    return split
