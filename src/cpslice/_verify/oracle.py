"""The layout rules read position by position, for ``cpslice verify``'s expected values.

A second, deliberately plain transcription of the layout rules (docs/layouts.md): a
loop over every position of every sample, written without the vectorized run
arithmetic of ``_layout.plan`` and without ``_layout.pack`` or ``_layout.extract``, and importing nothing
from cpslice. ``verify`` reads its expected response shares,
loss weights and gradient rows from here, so that a bug in the layout arithmetic
shows up as a failing row instead of agreeing with itself.

A ``Place`` is what one local row holds: ``(sample, within-sample position)``, or
None for padding. A sample's extent holds its tokens, then padding; a left-padded bshd
row (``offsets``) holds padding before them too. An order layout is read from the order
itself, row by row: local row ``j`` of rank ``r`` holds stream position
``order[r*T + j]`` (bshd: row after row, column ``order[b][r*S/c + k]`` of row ``b``).

A shared-prefix layout (``groups``) lays out *stars* where other layouts lay out samples:
star ``j`` holds its group's prompt once (star positions ``[0, P_j)``), then each sample's
response, branch ``g`` at star positions ``[P_j + D_g, P_j + D_g + R_g)``, ``D_g`` the
responses of the group's earlier samples. A row then *holds* several places: a prompt row,
position ``p`` of every sample of its group (``holders``); ``places`` gives its first.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

Place = tuple[int, int] | None


@dataclass(frozen=True)
class RankView:
    """One rank's layout, as plain numbers: what the rules need and nothing else.

    ``mode`` is ``"none"``, ``"zigzag"`` or ``"allgather"``; ``fmt`` ``"thd"`` or
    ``"bshd"``; ``seq`` the bshd row length; ``length`` the local tensor's length
    (for allgather, the piece length ``T``); ``align`` (thd) pads every sample with
    padding positions after its tokens up to a multiple of ``align``; ``padded`` (thd)
    gives each sample's positions ``W_i >= L_i`` outright, its padding included;
    ``offsets`` (bshd) the column ``o_i`` of its row where sample ``i``'s tokens start
    (None: column 0); ``order`` (mode ``"order"``) the token order: thd one row, a
    permutation of the stream of extents, bshd a row per sample, each a permutation of
    its ``seq`` columns; ``groups`` (thd) the shared-prefix group sizes: every rule above
    then reads the stars' lengths (``star_totals``), ``align`` and ``padded`` pad each star.
    """

    total: tuple[int, ...]
    response: tuple[int, ...]
    mode: str
    fmt: str
    seq: int | None
    rank: int
    size: int
    length: int
    align: int | None = None
    padded: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None
    order: tuple[tuple[int, ...], ...] | None = None
    groups: tuple[int, ...] | None = None


def star_totals(total: Sequence[int], response: Sequence[int], groups: Sequence[int]) -> tuple[int, ...]:
    """Each star's length ``L*_j = P_j + sum R_i`` over its group (``P_j`` its first
    sample's prompt, which every sample of the group has)."""
    out, first = [], 0
    for g in groups:
        out.append(total[first] - response[first] + sum(response[first : first + g]))
        first += g
    return tuple(out)


def _star_holders(view: RankView) -> list[list[list[tuple[int, int]]]]:
    """``[j][s]``: what star position ``s`` of star ``j`` holds, every ``(sample,
    position)``: the prompt position ``s < P_j`` of each sample of the group, else
    position ``P_j + (s - P_j - D_g)`` of the one branch ``g`` whose response covers it."""
    assert view.groups is not None
    stars, first = [], 0
    for g in view.groups:
        members = range(first, first + g)
        prompt = view.total[first] - view.response[first]
        star = [[(i, s) for i in members] for s in range(prompt)]
        for i in members:  # each branch's response after the earlier ones'
            star += [[(i, prompt + k)] for k in range(view.response[i])]
        stars.append(star)
        first += g
    return stars


