"""The rows a pass computes, as every kernel entry point takes them: ``rows``, an int64
index tensor of the block's local rows, ascending and without repeats, on the block's
device (None: every row). A kernel reads only those rows and writes only theirs, so
its work is proportional to their number whatever their runs, and a row outside them
(a prompt or padding row, whatever its logits) is never read: its statistics keep
their placeholders and its gradient row is left as it is (0 in a zeroed buffer).

A backend takes the index as it is: the default compiled kernels read chunks of a
fixed number of its rows where they are (``backends.compiled.chunk_stats_at``, an indirect load
in the fused loop; a Triton kernel would take one program per row). The eager loop
and invariant mode's compiled kernels walk the rows in pieces (``pieces``,
``chunked``): a piece whose rows are consecutive (every row, or a run of a CPU index)
is a slice, a view of the block; any other is its index, whose rows are gathered into a
contiguous buffer (``gather``) and their results written back at the index. A device
index is never read on the host.
"""

import torch
from torch import Tensor

from .._cache import boundary
from .memory import buffer

At = slice | Tensor
"""A piece of rows: a slice of consecutive rows, or an index tensor of them."""


@boundary  # data-dependent (nonzero): not for a compiled caller to trace
def index_of(need: Tensor, device: torch.device) -> Tensor | None:
    """The rows where ``need`` (CPU bool ``[T]``) is True, as the ascending int64 index on
    ``device`` that the kernels take; None where every row is (no index to read)."""
    if bool(need.all()):
        return None
    return need.nonzero()[:, 0].to(device)


def count(rows: Tensor | None, total: int) -> int:
    """The rows selected of ``total``."""
    return total if rows is None else int(rows.numel())


def size(at: At) -> int:
    """The rows of a piece (a slice from ``places``: its ``start`` and ``stop`` given)."""
    return int(at.stop - at.start) if isinstance(at, slice) else int(at.numel())


def places(rows: Tensor | None, bounds: list[tuple[int, int]]) -> list[At]:
    """Each ``[s, e)`` of ``bounds`` (positions among the selected rows) as the rows it
    holds: a slice where they are consecutive (``rows`` None; a run of a CPU index, read
    on the host, where it costs no sync, unless a compiled caller is tracing this), else
    the index ``rows[s:e]``."""
    if rows is None:
        return [slice(s, e) for s, e in bounds]
    host = rows.tolist() if rows.device.type == "cpu" and not torch.compiler.is_compiling() else None
    out: list[At] = []
    for s, e in bounds:
        if host is not None and e > s and host[e - 1] - host[s] == e - 1 - s:
            out.append(slice(host[s], host[e - 1] + 1))
        else:
            out.append(rows[s:e])
    return out


@boundary  # data-dependent (host reads of the masks): not for a compiled caller to trace
def holding(forward: Tensor | None, need: Tensor, total: int, chunk: int) -> list[tuple[int, int]]:
    """The pieces ``[s, e)`` of ``chunk`` positions among the rows of ``forward`` (CPU bool
    ``[T]``, None: all ``total``) that hold a row of ``need`` (CPU bool ``[T]``)."""
    hit = need if forward is None else need[forward]
    n = int(hit.numel())
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk) if bool(hit[s : s + chunk].any())]


def pieces(rows: Tensor | None, total: int, chunk: int) -> list[At]:
    """The selected rows of ``total`` in pieces of ``chunk`` (the last one shorter)."""
    n = count(rows, total)
    return places(rows, [(s, min(s + chunk, n)) for s in range(0, n, chunk)])


def numbers(at: At, device: torch.device) -> Tensor:
    """The row numbers of a piece, ``[n]`` int64."""
    return torch.arange(at.start, at.stop, device=device) if isinstance(at, slice) else at


def gather(x: Tensor, at: At, buf: Tensor | None) -> Tensor:
    """The rows ``at`` of ``x``: a view for a slice; for an index, gathered into the first
    rows of ``buf`` (``[m, ...]``, ``m`` at least theirs, of any dtype, contiguous) when
    given, else into a new tensor."""
    if isinstance(at, slice):
        return x[at]
    if buf is None:
        return x.index_select(0, at)
    if buf.shape[0] != at.numel():
        buf = buf[: at.numel()]
    if buf.dtype == x.dtype:
        return torch.index_select(x, 0, at, out=buf)
    return buf.copy_(x.index_select(0, at))


def chunk_starts(rows: int, chunk: int) -> tuple[int, list[int]]:
    """``(c, starts)``: the fixed chunk rows used for ``rows`` rows (``chunk``, or for
    fewer rows the largest power of two ``<= rows``) and the first row of each chunk;
    the last chunk ends at ``rows`` and may overlap the one before it."""
    if rows <= 0:
        return chunk, []
    c = chunk if rows >= chunk else 1 << (rows.bit_length() - 1)
    starts = list(range(0, rows - c + 1, c))
    if starts[-1] + c < rows:
        starts.append(rows - c)
    return c, starts




def chunked(x: Tensor, rows: Tensor | None, chunk: int) -> tuple[list[At], Tensor | None]:
    """Chunks of the ``rows`` of ``x`` (None: all) for a kernel of a fixed shape
    (``chunk_starts`` over them: ``chunk`` rows each, the last one may overlap the one
    before; ``places``) and one buffer of ``x``'s dtype to gather those that are not
    consecutive into (None: none is): invariant mode's compiled kernels."""
    c, starts = chunk_starts(count(rows, x.shape[0]), chunk)
    chunks = places(rows, [(s, s + c) for s in starts])
    gathered = not all(isinstance(at, slice) for at in chunks)
    return chunks, buffer((c, x.shape[1]), x.dtype, x.device, zero=False) if gathered else None
