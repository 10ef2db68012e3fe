"""One rank's check of one batch in one layout, against the float64 reference.

``set_up`` builds what both checks share: the rank's layout (from parallel_state, with
a left-padded case through ``Layout.from_attention_mask``, checked against
parallel_state's with the same row offsets; a padded case through ``Layout.from_cu_seqlens``;
an order case through ``Layout.from_order`` at parallel_state's rank and size; a
shared-prefix case with its groups (``shared_prefix``); none in a CP world without CP,
the whole batch on every CP rank) with a local length of one padding row more than the
layout needs (whose gradient must be zero: a function that reads the least length
instead of the tensor's misplaces rows), the oracle's ``RankView`` of it, and the
rank's packed rows of its TP vocabulary shard.
``check_batch`` then runs the path of a training step through the public API:

    pack -> response_log_probs(with_entropy=True, tp_group=<megatron's TP group>)
      -> [allgather and order] redistribute to the zigzag layout
      -> backward of a weighted sum of log-probs and entropy

``check_support_batch`` runs the same batch with every response token restricted to
a random set of kept ids (``Support.from_responses``, entropy over the set), in the
rank's own layout, and ``check_distill_batch`` the per-token divergence from a
teacher's top-k (``response_distillation``: the student's log-probs at the teacher's
ids under TP, only on the response rows). Expected shares, loss weights and gradient rows are read from
``oracle``, never from the code under check. ``max_error`` is the one error measure:
NaN, inf or a share of the wrong shape count as an infinite error.
"""

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._glue.distill import response_distillation
from .._glue.response import response_log_probs
from .._glue.support import Support
from .._layout.layout import Layout
from .._layout.pack import pack
from .._layout.redistribute import redistribute
from .._vocab.logits import log_probs_and_entropy
from . import oracle
from .batches import (
    TEMPERATURE,
    VOCAB_PER_RANK,
    Batch,
    batches_for,
    distill_reference,
    reference,
    response_sets,
    teacher_top_k,
)
from .cases import Case, Config

CHUNK_ROWS = 5
"""Rows per chunk of ``log_probs_and_entropy``, small so that every batch takes several."""


class Errors(NamedTuple):
    """Largest absolute errors against the reference (inf for NaN or a wrong shape)."""

    log_prob: float
    entropy: float
    grad: float
    distill: float
    invariance: float  # invariant=True here against decode time: 0 when the bits agree

    def worst(self, other: "Errors") -> "Errors":
        return Errors(*(max(a, b) for a, b in zip(self, other)))


def max_error(got: Sequence[Tensor], want: Sequence[Tensor]) -> float:
    """The largest ``|got - want|`` over every element of every pair; inf when the
    lists differ in length, a pair in shape, or a difference is not finite (NaN)."""
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for x, y in zip(got, want):
        if x.shape != y.shape:
            return math.inf
        if x.numel():
            diff = (x.detach().double() - y.double()).abs().max()
            worst = max(worst, float(diff) if bool(diff.isfinite()) else math.inf)
    return worst


def weighted(a: Sequence[Tensor], x: Sequence[Tensor], anchor: Tensor) -> Tensor:
    """``sum(w * v)``; a share of the wrong shape (already a failure: its error is inf)
    counts as ``0 * v``, so that the rank still runs the same backward as the others."""
    return sum(
        ((w * v).sum() if w.shape == v.shape else (v * 0).sum() for w, v in zip(a, x)), anchor
    )


class RankSetup(NamedTuple):
    """One rank's side of a batch in one layout, shared by both checks."""

    layout: Layout  # with local_length: the least the rules need, plus one padding row
    view: oracle.RankView  # the same layout, for the expected values
    shard: slice  # this TP rank's vocabulary columns
    logits: Tensor  # [local_length, VOCAB_PER_RANK] leaf: the rank's packed shard


def row_length(case: Case, batch: Batch) -> int | None:
    """The bshd row length ``S`` (None for thd): one more than the longest sample, made
    odd without CP (where no rule rounds a row up, so an odd ``S`` shows a rounding that
    should not be there); a left-padded case's rows end where its last sample ends
    (``left_padding`` makes that a multiple of ``2 * cp`` under zigzag), so that one
    sample ends exactly at its row's last column."""
    if case.fmt != "bshd":
        return None
    if batch.order is not None:  # an order's rows: as long as the order says
        return len(batch.order[0])
    if batch.offsets is not None:
        return max(o + t for o, t in zip(batch.offsets, batch.total))
    seq = max(batch.total) + 1
    return seq + 1 if case.mode == "none" and seq % 2 == 0 else seq


