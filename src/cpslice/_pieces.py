"""Where every layout puts its positions: each rank's *pieces*, and the orders they make.

A piece says that local rows ``[slot, slot + width)`` of a rank hold extent positions
``[first, first + width)`` of one sample (its padding included). The closed forms fill
the table arithmetically (``closed``); a layout of any token order fills it from the
order (``Order``).

torch's context parallelism (and MagiAttention's dispatch, and any other) rearranges
the positions of the packed stream by an index, then cuts the rearranged stream into
``cp_size`` contiguous pieces of ``T`` rows: row ``j`` of rank ``r`` holds stream
position ``order[r*T + j]`` (bshd: row after row, each row's columns
``order[b, r*S/c:(r+1)*S/c]``). The order is read once, into *pieces*: maximal runs of
consecutive local rows of one rank holding consecutive extent positions of one sample
(padding included). That is the table the closed forms fill arithmetically
(``_plan.runs`` reads both), so an order layout is read by the same code; the table
holds ``O(pieces)`` integers, never an entry per position. This module knows no
``Layout``: it takes the numbers a layout resolved.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._checks import kind
from ._errors import LayoutError
from ._types import CpMode, QkvFormat

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


def least_length(mode: CpMode, widths: tuple[int, ...], size: int) -> int:
    """The least local length a closed form's samples fit in (for allgather, the least
    piece length)."""
    stream = sum(widths)
    return stream // size if mode == "zigzag" else -(-stream // size)


def closed(mode: CpMode, widths: tuple[int, ...], rank: int, size: int, length: int) -> Pieces:
    """The pieces of a closed-form layout on CP rank ``rank`` of ``size``, its local
    tensor ``length`` rows, its samples' extents ``widths`` (docs/layouts.md)."""
    extent = torch.tensor(widths, dtype=_I64)
    samples = torch.arange(len(widths), dtype=_I64)
    if mode == "none":  # thd and bshd alike: rows of W_i, back to back
        return Pieces(samples, _cumsum0(extent), torch.zeros_like(extent), extent)
    c, r = size, rank
    if mode == "zigzag":  # chunks r and 2c - 1 - r of every extent
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

    def of_rank(self, rank: int) -> Pieces:
        """Rank ``rank``'s pieces, sorted by sample, then position."""
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
    """The order as a CPU int64 tensor (one host copy of a device tensor)."""
    if isinstance(order, (str, bytes)) or not isinstance(order, (Tensor, Sequence)):
        raise TypeError(f"order must be an integer tensor or a sequence of ints, got {kind(order)}")
    if not isinstance(order, Tensor):
        try:
            order = torch.tensor(order)
        except (TypeError, ValueError, RuntimeError) as err:  # ragged rows, not numbers
            raise TypeError(f"order must be an integer tensor or a sequence of ints ({err})") from None
    if order.is_floating_point() or order.is_complex() or order.dtype == torch.bool:
        raise TypeError(f"order must hold integers, got {order.dtype}")
    return order.detach().to("cpu", _I64)


def _check_permutation(values: Tensor, n: int, what: str, entry: str) -> None:
    """Raise unless ``values`` is a permutation of ``range(n)``; the message names the
    first bad entry (``entry.format(j)``) and the rule."""
    if values.numel() != n:
        raise LayoutError(f"{what} has {values.numel()} entries but must have {n} (a permutation of range({n}))")
    out = ((values < 0) | (values >= n)).nonzero()
    if out.numel():
        j = int(out[0])
        raise LayoutError(f"{entry.format(j)} = {int(values[j])} is outside [0, {n}) "
                          f"({what} must be a permutation of range({n}))")
    seen = torch.full((n,), n, dtype=_I64)
    seen.scatter_reduce_(0, values, torch.arange(n, dtype=_I64), "amin")
    repeated = (seen[values] != torch.arange(n, dtype=_I64)).nonzero()
    if repeated.numel():
        j = int(repeated[0])
        v = int(values[j])
        raise LayoutError(f"{entry.format(j)} = {v} repeats {entry.format(int(seen[v]))} "
                          f"({what} must be a permutation of range({n}): each position once)")


