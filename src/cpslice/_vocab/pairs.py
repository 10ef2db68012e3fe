"""The statistics of a pair of distributions over the same columns, for a divergence
between them (``vocab_divergence``): what a pass computes, how parts merge, the
collectives, the closed forms and the gradient's per-row terms.

A divergence's two sides are a *weight* distribution ``w`` and an *other* one ``o``:
``KL(w || o)`` (``"forward"``: the teacher's ``q`` weighs, ``KL(q || p)``;
``"reverse"``: the student's, ``KL(p || q)``), or ``"jsd"`` with ``w`` the teacher.
Each side's logits are read as the softmax reads them (``y`` capped, ``r = 1 / tau``).
For a block of columns, relative to each side's own max (docs/invariance.md has them
per tile):

    m_w = max y_w      S_w = sum e_w,   e_w = exp((y_w - m_w) r)
    m_o = max y_o      S_o = sum e_o
    C   = sum e_w (y_w - y_o) r            (kl only; 0 where e_w == 0)

(``PairStats``; per tile ``PairTiles``). Parts of disjoint columns merge exactly
(``merge``): ``S`` as ``stats.merge`` merges it, ``C`` with its weight distribution's
scale alone, ``C = sum_b exp((m_w,b - M_w) / tau) C_b``. Over the whole vocabulary
(``combine``: one all-gather of ``[k, T]`` under TP), with ``M'`` the max (0 where
``-inf``),

    KL(w || o) = C / S_w + (M'_o - M'_w) r + log S_o - log S_w

and ``"jsd"`` needs, per element, the mixture ``m = beta q + (1 - beta) p`` of both
normalized sides (``Sides``): a second pass sums ``Q = sum w (log w - log m)`` and ``P =
sum o (log o - log m)`` (``Mix``; ``combine_mix``: a second collective under TP), ``J =
beta Q + (1 - beta) P``. The gradient's per-row terms (``PairGrad``) come from these;
the kernels apply them per element (``backends.divergence``).
"""

import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from .._types import compute_dtype
from . import spec
from .softmax import Tau, reciprocal
from .stats import MERGE_ROWS, all_gather_rows

_T = TypeVar("_T")
PairKind = Literal["kl", "jsd"]
"""What a pair's kernels compute: ``"kl"`` (``KL(w || o)``: forward and reverse, the
sides ordered) or ``"jsd"``."""


class PairStats(NamedTuple):
    """A pair's statistics over some columns, one value per row (``[T]``): each side's max
    (-inf where every column is -inf) and sum of exp relative to it (0 there), and
    ``cross``, ``C`` (None for ``"jsd"``). Invariant mode's per-tile ones are
    ``PairTiles``; several parts' stacked, ``[P, T]`` fields, are a ``PairStats`` too."""

    wmax: Tensor
    wsum: Tensor
    omax: Tensor
    osum: Tensor
    cross: Tensor | None

    def map(self, fn: Callable[[Tensor], Tensor]) -> "PairStats":
        return PairStats(fn(self.wmax), fn(self.wsum), fn(self.omax), fn(self.osum),
                         None if self.cross is None else fn(self.cross))


class PairTiles(NamedTuple):
    """``PairStats`` per tile (``spec.TILE`` columns of global ids): ``[T, n]`` fields, views
    of ``[n, T]`` storage (a tile's row contiguous, as the all-gather sends it). They merge
    only in the spec's order (``merge_tiles``)."""

    wmax: Tensor
    wsum: Tensor
    omax: Tensor
    osum: Tensor
    cross: Tensor | None

    @property
    def tiles(self) -> int:
        return int(self.wmax.shape[1])

    def map(self, fn: Callable[[Tensor], Tensor]) -> "PairTiles":
        return PairTiles(fn(self.wmax), fn(self.wsum), fn(self.omax), fn(self.osum),
                         None if self.cross is None else fn(self.cross))


