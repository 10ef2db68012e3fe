"""The statistics of one row: what a pass computes, how parts merge, the all-gather, the results.

For a row of logits ``x`` over some of the vocabulary's columns (a chunk of the
logits, a ``[rows, V_block]`` block of ``hidden @ weight.T``, one TP shard, a token
set) and temperature ``tau``, the statistics relative to their own max ``m``, with
``d = (x - m) / tau``, are

    S = sum exp(d)        A = sum exp(d) * d        and the logits at the row's picked ids

(``RowStats``). Statistics of disjoint columns merge exactly (``merge``): with the
union's max ``M`` and ``delta_b = (m_b - M) / tau``,

    S = sum_b e^delta_b S_b        A = sum_b e^delta_b (A_b + delta_b S_b)

so vocabulary blocks and TP shards combine alike (the shards' after one all-gather,
``combine``). From the merged statistics of the whole vocabulary (``totals``):

    log p_j = (x_j - M) / tau - log S        H = log S - A / S

(``Totals``; the gradient's per-row terms are ``gradient``'s). Everything is computed in
``compute_dtype`` (float32; float64 for float64 inputs).
"""

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _probe
from . import spec
from .softmax import Tau, rows_of, scaled
from .spec import Merger

_Gather = Callable[..., object]
# all_gather_single replaces the deprecated all_gather_into_tensor (torch >= 2.13).
_all_gather: _Gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RowStats(NamedTuple):
    """Per-row statistics of logits over some of the vocabulary's columns (see the module
    docstring), one value per row: ``max`` ``m`` ``[T]`` (-inf where every column is
    -inf), ``sum`` ``S`` ``[T]`` (0 there), ``picked`` ``[T, k]`` the logits at each row's
    ``k`` picked ids where these columns hold them (else 0), ``ent`` ``A`` ``[T]`` (None
    without entropy). Invariant mode's per-tile statistics are ``TileStats``; the
    statistics of several parts, stacked, are ``Parts``."""

    max: Tensor
    sum: Tensor
    picked: Tensor
    ent: Tensor | None

    def map(self, fn: Callable[[Tensor], Tensor]) -> "RowStats":
        """``fn`` of every field (a None ``ent`` stays None): a slice, a view, a new buffer."""
        return RowStats(fn(self.max), fn(self.sum), fn(self.picked), None if self.ent is None else fn(self.ent))


class TileStats(NamedTuple):
    """Invariant mode's statistics per tile (``spec.TILE`` columns of global ids): ``max``,
    ``sum`` and ``ent`` ``[T, n]``, each tile's ``(m_j, s_j, a_j)`` (the dense pass's: a
    view of ``[n, T]`` storage, so that a tile's row of statistics is contiguous, as the
    all-gather sends it), ``picked`` ``[T, k]`` as ``RowStats``'. They merge only in the
    spec's order (``spec.merge_tiles``), never by ``merge``."""

    max: Tensor
    sum: Tensor
    picked: Tensor
    ent: Tensor | None

    @property
    def tiles(self) -> int:
        """The tiles these statistics hold."""
        return int(self.max.shape[1])

    def map(self, fn: Callable[[Tensor], Tensor]) -> "TileStats":
        """``fn`` of every field (a None ``ent`` stays None)."""
        return TileStats(fn(self.max), fn(self.sum), fn(self.picked), None if self.ent is None else fn(self.ent))


Stats = RowStats | TileStats
"""A pass's statistics: one value per row, or (invariant mode under TP, token sets) per tile."""


class Parts(NamedTuple):
    """The ``RowStats`` of ``P`` parts of disjoint columns (vocabulary blocks, TP shards),
    stacked: ``max``, ``sum``, ``ent`` ``[P, T]``, ``picked`` ``[P, T, k]``; ``merge`` makes
    them one ``RowStats``."""

    max: Tensor
    sum: Tensor
    picked: Tensor
    ent: Tensor | None

    def part(self, i: int) -> RowStats:
        """The statistics of part ``i`` (views)."""
        return RowStats(self.max[i], self.sum[i], self.picked[i], None if self.ent is None else self.ent[i])


def placeholders(
    rows: int, k: int, dtype: torch.dtype, device: torch.device, with_entropy: bool
) -> RowStats:
    """New statistics of ``rows`` rows holding the placeholders ``(0, 1, 0, 0)``: they merge
    to nothing wrong and are the same on every shard, for rows whose pass is skipped
    (their results come from a set). A pass then writes the rows it reads."""
    return RowStats(
        torch.zeros(rows, dtype=dtype, device=device),
        torch.ones(rows, dtype=dtype, device=device),
        torch.zeros((rows, k), dtype=dtype, device=device),
        torch.zeros(rows, dtype=dtype, device=device) if with_entropy else None,
    )


def merge(parts: Parts, tau: Tau) -> RowStats:
    """The statistics over the union of the disjoint columns of ``parts``: the max, the
    rescaled sums, the picked logits (at most one part holds each). A row that is -inf in
    every part keeps ``(-inf, 0, ., 0)``."""
    big = parts.max.amax(0)
    delta = (parts.max - torch.where(big == -math.inf, 0.0, big)) / tau
    scale = torch.exp(delta)
    ent = None
    if parts.ent is not None:
        # a part with S = 0 (all -inf) adds nothing; delta * S would be -inf * 0
        ent = torch.where(parts.sum > 0, scale * (parts.ent + delta * parts.sum), 0.0).sum(0)
    return RowStats(big, (scale * parts.sum).sum(0), parts.picked.sum(0), ent)


