"""The token-set driver: statistics and gradients restricted to each row's set.

A row ``t`` with a non-empty set ``S_t`` (a ``Support``) takes its log-prob (and, on
request, its entropy) under ``softmax(logits / tau)`` restricted to ``U_t = S_t +
{target_t}``. Everything here costs ``O(K + T)`` for ``K = sum |S_t|``: the logits are
read at the set's ids (one gather, or a dot product per element from hidden states),
never masked or copied. The elements of the ``U_t`` are the ``K`` set ids plus one
*candidate* per row, the target, which counts only where it is not already in ``S_t``.
Their statistics are ``stats.RowStats`` like any block's and combine across TP shards in
the same all-gather. With ``q`` the restricted distribution, ``H_u`` its entropy and
``log q_t`` the target's log-prob, the gradient w.r.t. a logit ``x_j`` of ``U_t`` is

    d log q_t / d x_j = (onehot_j - q_j) / tau
    d H_u / d x_j     = -q_j (log q_j + H_u) / tau

and zero outside ``U_t``: ``O(K + T)`` values (``element_grad``).
"""

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import invariant
from .shard import Shard
from .softmax import Softmax, Tau, rows_of, slope_of_capped
from .spec import FLOOR
from .stats import RowStats, Stats, Totals, placeholders
from .token_sets import Support, host_offsets

_I64 = torch.int64


class Elements(NamedTuple):
    """One call's set elements on one shard: ``E = K + T`` elements (the set ids, then one
    target candidate per row). ``row``/``col`` locate each in the local logits (``col`` 0
    where the shard does not hold it), ``member`` says it counts on this shard,
    ``is_target`` that it is the row's target; ``has_set`` is ``[T]``, ``host_has_set``
    its CPU copy; ``bad_row`` marks rows holding an id outside the vocabulary (their
    log-prob is NaN: on a device, where checking would cost a sync, as for targets)."""

    row: Tensor
    col: Tensor
    member: Tensor
    is_target: Tensor
    has_set: Tensor
    host_has_set: Tensor
    bad_row: Tensor


def elements(support: Support, targets: Tensor, shard: Shard, keep: Tensor | None = None) -> Elements:
    """The elements of every row's ``S_t + {target_t}`` that ``shard`` holds; with ``[T, 0]``
    targets (an entropy alone) of every row's ``S_t``, no candidate. ``O(K + T)``, no
    device sync. ``keep`` (CPU bool ``[T]``, None: all) are the rows to compute: the
    others have no set (no element of theirs counts, whatever their logits)."""
    device = targets.device
    rows = targets.shape[0]
    ids = support.ids.to(device, non_blocking=True)
    offsets = support.offsets.to(device, non_blocking=True)
    counts = offsets.diff()
    set_row = torch.repeat_interleave(
        torch.arange(rows, device=device), counts, output_size=ids.numel()
    )
    has_set, host_has_set = counts > 0, host_offsets(support).diff() > 0
    if keep is not None:
        has_set, host_has_set = has_set & keep.to(device, non_blocking=True), host_has_set & keep
    hit, cand_row, cand_counted = _candidates(ids, targets, set_row, has_set)
    outside = ((ids < 0) | (ids >= shard.vocab)).to(_I64)
    bad_row = torch.zeros(rows, dtype=_I64, device=device).index_add_(0, set_row, outside) > 0
    col, held = shard.columns(torch.cat([ids, targets.view(-1)]))
    counted = torch.cat([has_set[set_row], cand_counted])
    return Elements(
        torch.cat([set_row, cand_row]),
        col,
        held & counted,
        torch.cat([hit, torch.ones_like(cand_counted)]),
        has_set,
        host_has_set,
        bad_row,
    )


