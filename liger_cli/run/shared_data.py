"""Tokenize once per machine: the local main process builds the data cache while the others wait.

Why not `accelerator.wait_for_everyone()`: it is a collective (a gloo/NCCL barrier) with the process
group's timeout (30 minutes by default for NCCL, for gloo as well), and tokenizing a large dataset can
take longer, so the waiting ranks would die of a timeout with nothing wrong. Here the waiting ranks poll
the process group's key-value store (`check` never blocks, so there is no timeout to hit) until the
local main process writes whether it succeeded; then they prepare the data themselves, which reads every
entry from the cache. If the main process failed, they prepare it too and meet the same error (a bad
row is then reported by every rank, as it was before there was a cache).

One key per machine (several machines with their own disks each build their cache; on a shared disk the
atomic rename of a cache entry keeps one copy), and a counter per call, since several runs may share
one process group (tests/dist_driver.py).
"""

from __future__ import annotations

import time

_CALLS = {"n": 0}
POLL_S = 0.2


def build_once(accelerator, data_cfg, build):
    """`build()` (prepare the data) on the local main process first, then on the others."""
    _CALLS["n"] += 1
    if accelerator.num_processes == 1 or not getattr(data_cfg, "cache", True):
        return build()  # no cache: every rank tokenizes, as without one
    store = _store()
    if store is None:  # no process group store (some launchers): a plain barrier
        if accelerator.is_local_main_process:
            result = build()
            accelerator.wait_for_everyone()
            return result
        accelerator.wait_for_everyone()
        return build()
    machine = accelerator.process_index - accelerator.local_process_index
    key = f"liger/data/{machine}/{_CALLS['n']}"
    if accelerator.is_local_main_process:
        try:
            result = build()
        except BaseException:
            store.set(key, "failed")
            raise
        store.set(key, "ok")
        return result
    while not store.check([key]):
        time.sleep(POLL_S)
    return build()


def _store():
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except (ImportError, RuntimeError, AttributeError, ValueError):
        return None
