"""The whole offset arithmetic of docs/layouts.md, in one place.

Every operation of cpslice (extraction, sharding, packing, shifted targets,
response rows, redistribution) is a reading of the *runs* a layout puts on one
rank: a run says that local rows ``[local, local + length)`` hold within-sample
positions ``[start, start + length)`` of one sample. A sample has any number of runs
(1, 2 for zigzag's two chunks, as many as an order's pieces: ``_pieces``), in
ascending position order, and runs are grouped sample after sample. Padding
positions belong to no run. Every layout is read through each sample's *extent* ``W_i`` (its positions,
padding included: ``Layout.padded_lengths``) and the padding ``o_i`` before its tokens
in it (``Layout.row_offsets``: a left-padded bshd row), so the padded samples of verl
or Megatron-Bridge and the left-padded rows of Hugging Face trainers are more inputs
of the same runs, not other code paths.
A *selection* intersects the runs with one position range per sample and expands
the result into row indices with vectorized integer arithmetic: no Python loop
over samples, no per-sample ``torch.arange``.
"""

from collections.abc import Mapping
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from ._cache import boundary, cached
from ._errors import LayoutError
from ._layout import Layout, closed_mode
from ._pieces import Pieces, closed, least_length
from ._types import Strategy

_I64 = torch.int64


def strategy(layout: Layout) -> Strategy:
    """Which reading of docs/layouts.md a layout selects; see ``extraction_strategy``."""
    if layout.cp_mode != "none":
        return layout.cp_mode
    return "none-thd" if layout.qkv_format == "thd" else "none-bshd"


def exclusive_cumsum(x: Tensor) -> Tensor:
    """``[0, x_0, x_0 + x_1, ...]``: where each of back-to-back pieces of sizes ``x`` starts."""
    return torch.cumsum(x, 0) - x


def _lengths(layout: Layout) -> tuple[Tensor, Tensor]:
    total = torch.tensor(layout.total_lengths, dtype=_I64)
    response = torch.tensor(layout.response_lengths, dtype=_I64)
    return total, response


def packed_offsets(layout: Layout) -> Tensor:
    """``off_i = L_0 + ... + L_{i-1}``: where sample ``i`` starts when samples are concatenated."""
    return exclusive_cumsum(_lengths(layout)[0])


def response_base(layout: Layout, *, concatenated: bool = False) -> Tensor:
    """Per sample, what turns a within-sample position of the response span into an
    index of the response: ``p - (P_i - 1)``, or with ``concatenated`` an index into all
    responses back to back: ``R_0 + ... + R_{i-1} + p - (P_i - 1)``."""
    total, response = _lengths(layout)
    base = response - total + 1  # -(P_i - 1)
    return base + exclusive_cumsum(response) if concatenated else base


@cached(maxsize=64)
def needed_length(layout: Layout) -> int:
    """The least local length ``T`` the layout fits in."""
    if layout._order is not None:  # N / c rows of the rearranged stream
        return layout._order.length
    return least_length(closed_mode(layout), layout.padded_lengths, layout.cp_size)


def check_local_length(layout: Layout, length: int, what: str = "local_length") -> None:
    """Raise LayoutError unless ``length`` can be this rank's local length."""
    if layout.local_length is not None and length != layout.local_length:
        raise LayoutError(
            f"{what} has length {length} but the layout's local_length is "
            f"{layout.local_length} (pass a tensor of that length, or build the "
            "Layout with local_length=None)"
        )
    need = needed_length(layout)
    if length >= need:
        return
    total = sum(layout.padded_lengths)
    if layout.cp_mode == "allgather":
        what_sum = "total_lengths" if layout.padded_lengths == layout.total_lengths else (
            "padded_lengths"
        )
        rule = (
            f"cp_size * T = {layout.cp_size} * {length} = {layout.cp_size * length} < "
            f"sum({what_sum}) = {total} (the {layout.cp_size} pieces must cover the "
            "packed stream)"
        )
    else:
        rule = f"the layout needs at least {need} positions ({strategy(layout)} layout)"
    subject = f"local_length {length}" if what == "local_length" else (
        f"{what} has length {length}, which"
    )
    raise LayoutError(f"{subject} is too short: {rule}")


def _resolve_length(layout: Layout, length: int | None, what: str, least: bool) -> int:
    """The one resolution of ``T``: the given tensor's, else the layout's ``local_length``,
    else the least length the layout needs; checked against the layout. Without
    ``least``, an allgather layout with neither cannot know where its pieces start."""
    if length is not None:
        check_local_length(layout, length, what)
        return length
    if layout.local_length is not None:
        check_local_length(layout, layout.local_length)
        return layout.local_length
    if layout.cp_mode == "allgather" and not least:
        raise LayoutError(
            "an allgather layout's pieces [r*T, (r+1)*T) depend on the local length T, "
            "and this function receives no local tensor to read it from; build the "
            "Layout with local_length=T"
        )
    return needed_length(layout)


