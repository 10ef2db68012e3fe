"""How many rows each kernel call of the default reduction takes: the chunk sizing.

``Chunks`` holds the rows per chunk of the eager loop (``default_chunk_rows``: its two
work buffers within a cache-sized budget) and of the compiled kernels
(``compiled_chunk_rows``: a power of two, one fixed shape per chunk); ``chunks_for``
picks both for a pass (or takes the caller's ``chunk_size``), and ``Workspace`` holds the
eager loop's work buffers for a pass. The drivers size their passes here, and the eager
(``backends.eager``) and compiled (``backends.compiled``) backends read the sizes: a
module of its own, below both and below the engine's interface (``kernels``), so that
none of them imports another to learn a size.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from ..._types import compute_dtype

CHUNK_BYTES = 64 * 2**20
CPU_CHUNK_BYTES = 8 * 2**20
"""Eager row chunks are sized so that the two work buffers of one chunk hold about this
many bytes together (at least one row). On the CPU a chunk small enough to stay in the
last-level cache makes the several elementwise passes over it cheap (measured: 8 MiB is
1.4x faster than 64 MiB at T=4096, V=32768); on an accelerator larger chunks amortize
the per-kernel launch cost (measured on an H200: 64 MiB within 10% of 1 GiB chunks,
8 MiB 5x slower)."""
CPU_COMPILED_CHUNK_BYTES = 32 * 2**20
COMPILED_CHUNK_BYTES = 2**30
"""Rows per compiled chunk: ``[C, V]`` of the compute dtype within these bytes (CPU /
other devices), rounded down to a power of two. A compiled chunk needs no work buffer,
so the size only trades per-call overhead (and, on a GPU, occupancy) against the
redundant overlap of the tail chunk: on a GPU a chunk of a few hundred rows of a large
vocabulary would leave most of the device idle (one row per program)."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=compute_dtype(dtype)).element_size()


def default_chunk_rows(
    vocab: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> int:
    """Rows per eager chunk when ``chunk_size`` is None: two ``[rows, vocab]`` work buffers
    of the compute dtype within ``CPU_CHUNK_BYTES`` on the CPU and ``CHUNK_BYTES`` on any
    other device; at least one row."""
    budget = CPU_CHUNK_BYTES if torch.device(device).type == "cpu" else CHUNK_BYTES
    return max(1, budget // (2 * max(vocab, 1) * _itemsize(dtype)))


def compiled_chunk_rows(
    vocab: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> int:
    """Rows ``C`` of a compiled chunk: ``[C, vocab]`` of the compute dtype within
    ``CPU_COMPILED_CHUNK_BYTES`` on the CPU, ``COMPILED_CHUNK_BYTES`` elsewhere, rounded
    down to a power of two; at least 1."""
    budget = CPU_COMPILED_CHUNK_BYTES if torch.device(device).type == "cpu" else COMPILED_CHUNK_BYTES
    rows = max(1, budget // (max(vocab, 1) * _itemsize(dtype)))
    return 1 << (rows.bit_length() - 1)


class Chunks(NamedTuple):
    """Rows per chunk of the eager loop and of the compiled kernels."""

    eager: int
    compiled: int


def chunks_for(chunk_size: int | None, vocab: int, dtype: torch.dtype, device: torch.device) -> Chunks:
    """``chunk_size`` rows for both when given, else ``default_chunk_rows`` and
    ``compiled_chunk_rows`` of ``[*, vocab]`` blocks."""
    if chunk_size is not None:
        return Chunks(chunk_size, chunk_size)
    return Chunks(default_chunk_rows(vocab, dtype, device), compiled_chunk_rows(vocab, dtype, device))


class Workspace:
    """The eager loop's work buffers of the compute dtype (two; three with a cap), made on
    first use at the largest size asked of them and reused for every chunk (and block) of
    one pass."""

    def __init__(self) -> None:
        self._flat: list[Tensor] = []

    def take(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, count: int = 2) -> list[Tensor]:
        n = shape[0] * shape[1]
        if len(self._flat) < count or self._flat[0].numel() < n:
            size = max(n, self._flat[0].numel() if self._flat else 0)
            self._flat = [torch.empty(size, dtype=dtype, device=device) for _ in range(max(count, len(self._flat)))]
        return [buf[:n].view(shape) for buf in self._flat[:count]]
