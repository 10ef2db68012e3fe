"""The whole offset arithmetic of LAYOUTS.md, in one place.

Every operation of cpslice (extraction, sharding, packing, shifted targets,
response rows, redistribution) is a reading of the *runs* a layout puts on one
rank: a run says that local rows ``[local, local + length)`` hold within-sample
positions ``[start, start + length)`` of one sample. Each sample has the same
number ``k`` of runs (1, or 2 for zigzag's two chunks), in ascending position
order, and runs are grouped sample after sample. Padding positions belong to no
run. A *selection* intersects the runs with one position range per sample and
expands the result into row indices with vectorized integer arithmetic: no
Python loop over samples, no per-sample ``torch.arange``.
"""

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from ._cache import boundary, cached
from ._errors import LayoutError
from ._layout import Layout
from ._types import Strategy

_I64 = torch.int64


def strategy(layout: Layout) -> Strategy:
    """Which reading of LAYOUTS.md a layout selects; see ``extraction_strategy``."""
    if layout.cp_mode == "allgather":
        return "allgather"
    if layout.cp_mode == "zigzag":
        return "zigzag"
    return "none-thd" if layout.qkv_format == "thd" else "none-bshd"


def _ceil_div(a: Tensor, b: int) -> Tensor:
    return torch.div(a + (b - 1), b, rounding_mode="floor")


def _excl_cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


def _lengths(layout: Layout) -> tuple[Tensor, Tensor]:
    total = torch.tensor(layout.total_lengths, dtype=_I64)
    response = torch.tensor(layout.response_lengths, dtype=_I64)
    return total, response


def packed_offsets(layout: Layout) -> Tensor:
    """``off_i = L_0 + ... + L_{i-1}``: where sample ``i`` starts when samples are concatenated."""
    return _excl_cumsum(_lengths(layout)[0])


def response_base(layout: Layout, *, concatenated: bool = False) -> Tensor:
    """Per sample, what turns a within-sample position of the response span into an
    index of the response: ``p - (P_i - 1)``, or with ``concatenated`` an index into all
    responses back to back: ``R_0 + ... + R_{i-1} + p - (P_i - 1)``."""
    total, response = _lengths(layout)
    base = response - total + 1  # -(P_i - 1)
    return base + _excl_cumsum(response) if concatenated else base


