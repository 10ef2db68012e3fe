"""Where every layout puts its positions: each rank's *pieces*, and the orders they make.

A piece says that local rows ``[slot, slot + width)`` of a rank hold extent positions
``[first, first + width)`` of one sample (its padding included). The closed forms fill
the table arithmetically (``Closed``); a layout of any token order fills it from the
order (``Order``).

torch's context parallelism (and MagiAttention's dispatch, and any other) rearranges
the positions of the packed stream by an index, then cuts the rearranged stream into
``cp_size`` contiguous pieces of ``T`` rows: row ``j`` of rank ``r`` holds stream
position ``order[r*T + j]`` (bshd: row after row, each row's columns
``order[b, r*S/c:(r+1)*S/c]``). The order is read once, into *pieces*: maximal runs of
consecutive local rows of one rank holding consecutive extent positions of one sample
(padding included). That is the table the closed forms fill arithmetically
(``plan.runs`` reads both), so an order layout is read by the same code; the table
holds ``O(pieces)`` integers, never an entry per position. This module knows no
``Layout``: it takes the numbers a layout resolved.
"""

import array
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .._checks import kind
from .._errors import LayoutError
from .._types import CpMode, QkvFormat

_I64 = torch.int64


class Pieces(NamedTuple):
    """Extent pieces: local rows ``[slot, slot + width)`` of a rank hold extent positions
    ``[first, first + width)`` of ``sample`` (CPU int64, one entry per piece)."""

    sample: Tensor
    slot: Tensor
    first: Tensor
    width: Tensor


def _cumsum0(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


def _ints(values: tuple[int, ...]) -> Tensor:
    """``torch.tensor(values, dtype=torch.int64)``, through a buffer: a third of the time
    for the thousands of widths of a large batch."""
    return torch.frombuffer(array.array("q", values), dtype=_I64) if values else torch.zeros(0, dtype=_I64)


class Closed(NamedTuple):
    """A closed-form layout's placement: ``mode``'s arithmetic over the samples' extents
    ``widths`` on ``size`` ranks (docs/layouts.md). With ``Order``, the record a
    ``Layout`` keeps of where its rows sit (``Layout._placement``): both answer
    ``least_length`` and ``of_rank``."""

    mode: CpMode
    widths: tuple[int, ...]
    size: int

    @property
    def least_length(self) -> int:
        """The least local length the samples fit in (for allgather, the least piece
        length)."""
        stream = sum(self.widths)
        return stream // self.size if self.mode == "zigzag" else -(-stream // self.size)

    def of_rank(self, rank: int, length: int) -> Pieces:
        """The pieces of CP rank ``rank``, its local tensor ``length`` rows."""
        extent = _ints(self.widths)
        samples = torch.arange(len(self.widths), dtype=_I64)
        if self.mode == "none":  # thd and bshd alike: rows of W_i, back to back
            return Pieces(samples, _cumsum0(extent), torch.zeros_like(extent), extent)
        c, r = self.size, rank
        if self.mode == "zigzag":  # chunks r and 2c - 1 - r of every extent
            chunk = torch.div(extent, 2 * c, rounding_mode="floor")
            block = _cumsum0(2 * chunk)
            slot = torch.stack([block, block + chunk], 1).reshape(-1)
            first = torch.stack([r * chunk, (2 * c - 1 - r) * chunk], 1).reshape(-1)
            return Pieces(torch.repeat_interleave(samples, 2), slot, first, torch.repeat_interleave(chunk, 2))
        # allgather: the stream of padded samples, cut into pieces of `length`.
        offset = _cumsum0(extent)
        lo = offset.clamp_min(r * length)
        end = (offset + extent).clamp_max((r + 1) * length)
        slot = (lo - r * length).clamp(0, length)
        return Pieces(samples, slot, lo - offset, (end - lo).clamp_min(0))


class Order:
    """Every rank's pieces of an order layout: the layout's whole placement, compared and
    hashed by value (two orders are equal when they place every position at the same
    row of the same rank)."""

    __slots__ = ("length", "_bounds", "_table", "_hash")

    def __init__(self, length: int, bounds: list[int], table: Tensor) -> None:
        self.length = length
        """``T``, the rows of every rank's local tensor."""
        self._bounds = bounds  # rank r's pieces are table[:, bounds[r]:bounds[r + 1]]
        self._table = table  # [4, pieces]: sample, slot, first, width
        self._hash = hash((length, tuple(bounds), table.numpy().tobytes()))

    @property
    def pieces(self) -> int:
        """The number of pieces over all ranks."""
        return int(self._table.shape[1])

    @property
    def least_length(self) -> int:
        """``T``: an order's ranks hold ``length`` rows each."""
        return self.length

    def of_rank(self, rank: int, length: int | None = None) -> Pieces:
        """Rank ``rank``'s pieces, sorted by sample, then position (``length`` is not
        read: an order fixes its own, which a call's ``T`` is checked against)."""
        part = self._table[:, self._bounds[rank]:self._bounds[rank + 1]]
        return Pieces(part[0], part[1], part[2], part[3])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Order) and self._hash == other._hash and self.length == other.length
                and self._bounds == other._bounds and torch.equal(self._table, other._table))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"<order: {len(self._bounds) - 1} ranks of {self.length} rows, {self.pieces} pieces>"


