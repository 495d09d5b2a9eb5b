"""Statistics of encoded tables as Arrow and NumPy column operations.

A cached table of 100k examples is read column by column (lengths, learned-token counts, histograms,
packing fill), never row by row in Python: iterating a `datasets` column builds one Python list per
row, which took most of a cached `liger data`.
"""

from __future__ import annotations

import numpy as np

from liger_cli.data.encode import IGNORE_INDEX


def column(dataset, name: str):
    """The dataset's column as one pyarrow array, in the dataset's order (a selection applied)."""
    return dataset.with_format("arrow")[name].combine_chunks()


def numbers(dataset, name: str) -> np.ndarray:
    """A column of numbers (or strings) as a NumPy array."""
    return column(dataset, name).to_numpy(zero_copy_only=False)


def list_lengths(dataset, name: str) -> np.ndarray:
    """The length of each list of a list column (the tokens of each example)."""
    import pyarrow.compute as pc

    return pc.list_value_length(column(dataset, name)).to_numpy(zero_copy_only=False).astype(np.int64)


def learned_per_example(dataset, name: str = "labels") -> np.ndarray:
    """How many labels of each example are learned, its first label aside (never a prediction target)."""
    import pyarrow.compute as pc

    lists = column(dataset, name)
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    learned = pc.list_flatten(lists).to_numpy(zero_copy_only=False) != IGNORE_INDEX
    ends = np.cumsum(lengths)
    starts = ends - lengths
    running = np.concatenate([[0], np.cumsum(learned, dtype=np.int64)])
    per = running[ends] - running[starts]
    nonempty = lengths > 0
    per[nonempty] -= learned[starts[nonempty]]
    return per


def pack_starts(lengths: np.ndarray, max_seq_len: int) -> np.ndarray:
    """Where each row of the greedy packer (encode.pack_examples) starts, as example indices: a row
    takes examples while their tokens fit in max_seq_len (at least one). One step per packed row."""
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    starts, k, n = [], 0, len(lengths)
    while k < n:
        starts.append(k)
        k = max(k + 1, int(np.searchsorted(ends, ends[k] + max_seq_len, side="right")) - 1)
    return np.asarray(starts, dtype=np.int64)


def histogram(lengths: np.ndarray, max_seq_len: int, bins: int) -> np.ndarray:
    """Counts in `bins` equal bins up to max_seq_len, then one for the lengths past it."""
    width = -(-max_seq_len // bins)
    lengths = np.asarray(lengths, dtype=np.int64)
    which = np.where(lengths <= max_seq_len, np.minimum((lengths - 1) // width, bins), bins)
    return np.bincount(np.where(which < 0, bins, which), minlength=bins + 1)  # an empty one: the last