def _stream(order: Tensor, fmt: QkvFormat, widths: tuple[int, ...], seq: int | None,
            size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The checked order in its full shape (thd ``[N]``, bshd ``[B, S]``), the stream
    position each row of each rank holds (``[c, T]``), where each extent starts."""
    n_stream = sum(widths)
    starts = _cumsum0(torch.tensor(widths, dtype=_I64))
    if fmt == "thd":
        if order.dim() == 2 and order.shape[0] == 1:
            order = order[0]
        if order.dim() != 1:
            raise LayoutError(f"a thd order has shape [N] or [1, N], got {list(order.shape)}")
        _check_permutation(order, n_stream, "a thd order", "order[{}]")
        if n_stream % size:
            raise LayoutError(f"cp_size {size} does not divide the order's {n_stream} positions "
                              "(each rank holds N / cp_size of them)")
        return order, order.view(size, -1), starts
    assert seq is not None
    rows = len(widths)
    if order.dim() == 2 and order.shape[0] == 1:  # torch's [1, S]: one index for every row
        order = order[0]
    if order.dim() == 1:
        order = order.expand(rows, -1)
    if order.dim() != 2 or order.shape[0] != rows:
        raise LayoutError(f"a bshd order has shape [S], [1, S] or [B, S] = [{rows}, {seq}], got {list(order.shape)}")
    if order.shape[1] != seq:
        raise LayoutError(f"a bshd order's rows have {order.shape[1]} columns but max_seq_len is {seq}")
    bad = (order.sort(1).values != torch.arange(seq)).any(1).nonzero()
    if bad.numel():
        b = int(bad[0])
        _check_permutation(order[b], seq, f"row {b} of a bshd order", f"order[{b}, {{}}]")
    if seq % size:
        raise LayoutError(f"cp_size {size} does not divide max_seq_len {seq} (each rank holds "
                          "S / cp_size columns of every row)")
    per_rank = (order + starts[:, None]).view(rows, size, seq // size).transpose(0, 1)
    return order, per_rank.reshape(size, -1), starts


def read(order: object, fmt: QkvFormat, widths: tuple[int, ...], seq: int | None,
         size: int) -> tuple[Tensor, Order]:
    """The checked ``order`` in its full shape, and its pieces: each rank's local rows
    run-length encoded (``seq``: a bshd row's ``S``)."""
    full, stream, starts = _stream(_host(order), fmt, widths, seq, size)
    length = int(stream.shape[1])
    if not stream.numel():
        return full, Order(length, [0] * (size + 1), torch.zeros((4, 0), dtype=_I64))
    flat = stream.reshape(-1)
    sample = torch.searchsorted(starts, flat, right=True) - 1
    new = torch.ones_like(flat, dtype=torch.bool)
    new[1:] = (flat[1:] != flat[:-1] + 1) | (sample[1:] != sample[:-1])
    new[::length] = True  # a rank's first row
    head = new.nonzero().view(-1)
    width = torch.diff(head, append=torch.tensor([flat.numel()]))
    rank = torch.div(head, length, rounding_mode="floor")
    s = sample[head]
    first = flat[head] - starts[s]
    key = (rank * len(widths) + s) * (max(widths) + 1) + first
    by = torch.argsort(key)
    table = torch.stack([s, head - rank * length, first, width])[:, by]
    bounds = torch.searchsorted(rank[by], torch.arange(size + 1)).tolist()
    return full, Order(length, bounds, table.contiguous())


def order_of(fmt: QkvFormat, widths: tuple[int, ...], seq: int | None, pieces: list[Pieces],
             length: int) -> Tensor:
    """The rearrange index of a layout whose ranks' pieces are ``pieces``, each local
    tensor ``length`` rows: thd ``[N]``, bshd ``[B, S]`` (see ``Layout.order``)."""
    extent = torch.tensor(widths, dtype=_I64)
    starts = _cumsum0(extent)
    n_stream, size = int(extent.sum()), len(pieces)
    if length * size != n_stream:
        raise LayoutError(
            f"this layout's {size} local tensors of {length} rows hold {length * size} rows, not the "
            f"{n_stream} positions of the stream, so no order places it (allgather: pass "
            f"local_length = sum(padded_lengths) / cp_size = {n_stream / size:g}, which must be an integer)")
    out = torch.full((n_stream,), -1, dtype=_I64)
    for r, p in enumerate(pieces):
        total = int(p.width.sum())
        shift = _cumsum0(p.width)
        step = torch.arange(total, dtype=_I64)
        rows = torch.repeat_interleave(p.slot - shift, p.width, output_size=total) + step
        pos = torch.repeat_interleave(starts[p.sample] + p.first - shift, p.width, output_size=total) + step
        out[r * length + rows] = pos
    if fmt == "thd":
        return out
    rows_, width = len(widths), widths[0] if widths else seq or 0  # zigzag: S padded to W
    per_row = out.view(size, rows_, width // size).transpose(0, 1).reshape(rows_, width)
    return per_row - starts[:, None]


def twin(order: Tensor, fmt: QkvFormat, widths: tuple[int, ...], seq: int | None, size: int) -> CpMode | None:
    """The closed form (at local length ``N / size``) that places every position where
    the checked, shape-normalized ``order`` does, if one does."""
    length = sum(widths) // size
    modes: list[CpMode] = ["none"] if size == 1 else (["allgather"] if fmt == "thd" else [])
    if size > 1 and all(w % (2 * size) == 0 for w in widths):
        modes.append("zigzag")
    for mode in modes:
        placed = order_of(fmt, widths, seq, [closed(mode, widths, r, size, length) for r in range(size)], length)
        if torch.equal(placed, order):
            return mode
    return None
