"""What the benchmarks share (not a benchmark itself: ``cpslice bench`` runs the
``bench_*.py`` modules only).

The peak memory of one step (``peak_growth``: the growth of the peak RSS beyond the RSS
before it), and for the benchmarks that run torch.distributed a store this process
serves on a port it holds from the start (port 0: the system picks it, so no other
program can take it between choosing and binding), the ranks that join it, spawned,
and a median time taken in step on every rank.
"""

import ctypes
import gc
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped


def host_store() -> TCPStore:
    """A store served from this process on 127.0.0.1 (``store.port`` says where)."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join_store(port: int) -> TCPStore:
    """A client of the store ``host_store`` serves on ``port``, for
    ``torch.distributed.init_process_group(store=...)``."""
    return TCPStore("127.0.0.1", port, is_master=False)


def spawn_ranks(
    worker: Callable[..., None], world: int, args: tuple[Any, ...], timeout: float
) -> Any:
    """Run ``worker(rank, port, *args, queue)`` on ``world`` spawned processes that join
    a gloo group through the store held here; return what rank 0 puts on the queue."""
    store = host_store()  # held (and its port with it) until the ranks are done
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, store.port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=timeout)
    for p in procs:
        p.join(timeout=60)
    return result


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median wall ms of ``fn`` on every rank of the default group, after one warm-up
    call, each run started together (a barrier before it)."""
    fn()
    dist.barrier()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    assert match is not None
    return int(match.group(1)) * 1024


def _reset_peak() -> None:
    """Return the allocator's free heap to the system (glibc keeps up to tens of MiB
    of freed memory, which the next step would reuse unseen), then reset the peak RSS
    (``VmHWM``) to the current RSS."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    with open("/proc/self/clear_refs", "w") as f:  # Linux: '5' resets VmHWM to the RSS
        f.write("5")


def peak_growth(step: Callable[[], object]) -> int:
    """Bytes the peak RSS grows by during one ``step()`` beyond the RSS before it (the
    free heap returned and the peak reset first: ``_reset_peak``)."""
    _reset_peak()
    base = _rss_bytes()
    step()
    return _peak_bytes() - base
