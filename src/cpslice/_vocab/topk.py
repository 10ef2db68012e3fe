"""The teacher's side of distillation: each row's ``k`` most likely ids over the whole
(tensor-parallel) vocabulary, and their log-probs.

A driver reduces each of its blocks to the block's ``k`` largest logits and their global
ids (``of_columns``), keeping a running best over its vocabulary blocks (``merge``);
``choose`` sends every shard's candidates with its row statistics in the one all-gather
(``stats.combine``) and takes the best ``k`` of all shards' candidates. Their log-probs
are ``(x - M) / tau - log S`` as for any picked ids, so the gradient is that of
``log_probs_at`` at the chosen ids (the backward of the driver, no communication):
``torch.topk`` of the full ``log_softmax`` and its gradient into the chosen entries.
The softmax is monotone in the logits, so the largest logits are the most likely ids.
"""

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._errors import LayoutError
from . import spec
from .invariant import merge_tiles
from .shard import Shard
from .softmax import Softmax, per_row
from .stats import Stats, Totals, combine

EXACT_FLOAT32_IDS = 2**24
"""Candidate ids travel as floats with the statistics (one all-gather): float32 holds
every integer below this exactly."""


class Candidates(NamedTuple):
    """Per row, up to ``k`` largest logits (compute dtype), descending, and their global
    ids (int64)."""

    values: Tensor
    ids: Tensor


def of_columns(x: Tensor, first_id: int, k: int, dtype: torch.dtype, width: int) -> Candidates:
    """The ``min(k, V)`` largest logits of each row of the ``[n, V]`` block ``x`` whose column
    0 is global id ``first_id``, padded with -inf candidates to ``width`` (every shard
    sends as many, one of padded ids only too)."""
    values, columns = torch.topk(x, min(k, x.shape[1]), dim=1)
    pad = width - values.shape[1]
    if pad > 0:
        values = torch.nn.functional.pad(values.to(dtype), (0, pad), value=-math.inf)
        columns = torch.nn.functional.pad(columns, (0, pad))
    return Candidates(values.to(dtype), columns + first_id)


def exact(x: Tensor, first_id: int, k: int, dtype: torch.dtype, width: int, pad_id: int) -> Candidates:
    """``of_columns`` in invariant mode: the ``min(k, V)`` largest logits of each row, ties
    broken by the smaller id (NaN counted as the largest: ``spec.largest``, then
    ``spec.best``), so the ids are a function of the row's values alone; padded to
    ``width`` with ``(-inf, pad_id)``, an id past every real one, so that a tie at -inf
    never picks a pad (a ``width`` below ``min(k, V)`` pads nothing)."""
    rows, vocab = x.shape
    kk = min(k, vocab)
    width = max(width, kk)
    values = torch.full((rows, width), -math.inf, dtype=dtype, device=x.device)
    ids = torch.full((rows, width), pad_id, dtype=torch.int64, device=x.device)
    if kk == 0 or rows == 0:
        return Candidates(values, ids)
    y = x.to(dtype).nan_to_num(nan=math.inf)
    columns = spec.largest(y, kk)
    chosen = best(Candidates(y.gather(1, columns), columns), kk)
    values[:, :kk] = x.gather(1, chosen.ids).to(dtype)
    ids[:, :kk] = chosen.ids + first_id
    return Candidates(values, ids)


def best(c: Candidates, k: int) -> Candidates:
    """The first ``k`` of ``c`` by value, descending, ties by the smaller id
    (``spec.best``): invariant mode's choice among candidates."""
    return Candidates(*spec.best(c.values, c.ids, k))


def merge(a: Candidates, b: Candidates, k: int, invariant: bool = False) -> Candidates:
    """The best ``k`` of two rows of candidates each (as many as there are, up to ``k``);
    in invariant mode by ``best``."""
    values = torch.cat([a.values, b.values], 1)
    ids = torch.cat([a.ids, b.ids], 1)
    if invariant:
        return best(Candidates(values, ids), min(k, values.shape[1]))
    top, at = torch.topk(values, min(k, values.shape[1]), dim=1)
    return Candidates(top, ids.gather(1, at))


def check_k(k: int, vocab_total: int, dtype: torch.dtype) -> None:
    """Refuse a ``k`` the vocabulary cannot fill, and ids a float32 gather would round."""
    if k > vocab_total:
        raise LayoutError(
            f"k={k} is larger than the vocabulary: {vocab_total} ids over all TP shards; "
            f"k must be <= {vocab_total}"
        )
    if dtype != torch.float64 and vocab_total > EXACT_FLOAT32_IDS:
        raise LayoutError(
            f"a vocabulary of {vocab_total} ids is beyond what top-k's float32 all-gather "
            f"carries exactly (ids below {EXACT_FLOAT32_IDS}); pass float64 logits"
        )


def choose(
    dense: Stats, local: Candidates, k: int, shard: Shard, softmax: Softmax, tiles: int | None = None
) -> tuple[Tensor, Tensor, Totals]:
    """``([T, k] log-probs, [T, k] ids, Totals)``: the best ``k`` of every shard's candidates
    (raw logits: the cap is monotone), descending, after one all-gather of this shard's
    ``dense`` statistics (without picked ids) and its candidates. With ``tiles``
    (invariant mode: ``dense`` per tile) the tiles merge in the fixed order and the
    candidates by ``best``."""
    rows, c = local.values.shape
    tau = softmax.tau
    extra = torch.cat([local.values.t(), local.ids.t().to(local.values.dtype)])
    (totals,), gathered = combine([dense], tau, shard.group, extra, tiles, merger=merge_tiles)
    assert gathered is not None
    # [W, c, T] per shard -> [T, W * c]
    width = gathered.shape[0] * c  # not -1: T = 0 (a rank of no rows) has no size to infer
    values = gathered[:, :c].permute(2, 0, 1).reshape(rows, width)
    ids = gathered[:, c:].permute(2, 0, 1).reshape(rows, width)
    if tiles is None:
        top, at = torch.topk(values, k, dim=1)
        chosen = ids.gather(1, at)
    else:
        top, chosen = best(Candidates(values, ids), k)
    log_p = (softmax.logits(top) - totals.max[:, None]) / per_row(tau) - totals.log_sum[:, None]
    return log_p, chosen.to(torch.int64), totals