PairOut = PairStats | PairTiles
"""Where a pass writes: merged (``[T]``) or, invariant mode under TP, per tile."""


class Mix(NamedTuple):
    """``"jsd"``'s second pass: ``wsum`` ``Q = sum w (log w - log m)`` and ``osum`` ``P =
    sum o (log o - log m)``, ``[T]`` (or ``[T, n]`` per tile in invariant mode under TP)."""

    wsum: Tensor
    osum: Tensor


class Sides(NamedTuple):
    """Both sides normalized, per row ``[T]``: each ``M'`` (the max, 0 where ``-inf``) and
    ``log S``, so that ``log w_j = (y_w,j - M'_w) r - log S_w`` (clamped at ``FLOOR``)."""

    wmax: Tensor
    wlog: Tensor
    omax: Tensor
    olog: Tensor


class Weights(NamedTuple):
    """``"jsd"``'s mixture ``m = bw w + bo o``: the weights (``beta`` and ``1 - beta``, the
    teacher's first) and their logs, computed in float64 and rounded to ``dtype``."""

    bw: float
    bo: float
    log_bw: float
    log_bo: float

    @classmethod
    def of(cls, beta: float) -> "Weights":
        return cls(beta, 1.0 - beta, math.log(beta), math.log1p(-beta))


class PairGrad(NamedTuple):
    """The gradient's per-row terms (``[T]``): ``kl``, ``o``'s ``co (o_j - w_j)`` and ``w``'s
    ``cw w_j (log w_j - log o_j - kw)``; ``"jsd"``, each side's ``c w_j (log w_j - log m_j -
    k)`` (``kw`` = ``Q``, ``ko`` = ``P``; ``weights`` the mixture's). Each ``c`` holds the
    upstream gradient, ``r`` and the side's share of the mixture."""

    kind: PairKind
    sides: Sides
    kw: Tensor
    ko: Tensor
    cw: Tensor
    co: Tensor
    weights: Weights | None

    def rows(self, at: "slice | Tensor") -> "PairGrad":
        """The terms of some rows."""
        return PairGrad(self.kind, Sides(*(f[at] for f in self.sides)), self.kw[at], self.ko[at], self.cw[at],
                        self.co[at], self.weights)


class Plan(NamedTuple):
    """What a divergence computes: its ``kind`` for the kernels, whether the student is the
    weight side (``swap``: ``"reverse"``), and ``"jsd"``'s ``weights``."""

    kind: PairKind
    swap: bool
    weights: Weights | None

    @classmethod
    def of(cls, kind: str, beta: float) -> "Plan":
        """The plan of a checked kind at a checked ``beta`` (its ends already mapped)."""
        if kind == "jsd":
            return cls("jsd", False, Weights.of(beta))
        return cls("kl", kind == "reverse", None)

    def order(self, student: _T, teacher: _T) -> tuple[_T, _T]:
        """``(w, o)`` of ``(student, teacher)`` (their logits, their gradients)."""
        return (student, teacher) if self.swap else (teacher, student)


def placeholders(rows: int, cross: bool, dtype: torch.dtype, device: torch.device) -> PairStats:
    """``[rows]`` statistics holding ``(0, 1, 0, 1, 0)``: finite, the same on every shard, for
    rows a pass does not read (their results are not to be read)."""
    def zeros() -> Tensor:
        return torch.zeros(rows, dtype=dtype, device=device)

    def ones() -> Tensor:
        return torch.ones(rows, dtype=dtype, device=device)

    return PairStats(zeros(), ones(), zeros(), ones(), zeros() if cross else None)


def tile_placeholders(n: int, rows: int, cross: bool, dtype: torch.dtype, device: torch.device) -> PairTiles:
    """``[rows, n]`` per-tile statistics holding ``(0, 1, 0, 1, 0)``, ``[n, rows]`` storage."""
    def fill(value: float) -> Tensor:
        return torch.full((n, rows), value, dtype=dtype, device=device).t()

    return PairTiles(fill(0.0), fill(1.0), fill(0.0), fill(1.0), fill(0.0) if cross else None)


