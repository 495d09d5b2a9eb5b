"""How a source's rows are tokenized: by how many processes, through `datasets`' map.

data.num_proc when the recipe sets it; else every usable core, capped so that each process gets at
least MIN_ROWS_PER_PROCESS rows (a process costs a fork and a copy of the tokenizer, which a few
hundred rows do not pay back). A run of several processes tokenizes on the main process of each
machine only when the cache is on (liger_cli.run.shared_data); with the cache off every process of
the machine tokenizes, so the cores are shared out between them.
"""

from __future__ import annotations

import os

from liger_cli.data.files import quiet_datasets
from liger_cli.process_state import tokenizers_single_threaded

MIN_ROWS_PER_PROCESS = 2000
BATCH_ROWS = 1000  # rows per call of the encoding function


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def tokenizing_processes(data_cfg, rows: int) -> int:
    """data.num_proc, else the default described in the module docstring (at least 1)."""
    asked = getattr(data_cfg, "num_proc", None)
    if asked:
        return int(asked)
    cores = usable_cores()
    if not getattr(data_cfg, "cache", True):  # every process of this machine tokenizes its own copy
        cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(cores, rows // MIN_ROWS_PER_PROCESS))


def encode_table(rows, encode_batch, fingerprint: str, processes: int):
    """The encoded table: `encode_batch` mapped over batches of BATCH_ROWS rows by `processes` processes,
    in memory, never from `datasets`' own cache (liger_cli.data.cache is the cache)."""
    with quiet_datasets(), tokenizers_single_threaded(processes > 1):
        return rows.map(
            encode_batch,
            batched=True,
            batch_size=BATCH_ROWS,
            remove_columns=rows.column_names,
            load_from_cache_file=False,
            keep_in_memory=True,
            num_proc=processes if processes > 1 else None,
            new_fingerprint=fingerprint,
        )