def _host(order: object) -> Tensor:
    """The order as a contiguous CPU int64 tensor (one host copy of a device tensor)."""
    if isinstance(order, (str, bytes)) or not isinstance(order, (Tensor, Sequence)):
        raise TypeError(f"order must be an integer tensor or a sequence of ints, got {kind(order)}")
    if not isinstance(order, Tensor):
        try:
            order = torch.tensor(order)
        except (TypeError, ValueError, RuntimeError) as err:  # ragged rows, not numbers
            raise TypeError(f"order must be an integer tensor or a sequence of ints ({err})") from None
    if order.is_floating_point() or order.is_complex() or order.dtype == torch.bool:
        raise TypeError(f"order must hold integers, got {order.dtype}")
    return order.detach().to("cpu", _I64).contiguous()


_CHUNK = 1 << 16
"""Rows of the order compared per step of ``_heads``: its temporaries stay in cache."""


def _heads(flat: Tensor, every: int) -> Tensor:
    """Where each maximal run of ``flat`` holding consecutive values (``v, v + 1, ...``)
    starts, a run also starting at each multiple of ``every`` (a rank's first row): one
    pass in steps, no temporary of the order's size. numpy's, over the tensor's memory:
    a third of torch's time for these two small kernels a step, and its ``flatnonzero``
    a tenth of ``nonzero``'s."""
    values = flat.numpy()
    n = values.size
    new = np.empty(n, dtype=np.bool_)
    step = np.empty(min(_CHUNK, n), dtype=np.int64)
    for lo in range(1, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        np.not_equal(np.subtract(values[lo:hi], values[lo - 1:hi - 1], out=step[:hi - lo]), 1,
                     out=new[lo:hi])
    new[::max(every, 1)] = True
    return torch.from_numpy(np.flatnonzero(new).astype(np.int64, copy=False))


def _tiles(flat: Tensor, heads: Tensor, n: int) -> bool:
    """Whether the runs starting at ``heads`` (each an interval of consecutive values)
    cover ``[0, n)``: then ``flat`` is a permutation of ``range(n)``, each value once."""
    if not heads.numel():
        return n == 0
    at = heads.numpy()
    first = flat.numpy()[at]
    by = np.argsort(first)
    lo = first[by]
    hi = lo + np.diff(at, append=flat.numel())[by]
    return int(lo[0]) == 0 and int(hi[-1]) == n and bool(np.array_equal(lo[1:], hi[:-1]))


def _check_permutation(values: Tensor, n: int, what: str, entry: str, every: int = 0) -> Tensor:
    """Raise unless ``values`` is a permutation of ``range(n)``; the message names the
    first bad entry (``entry.format(j)``) and the rule. Returns where the runs of
    consecutive values of ``values`` start, cut at each multiple of ``every``
    (``_heads``)."""
    if values.numel() != n:
        raise LayoutError(f"{what} has {values.numel()} entries but must have {n} (a permutation of range({n}))")
    heads = _heads(values, every or n)
    if _tiles(values, heads, n):  # the runs cover range(n): a permutation
        return heads
    out = ((values < 0) | (values >= n)).nonzero()
    if out.numel():
        j = int(out[0])
        raise LayoutError(f"{entry.format(j)} = {int(values[j])} is outside [0, {n}) "
                          f"({what} must be a permutation of range({n}))")
    seen = torch.full((n,), n, dtype=_I64)
    seen.scatter_reduce_(0, values, torch.arange(n, dtype=_I64), "amin")
    repeated = (seen[values] != torch.arange(n, dtype=_I64)).nonzero()
    j = int(repeated[0])  # in range and not a permutation: a value repeats
    v = int(values[j])
    raise LayoutError(f"{entry.format(j)} = {v} repeats {entry.format(int(seen[v]))} "
                      f"({what} must be a permutation of range({n}): each position once)")


def _stream(
    order: Tensor, fmt: QkvFormat, widths: tuple[int, ...], seq: int | None, size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The checked order in its full shape (thd ``[N]``, bshd ``[B, S]``), the stream
    position each row of each rank holds (``[c, T]``), where each extent starts, and
    where the runs of consecutive stream positions of the rows (row after row, rank
    after rank) start (``_heads``)."""
    starts = _cumsum0(_ints(widths))
    if fmt == "thd":
        order, heads = _thd_stream(order, sum(widths), size)
        return order, order.view(size, -1), starts, heads
    assert seq is not None
    order = _bshd_shape(order, len(widths), seq)
    per_rank, heads = _bshd_stream(order, starts, seq, size)
    return order, per_rank, starts, heads


def _thd_stream(order: Tensor, n_stream: int, size: int) -> tuple[Tensor, Tensor]:
    """A thd order ``[N]`` (or ``[1, N]``), checked a permutation that ``size`` ranks
    split evenly, and its runs' heads over ``size`` ranks."""
    if order.dim() == 2 and order.shape[0] == 1:
        order = order[0]
    if order.dim() != 1:
        raise LayoutError(f"a thd order has shape [N] or [1, N], got {list(order.shape)}")
    every = n_stream // size if n_stream % size == 0 else n_stream
    heads = _check_permutation(order, n_stream, "a thd order", "order[{}]", every)
    if n_stream % size:
        raise LayoutError(f"cp_size {size} does not divide the order's {n_stream} positions "
                          "(each rank holds N / cp_size of them)")
    return order, heads


def _bshd_shape(order: Tensor, rows: int, seq: int) -> Tensor:
    """A bshd order ``[S]``, ``[1, S]`` (one index for every row, as torch's) or
    ``[B, S]``, as ``[B, S]``."""
    if order.dim() == 2 and order.shape[0] == 1:  # torch's [1, S]: one index for every row
        order = order[0]
    if order.dim() == 1:
        order = order.expand(rows, -1)
    if order.dim() != 2 or order.shape[0] != rows:
        raise LayoutError(f"a bshd order has shape [S], [1, S] or [B, S] = [{rows}, {seq}], "
                          f"got {list(order.shape)}")
    if order.shape[1] != seq:
        raise LayoutError(f"a bshd order's rows have {order.shape[1]} columns but max_seq_len is {seq}")
    return order


def _bshd_stream(order: Tensor, starts: Tensor, seq: int, size: int) -> tuple[Tensor, Tensor]:
    """A ``[B, S]`` bshd order's stream positions per rank (``[c, T]``) and its runs'
    heads; refused where a row is not a permutation of ``range(S)`` (the first such row
    named) or ``size`` does not divide ``S``."""
    rows = order.shape[0]
    if not seq % size and _in_range(order, seq):  # each row a permutation: read at once
        per_rank = (order + starts[:, None]).view(rows, size, seq // size).transpose(0, 1)
        per_rank = per_rank.reshape(size, -1).contiguous()
        flat = per_rank.view(-1)
        heads = _heads(flat, per_rank.shape[1])
        if _tiles(flat, heads, flat.numel()):  # in range, the shifted rows cover the whole
            return per_rank, heads
    bad = (order.sort(1).values != torch.arange(seq)).any(1).nonzero()
    if bad.numel():
        b = int(bad[0])
        _check_permutation(order[b], seq, f"row {b} of a bshd order", f"order[{b}, {{}}]")
    if seq % size:
        raise LayoutError(f"cp_size {size} does not divide max_seq_len {seq} (each rank holds "
                          "S / cp_size columns of every row)")
    raise AssertionError("a bshd order both is and is not a permutation")  # pragma: no cover


def _in_range(order: Tensor, seq: int) -> bool:
    """Whether every value of ``order`` is in ``[0, seq)``."""
    if not order.numel():
        return True
    lo, hi = torch.aminmax(order)
    return int(lo) >= 0 and int(hi) < seq


def _pieces_of(
    flat: Tensor, heads: Tensor, starts: Tensor, widths: tuple[int, ...], length: int
) -> tuple[Tensor, Tensor]:
    """The pieces of the rows ``flat`` (row ``r*T + j`` holds stream position
    ``flat[r*T + j]``), ``heads`` where its runs of consecutive positions start (cut at
    the ranks' first rows): each run cut at the samples' starts too.
    Returns the table ``[4, pieces]`` (sample, slot, first, width) and each piece's rank,
    sorted by rank, sample, then position. In numpy, one thread: tens of thousands of
    runs are too few to gain from torch's threads, and enough for each of its parallel
    kernels to wait for a busy core."""
    start, extent = starts.numpy(), _ints(widths).numpy()
    runs = heads.numpy()
    lo = flat.numpy()[runs]  # each run's first stream position, and the one after its last
    hi = lo + np.diff(runs, append=flat.numel())
    by = np.argsort(lo)  # in position order the runs cover the stream: a sorted lookup
    sample = np.empty_like(lo)
    sample[by] = np.searchsorted(start, lo[by], side="right") - 1
    if bool((hi > start[sample] + extent[sample]).any()):  # runs across samples: cut them
        count = np.empty_like(lo)
        count[by] = np.searchsorted(start, hi[by] - 1, side="right") - sample[by]  # one piece a sample
        run = np.repeat(np.arange(runs.size), count)
        sample = sample[run] + np.arange(run.size) - np.repeat(np.cumsum(count) - count, count)
        begin = np.maximum(lo[run], start[sample])
        end = np.minimum(hi[run], start[sample] + extent[sample])
        runs, lo, hi = runs[run] + (begin - lo[run]), begin, end
    rank = runs // length
    first = lo - start[sample]
    by = np.argsort((rank * len(widths) + sample) * (max(widths) + 1) + first)
    table = np.stack([sample[by], (runs - rank * length)[by], first[by], (hi - lo)[by]]).astype(np.int64)
    return torch.from_numpy(table), torch.from_numpy(rank[by].astype(np.int64))


def read(order: object, fmt: QkvFormat, widths: tuple[int, ...], seq: int | None,
         size: int) -> tuple[Tensor, Order]:
    """The checked ``order`` in its full shape, and its pieces: each rank's local rows
    run-length encoded (``seq``: a bshd row's ``S``)."""
    full, stream, starts, heads = _stream(_host(order), fmt, widths, seq, size)
    length = int(stream.shape[1])
    if not stream.numel():
        return full, Order(length, [0] * (size + 1), torch.zeros((4, 0), dtype=_I64))
    table, rank = _pieces_of(stream.reshape(-1), heads, starts, widths, length)
    bounds = torch.searchsorted(rank, torch.arange(size + 1)).tolist()
    return full, Order(length, bounds, table)


def placed(widths: tuple[int, ...], pieces: list[Pieces], length: int) -> tuple[Tensor, Tensor]:
    """Every position the ranks' pieces ``pieces`` place: its row among the ranks' local
    tensors of ``length`` rows concatenated in rank order (row ``j`` of rank ``r`` is
    ``r * length + j``), and its position in the stream of the extents ``widths`` back to
    back; rank after rank, piece after piece."""
    starts = _cumsum0(_ints(widths))
    rows, positions = [], []
    for r, p in enumerate(pieces):
        total = int(p.width.sum())
        shift = _cumsum0(p.width)
        step = torch.arange(total, dtype=_I64)
        rows.append(torch.repeat_interleave(r * length + p.slot - shift, p.width, output_size=total) + step)
        positions.append(torch.repeat_interleave(starts[p.sample] + p.first - shift, p.width, output_size=total)
                         + step)
    return torch.cat(rows), torch.cat(positions)


def order_of(fmt: QkvFormat, widths: tuple[int, ...], seq: int | None, pieces: list[Pieces],
             length: int) -> Tensor:
    """The rearrange index of a layout whose ranks' pieces are ``pieces``, each local
    tensor ``length`` rows: thd ``[N]``, bshd ``[B, S]`` (see ``Layout.order``)."""
    extent = _ints(widths)
    starts = _cumsum0(extent)
    n_stream, size = int(extent.sum()), len(pieces)
    if length * size != n_stream:
        raise LayoutError(
            f"this layout's {size} local tensors of {length} rows hold {length * size} rows, not the "
            f"{n_stream} positions of the stream, so no order places it (allgather: pass "
            f"local_length = sum(padded_lengths) / cp_size = {n_stream / size:g}, which must be an integer)")
    out = torch.full((n_stream,), -1, dtype=_I64)
    rows, positions = placed(widths, pieces, length)
    out[rows] = positions
    if fmt == "thd":
        return out
    rows_, width = len(widths), widths[0] if widths else seq or 0  # zigzag: S padded to W
    per_row = out.view(size, rows_, width // size).transpose(0, 1).reshape(rows_, width)
    return per_row - starts[:, None]


def _merged(p: Pieces) -> Tensor:
    """A rank's pieces ``p`` as an order's reading gives them: the empty ones dropped,
    those that continue each other (the same sample, the next rows, the next positions)
    merged, sorted by sample, then position (``[4, pieces]``)."""
    keep = p.width > 0
    if not bool(keep.any()):
        return torch.zeros((4, 0), dtype=_I64)
    sample, slot, first, width = p.sample[keep], p.slot[keep], p.first[keep], p.width[keep]
    by = torch.argsort(slot)
    sample, slot, first, width = sample[by], slot[by], first[by], width[by]
    joins = torch.ones_like(sample, dtype=torch.bool)
    joins[1:] = ((sample[1:] != sample[:-1]) | (slot[1:] != slot[:-1] + width[:-1])
                 | (first[1:] != first[:-1] + width[:-1]))
    head = joins.nonzero().view(-1)
    end = torch.cat([head[1:], torch.tensor([sample.numel()])])
    merged = torch.stack([sample[head], slot[head], first[head], (slot[end - 1] + width[end - 1]) - slot[head]])
    return merged[:, torch.argsort(merged[0] * (int(first.max()) + 1) + merged[2])]


_PROBES = 64
"""Rows of rank 0, spread over its local tensor, that ``twin`` compares first: a closed
form that places one of them elsewhere is refused at once."""


def _probe(p: Pieces, starts: Tensor, rows: Tensor) -> Tensor:
    """The stream positions that a rank's local rows ``rows`` hold, read from its pieces
    ``p`` (-1 for a row none holds)."""
    keep = p.width > 0
    by = torch.argsort(p.slot[keep])
    slot, width = p.slot[keep][by], p.width[keep][by]
    pos = (starts[p.sample[keep]] + p.first[keep])[by]
    if not slot.numel():
        return torch.full_like(rows, -1)
    at = (torch.searchsorted(slot, rows, right=True) - 1).clamp_min(0)
    inside = (rows >= slot[at]) & (rows < slot[at] + width[at])
    return torch.where(inside, pos[at] + rows - slot[at], -1)


def twin(placed: Order, fmt: QkvFormat, widths: tuple[int, ...], size: int) -> CpMode | None:
    """The closed form (at local length ``N / size``) that places every position where
    the order read as ``placed`` does, if one does, in ``O(pieces)`` with no index built:
    none and allgather place row ``j`` of rank ``r`` at stream position ``r*T + j`` (the
    identity); zigzag when its pieces, merged as an order's reading merges them, are the
    order's (refused at once for another count of pieces, or when it places one of a few
    rows of rank 0 elsewhere)."""
    length = sum(widths) // size
    starts = _cumsum0(_ints(widths))
    if size == 1 or fmt == "thd":
        counts = torch.tensor([placed._bounds[r + 1] - placed._bounds[r] for r in range(size)])
        table = placed._table
        row = torch.repeat_interleave(torch.arange(size) * length, counts) + table[1]
        if torch.equal(starts[table[0]] + table[2], row):
            return "none" if size == 1 else "allgather"
    if size == 1 or any(w % (2 * size) for w in widths):
        return None
    if placed.pieces != len(widths) * (2 * size - 1):  # zigzag's: 2 chunks a sample, rank c-1's one
        return None
    rows = torch.linspace(0, max(length - 1, 0), min(_PROBES, length)).round().to(_I64)
    zigzag = Closed("zigzag", widths, size)
    if not torch.equal(_probe(zigzag.of_rank(0, length), starts, rows), _probe(placed.of_rank(0), starts, rows)):
        return None
    tables = [_merged(zigzag.of_rank(r, length)) for r in range(size)]
    return "zigzag" if all(torch.equal(t, torch.stack(placed.of_rank(r))) for r, t in enumerate(tables)) else None