def _side(m: Tensor, s: Tensor, tau: Tau) -> tuple[Tensor, Tensor, Tensor]:
    """``(M, S, scale)`` of one side's ``[P, T]`` parts: ``stats.merge``'s arithmetic."""
    big = m.amax(0)
    scale = torch.exp((m - torch.where(big == -math.inf, 0.0, big)) / tau)
    return big, (scale * s).sum(0), scale


def stacked(parts: Sequence[PairStats]) -> PairStats:
    """``[P, T]`` statistics of ``P`` parts' ``[T]`` ones, for ``merge``."""
    cross = [p.cross for p in parts if p.cross is not None]
    return PairStats(torch.stack([p.wmax for p in parts]), torch.stack([p.wsum for p in parts]),
                     torch.stack([p.omax for p in parts]), torch.stack([p.osum for p in parts]),
                     torch.stack(cross) if cross else None)


def merge(parts: PairStats, tau: Tau) -> PairStats:
    """The statistics over the union of the disjoint columns of ``parts`` (``[P, T]``
    fields): each side's max and rescaled sum, and ``C`` rescaled by the weight side's
    scales (a part whose scale is 0 adds 0)."""
    wmax, wsum, scale = _side(parts.wmax, parts.wsum, tau)
    omax, osum, _ = _side(parts.omax, parts.osum, tau)
    cross = None if parts.cross is None else torch.where(scale == 0, 0.0, scale * parts.cross).sum(0)
    return PairStats(wmax, wsum, omax, osum, cross)


def merge_tiles(tiles: PairTiles, tau: Tau) -> PairStats:
    """The spec's merge of ``[n, R]`` tiles in global order (invariant mode): each side by
    ``spec.merge_tiles``, ``C`` by ``spec.merge_cross``."""
    wmax, wsum, _ = spec.merge_tiles(tiles.wmax, tiles.wsum, None, tau)
    omax, osum, _ = spec.merge_tiles(tiles.omax, tiles.osum, None, tau)
    cross = None if tiles.cross is None else spec.merge_cross(tiles.wmax, tiles.cross, tau)
    return PairStats(wmax, wsum, omax, osum, cross)


def combine(stats: PairOut, tau: Tau, group: dist.ProcessGroup | None, tiles: int | None) -> PairStats:
    """This shard's statistics merged over every shard of ``group`` by one all-gather of
    its ``[k, T]`` rows (``k`` 4 or 5, times the local tiles in invariant mode), in each
    mode's order: ``merge`` of the shards, or (``tiles``, invariant mode) the first
    ``tiles`` of all shards' tiles merged in global order (``merge_tiles``), ``MERGE_ROWS``
    rows at a time. Without a group, merged statistics are returned as they are.
    Collectives: one ``all_gather`` with ``group``, else none."""
    if group is None and isinstance(stats, PairStats):
        return stats
    fields = [f for f in stats if f is not None]
    n = 1 if isinstance(stats, PairStats) else stats.tiles
    local = torch.stack([r for f in fields for r in ([f] if n == 1 and f.dim() == 1 else list(f.t()))])
    gathered = all_gather_rows(local, group)  # [W, k * n, T]
    world, t = gathered.shape[0], gathered.shape[2]
    # [k, W * n, T]: each field's tiles (or shards) of every shard, in global order
    per = gathered.view(world, len(fields), n, t).transpose(0, 1).reshape(len(fields), world * n, t)
    absent = [] if stats.cross is not None else [None]
    if tiles is None:
        return merge(PairStats(*per, *absent), tau)
    out = [per.new_empty(t) for _ in fields]
    for lo in range(0, t, MERGE_ROWS):
        at = slice(lo, min(lo + MERGE_ROWS, t))
        part = PairTiles(*(f[:tiles, at] for f in per), *absent)
        for o, m in zip(out, merge_tiles(part, tau if isinstance(tau, float) else tau[at])):
            assert m is not None
            o[at] = m
    return PairStats(*out, *absent)