def least_length(
    total: Sequence[int], mode: str, fmt: str, seq: int | None, size: int,
    align: int | None = None, padded: Sequence[int] | None = None,
) -> int:
    """The fewest local rows that hold this rank's positions of every sample (an order
    layout: the stream's ``N / size``); for a shared-prefix layout, ``total`` holds the
    stars' lengths (``star_totals``)."""
    if mode in ("allgather", "order"):
        stream = sum(_extent(i, n, fmt, seq, align, padded) for i, n in enumerate(total))
        return -(-stream // size)
    return len(_places(total, mode, fmt, seq, 0, size, None, align, padded, None))


def _padded(width: int, multiple: int) -> int:
    while width % multiple:
        width += 1
    return width


def _extent(
    i: int, n: int, fmt: str, seq: int | None, align: int | None, padded: Sequence[int] | None
) -> int:
    """Sample ``i``'s positions (``n`` tokens), its own padding included."""
    if fmt == "bshd":
        return int(seq or 0)
    if padded is not None:
        return int(padded[i])
    return _padded(n, align) if align else n


def _place(total: Sequence[int], offsets: Sequence[int] | None, i: int, p: int) -> Place:
    """Position ``p`` of sample ``i``'s extent: its tokens from column ``o_i`` on."""
    o = offsets[i] if offsets is not None else 0
    return (i, p - o) if o <= p < o + total[i] else None


def _order_places(view: RankView) -> list[Place]:
    """An order layout's rows, read from the order: row ``j`` of rank ``r`` holds stream
    position ``order[r*T + j]`` (bshd: row after row, each row's columns
    ``order[b][r*S/c:(r+1)*S/c]``)."""
    assert view.order is not None, "an order layout needs its order"
    if view.fmt == "thd":
        (index,) = view.order
        stream = [
            _place(view.total, None, i, p)
            for i, n in enumerate(view.total)
            for p in range(_extent(i, n, "thd", None, view.align, view.padded))
        ]
        t = len(index) // view.size
        return [stream[index[view.rank * t + j]] for j in range(t)]
    columns = int(view.seq or 0) // view.size
    return [
        _place(view.total, view.offsets, b, row[view.rank * columns + k])
        for b, row in enumerate(view.order)
        for k in range(columns)
    ]


def _places(
    total: Sequence[int], mode: str, fmt: str, seq: int | None, rank: int, size: int,
    length: int | None, align: int | None, padded: Sequence[int] | None,
    offsets: Sequence[int] | None,
) -> list[Place]:
    rows: list[Place] = []

    def extent(i: int, n: int) -> int:
        return _extent(i, n, fmt, seq, align, padded)

    def place(i: int, p: int) -> Place:
        return _place(total, offsets, i, p)

    if mode == "none":
        for i, n in enumerate(total):
            rows += [place(i, p) for p in range(extent(i, n))]
    elif mode == "zigzag":
        for i, n in enumerate(total):
            width = _padded(extent(i, n), 2 * size)
            chunk = width // (2 * size)
            for k in (rank, 2 * size - 1 - rank):  # chunk r, then chunk 2c-1-r
                rows += [place(i, p) for p in range(k * chunk, (k + 1) * chunk)]
    elif mode == "allgather":
        assert length is not None, "allgather needs the piece length"
        stream: list[Place] = [
            place(i, p) for i, n in enumerate(total) for p in range(extent(i, n))
        ]
        stream += [None] * (size * length - len(stream))
        rows = stream[rank * length : (rank + 1) * length]
    else:
        raise ValueError(f"unknown cp mode {mode!r}")
    return rows


def holders(view: RankView) -> list[list[tuple[int, int]]]:
    """Every ``(sample, position)`` each of the rank's ``view.length`` local rows holds:
    none for padding, one without a shared prefix, each sample of the group for a star's
    prompt row."""
    if view.groups is None:
        return [[] if place is None else [place] for place in places(view)]
    stars = star_totals(view.total, view.response, view.groups)
    # the stars laid out as samples of their own, then each star position's holders
    star_rows = places(replace(view, total=stars, response=(0,) * len(stars), groups=None))
    table = _star_holders(view)
    return [[] if place is None else table[place[0]][place[1]] for place in star_rows]


def places(view: RankView) -> list[Place]:
    """What each of the rank's ``view.length`` local rows holds (padding: None; a shared
    prompt row: its group's first sample's position, ``holders`` gives them all)."""
    if view.groups is not None:
        return [held[0] if held else None for held in holders(view)]
    rows = _order_places(view) if view.mode == "order" else _places(
        view.total, view.mode, view.fmt, view.seq, view.rank, view.size, view.length,
        view.align, view.padded, view.offsets,
    )
    if len(rows) > view.length:
        raise ValueError(f"local length {view.length} < {len(rows)} rows this rank holds")
    return rows + [None] * (view.length - len(rows))


def share_offsets(view: RankView) -> list[list[int]]:
    """Per sample, the offsets into its whole response (``p - (P_i - 1)``) of the
    response-span positions ``p`` that this rank holds, in ascending order (a closed
    form's rows hold them in that order already; an order's rows, in any)."""
    out: list[list[int]] = [[] for _ in view.total]
    for held in holders(view):
        for i, p in held:  # a shared prompt's last row: in every branch's share
            first = view.total[i] - view.response[i] - 1  # P_i - 1
            if first <= p < view.total[i] - 1:
                out[i].append(p - first)
    for offsets in out:
        assert view.mode == "order" or offsets == sorted(offsets)
        offsets.sort()
    return out


def shares(whole: Sequence[Tensor], view: RankView) -> list[Tensor]:
    """This rank's share of each whole per-sample response tensor ``[R_i, *rest]``."""
    return [
        w[torch.tensor(offsets, dtype=torch.int64)]
        for w, offsets in zip(whole, share_offsets(view))
    ]


def rows(per_sample: Sequence[Tensor], view: RankView) -> Tensor:
    """The rank's local ``[length, *rest]`` tensor of whole per-sample ``[L_i, *rest]``
    tensors: row ``j`` is ``per_sample[i][p]`` where it holds ``(i, p)``, else zero; a row
    that holds several (a shared prompt row) the sum over them, as a gradient sums over the
    branches that read the row."""
    first = per_sample[0]
    out = torch.zeros((view.length, *first.shape[1:]), dtype=first.dtype)
    for j, held in enumerate(holders(view)):
        for i, p in held:
            out[j] += per_sample[i][p]
    return out