def attention_mask(batch: Batch, seq: int) -> Tensor:
    """The ``[B, S]`` int64 Hugging Face attention mask of a left-padded batch: 1 at the
    columns ``[o_i, o_i + L_i)`` of row ``i``."""
    assert batch.offsets is not None
    column = torch.arange(seq)
    start = torch.tensor(batch.offsets)[:, None]
    return ((column >= start) & (column < start + torch.tensor(batch.total)[:, None])).long()


def _layout(case: Case, batch: Batch, seq: int | None) -> Layout:
    """The rank's layout: from megatron-core's parallel_state; for a padded case from
    ``Layout.from_cu_seqlens``, for a left-padded one from ``Layout.from_attention_mask``
    and for an order case from ``Layout.from_order``, with the rank and size it gives;
    for none in a CP world a layout without CP (the whole batch on this rank).

    Raises:
        RuntimeError: parallel_state gives another CP mode than the case's, or another
            layout than the attention mask.
    """
    # zigzag and none: the mode parallel_state gives (checked against the case's below)
    state = Layout.from_parallel_state(
        batch.total, batch.response, qkv_format=case.fmt, max_seq_len=seq,
        cp_mode="allgather" if case.mode == "allgather" else None, align=case.align,
        row_offsets=batch.offsets, shared_prefix=batch.groups,
    )
    if batch.order is not None:  # thd: [1, N], as torch's balancers give it
        return Layout.from_order(torch.tensor(batch.order), batch.total, batch.response,
                                 cp_rank=state.cp_rank, cp_size=state.cp_size,
                                 qkv_format=case.fmt, max_seq_len=seq, padded_lengths=batch.padded)
    if case.mode == "none" and state.cp_size > 1:
        return Layout(batch.total, batch.response, qkv_format=case.fmt, max_seq_len=seq,
                      row_offsets=batch.offsets)
    if state.cp_mode != case.mode:
        raise RuntimeError(f"parallel_state gave cp_mode {state.cp_mode!r}, not {case.mode!r}")
    mode = state._closed_mode()
    if batch.offsets is not None:
        # the way a Hugging Face trainer builds it: from the batch's attention mask
        assert seq is not None
        rows = Layout.from_attention_mask(attention_mask(batch, seq), batch.response,
                                          cp_mode=mode, cp_rank=state.cp_rank,
                                          cp_size=state.cp_size)
        if rows != state:
            raise RuntimeError(f"Layout.from_attention_mask gave {rows!r}, parallel_state {state!r}")
        return rows
    if batch.padded is None:
        return state
    bounds = [0, *itertools.accumulate(batch.padded)]
    return Layout.from_cu_seqlens(bounds, batch.total, batch.response, cp_mode=mode,
                                  cp_rank=state.cp_rank, cp_size=state.cp_size)


def set_up(case: Case, batch: Batch, tp_rank: int) -> RankSetup:
    """The rank's layout with one padding row more than it needs, its oracle view and
    its packed logits.

    Raises:
        RuntimeError: parallel_state gives another CP mode than the case's.
    """
    seq = row_length(case, batch)
    layout = _layout(case, batch, seq)
    # one padding row more than the rules need (from the oracle, not from ``_layout.plan``); a
    # shared-prefix layout's extents are its stars
    units = batch.total if batch.groups is None else oracle.star_totals(batch.total, batch.response, batch.groups)
    length = oracle.least_length(
        units, case.mode, case.fmt, seq, layout.cp_size, case.align, batch.padded
    ) + 1
    layout = layout.with_local_length(length)
    view = oracle.RankView(batch.total, batch.response, case.mode, case.fmt, seq,
                           layout.cp_rank, layout.cp_size, length, case.align, batch.padded,
                           batch.offsets, batch.order, batch.groups)
    shard = slice(tp_rank * VOCAB_PER_RANK, (tp_rank + 1) * VOCAB_PER_RANK)
    logits = pack([x[:, shard] for x in batch.logits], layout).requires_grad_()
    return RankSetup(layout, view, shard, logits)


def _grad_error(
    s: RankSetup, batch: Batch, lp: Sequence[Tensor], ent: Sequence[Tensor],
    where: oracle.RankView, ref_grad: Sequence[Tensor],
) -> float:
    """Backward of ``sum w_lp * lp + w_ent * ent`` (``lp``, ``ent`` the shares in the
    layout ``where``), and the error of the logits' gradient rows."""
    anchor = s.logits.sum() * 0  # a rank holding no response still runs backward
    loss = weighted(oracle.shares(batch.w_lp, where), lp, anchor) + weighted(
        oracle.shares(batch.w_ent, where), ent, anchor
    )
    (grad,) = torch.autograd.grad(loss, s.logits)
    return max_error([grad], [oracle.rows([g[:, s.shard] for g in ref_grad], s.view)])