def write(out: Stats, at: slice | Tensor | tuple[slice | Tensor, slice], m: Tensor, s: Tensor,
          a: Tensor | None) -> None:
    """``out``'s ``max``, ``sum`` and (where both are there) ``ent`` at ``at`` from ``m``,
    ``s`` and ``a``; ``picked`` left as it is."""
    out.max[at], out.sum[at] = m, s
    if out.ent is not None and a is not None:
        out.ent[at] = a


class Totals(NamedTuple):
    """A row's results over the whole vocabulary (or its restricted set): ``max`` ``M``,
    ``log_sum`` ``log S``, ``log_probs`` ``[T, k]`` of the picked ids, ``entropy`` ``[T]``
    or None."""

    max: Tensor
    log_sum: Tensor
    log_probs: Tensor
    entropy: Tensor | None


def totals(stats: RowStats, tau: Tau) -> Totals:
    """``Totals`` from the merged statistics of the whole vocabulary."""
    log_s = torch.log(stats.sum)
    log_p = scaled(stats.picked, stats.max, tau) - log_s[:, None]
    entropy = None if stats.ent is None else log_s - stats.ent / stats.sum
    return Totals(stats.max, log_s, log_p, entropy)


def _rows(stats: Stats, with_picked: bool) -> list[Tensor]:
    """The ``[T]`` rows of ``stats`` that travel in the all-gather (a tile's a row)."""
    def of(field: Tensor) -> list[Tensor]:
        return [field] if isinstance(stats, RowStats) else list(field.t())

    rows = [*of(stats.max), *of(stats.sum)]
    if with_picked:
        rows += list(stats.picked.t())
    return rows + ([] if stats.ent is None else of(stats.ent))


def all_gather_rows(local: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``[W, r, T]``: every shard's ``[r, T]`` rows, by one all-gather over ``group`` (``W`` 1
    and no communication without one)."""
    if group is None:
        return local[None]
    world = dist.get_world_size(group)
    # the concatenation form [W * r, T]: gloo refuses the stacked [W, r, T]
    flat = local.new_empty((world * local.shape[0], local.shape[1]))
    if _probe.active is not None:
        _probe.active.collective("all_gather", local.numel())
    _all_gather(flat, local, group=group)
    return flat.view(world, *local.shape)


MERGE_ROWS = 1024
"""Rows per piece of ``combine``'s tile merge: its temporaries are a few ``[tiles, rows]``
buffers of this many rows, not of ``T``."""


def combine(
    parts: Sequence[Stats],
    tau: Tau,
    group: dist.ProcessGroup | None,
    extra: Tensor | None = None,
    tiles: int | None = None,
    merger: Merger | None = None,
) -> tuple[list[Totals], Tensor | None]:
    """``Totals`` of each of ``parts`` (this shard's statistics of the same rows, e.g. the
    full vocabulary and the token sets) over all shards of ``group``, by one all-gather.
    Every part after the first shares the first's picked logits (they are not sent
    again). ``extra`` ``[r, T]`` rows ride along unmerged: every shard's come back as
    ``[W, r, T]``. With ``tiles`` (invariant mode) a ``TileStats`` part's first ``tiles``
    of all shards' tiles, in global order, merge by ``merger`` (``spec.merge_tiles`` if
    None; invariant mode's backend passes its own, of the same bits), ``MERGE_ROWS`` rows
    at a time; a ``RowStats`` part (without a group: merged so already, by
    ``invariant.stats``) is read as it is.
    Collectives: one ``all_gather`` with ``group``, else none."""
    first = parts[0]
    k = first.picked.shape[1]
    rows = [r for i, p in enumerate(parts) for r in _rows(p, i == 0)]
    local = torch.stack(rows if extra is None else [*rows, *extra.to(first.max.dtype)])
    gathered = all_gather_rows(local, group)
    world = gathered.shape[0]
    out, at = [], 0
    picked = None
    for i, p in enumerate(parts):
        n = 1 if isinstance(p, RowStats) else p.tiles
        at_m, at_s = at, at + n
        at += 2 * n
        if i == 0:
            picked, at = gathered[:, at : at + k].transpose(1, 2), at + k
        at_e = None
        if p.ent is not None:
            at_e, at = at, at + n
        assert picked is not None
        if tiles is None or isinstance(p, RowStats):
            assert tiles is None or world == 1, "merged statistics under TP"
            shards = Parts(gathered[:, at_m], gathered[:, at_s], picked, None if at_e is None else gathered[:, at_e])
            out.append(totals(merge(shards, tau) if tiles is None else shards.part(0), tau))
        else:
            out.append(totals(_merge_gathered(gathered, (at_m, at_s, at_e), n, tiles, picked.sum(0), tau, merger),
                              tau))
    return out, None if extra is None else gathered[:, at:]


def _merge_gathered(
    gathered: Tensor, at: tuple[int, int, int | None], n: int, tiles: int, picked: Tensor, tau: Tau,
    merger: Merger | None,
) -> RowStats:
    """``spec.merge_tiles`` of the first ``tiles`` of every shard's ``n`` tiles of one part of
    ``combine``'s ``[W, r, T]`` rows (its ``max``, ``sum`` and ``ent`` rows at ``at``),
    ``MERGE_ROWS`` rows at a time, into ``[T]`` fields."""
    world, t = gathered.shape[0], gathered.shape[2]

    def new() -> Tensor:
        return gathered.new_empty(t)

    merged = RowStats(new(), new(), picked, None if at[2] is None else new())
    for lo in range(0, t, MERGE_ROWS):
        hi = min(lo + MERGE_ROWS, t)
        m, s, a = (None if i is None else gathered[:, i : i + n, lo:hi].reshape(world * n, hi - lo)[:tiles]
                   for i in at)
        assert m is not None and s is not None
        write(merged, slice(lo, hi), *(merger or spec.merge_tiles)(m, s, a, rows_of(tau, slice(lo, hi))))
    return merged
