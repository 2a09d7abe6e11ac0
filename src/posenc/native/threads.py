"""The threads the kernels of :mod:`posenc.native` run on: a call's rows split over ``torch.get_num_threads()``
threads where the work is large (ctypes releases the GIL during a call). Imports torch only.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

# tensors with at least this many elements are split over torch.get_num_threads() threads
PARALLEL_NUMEL = 1 << 18

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _threads() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    n = torch.get_num_threads()
    # a new pool when torch's thread count changed, or in a forked child (its parent's worker threads are gone)
    if _pool is None or _pool._max_workers != n or _pool_pid != os.getpid():  # noqa: SLF001
        _pool, _pool_pid = ThreadPoolExecutor(max_workers=n, thread_name_prefix="posenc-native"), os.getpid()
    return _pool


def _split(n: int, numel: int) -> list[tuple[int, int]]:
    """``[0, n)`` in one range, or one per thread where the work (``numel``) is large."""
    k = torch.get_num_threads() if numel >= PARALLEL_NUMEL else 1
    step = -(-n // max(1, k))
    return [(a, min(n, a + step)) for a in range(0, n, max(1, step))]


def _run(calls: list) -> None:
    """Run ``(fn, *args)`` calls, on the thread pool when there are several (ctypes releases the GIL)."""
    if len(calls) == 1:
        fn, *args = calls[0]
        fn(*args)
        return
    pool = _threads()
    for job in [pool.submit(*c) for c in calls]:
        job.result()
