"""What the GPU command (``benchmarks/gpu_check.py``) measures with, on a CUDA device or,
for its smoke run (``--smoke``), on the CPU: one ``Device`` holds every call that differs
between the two (synchronizing, timing a call, its peak memory, returning freed memory),
so that the same code runs on both and the smoke run proves it on a machine without a
GPU; and a ``Deadline`` that stops a stage past its share of the command's budget,
saying so, instead of overrunning it silently.

On CUDA a call is timed by CUDA events recorded around it (the device's own clock), and
its peak memory is the allocator's (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``) beyond what was allocated before it. On the CPU the wall
clock times it and the peak RSS's growth (``harness.peak_growth``) is its memory: smoke
figures, never the ones the goals speak of.
"""

import contextlib
import gc
import platform
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from types import FrameType

import torch

from .harness import peak_growth


class Device:
    """A CUDA device (``torch.device("cuda")``) or the CPU, and how each measures."""

    def __init__(self, where: str) -> None:
        self.where = torch.device(where)
        self.cuda = self.where.type == "cuda"

    def name(self) -> str:
        """The device's name (``NVIDIA H200``), or the CPU's."""
        if self.cuda:
            return torch.cuda.get_device_name(self.where)
        return f"CPU ({platform.processor() or platform.machine()}, smoke run)"

    def sync(self) -> None:
        """Wait for the work queued on the device (nothing to wait for on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.where)

    def elapsed_ms(self, fn: Callable[[], object]) -> float:
        """Milliseconds of one call of ``fn``: between CUDA events recorded before and after
        it (the queue drained first), or the wall clock on the CPU."""
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end))

    def median_ms(self, fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
        """The median of ``repeat`` timed calls of ``fn`` after ``warmup`` untimed ones."""
        for _ in range(warmup):
            fn()
        return float(statistics.median(self.elapsed_ms(fn) for _ in range(max(1, repeat))))

    def peak_growth(self, fn: Callable[[], object]) -> int:
        """Bytes the peak memory grows by during one call of ``fn`` beyond what was allocated
        before it: the CUDA allocator's peak (its statistics reset first), or on the CPU the
        peak RSS's (``harness.peak_growth``)."""
        if not self.cuda:
            return peak_growth(fn)
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.where)
        base = torch.cuda.memory_allocated(self.where)
        fn()
        self.sync()
        return torch.cuda.max_memory_allocated(self.where) - base

    def release(self) -> None:
        """Drop what no one holds: Python's garbage, then the CUDA allocator's cached blocks."""
        gc.collect()
        if self.cuda:
            self.sync()
            torch.cuda.empty_cache()

    def total_bytes(self) -> int:
        """The device's memory (0 on the CPU: not the smoke run's concern)."""
        return torch.cuda.get_device_properties(self.where).total_memory if self.cuda else 0


class OverBudget(BaseException):
    """Raised inside a ``Deadline.limit`` block that runs past its seconds: a
    ``BaseException``, as ``KeyboardInterrupt`` is, so that no ``except Exception`` of a
    method that fails (a peer's, a check's) takes it for a failure and goes on."""


class Deadline:
    """The command's budget: ``seconds`` from now. ``limit`` raises ``OverBudget`` inside a
    block that runs past its share (SIGALRM: between two Python bytecodes, so a CUDA
    synchronization in progress ends first)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left(self) -> float:
        """Seconds left before the deadline (negative past it)."""
        return self.end - time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the command started."""
        return time.monotonic() - self.start

    @contextlib.contextmanager
    def limit(self, seconds: float) -> Iterator[float]:
        """Within the block, at most ``seconds`` and never past the deadline (it yields
        the seconds it allows): past them, ``OverBudget`` is raised in the block."""
        allowed = max(0.001, min(seconds, self.left()))

        def stop(signum: int, frame: FrameType | None) -> None:
            raise OverBudget(f"past its {allowed:.3g} s")

        before = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, allowed)
        try:
            yield allowed
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
