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
    """A column of numbers as a NumPy array."""
    values, rows = _stored(dataset, name)
    found = values.to_numpy()
    return found if rows is None else found[rows]


def list_lengths(dataset, name: str) -> np.ndarray:
    """The length of each list of a list column (the tokens of each example)."""
    import pyarrow.compute as pc

    values, rows = _stored(dataset, name)
    found = pc.list_value_length(values).to_numpy().astype(np.int64)
    return found if rows is None else found[rows]


def learned_per_example(dataset, name: str = "labels") -> np.ndarray:
    """How many labels of each example are learned, its first label aside (never a prediction target)."""
    import pyarrow.compute as pc

    values, rows = _stored(dataset, name)
    lengths = pc.list_value_length(values).to_numpy().astype(np.int64)
    learned = pc.list_flatten(values).to_numpy() != IGNORE_INDEX
    ends = np.cumsum(lengths)
    starts = ends - lengths
    running = np.concatenate([[0], np.cumsum(learned, dtype=np.int64)])
    per = running[ends] - running[starts]
    nonempty = lengths > 0
    per[nonempty] -= learned[starts[nonempty]]
    return per if rows is None else per[rows]


def _stored(dataset, name: str):
    """The column as the table under the dataset stores it (every row, no copy), and which of its rows
    the dataset shows, in order (None: all): a selection is applied to the per-row results, not to the
    lists, which would copy every token."""
    indices = getattr(dataset, "_indices", None)  # how `datasets` keeps a selection: a column of rows
    rows = None if indices is None else indices.column(0).to_numpy()
    return dataset.data.column(name), rows


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


def pack_table(dataset, max_seq_len: int, chunk: int):
    """`encode.pack_examples` over each run of `chunk` consecutive examples, as column operations: the
    tokens stay in order, packed rows are new list offsets over them, each example's first label becomes
    -100 and its position_ids restart at 0. Reads the lengths column once; one Arrow chunk per run."""
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets.table import InMemoryTable

    ids, labels = column(dataset, "input_ids"), column(dataset, "labels")
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    if (lengths == 0).any():
        raise ValueError("an example without tokens cannot be packed")
    flat = {
        "input_ids": pc.list_flatten(ids).to_numpy(zero_copy_only=False).astype(np.int64),
        "labels": pc.list_flatten(labels).to_numpy(zero_copy_only=False).astype(np.int64),
    }
    first = np.cumsum(lengths) - lengths  # each example's first token
    flat["labels"][first] = IGNORE_INDEX
    flat["position_ids"] = np.arange(len(flat["input_ids"]), dtype=np.int64) - np.repeat(first, lengths)
    kinds = {  # as the source columns hold them (input_ids: int32, as `datasets` writes that column)
        name: dataset.data.schema.field(name).type if name in dataset.column_names else pa.list_(pa.int64())
        for name in flat
    }
    pieces: dict[str, list] = {name: [] for name in flat}
    for k in range(0, len(lengths), chunk):
        begin, end = first[k], first[k] + lengths[k : k + chunk].sum()
        rows = k + pack_starts(lengths[k : k + chunk], max_seq_len)
        offsets = pa.array(np.append(first[rows], end) - begin, type=pa.int32())
        for name, values in flat.items():
            values = pa.array(values[begin:end], type=kinds[name].value_type)
            pieces[name].append(pa.ListArray.from_arrays(offsets, values))
    arrays = {name: pa.chunked_array(found, type=kinds[name]) for name, found in pieces.items()}
    return datasets.Dataset(InMemoryTable(pa.table(arrays)))


def flat_values(dataset, name: str) -> np.ndarray:
    """The values of a list column, every row's list joined in the dataset's order (a selection applied
    by index arithmetic, not row by row)."""
    import pyarrow.compute as pc

    values, rows = _stored(dataset, name)
    flat = pc.list_flatten(values).to_numpy(zero_copy_only=False)
    if rows is None:
        return flat
    lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False).astype(np.int64)
    starts, taken = np.cumsum(lengths) - lengths, lengths[rows]
    into = np.cumsum(taken) - taken
    return flat[np.arange(taken.sum()) - np.repeat(into, taken) + np.repeat(starts[rows], taken)]