def _candidates(ids: Tensor, targets: Tensor, set_row: Tensor, has_set: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Of ``[T]`` targets: which set ids are their row's target (``[K]``), and each row's
    candidate, the target: its row and whether it counts (``[T]``: where the row has a set
    that lacks it). Of ``[T, 0]`` targets: no set id is a target, no candidate."""
    if targets.dim() == 2:
        assert targets.shape[1] == 0, targets.shape
        none = set_row[:0]
        return torch.zeros_like(ids, dtype=torch.bool), none, none.bool()
    rows = targets.shape[0]
    hit = ids == targets[set_row]
    in_set = torch.zeros(rows, dtype=_I64, device=ids.device).index_add_(0, set_row, hit.to(_I64)) > 0
    return hit, torch.arange(rows, device=ids.device), has_set & ~in_set


def set_stats(
    x: Tensor, el: Elements, picked: Tensor, tau: Tau, with_entropy: bool, tiles: int | None = None
) -> Stats:
    """This shard's restricted statistics from the ``[E]`` logits ``x`` of the elements
    (compute dtype, as the softmax reads them: capped), ``picked`` ``[T, 1]`` the dense
    statistics' target logits. Rows
    without a set get ``stats.placeholders``, the same on every shard. With ``tiles``
    (invariant mode: the shard's tiles) ``TileStats``, by ``invariant.set_stats``."""
    rows = picked.shape[0]
    if tiles is not None:
        return invariant.set_stats(x, el.row, el.col, el.member, rows, tiles, tau, with_entropy)
    xm = torch.where(el.member, x, -math.inf)
    m = torch.full((rows,), -math.inf, dtype=x.dtype, device=x.device)
    m = m.scatter_reduce(0, el.row, xm, "amax")
    shift = torch.where(m == -math.inf, 0.0, m)
    d = (xm - shift[el.row]) / rows_of(tau, el.row)
    if with_entropy:
        d = d.clamp(min=FLOOR)
    e = torch.where(el.member, torch.exp(d), 0.0)
    s = torch.zeros(rows, dtype=x.dtype, device=x.device).index_add_(0, el.row, e)
    a = None
    if with_entropy:
        a = torch.zeros(rows, dtype=x.dtype, device=x.device).index_add_(0, el.row, e * d)
    ph = placeholders(rows, picked.shape[1], x.dtype, x.device, with_entropy)
    has = el.has_set
    return RowStats(
        torch.where(has, m, ph.max),
        torch.where(has, s, ph.sum),
        picked,
        None if a is None or ph.ent is None else torch.where(has, a, ph.ent),
    )


class Restricted(NamedTuple):
    """What the backward needs of one call's sets: the elements, their ``[E]`` logits and
    the restricted ``Totals`` (entropy None unless it was computed)."""

    elements: Elements
    logits: Tensor
    totals: Totals


class Split(NamedTuple):
    """The upstream gradients split between the dense pass (``g_lp`` ``[T, 1]``,
    ``g_entropy``) and the sets' rows (``set_lp`` ``[T]``, ``set_entropy``, None where
    not restricted), and ``dense``: CPU bool ``[T]``, the rows that still need the dense
    pass (None: all)."""

    g_lp: Tensor
    g_entropy: Tensor | None
    set_lp: Tensor | None
    set_entropy: Tensor | None
    dense: Tensor | None


def split(
    restricted: Restricted | None,
    g_lp: Tensor,
    g_entropy: Tensor | None,
    entropy_over_support: bool,
    rows: Tensor | None = None,
) -> Split:
    """``Split`` of the upstream gradients (``g_lp`` ``[T, 1]``, or ``[T, 0]`` for an entropy
    alone); without sets, all dense. ``rows`` (CPU bool ``[T]``, None: all) bounds the
    rows the dense pass may need: the others were never computed."""
    if restricted is None:
        return Split(g_lp, g_entropy, None, None, None)
    el = restricted.elements
    # rows with a set: the log-prob's gradient is sparse, and so is the entropy's with
    # entropy_over="support" (or no entropy gradient); an entropy alone has no log-prob
    picked = g_lp[:, 0] if g_lp.shape[1] else g_lp.new_zeros(g_lp.shape[0])
    set_lp = torch.where(el.has_set, picked, 0.0)
    dense_lp = g_lp - set_lp[:, None]
    set_h = None
    if g_entropy is not None and restricted.totals.entropy is not None:
        set_h = torch.where(el.has_set, g_entropy.to(g_lp.dtype), 0.0)
        g_entropy = g_entropy.to(g_lp.dtype) - set_h
    dense = None
    if g_entropy is None or entropy_over_support:
        dense = ~el.host_has_set if rows is None else ~el.host_has_set & rows
    return Split(dense_lp, g_entropy, set_lp, set_h, dense)


def element_grad(
    restricted: Restricted, set_lp: Tensor, set_entropy: Tensor | None, softmax: Softmax
) -> Tensor:
    """``[E]``: the gradient w.r.t. each element's raw logit (zero where it does not count
    on this shard), through the cap's ``tanh`` (``restricted.logits`` are capped), from
    the upstream gradients of the restricted log-prob and entropy (zero on rows they do
    not apply to)."""
    el, x, tot = restricted.elements, restricted.logits, restricted.totals
    r = el.row
    tau = rows_of(softmax.tau, r)
    log_q = (x - tot.max[r]) / tau - tot.log_sum[r]
    glp = set_lp[r]
    if set_entropy is not None and tot.entropy is not None:
        log_q = log_q.clamp(min=FLOOR)
        coef = -torch.exp(log_q) * (glp + set_entropy[r] * (log_q + tot.entropy[r]))
    else:
        coef = -torch.exp(log_q) * glp
    coef = torch.where(el.is_target, coef + glp, coef) / tau
    if softmax.cap is not None:  # x = cap * tanh(raw / cap)
        coef = coef * slope_of_capped(x, softmax.cap)
    return torch.where(el.member, coef, 0.0)


def scatter_grad(grad: Tensor, el: Elements, coef: Tensor) -> None:
    """Add the elements' gradient ``coef`` (``element_grad``) into ``grad`` (``[T,
    V_local]``, contiguous). One ``index_add_`` of ``E`` values."""
    grad.view(-1).index_add_(0, el.row * grad.shape[1] + el.col, coef.to(grad.dtype))