def check_batch(
    case: Case, batch: Batch, tp_rank: int, tp_group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup,
) -> tuple[Errors, bool]:
    """This rank's errors for one batch in one layout, and whether it held no response.

    Collectives: the TP all-gather of ``response_log_probs``; for allgather, the
    all-to-all of ``redistribute`` and its reverse in backward. Every rank enters them.
    """
    s = set_up(case, batch, tp_rank)
    lp, ent = response_log_probs(
        s.logits, batch.tokens, s.layout, with_entropy=True, temperature=TEMPERATURE,
        tp_group=tp_group, chunk_size=CHUNK_ROWS,
    )
    empty = sum(int(x.numel()) for x in lp) == 0
    err_lp = max_error(lp, oracle.shares(batch.ref_lp, s.view))
    err_ent = max_error(ent, oracle.shares(batch.ref_ent, s.view))
    where = s.view
    if case.mode in ("allgather", "order"):
        # what loss code written for ring attention reads: zigzag (none at cp 1)
        zigzag = Layout.from_parallel_state(batch.total, batch.response)
        mode = "zigzag" if s.layout.cp_size > 1 else "none"
        where = oracle.RankView(
            batch.total, batch.response, mode, "thd", None, s.layout.cp_rank, s.layout.cp_size,
            oracle.least_length(batch.total, mode, "thd", None, s.layout.cp_size),
        )
        lp, ent = redistribute((lp, ent), s.layout, zigzag, cp_group=cp_group)
        err_lp = max(err_lp, max_error(lp, oracle.shares(batch.ref_lp, where)))
        err_ent = max(err_ent, max_error(ent, oracle.shares(batch.ref_ent, where)))
    err_grad = _grad_error(s, batch, lp, ent, where, batch.ref_grad)
    return Errors(err_lp, err_ent, err_grad, 0.0, 0.0), empty


def check_support_batch(
    case: Case, batch: Batch, config: Config, tp_rank: int, tp_group: dist.ProcessGroup
) -> Errors:
    """This rank's errors for the batch under per-token sets, in the case's layout.

    Collectives: the TP all-gather of ``response_log_probs``; every rank enters it.
    """
    s = set_up(case, batch, tp_rank)
    sets = response_sets(batch, VOCAB_PER_RANK * config.tp_size, config.seed + 101)
    ref_lp, ref_ent, ref_grad = reference(batch, sets)
    ids = [[j for kept in sample for j in kept] for sample in sets]
    offsets = [[0] for _ in sets]
    for off, sample in zip(offsets, sets):
        for kept in sample:
            off.append(off[-1] + len(kept))
    support = Support.from_responses(ids, offsets, s.layout)
    lp, ent = response_log_probs(
        s.logits, batch.tokens, s.layout, with_entropy=True, temperature=TEMPERATURE,
        tp_group=tp_group, chunk_size=CHUNK_ROWS, support=support, entropy_over="support",
    )
    return Errors(
        max_error(lp, oracle.shares(ref_lp, s.view)),
        max_error(ent, oracle.shares(ref_ent, s.view)),
        _grad_error(s, batch, lp, ent, s.view, ref_grad),
        0.0,
        0.0,
    )


def check_distill_batch(
    case: Case, batch: Batch, config: Config, tp_rank: int, tp_group: dist.ProcessGroup
) -> Errors:
    """This rank's errors for the batch as the divergence from a teacher's top-k, in the
    case's layout: the divergence shares and the logits' gradient of their weighted sum.

    Collectives: the TP all-gather of ``response_distillation``; every rank enters it.
    """
    s = set_up(case, batch, tp_rank)
    teacher_lp, teacher_ids = teacher_top_k(batch, VOCAB_PER_RANK * config.tp_size, config.seed + 303)
    ref_div, ref_grad = distill_reference(batch, teacher_lp, teacher_ids)
    div = response_distillation(
        s.logits, teacher_lp, teacher_ids, s.layout, kind="jsd", temperature=TEMPERATURE,
        tp_group=tp_group, chunk_size=CHUNK_ROWS,
    )
    anchor = s.logits.sum() * 0  # a rank holding no response still runs backward
    (grad,) = torch.autograd.grad(weighted(oracle.shares(batch.w_lp, s.view), div, anchor), s.logits)
    want = oracle.rows([g[:, s.shard] for g in ref_grad], s.view)
    return Errors(0.0, 0.0, max_error([grad], [want]), max_error(div, oracle.shares(ref_div, s.view)), 0.0)