def _zigzag_chunk(layout: Layout, total: Tensor) -> Tensor:
    """``C_i``: each sample is padded to ``W_i = 2c * C_i`` positions."""
    two_c = 2 * layout.cp_size
    if layout.qkv_format == "bshd":
        assert layout.max_seq_len is not None
        width = -(-layout.max_seq_len // two_c)
        return torch.full_like(total, width)
    return _ceil_div(total, two_c)


@cached(maxsize=64)
def needed_length(layout: Layout) -> int:
    """The least local length ``T`` the layout fits in."""
    total, _ = _lengths(layout)
    s = strategy(layout)
    if s == "none-thd":
        return int(total.sum())
    if s == "none-bshd":
        assert layout.max_seq_len is not None
        return layout.num_samples * layout.max_seq_len
    if s == "zigzag":
        return int(2 * _zigzag_chunk(layout, total).sum())
    return -(-int(total.sum()) // layout.cp_size)


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
    total = sum(layout.total_lengths)
    if layout.cp_mode == "allgather":
        rule = (
            f"cp_size * T = {layout.cp_size} * {length} = {layout.cp_size * length} < "
            f"sum(total_lengths) = {total} (the {layout.cp_size} pieces must cover the "
            "packed stream)"
        )
    else:
        rule = f"the layout needs at least {need} positions ({strategy(layout)} layout)"
    subject = f"local_length {length}" if what == "local_length" else (
        f"{what} has length {length}, which"
    )
    raise LayoutError(f"{subject} is too short: {rule}")


@boundary
def default_length(layout: Layout) -> int:
    """``local_length`` when set (and long enough), else the least length the layout
    needs (for allgather, the least piece length): the length of a local tensor cpslice
    builds itself."""
    if layout.local_length is not None:
        check_local_length(layout, layout.local_length)
        return layout.local_length
    return needed_length(layout)


@boundary
def resolve_length(layout: Layout, length: int | None = None, what: str = "local tensor") -> int:
    """The local length ``T``: the given tensor's, else the layout's, else the least one.

    An allgather layout with neither cannot know where its pieces start.
    """
    if length is not None:
        check_local_length(layout, length, what)
        return length
    if layout.local_length is not None:
        check_local_length(layout, layout.local_length)
        return layout.local_length
    if layout.cp_mode == "allgather":
        raise LayoutError(
            "an allgather layout's pieces [r*T, (r+1)*T) depend on the local length T, "
            "and this function receives no local tensor to read it from; build the "
            "Layout with local_length=T"
        )
    return needed_length(layout)


class Runs(NamedTuple):
    """``k`` runs per sample: rows ``[local, local+length)`` hold positions ``[start, start+length)``.

    ``width >= length`` is the rows the run occupies, its own padding included (a
    zigzag chunk, a bshd row); for allgather, where only the stream's tail is
    padding, ``width == length``. A run of ``length`` 0 may carry any ``start``.
    """

    k: int
    local: Tensor
    start: Tensor
    length: Tensor
    width: Tensor


def runs(layout: Layout, length: int) -> Runs:
    """The runs of the layout on its rank, whose local tensor has ``length`` rows."""
    total, _ = _lengths(layout)
    n = layout.num_samples
    s = strategy(layout)
    zero = torch.zeros_like(total)
    if s == "none-thd":
        return Runs(1, _excl_cumsum(total), zero, total, total)
    if s == "none-bshd":
        assert layout.max_seq_len is not None
        row = torch.full_like(total, layout.max_seq_len)
        return Runs(1, torch.arange(n, dtype=_I64) * layout.max_seq_len, zero, total, row)
    c, r = layout.cp_size, layout.cp_rank
    if s == "zigzag":
        chunk = _zigzag_chunk(layout, total)
        block = _excl_cumsum(2 * chunk)
        local = torch.stack([block, block + chunk], 1)
        start = torch.stack([r * chunk, (2 * c - 1 - r) * chunk], 1)
        size = torch.minimum(chunk.unsqueeze(1), (total.unsqueeze(1) - start).clamp_min(0))
        width = torch.repeat_interleave(chunk, 2)
        return Runs(2, local.reshape(-1), start.reshape(-1), size.reshape(-1), width)
    # allgather: the packed stream, cut into pieces of `length`.
    offset = _excl_cumsum(total)
    lo = offset.clamp_min(r * length)
    hi = (offset + total).clamp_max((r + 1) * length)
    size = (hi - lo).clamp_min(0)
    local = (lo - r * length).clamp(0, length)
    return Runs(1, local, lo - offset, size, size)


class Selection(NamedTuple):
    """The rows of one rank that hold a per-sample position range, in position order.

    ``rows[j]`` is a local row, ``positions[j]`` the within-sample position it holds;
    ``counts[i]`` elements belong to sample ``i`` (samples in order). ``run_first`` and
    ``run_count`` describe the same elements run by run (``k`` runs per sample).
    """

    rows: Tensor
    positions: Tensor
    counts: list[int]
    k: int
    run_first: Tensor
    run_count: Tensor

    def sources(self, base: Tensor) -> Tensor:
        """For every element, ``base[sample] + position``: its index in a concatenation
        of per-sample tensors where sample ``i`` starts at ``base[i]``."""
        return self.expand(self.run_sources(base))

    def run_sources(self, base: Tensor) -> Tensor:
        """``sources`` of each run's first element (``k`` runs per sample)."""
        return torch.repeat_interleave(base, self.k) + self.run_first

    def expand(self, first: Tensor) -> Tensor:
        """``first[run] + 0, 1, ..., run_count[run] - 1`` for every run, concatenated."""
        total = int(self.rows.numel())
        step = torch.repeat_interleave(first - _excl_cumsum(self.run_count), self.run_count)
        return step + torch.arange(total, dtype=_I64)


def _select(layout: Layout, length: int, lo: Tensor, hi: Tensor) -> Selection:
    rs = runs(layout, length)
    lo_r = torch.repeat_interleave(lo, rs.k)
    hi_r = torch.repeat_interleave(hi, rs.k)
    first = torch.maximum(rs.start, lo_r)
    count = (torch.minimum(rs.start + rs.length, hi_r) - first).clamp_min(0)
    first_row = rs.local + (first - rs.start)
    total = int(count.sum())
    shift = _excl_cumsum(count)
    arange = torch.arange(total, dtype=_I64)
    rows = torch.repeat_interleave(first_row - shift, count, output_size=total) + arange
    positions = torch.repeat_interleave(first - shift, count, output_size=total) + arange
    counts: list[int] = count.view(-1, rs.k).sum(1).tolist()
    return Selection(rows, positions, counts, rs.k, first, count)


Span = Literal["response", "sample", "targets"]


def select(layout: Layout, length: int, span: Span) -> Selection:
    """The selection of one span of every sample (rows on the CPU), computed anew.

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
    return _select(layout, length, lo, hi)


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