@boundary
def default_length(layout: Layout) -> int:
    """``local_length`` when set (and long enough), else the least length the layout
    needs (for allgather, the least piece length): the length of a local tensor cpslice
    builds itself."""
    return _resolve_length(layout, None, "local_length", least=True)


@boundary
def resolve_length(layout: Layout, length: int | None = None, what: str = "local tensor") -> int:
    """The local length ``T``: the given tensor's, else the layout's, else the least one.

    An allgather layout with neither cannot know where its pieces start.
    """
    return _resolve_length(layout, length, what, least=False)


class Runs(NamedTuple):
    """Rows ``[local, local+length)`` hold positions ``[start, start+length)`` of ``sample``.

    A run is a piece of the sample's extent on this rank (``_pieces``: all of it, a zigzag
    chunk, the part on an allgather piece, a run of an order): it occupies rows
    ``[local - lead, local - lead + width)``, ``width >= lead + length``, and holds the
    sample's tokens at ``[local, local + length)``, padding before them (``lead`` rows: a
    left-padded bshd row's columns before ``o_i``) and after them (a zigzag chunk, a bshd
    row, a padded sample). A run of ``length`` 0 holds padding only; then ``start`` is the
    position its first padding row would hold had it held a token past the sample's end
    (0 for padding before it). Runs are sorted by sample, then position.
    """

    sample: Tensor
    local: Tensor
    start: Tensor
    length: Tensor
    width: Tensor
    lead: Tensor


def _tokens(p: Pieces, layout: Layout) -> Runs:
    """The runs of extent pieces ``p`` (rows ``[slot, slot + width)`` holding extent
    positions ``[first, first + width)``), of which the sample's tokens are ``[o_i, o_i +
    L_i)`` (its tokens ``[0, L_i)``, ``o_i`` padding positions before them)."""
    total, _ = _lengths(layout)
    offset = torch.tensor(layout.row_offsets, dtype=_I64)[p.sample]
    end = offset + total[p.sample]
    first, width = p.first, p.width
    lead = (offset - first).clamp(0).minimum(width)
    size = (torch.minimum(first + width, end) - torch.maximum(first, offset)).clamp_min(0)
    return Runs(p.sample, p.slot + lead, (first - offset).clamp_min(0), size, width, lead)


def runs(layout: Layout, length: int, rank: int | None = None) -> Runs:
    """The runs of the layout on its rank (or on CP rank ``rank`` of its group), whose
    local tensor has ``length`` rows."""
    r, placed = layout.cp_rank if rank is None else rank, layout._order
    if placed is not None:
        return _tokens(placed.of_rank(r), layout)
    return _tokens(closed(closed_mode(layout), layout.padded_lengths, r, layout.cp_size, length), layout)


class Selection(NamedTuple):
    """The rows of one rank that hold a per-sample position range, in position order.

    ``rows[j]`` is a local row, ``positions[j]`` the within-sample position it holds;
    ``counts[i]`` elements belong to sample ``i`` (samples in order). ``run_sample``,
    ``run_first`` and ``run_count`` describe the same elements run by run.
    """

    rows: Tensor
    positions: Tensor
    counts: list[int]
    run_sample: Tensor
    run_first: Tensor
    run_count: Tensor

    def sources(self, base: Tensor) -> Tensor:
        """For every element, ``base[sample] + position``: its index in a concatenation
        of per-sample tensors where sample ``i`` starts at ``base[i]``."""
        return self.expand(self.run_sources(base))

    def run_sources(self, base: Tensor) -> Tensor:
        """``sources`` of each run's first element."""
        return base[self.run_sample] + self.run_first

    def expand(self, first: Tensor) -> Tensor:
        """``first[run] + 0, 1, ..., run_count[run] - 1`` for every run, concatenated."""
        total = int(self.rows.numel())
        step = torch.repeat_interleave(first - exclusive_cumsum(self.run_count), self.run_count, output_size=total)
        return step + torch.arange(total, dtype=_I64)


def _select(layout: Layout, length: int, lo: Tensor, hi: Tensor, rank: int | None) -> Selection:
    rs = runs(layout, length, rank)
    lo_r = lo[rs.sample]
    hi_r = hi[rs.sample]
    first = torch.maximum(rs.start, lo_r)
    count = (torch.minimum(rs.start + rs.length, hi_r) - first).clamp_min(0)
    first_row = rs.local + (first - rs.start)
    total = int(count.sum())
    shift = exclusive_cumsum(count)
    arange = torch.arange(total, dtype=_I64)
    rows = torch.repeat_interleave(first_row - shift, count, output_size=total) + arange
    positions = torch.repeat_interleave(first - shift, count, output_size=total) + arange
    per_sample = torch.zeros(layout.num_samples, dtype=_I64).index_add_(0, rs.sample, count)
    counts: list[int] = per_sample.tolist()
    return Selection(rows, positions, counts, rs.sample, first, count)