TILE_COLUMNS = 128
"""Invariant mode's tile: for its check each TP rank's ``VOCAB_PER_RANK`` columns are
widened to one tile, the rest ``-inf`` (masked tokens)."""


def _widen(x: Tensor) -> Tensor:
    """``[..., k * VOCAB_PER_RANK]`` logits with each shard's columns followed by ``-inf``
    to ``TILE_COLUMNS``."""
    lead, shards = x.shape[:-1], x.shape[-1] // VOCAB_PER_RANK
    pad = x.new_full((*lead, shards, TILE_COLUMNS - VOCAB_PER_RANK), -math.inf)
    return torch.cat([x.reshape(*lead, shards, VOCAB_PER_RANK), pad], -1).reshape(*lead, shards * TILE_COLUMNS)


def check_invariance_batch(case: Case, batch: Batch, tp_rank: int, tp_group: dist.ProcessGroup) -> float:
    """The largest difference between ``invariant=True`` log-probs, entropies and logits'
    gradient rows in the case's layout at this CP and TP size and decode time's: one
    call over every response row, TP 1, no layout (the vocabulary widened to whole
    tiles, ``_widen``). 0 when every bit agrees; the gradient is left out for shared
    prefixes (a shared prompt's last row sums its branches' terms).

    Collectives: the TP all-gather of ``response_log_probs``; every rank enters it.
    """
    s = set_up(case, batch, tp_rank)
    tokens = [t // VOCAB_PER_RANK * TILE_COLUMNS + t % VOCAB_PER_RANK for t in batch.tokens]
    x = _widen(s.logits.detach()).requires_grad_()
    lp, ent = response_log_probs(x, tokens, s.layout, with_entropy=True, temperature=TEMPERATURE,
                                 tp_group=tp_group, chunk_size=CHUNK_ROWS, invariant=True)
    spans = [slice(t - r - 1, t - 1) for t, r in zip(batch.total, batch.response)]
    rows = torch.cat([_widen(g[span]) for g, span in zip(batch.logits, spans)]).requires_grad_()
    targets = torch.cat([tok[span.start + 1 : span.stop + 1] for tok, span in zip(tokens, spans)])
    want_lp, want_ent = log_probs_and_entropy(rows, targets, with_entropy=True, temperature=TEMPERATURE,
                                              invariant=True)
    torch.autograd.backward((want_lp * torch.cat(batch.w_lp)).sum() + (want_ent * torch.cat(batch.w_ent)).sum())
    sizes = list(batch.response)
    error = max(max_error(lp, oracle.shares(list(torch.split(want_lp.detach(), sizes)), s.view)),
                max_error(ent, oracle.shares(list(torch.split(want_ent.detach(), sizes)), s.view)))
    if batch.groups is not None:
        return error
    anchor = x.sum() * 0  # a rank holding no response still runs backward
    loss = weighted(oracle.shares(batch.w_lp, s.view), lp, anchor) + weighted(
        oracle.shares(batch.w_ent, s.view), ent, anchor)
    (grad,) = torch.autograd.grad(loss, x)
    assert rows.grad is not None
    shard = slice(tp_rank * TILE_COLUMNS, (tp_rank + 1) * TILE_COLUMNS)
    full = []
    for t, span, part in zip(batch.total, spans, torch.split(rows.grad, sizes)):
        whole = part.new_zeros((t, part.shape[1]))
        whole[span] = part
        full.append(whole[:, shard])
    return max(error, max_error([grad], [oracle.rows(full, s.view)]))


def check_case(
    case: Case, config: Config, tp_rank: int, tp_group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup,
) -> tuple[Errors, tuple[bool, ...]]:
    """This rank's worst errors over the case's batches, each checked plain, under
    per-token sets and as distillation, and per batch whether this rank held no
    response."""
    errors = Errors(0.0, 0.0, 0.0, 0.0, 0.0)
    empty = []
    for batch in batches_for(case, config):
        e, none_held = check_batch(case, batch, tp_rank, tp_group, cp_group)
        errors = errors.worst(e).worst(
            check_support_batch(case, batch, config, tp_rank, tp_group)
        ).worst(check_distill_batch(case, batch, config, tp_rank, tp_group))
        invariance = check_invariance_batch(case, batch, tp_rank, tp_group)
        errors = errors.worst(Errors(0.0, 0.0, 0.0, 0.0, invariance))
        empty.append(none_held)
    return errors, tuple(empty)
