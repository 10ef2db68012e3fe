"""The offset arithmetic of docs/layouts.md read from a layout's placement (``pieces.py``
places each rank's rows): every offset an operation uses comes from here.

Every operation of cpslice (extraction, sharding, packing, shifted targets,
response rows, redistribution) is a reading of the *runs* a layout puts on one
rank: a run says that local rows ``[local, local + length)`` hold within-sample
positions ``[start, start + length)`` of one sample. A sample has any number of runs
(1, 2 for zigzag's two chunks, as many as an order's pieces: ``pieces.py``), in
ascending position order, and runs are grouped sample after sample. Padding
positions belong to no run. Every layout is read through each sample's *extent* ``W_i`` (its positions,
padding included: ``Layout.padded_lengths``) and the padding ``o_i`` before its tokens
in it (``Layout.row_offsets``: a left-padded bshd row), so the padded samples of verl
or Megatron-Bridge and the left-padded rows of Hugging Face trainers are more inputs
of the same runs, not other code paths.
A *selection* intersects the runs with one position range per sample and expands
the result into row indices with vectorized integer arithmetic: no Python loop
over samples, no per-sample ``torch.arange``.

A shared-prefix layout lays out *stars* (a group's prompt once, then its responses back
to back) where other layouts lay out samples: the pieces are the stars', and each
sample's runs are the star's rows that hold its positions (``_star_runs``), so the rows
of a group's prompt are in the runs of every sample of the group. A selection's
*elements* then share rows: the prompt's last row predicts the first response token of
each branch. At *depth* ``d`` (multi-token prediction) position ``p`` predicts token
``p + 1 + d`` of its sample; the response and targets spans move with it.
"""

from collections.abc import Mapping
from typing import Literal, NamedTuple, NoReturn

import torch
from torch import Tensor

from .._cache import boundary, cached
from .._errors import LayoutError
from .._types import Strategy
from .layout import Layout
from .pieces import Pieces, placed

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


def response_base(layout: Layout, *, concatenated: bool = False, depth: int = 0) -> Tensor:
    """Per sample, what turns a within-sample position of the response span (at ``depth``)
    into an index of the response: ``p + 1 + d - P_i``, or with ``concatenated`` an index
    into all responses back to back: ``R_0 + ... + R_{i-1} + p + 1 + d - P_i``."""
    total, response = _lengths(layout)
    base = response - total + 1 + depth  # 1 + d - P_i
    return base + exclusive_cumsum(response) if concatenated else base


@cached(maxsize=64)
def needed_length(layout: Layout) -> int:
    """The least local length ``T`` the layout fits in."""
    return layout._placement().least_length  # an order's: N / c rows of the rearranged stream


def check_local_length(layout: Layout, length: int, what: str = "local_length") -> None:
    """Raise LayoutError unless ``length`` can be this rank's local length: the
    layout's ``local_length`` when it declares one (at least what it needs), else
    exactly the least length it needs (``needed_length``). A tensor longer than that
    is not read as padding: its extra rows are only padding where the layout says so."""
    declared = layout.local_length
    if declared is not None and length != declared:
        raise LayoutError(
            f"{what} has length {length} but the layout's local_length is {declared} (pass "
            "a tensor of that length, or build the Layout with local_length=None)"
            + _unsharded(layout, length, declared)
        )
    need = needed_length(layout)
    if length < need:
        _too_short(layout, length, what, need)
    if declared is None and length != need:
        raise LayoutError(
            f"{what} has length {length} but the layout needs exactly {need} rows "
            f"({strategy(layout)} layout)" + _unsharded(layout, length, need)
            + "; rows past what the layout needs are padding only where it declares them: "
            f"Layout(..., local_length={length}) or layout.with_local_length({length}) reads "
            f"rows [{need}, {length}) as padding"
        )