def sides(stats: PairStats, invariant: bool) -> Sides:
    """Both sides' ``M'`` and ``log S`` (invariant mode: the spec's ``log``)."""
    log = spec.log if invariant else torch.log

    def shifted(m: Tensor) -> Tensor:
        return torch.where(m == -math.inf, 0.0, m)

    return Sides(shifted(stats.wmax), log(stats.wsum), shifted(stats.omax), log(stats.osum))


def kl(stats: PairStats, both: Sides, tau: Tau) -> Tensor:
    """``KL(w || o) = C / S_w + (M'_o - M'_w) r + log S_o - log S_w`` per row (+inf where
    the other side is 0 where the weight side is not)."""
    assert stats.cross is not None
    r = reciprocal(tau, both.wmax.dtype)
    return stats.cross / stats.wsum + (both.omax - both.wmax) * r + both.olog - both.wlog


def combine_mix(mix: Mix, group: dist.ProcessGroup | None, tiles: int | None) -> Mix:
    """``Mix`` over every shard of ``group``: one all-gather of the ``[2, T]`` sums (per
    tile in invariant mode: ``[2 n, T]``), then every rank sums all shards' in rank order
    (invariant mode, ``tiles`` the distribution's: its tiles, in global order, by
    ``spec.tree``), the same bits on every rank. Without a group, ``mix`` as it is
    (already merged).
    Collectives: one ``all_gather`` with ``group``, else none."""
    if group is None:
        return mix
    n = mix.wsum.shape[1] if mix.wsum.dim() == 2 else 1
    local = torch.cat([mix.wsum.t(), mix.osum.t()]) if mix.wsum.dim() == 2 else torch.stack(list(mix))
    gathered = all_gather_rows(local, group)  # [W, 2 n, T]
    world, t = gathered.shape[0], gathered.shape[2]
    both = gathered.view(world, 2, n, t).transpose(0, 1).reshape(2, world * n, t)
    if tiles is not None:
        return Mix(*(spec.tree(f[:tiles].t().contiguous()) for f in both))
    return Mix(both[0].sum(0), both[1].sum(0))


def jsd(mix: Mix, weights: Weights, dtype: torch.dtype) -> Tensor:
    """``J = beta Q + (1 - beta) P``, the weights rounded to ``dtype`` as the kernels'."""
    bw, bo = (torch.tensor(b, dtype=dtype) for b in (weights.bw, weights.bo))
    return bw * mix.wsum + bo * mix.osum


def grad_terms(plan: Plan, both: Sides, kw: Tensor, ko: Tensor, g: Tensor, tau: Tau) -> PairGrad:
    """The gradient's per-row terms from the upstream ``g`` ``[T]``: each side's ``c`` is
    ``g r`` (``"jsd"``: times its weight in the mixture); ``k`` 0 where ``g`` is (a row of
    infinite KL and no gradient gets zeros, not ``0 * inf``)."""
    r = reciprocal(tau, both.wmax.dtype)
    gr = g.to(both.wmax.dtype) * r
    # a row of no upstream gradient (a masked token) gets exactly 0, its divergence +inf too
    kw, ko = (torch.where(gr == 0, 0.0, k) for k in (kw, ko))
    if plan.weights is None:
        return PairGrad("kl", both, kw, ko, gr, gr, None)
    return PairGrad("jsd", both, kw, ko, gr * plan.weights.bw, gr * plan.weights.bo, plan.weights)


def cdt_of(a: Tensor, b: Tensor) -> torch.dtype:
    """A pair's compute dtype: float64 if either side is, else float32."""
    return compute_dtype(torch.promote_types(a.dtype, b.dtype))