Span = Literal["response", "sample", "targets"]


def select(layout: Layout, length: int, span: Span, rank: int | None = None) -> Selection:
    """The selection of one span of every sample (rows on the CPU), computed anew, on the
    layout's rank (or on CP rank ``rank`` of its group: another rank's rows, no other
    ``Layout`` built).

    - ``"response"``: positions ``[P_i - 1, L_i - 1)``, the logits that predict the
      response (what extraction returns);
    - ``"sample"``: positions ``[0, L_i)``, every token (what packing writes);
    - ``"targets"``: positions ``[0, L_i - 1)``, those whose next token exists.
    """
    total, response = _lengths(layout)
    if span == "response":
        lo, hi = total - response - 1, total - 1
    elif span == "sample":
        lo, hi = torch.zeros_like(total), total
    else:
        lo, hi = torch.zeros_like(total), total - 1
    return _select(layout, length, lo, hi, rank)


# A few layouts at a time: one step reads the same layout several times (log-probs,
# entropy, masks), and a selection of ~1M rows holds ~16 MB.
@cached(maxsize=8)
def selection(layout: Layout, length: int, span: Span) -> Selection:
    """``select``, cached: the selections of this rank's layouts that a step reads."""
    return select(layout, length, span)


@cached(maxsize=8)
def rows_on(layout: Layout, length: int, span: Span, device: torch.device) -> Tensor:
    """``selection(...).rows`` on ``device``, cached so a step copies it once."""
    return selection(layout, length, span).rows.to(device)


class Read:
    """One span of a resolved layout, as a call reads it: the ``selection`` (CPU) and its
    ``rows`` on the call's device; ``sources`` and ``mask`` are computed at their first
    reading (an extraction reads neither) and kept with the cached read."""

    __slots__ = ("selection", "rows", "_layout", "_length", "_span", "_device", "_sources", "_mask")

    def __init__(self, selection: Selection, rows: Tensor, layout: Layout, length: int, span: Span,
                 device: torch.device) -> None:
        self.selection, self.rows = selection, rows
        self._layout, self._length, self._span, self._device = layout, length, span, device
        self._sources: Tensor | None = None
        self._mask: Tensor | None = None

    @property
    def sources(self) -> Tensor:
        """On the call's device: for every row the element of the concatenated per-sample
        tensors it holds (``"sample"``: the token, ``"targets"``: the next token,
        ``"response"``: the element of the concatenated whole responses)."""
        if self._sources is None:
            self._sources = self.selection.sources(_base(self._layout, self._span)).to(self._device)
        return self._sources

    @property
    def mask(self) -> Tensor:
        """CPU bool ``[T]``: the rows of the span."""
        if self._mask is None:
            self._mask = torch.zeros(self._length, dtype=torch.bool).index_fill_(0, self.selection.rows, True)
        return self._mask


class Local(NamedTuple):
    """A layout resolved once for one call: the ``layout``, this rank's local length
    ``length`` (``T``), the ``device`` of the call's tensors and the ``reads`` of the spans
    the call asked for. Private workers take this record, never a ``Layout``: nothing
    after the resolution reads the layout's lengths again."""

    layout: Layout
    length: int
    device: torch.device
    reads: Mapping[Span, Read]


def _base(layout: Layout, span: Span) -> Tensor:
    """Where each sample starts in the concatenation ``Read.sources`` indexes, plus the
    shift from position to element (``p + 1`` for targets; ``p - (P_i - 1)`` for the
    response)."""
    if span == "response":
        return response_base(layout, concatenated=True)
    return packed_offsets(layout) + (1 if span == "targets" else 0)


@cached(maxsize=16)
def _read(layout: Layout, length: int, span: Span, device: torch.device) -> Read:
    return Read(selection(layout, length, span), rows_on(layout, length, span, device), layout, length, span, device)


@boundary
def resolve(
    layout: Layout,
    length: int | None = None,
    what: str = "local tensor",
    spans: tuple[Span, ...] = (),
    device: torch.device | str = "cpu",
    *,
    least: bool = False,
) -> Local:
    """The layout resolved for one call: ``T`` (the given tensor's ``length``, else the
    layout's ``local_length``, else, with ``least`` or outside allgather, the least
    length it needs; checked, the message naming ``what``) and each span's ``Read`` on
    ``device`` (cached, so repeated steps copy nothing anew).

    Raises:
        LayoutError: as ``resolve_length``.
    """
    t = _resolve_length(layout, length, what, least)
    dev = torch.device(device)
    return Local(layout, t, dev, {span: _read(layout, t, span, dev) for span in spans})
