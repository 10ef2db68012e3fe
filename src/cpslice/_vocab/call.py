"""What every vocabulary driver shares around its blocks: a call's settings, the one
all-gather and the choice of each row's result (forward), the state saved for backward,
and the per-row gradient terms (backward).

A driver (``logits``, ``hidden``) computes this shard's dense statistics (``Stats``) its own way
and, with a support, the sets' (``set_elements``); ``finish`` turns them into the results and
the ``Saved`` record its backward reads; ``row_terms`` turns the upstream gradients and
that record into the ``RowGrad`` its kernels apply, and the sets' share of them.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .gradient import RowGrad, row_grad
from .invariant import merge_tiles
from .set_elements import Elements, Restricted, Split, split
from .shard import Shard
from .softmax import Softmax, Tau
from .spec import tiles
from .stats import Stats, combine
from .token_sets import Support


class Options(NamedTuple):
    """A call's settings, everything but its inputs: ``tau`` the temperature (one, or a
    ``[T]`` tensor of one per row); ``chunk_size`` rows per chunk (None: the driver's
    default); ``support`` per-row sets, with ``over_support`` the entropy of rows with a
    set taken over the set; ``rows`` the rows to compute; ``cap`` the soft-cap of the
    logits; ``vocab_size`` the ids of the distribution (None: the whole vocabulary);
    ``invariant`` the bitwise-invariant reduction."""

    with_entropy: bool
    entropy_grad: bool
    tau: Tau
    tp_group: dist.ProcessGroup | None
    chunk_size: int | None
    support: Support | None
    over_support: bool
    rows: Tensor | None = None
    """CPU bool ``[T]``: the rows to compute (None: all). The others are never read (no
    dense pass, no set element), get results that are not to be read, and a gradient
    row of zeros, whatever their logits."""
    cap: float | None = None
    vocab_size: int | None = None
    invariant: bool = False
    """Invariant mode (``invariant``): per-tile statistics merged in a fixed order, by
    kernels whose compiled and eager forms give the same bits."""

    @property
    def softmax(self) -> Softmax:
        return Softmax(self.tau, self.cap, self.invariant)

    @property
    def dense_entropy(self) -> bool:
        """Whether every row, those with a set included, needs the full vocabulary's
        entropy (and so the full pass)."""
        return self.with_entropy and not self.over_support


class Sets(NamedTuple):
    """A driver's sets on this shard: the elements, their ``[E]`` logits (compute dtype)
    and their restricted statistics."""

    elements: Elements
    logits: Tensor
    stats: Stats


@dataclass(frozen=True)
class Saved:
    """What a forward leaves for its backward besides the tensors it saves with
    ``save_for_backward`` (its inputs and, when its gradient is wanted, the entropy): this
    shard, each row's global ``max`` and ``log_sum`` (``M``, ``log S``), the sets'
    ``Restricted`` record, the call's options, and ``dense_rows``, CPU bool ``[T]``: the
    rows its dense pass read (None: all)."""

    shard: Shard
    max: Tensor
    log_sum: Tensor
    restricted: Restricted | None
    options: Options
    dense_rows: Tensor | None


def tile_count(shard: Shard, options: Options) -> int | None:
    """The distribution's tiles in invariant mode (``stats.combine``'s ``tiles``), else None."""
    return tiles(shard.vocab) if options.invariant else None


def finish(
    dense: Stats,
    sets: Sets | None,
    ids: Tensor,
    shard: Shard,
    options: Options,
    dense_rows: Tensor | None,
) -> tuple[Tensor, Tensor | None, Saved]:
    """From this shard's statistics: the one all-gather (``stats.combine``), then the
    log-probs of ``ids`` (``[T, k]``, or ``[T]`` for ``[T]`` targets) and the entropy (None
    without it), rows with a set taking their restricted ones (the entropy only when
    computed over the set), NaN where an id (or a set's) is outside the vocabulary; and
    the ``Saved`` record."""
    parts = [dense] if sets is None else [dense, sets.stats]
    totals, _ = combine(parts, options.tau, shard.group, tiles=tile_count(shard, options), merger=merge_tiles)
    log_p, entropy = totals[0].log_probs, totals[0].entropy
    valid = (ids >= 0) & (ids < shard.vocab)
    restricted = None
    if sets is not None:
        restricted = Restricted(sets.elements, sets.logits, totals[1])
        has_set = sets.elements.has_set
        log_p = torch.where(has_set[:, None], totals[1].log_probs, log_p)
        if totals[1].entropy is not None:
            assert entropy is not None
            entropy = torch.where(has_set, totals[1].entropy, entropy)
        valid = valid & ~(sets.elements.bad_row if ids.dim() == 1 else sets.elements.bad_row[:, None])
    saved = Saved(shard, totals[0].max, totals[0].log_sum, restricted, options, dense_rows)
    # a fresh [T] for [T] targets, not a view of [T, 1]: an output modified in place
    # must not be a view made inside a Function
    log_p = log_p[:, 0] if ids.dim() == 1 else log_p
    return torch.where(valid, log_p, math.nan), entropy, saved


def row_terms(
    saved: Saved,
    ids: Tensor,
    entropy: Tensor | None,
    g_lp: Tensor | None,
    g_entropy: Tensor | None,
) -> tuple[RowGrad, Split]:
    """The dense pass's ``RowGrad`` on this shard and the sets' ``Split`` of the upstream
    gradients (``g_lp`` shaped as ``ids``, ``[T, k]`` or ``[T]``, or None; ``g_entropy``
    ``[T]`` or None); ``entropy`` is
    the saved one (None when its gradient was not wanted)."""
    opts = saved.options
    if ids.dim() == 1:
        ids = ids[:, None]
        g_lp = None if g_lp is None else g_lp[:, None]
    if entropy is None:
        g_entropy = None
    column, held = saved.shard.columns(ids)
    g = torch.zeros(ids.shape, dtype=saved.max.dtype, device=ids.device) if g_lp is None else (
        g_lp.to(saved.max.dtype)
    )
    parts = split(saved.restricted, g, g_entropy, opts.over_support, opts.rows)
    h = None if parts.g_entropy is None else entropy
    row = row_grad(parts.g_lp, parts.g_entropy, h, opts.tau, column, held, with_hot=g_lp is not None)
    return row, parts