def _unsharded(layout: Layout, length: int, need: int) -> str:
    """A hint for a CP layout's local tensor as long as the whole stream (its samples
    back to back, their padded lengths, or ``cp_size`` local tensors of ``need`` rows):
    it looks unsharded."""
    c = layout.cp_size
    whole = {"sum(padded_lengths)": sum(layout.padded_lengths), f"cp_size * {need}": c * need}
    if layout.shared_prefix is None:  # a shared prefix's stream holds a prompt once per group
        whole["sum(total_lengths)"] = sum(layout.total_lengths)
    matched = [f"{name} = {value}" for name, value in whole.items() if value == length]
    if c == 1 or not matched:
        return ""
    return (
        f"; {length} rows are the whole stream of the {c} CP ranks ({', '.join(matched)}), "
        "so the tensor looks unsharded: shard it before the call, with "
        "cpslice.pack(per_sample, layout) for a tensor you build, or the framework's CP "
        "split (megatron's get_batch_on_this_cp_rank, slime's or verl's zigzag slicing)"
    )


def _too_short(layout: Layout, length: int, what: str, need: int) -> NoReturn:
    """Refuse a local length shorter than the ``need`` of the layout (the rule named)."""
    total = sum(layout.padded_lengths)
    if layout.cp_mode == "allgather":
        what_sum = "total_lengths" if layout.padded_lengths == layout.total_lengths else (
            "padded_lengths"
        )
        rule = (
            f"cp_size * T = {layout.cp_size} * {length} = {layout.cp_size * length} < "
            f"sum({what_sum}) = {total} (the {layout.cp_size} pieces must cover the "
            f"packed stream: T >= {need})"
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

    A run is a piece of the sample's extent on this rank (``pieces.py``: all of it, a zigzag
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


class Segments(NamedTuple):
    """Where each sample's positions sit in its group's star (``shared_prefix``): star
    positions ``[lo, lo + size)`` of star ``star`` hold positions ``[start, start + size)``
    of ``sample``; a sample's segments in position order, samples in order."""

    sample: Tensor
    star: Tensor
    lo: Tensor
    size: Tensor
    start: Tensor


@cached(maxsize=16)
def segments(layout: Layout) -> Segments:
    """A shared-prefix layout's segments: a group's first sample holds star positions
    ``[0, L_i)``; branch ``g > 0`` the prompt ``[0, P)``, then its response at
    ``[P + D_g, P + D_g + R_g)``, ``D_g`` the responses of the group's earlier branches."""
    assert layout.shared_prefix is not None
    total, response = _lengths(layout)
    sizes = torch.tensor(layout.shared_prefix, dtype=_I64)
    star = torch.repeat_interleave(torch.arange(len(sizes), dtype=_I64), sizes, output_size=len(total))
    first = exclusive_cumsum(sizes)[star]
    prompt = total - response
    before = exclusive_cumsum(response)
    offset = before - before[first]  # D_g
    lead = offset == 0  # the group's first (and its empty-response predecessors: D_g = 0)
    samples = torch.arange(len(total), dtype=_I64)
    size_a = torch.where(lead, total, prompt)
    size_b = torch.where(lead, torch.zeros_like(total), response)
    both = torch.stack
    return Segments(
        torch.repeat_interleave(samples, 2), torch.repeat_interleave(star, 2),
        both([torch.zeros_like(total), prompt + offset], 1).reshape(-1),
        both([size_a, size_b], 1).reshape(-1), both([torch.zeros_like(total), prompt], 1).reshape(-1),
    )


def _star_runs(p: Pieces, layout: Layout) -> Runs:
    """The runs of a shared-prefix layout's star pieces ``p``: every segment of every sample
    against every piece of its star on the rank, the non-empty intersections (a run of
    token rows only: ``width`` its ``length``, no ``lead``)."""
    seg = segments(layout)
    stars = len(layout.padded_lengths)
    count = torch.bincount(p.sample, minlength=stars)
    pairs = count[seg.star]
    total = int(pairs.sum())
    which = torch.repeat_interleave(torch.arange(len(pairs), dtype=_I64), pairs, output_size=total)
    piece = exclusive_cumsum(count)[seg.star[which]] + torch.arange(total, dtype=_I64) - exclusive_cumsum(pairs)[which]
    first, width, slot = p.first[piece], p.width[piece], p.slot[piece]
    lo = torch.maximum(first, seg.lo[which])
    size = (torch.minimum(first + width, seg.lo[which] + seg.size[which]) - lo).clamp_min(0)
    keep = size > 0
    size = size[keep]
    lo, first, slot, which = lo[keep], first[keep], slot[keep], which[keep]
    start = seg.start[which] + lo - seg.lo[which]
    return Runs(seg.sample[which], slot + lo - first, start, size, size, torch.zeros_like(size))


@cached(maxsize=16)
def _pieces_on(layout: Layout, length: int, rank: int) -> Pieces:
    """The pieces of CP rank ``rank``: one reading of the placement for every span a
    call reads."""
    return layout._placement().of_rank(rank, length)


def runs(layout: Layout, length: int, rank: int | None = None) -> Runs:
    """The runs of the layout on its rank (or on CP rank ``rank`` of its group), whose
    local tensor has ``length`` rows."""
    pieces = _pieces_on(layout, length, layout.cp_rank if rank is None else rank)
    return _tokens(pieces, layout) if layout.shared_prefix is None else _star_runs(pieces, layout)


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


def select(layout: Layout, length: int, span: Span, rank: int | None = None, depth: int = 0) -> Selection:
    """The selection of one span of every sample (rows on the CPU), computed anew, on the
    layout's rank (or on CP rank ``rank`` of its group: another rank's rows, no other
    ``Layout`` built), at ``depth`` ``d`` (position ``p`` predicts token ``p + 1 + d``).

    - ``"response"``: positions ``[P_i - 1 - d, L_i - 1 - d)`` from 0, the logits that
      predict the response (what extraction returns); with a shared prefix, a group's
      prompt rows among them are elements of each branch;
    - ``"sample"``: positions ``[0, L_i)``, every token (what packing writes); with a
      shared prefix, every sample but its group's first omits the prompt, so that each
      row is selected once;
    - ``"targets"``: positions ``[0, L_i - 1 - d)``, those whose target token exists.
    """
    total, response = _lengths(layout)
    zero = torch.zeros_like(total)
    if span == "response":
        lo, hi = _response_span(total, response, depth)
    elif span == "sample":
        lo, hi = zero, total
        if layout.shared_prefix is not None:
            lo = torch.where(_repeats_prompt(layout), total - response, zero)
    else:
        lo, hi = zero, total - 1 - depth
    return _select(layout, length, lo, hi, rank)


def _response_span(total: Tensor, response: Tensor, depth: int) -> tuple[Tensor, Tensor]:
    """Per sample, the positions ``[lo, hi)`` whose depth-``d`` targets are response tokens."""
    return (total - response - 1 - depth).clamp_min(0), total - 1 - depth


def predicted(layout: Layout, depth: int) -> Tensor:
    """The bool ``[R]`` mask, over all whole responses back to back, of the tokens that a
    position of the response span predicts at ``depth``: all but the first
    ``d + 1 - P_i`` of a sample whose prompt is shorter than ``d + 1``."""
    total, response = _lengths(layout)
    first = _response_span(total, response, depth)[0] + response_base(layout, concatenated=True, depth=depth)
    count = int(response.sum())
    sample = torch.repeat_interleave(torch.arange(response.numel(), dtype=_I64), response, output_size=count)
    return torch.arange(count, dtype=_I64) >= first[sample]


@cached(maxsize=8)
def prompt_pairs(layout: Layout) -> tuple[Tensor, Tensor, Tensor]:
    """For a shared-prefix layout, every prompt token of every sample but its group's
    first, as indices into the concatenated per-sample tensors: ``(copy, first, sample)``,
    the token, the same token of the group's first sample, and the sample it belongs to."""
    total, response = _lengths(layout)
    prompt = torch.where(_repeats_prompt(layout), total - response, torch.zeros_like(total))
    count = int(prompt.sum())
    sample = torch.repeat_interleave(torch.arange(len(total), dtype=_I64), prompt, output_size=count)
    position = torch.arange(count, dtype=_I64) - exclusive_cumsum(prompt)[sample]
    offsets = packed_offsets(layout)
    assert layout.shared_prefix is not None
    sizes = torch.tensor(layout.shared_prefix, dtype=_I64)
    first = torch.repeat_interleave(exclusive_cumsum(sizes), sizes, output_size=len(total))
    return offsets[sample] + position, offsets[first[sample]] + position, sample


def _repeats_prompt(layout: Layout) -> Tensor:
    """Per sample of a shared-prefix layout: whether it is not its group's first."""
    assert layout.shared_prefix is not None
    out = torch.ones(layout.num_samples, dtype=torch.bool)
    out[exclusive_cumsum(torch.tensor(layout.shared_prefix, dtype=_I64))] = False
    return out


# A few layouts at a time: one step reads the same layout several times (log-probs,
# entropy, masks), and a selection of ~1M rows holds ~16 MB.
@cached(maxsize=8)
def selection(layout: Layout, length: int, span: Span, depth: int = 0) -> Selection:
    """``select``, cached: the selections of this rank's layouts that a step reads."""
    return select(layout, length, span, depth=depth)


def selection_at(layout: Layout, length: int, span: Span, depth: int) -> Selection:
    """``selection`` at ``depth``, called as every caller at depth 0 calls it (one cache
    entry per selection: ``lru_cache`` keys a defaulted argument apart from a given one)."""
    return selection(layout, length, span) if depth == 0 else selection(layout, length, span, depth)


@cached(maxsize=8)
def rows_on(layout: Layout, length: int, span: Span, device: torch.device, depth: int = 0) -> Tensor:
    """``selection(...).rows`` on ``device``, cached so a step copies it once."""
    return selection_at(layout, length, span, depth).rows.to(device)


class Picks(NamedTuple):
    """The elements of a response read as the vocabulary engine computes them: each
    distinct row once (``rows``, on the call's device), element ``e`` the pick ``slot[e]``
    of row ``rows[element[e]]``, ``k`` picks per row at most (1 unless rows are shared: a
    shared prefix's prompt rows, one pick per branch); ``host_*`` the same on the CPU."""

    rows: Tensor
    element: Tensor
    slot: Tensor
    k: int
    host_rows: Tensor
    host_element: Tensor
    host_slot: Tensor


class Read:
    """One span of a resolved layout, as a call reads it: the ``selection`` (CPU) and its
    ``rows`` on the call's device, with what the span's readings need of the layout,
    taken at the resolution (nothing later reads the layout again); ``sources``,
    ``targets``, ``picks``, ``mask`` and ``whole_runs`` are computed at their first
    reading (an extraction reads none) and kept with the cached read."""

    __slots__ = ("selection", "rows", "_length", "_device", "_base", "_target_base", "_whole_base", "_distinct",
                 "_sources", "_targets", "_picks", "_mask", "_whole_runs")

    def __init__(self, selection: Selection, rows: Tensor, layout: Layout, length: int, span: Span,
                 device: torch.device, depth: int = 0) -> None:
        self.selection, self.rows = selection, rows
        self._length, self._device = length, device
        self._base = _base(layout, span, depth)
        self._target_base = packed_offsets(layout) + 1 + depth
        self._whole_base = response_base(layout, depth=depth) if span == "response" else None
        self._distinct = layout.shared_prefix is None
        self._sources: Tensor | None = None
        self._targets: Tensor | None = None
        self._picks: Picks | None = None
        self._mask: Tensor | None = None
        self._whole_runs: list[list[tuple[int, int]]] | None = None

    @property
    def sources(self) -> Tensor:
        """On the call's device: for every element the element of the concatenated
        per-sample tensors it holds (``"sample"``: the token, ``"targets"``: its target
        token, ``"response"``: the element of the concatenated whole responses)."""
        if self._sources is None:
            self._sources = self.selection.sources(self._base).to(self._device)
        return self._sources

    @property
    def targets(self) -> Tensor:
        """On the call's device: for every element the index of its target token
        (``p + 1 + d`` of its sample) in the concatenated per-sample tokens."""
        if self._targets is None:
            self._targets = self.selection.sources(self._target_base).to(self._device)
        return self._targets

    @property
    def picks(self) -> Picks:
        """The elements' distinct rows and picks (``Picks``)."""
        if self._picks is None:
            self._picks = _picks(self.selection.rows, self._distinct, self._device)
        return self._picks

    @property
    def mask(self) -> Tensor:
        """CPU bool ``[T]``: the rows of the span."""
        if self._mask is None:
            self._mask = torch.zeros(self._length, dtype=torch.bool).index_fill_(0, self.selection.rows, True)
        return self._mask

    @property
    def whole_runs(self) -> list[list[tuple[int, int]]]:
        """A ``"response"`` read's runs in the whole responses: per sample, where each of
        its non-empty runs on this rank starts in the sample's whole response-aligned
        tensor, and its length (what ``shard_responses`` cuts)."""
        assert self._whole_base is not None, "whole_runs reads the response span"
        if self._whole_runs is None:
            self._whole_runs = _whole_runs(self.selection, self._whole_base)
        return self._whole_runs


@boundary
def _whole_runs(sel: Selection, base: Tensor) -> list[list[tuple[int, int]]]:
    """``Read.whole_runs`` of ``sel``, its samples' whole tensors indexed from ``base``
    (host arithmetic: behind the compile boundary)."""
    runs: list[list[tuple[int, int]]] = [[] for _ in sel.counts]
    live = sel.run_count > 0
    starts = sel.run_sources(base)[live].tolist()
    for i, start, size in zip(sel.run_sample[live].tolist(), starts, sel.run_count[live].tolist()):
        runs[i].append((start, size))
    return runs


def _picks(rows: Tensor, distinct: bool, device: torch.device) -> Picks:
    """``Picks`` of the CPU ``rows`` of a selection (``distinct``: no row twice, as in
    every layout without a shared prefix)."""
    total = int(rows.numel())
    if distinct:
        every, zero = torch.arange(total, dtype=_I64), torch.zeros(total, dtype=_I64)
        return Picks(rows.to(device), every.to(device), zero.to(device), 1, rows, every, zero)
    unique, element, counts = torch.unique(rows, sorted=True, return_inverse=True, return_counts=True)
    order = torch.argsort(element, stable=True)
    slot = torch.empty(total, dtype=_I64)
    slot[order] = torch.arange(total, dtype=_I64) - torch.repeat_interleave(
        exclusive_cumsum(counts), counts, output_size=total
    )
    k = int(counts.max()) if total else 1
    return Picks(unique.to(device), element.to(device), slot.to(device), k, unique, element, slot)


class Local(NamedTuple):
    """A layout resolved once for one call: the ``layout``, this rank's local length
    ``length`` (``T``), the ``device`` of the call's tensors, the ``reads`` of the spans
    the call asked for and their ``depth``. Private workers take this record, never a
    ``Layout``: nothing after the resolution reads the layout's lengths again."""

    layout: Layout
    length: int
    device: torch.device
    reads: Mapping[Span, Read]
    depth: int = 0


def _base(layout: Layout, span: Span, depth: int) -> Tensor:
    """Where each sample starts in the concatenation ``Read.sources`` indexes, plus the
    shift from position to element (``p + 1 + d`` for targets; ``p + 1 + d - P_i`` for
    the response)."""
    if span == "response":
        return response_base(layout, concatenated=True, depth=depth)
    return packed_offsets(layout) + (1 + depth if span == "targets" else 0)


@cached(maxsize=16)
def _read(layout: Layout, length: int, span: Span, device: torch.device, depth: int = 0) -> Read:
    return Read(selection_at(layout, length, span, depth), rows_on(layout, length, span, device, depth), layout,
                length, span, device, depth)


@boundary
def resolve(
    layout: Layout,
    length: int | None = None,
    what: str = "local tensor",
    spans: tuple[Span, ...] = (),
    device: torch.device | str = "cpu",
    *,
    least: bool = False,
    depth: int = 0,
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
    reads = {span: _read(layout, t, span, dev, 0 if span == "sample" else depth) for span in spans}
    return Local(layout, t, dev, reads, depth)


@cached(maxsize=8)
def _stream_rows(layout: Layout, length: int, device: torch.device) -> Tensor:
    # every rank's pieces, read from the placement (not through ``_pieces_on``, whose few
    # entries are this rank's): the index they give is what is cached
    placement = layout._placement()
    rows, positions = placed(layout.padded_lengths, [placement.of_rank(r, length) for r in range(layout.cp_size)],
                             length)
    return torch.empty(sum(layout.padded_lengths), dtype=_I64).index_copy_(0, positions, rows).to(device)


def stream_rows(local: Local) -> Tensor:
    """For each position of the layout's stream without CP (its extents ``W_i``, one per
    star with a shared prefix, back to back: the positions ``Layout.order`` indexes), the
    row that holds it among the CP ranks' local tensors of ``T`` rows concatenated in rank
    order, on the call's device: ``Layout.order``'s inverse. The ranks' pieces cover the
    stream once, so each position has one row; rows past it (an allgather's tail, a local
    tensor longer than the layout needs) hold none."""
    return _stream_rows(local.layout, local.length, local.device)
