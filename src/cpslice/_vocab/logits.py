"""The logits driver: log-probs and entropy from this rank's ``[T, V_local]`` logits.

Its kernels take chunks of rows of the logits themselves (``kernels.stats`` forward,
``kernels.grad`` backward, compiled or Triton where ``CPSLICE_BACKEND`` says so); only ``[T]``
statistics cross ranks (``call.finish``: one all-gather under TP), and the backward
recomputes ``p`` chunk by chunk from the saved logits and the global ``M`` and ``log S``,
writing the gradient once into one ``[T, V_local]`` buffer, with no communication.
"""

import math
from collections.abc import Sequence
from typing import Literal, Unpack, overload

import torch
import torch.distributed as dist
from torch import Tensor

from .._types import (
    ChunkArg,
    EntropyOverArg,
    IntArg,
    Logits,
    PerPosition,
    RealArg,
    TemperatureArg,
    TensorArg,
    compute_dtype,
)
from . import args, head, invariant, kernels, spec, topk
from .backends.chunks import Chunks, chunks_for
from .call import Options, Saved, Sets, finish, row_terms, tile_count
from .memory import buffer
from .rows import gather, index_of, pieces
from .set_elements import element_grad, elements, scatter_grad, set_stats
from .shard import Shard, shard_of
from .stats import Stats, placeholders
from .token_sets import SupportArg


def forward(logits: Logits, ids: Tensor, options: Options) -> tuple[Tensor, Tensor | None, Saved]:
    """The log-probs of ``ids`` (``[T]`` targets or ``[T, k]``), the entropy (None without
    it) and what the backward needs."""
    rows, vocab = logits.shape
    shard = shard_of(options.tp_group, vocab, options.vocab_size)
    softmax = options.softmax
    chunks = chunks_for(options.chunk_size, vocab, logits.dtype, logits.device)
    picked_ids = ids[:, None] if ids.dim() == 1 else ids
    column, held = shard.columns(picked_ids)
    el = None if options.support is None else elements(options.support, ids, shard, options.rows)
    need = options.rows
    if el is not None and not options.dense_entropy:
        # rows with a set need no full pass: their log-prob (and entropy) is sparse
        need = ~el.host_has_set if need is None else ~el.host_has_set & need
    dense = _dense(logits, shard, options, chunks, None if need is None else index_of(need, logits.device),
                   column.shape[1])
    picked = softmax.logits(logits.gather(1, column).to(dense.max.dtype))
    dense = dense._replace(picked=torch.where(held, picked, 0.0))
    sets = None
    if el is not None:
        x = softmax.logits(logits[el.row, el.col].to(dense.max.dtype))
        with_h = options.with_entropy and options.over_support
        tiles = spec.tiles(shard.size) if options.invariant else None
        sets = Sets(el, x, set_stats(x, el, dense.picked, softmax.tau, with_h, tiles))
    return finish(dense, sets, ids, shard, options, need)


def _dense(
    logits: Logits, shard: Shard, options: Options, chunks: Chunks, rows: Tensor | None, k: int
) -> Stats:
    """This shard's dense statistics of the ``rows`` (an ascending index, None: all;
    placeholders elsewhere) over the distribution's columns only (a padded vocabulary's
    rows are no ids of it), with room for ``k`` picked logits: ``[T]`` fields, or per
    tile in invariant mode."""
    total = logits.shape[0]
    cdt = compute_dtype(logits.dtype)
    if not options.invariant:
        dense = placeholders(total, k, cdt, logits.device, options.with_entropy)
        kernels.stats(logits[:, : shard.valid], options.softmax, dense, chunks=chunks, rows=rows)
        return dense
    stats = invariant.placeholders(shard, total, k, cdt, logits.device, options.with_entropy)
    invariant.stats(logits, options.softmax, shard.valid, stats, rows, chunks.eager)
    return stats


def backward(
    logits: Logits, ids: Tensor, entropy: Tensor | None, saved: Saved,
    g_lp: Tensor | None, g_entropy: Tensor | None,
) -> Logits:
    """The gradient w.r.t. ``logits``: one new ``[T, V_local]`` buffer, written once (0 at a
    padded vocabulary's columns)."""
    opts = saved.options
    rows, vocab = logits.shape
    valid = saved.shard.valid
    chunks = chunks_for(opts.chunk_size, vocab, logits.dtype, logits.device)
    row, parts = row_terms(saved, ids, entropy, g_lp, g_entropy)
    need = saved.dense_rows if parts.dense is None else parts.dense
    # the rows to compute; a zeroed buffer when some are not (their gradient is 0)
    index = None if need is None else index_of(need, logits.device)
    grad = buffer(logits.shape, logits.dtype, logits.device, zero=index is not None)
    if index is None and valid < vocab:
        grad[:, valid:].zero_()
    (invariant.grad if opts.invariant else kernels.grad)(
        logits[:, :valid], saved.max, saved.log_sum, opts.softmax, row, grad[:, :valid], chunks=chunks, rows=index,
    )
    if saved.restricted is not None:
        assert parts.set_lp is not None
        coef = element_grad(saved.restricted, parts.set_lp, parts.set_entropy, opts.softmax)
        scatter_grad(grad, saved.restricted.elements, coef)
    return grad


def topk_forward(logits: Logits, k: int, options: Options) -> tuple[Tensor, Tensor, Saved]:
    """The ``[T, k]`` largest log-probs, descending, their ``[T, k]`` global ids, and what
    the backward (``backward`` at those ids) needs."""
    rows, vocab = logits.shape
    shard = shard_of(options.tp_group, vocab, options.vocab_size)
    cdt = compute_dtype(logits.dtype)
    chunks = chunks_for(options.chunk_size, vocab, logits.dtype, logits.device)
    x = logits[:, : shard.valid]
    index = None if options.rows is None else index_of(options.rows, logits.device)
    dense = _dense(logits, shard, options._replace(with_entropy=False), chunks, index, 0)
    width = min(k, vocab)
    if index is None and not options.invariant:
        local = topk.of_columns(x, shard.offset, k, cdt, width=width)
    else:  # the rows to compute only; the others' candidates are -inf, never read
        local = topk.Candidates(torch.full((rows, width), -math.inf, dtype=cdt, device=logits.device),
                                torch.full((rows, width), shard.total, dtype=torch.int64, device=logits.device))
        for at in pieces(index, rows, chunks.eager):
            part = gather(x, at, None)
            local.values[at], local.ids[at] = (
                topk.exact(part, shard.offset, k, cdt, width, shard.total) if options.invariant
                else topk.of_columns(part, shard.offset, k, cdt, width=width)
            )
    log_p, ids, totals = topk.choose(dense, local, k, shard, options.softmax, tile_count(shard, options))
    return log_p, ids, Saved(shard, totals.max, totals.log_sum, None, options, options.rows)


class LogitsHead:
    """The logits head (``head.Head``): this rank's ``[T, V_local]`` logits, computed in
    place by this module's ``forward``, ``backward`` and ``topk_forward``."""

    what = "logits"
    in_place = True
    default_chunk = None

    def __init__(self, logits: Tensor) -> None:
        self.logits = self.x = logits
        self.tensors = (logits,)
        self.vocab_local = int(logits.shape[1])

    def take(self, index: Tensor) -> "LogitsHead":
        return LogitsHead(self.logits.index_select(0, index))

    def whole(self) -> "LogitsHead":
        return self

    def forward(self, ids: Tensor, options: Options) -> tuple[Tensor, Tensor | None, Saved]:
        return forward(self.logits, ids, options)

    def topk_forward(self, k: int, options: Options) -> tuple[Tensor, Tensor, Saved]:
        return topk_forward(self.logits, k, options)

    def backward(
        self, ids: Tensor, entropy: Tensor | None, saved: Saved, g_lp: Tensor | None, g_entropy: Tensor | None,
        want: Sequence[bool],
    ) -> tuple[Tensor | None, ...]:
        return (backward(self.logits, ids, entropy, saved, g_lp, g_entropy) if want[0] else None,)


@overload
def log_probs_and_entropy(
    logits: TensorArg, targets: TensorArg, *, with_entropy: Literal[False] = False, **kwargs: Unpack[args.Keywords]
) -> tuple[PerPosition, None]: ...
@overload
def log_probs_and_entropy(
    logits: TensorArg, targets: TensorArg, *, with_entropy: Literal[True], **kwargs: Unpack[args.Keywords]
) -> tuple[PerPosition, PerPosition]: ...
@overload
def log_probs_and_entropy(
    logits: TensorArg, targets: TensorArg, *, with_entropy: bool = False, **kwargs: Unpack[args.Keywords]
) -> tuple[PerPosition, PerPosition | None]: ...
def log_probs_and_entropy(
    logits: TensorArg, targets: TensorArg, *, with_entropy: bool = False, entropy_grad: bool = True,
    temperature: TemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None,
    support: SupportArg = None, entropy_over: EntropyOverArg = "full", softcap: RealArg | None = None,
    vocab_size: IntArg | None = None, invariant: bool = False,
) -> tuple[PerPosition, PerPosition | None]:
    """Log-prob of each row's target, and optionally its entropy, under ``softmax(logits /
    temperature)`` over the full (possibly tensor-parallel) vocabulary.

    Args:
        logits: ``[T, V_local]`` float32 or bfloat16 (float16, float64 accepted), this
            rank's vocabulary shard: TP rank ``r`` holds token ids ``[r * V_local, (r + 1)
            * V_local)``, all shards of equal size. Never modified; saved for backward by
            reference (do not modify it in place before backward). Or a ``DTensor``
            ``Shard(-1)`` over the TP mesh dimension: docs/recipes.md, "DTensor logits".
            Or ``[..., V_local]`` with any leading shape (a model's ``[B, S, V_local]``):
            its rows are the flattened leading dimensions, and every result and per-row
            argument has the leading shape ``[...]`` (``[T]`` above); a view of the
            logits where the leading dimensions merge, else ``reshape``'s one copy, held
            until backward (e.g. ``logits[:, :-1]``: pass the whole logits and slice the
            results instead; docs/api-guide.md, "[B, S, V] logits and the entropy alone").
        targets: ``[T]`` int64 *global* token ids (``[...]``, the logits' leading shape); a
            target in another rank's shard takes its logit from that rank. Padding rows
            need some id in range.
        with_entropy: also return the entropy of each row's distribution.
        entropy_grad: False: the entropy is a detached metric (no gradient, none saved).
        temperature: finite, > 0; the (capped) logits are divided by it. A ``[T]`` float
            tensor gives one per row (rollouts sampled at different temperatures), each
            checked where it is on the CPU (on a device a bad one gives its row NaN); for
            ``[..., V_local]`` logits ``[...]`` or flattened ``[T]``.
        tp_group: the tensor-parallel group the vocabulary is split over (None: all local).
        chunk_size: rows per chunk of work; None picks ``default_chunk_rows`` (two
            ``[rows, V_local]`` float32 buffers within 8 MiB on the CPU, 64 MiB elsewhere;
            the compiled kernels', ``CPSLICE_BACKEND``: 32 MiB and 1 GiB).
        support: per-row token sets (top-p / top-k replay), the same on every rank of
            ``tp_group``, over the ``T`` flattened rows. A row with a non-empty set ``S_t`` takes its log-prob under the
            softmax restricted to ``S_t`` plus its target (even outside the set: finite),
            its gradient zero outside; an empty set is unrestricted. ``O(K)`` work on
            those rows: the logits are gathered at the set's ids, never masked or copied.
        entropy_over: ``"full"`` (default): the entropy over the whole vocabulary, one
            full pass over every row. ``"support"``: rows with a set take the entropy of
            their restricted distribution, with no full pass over them.
        softcap: ``c`` (finite, > 0) for a model whose output is soft-capped (Gemma 2 and
            3's ``final_logit_softcapping``): the softmax reads ``c * tanh(x / c) /
            temperature`` inside the chunk kernels, the gradient through the ``tanh``.
        vocab_size: the ids of the distribution, ``[0, vocab_size)`` of a padded vocabulary
            (megatron pads the LM head to a multiple of ``make_vocab_size_divisible_by *
            tp``; the inference engine samples only the tokenizer's ids): the padded ids,
            on whichever shard, are excluded from the softmax, the entropy and any top-k,
            and get zero gradient; a target or set id ``>= vocab_size`` is refused like one
            outside the vocabulary. At most the full vocabulary (all shards); None: all.
        invariant: True: each row's results and its logits' gradient are a function of
            that row's logits and these options alone, bit for bit (docs/invariance.md,
            the spec); under TP, ``V_local`` a multiple of 128. False: the fastest order.

    Returns:
        ``(log_probs, entropy)``, each ``[T]`` (``[...]``) float32 (float64 for float64
        logits, which are computed in float64), entropy None unless ``with_entropy``. Differentiable
        w.r.t. ``logits``. Memory: beyond the logits, ``[T]`` statistics and the chunk
        work buffers in forward, the one ``[T, V_local]`` gradient (dtype of logits) in
        backward; with a support, ``O(K + T)`` more. A row whose logits are all -inf, or
        hold NaN or +inf, gives NaN; single -inf logits (masked tokens) are fine.

    Collectives: with ``tp_group``, exactly one ``all_gather`` of a ``[k, T]`` tensor in
    forward (``k`` = 4 with entropy, else 3; with a support 2 more, 3 more with
    ``entropy_over="support"``; invariant: each statistic once per local tile), entered
    by every rank whatever its inputs or sets (T = 0 too); ``T`` and the options must
    agree across the group. Backward enters none; without ``tp_group``, nothing does.

    Raises:
        TypeError: logits not a floating-point tensor, targets not an int64 tensor,
            temperature not a real number or a floating-point tensor, softcap not a real
            number, chunk_size or vocab_size not an integer, support not a ``Support``.
        LayoutError: logits not at least 2-D or with 0 columns, targets not ``[T]`` (not
            the leading shape), tensors on different devices, temperature (or a row's)
            not finite and > 0 or not ``[T]`` (``[...]``), softcap not finite and > 0,
            chunk_size < 1, vocab_size < 1 or beyond the full vocabulary,
            ``entropy_over`` not ``"full"`` or ``"support"``, a support over another
            number of rows; on the CPU (where it costs no device
            sync; on a device such a row's log-prob is NaN) a target or a support id
            outside ``[0, vocab_size)``; a DTensor placed otherwise; invariant mode's TP
            shard not whole tiles. Before any collective.
    """
    logits_, targets_, tp, lead = args.logits_and_targets(logits, targets, tp_group=tp_group)
    x = LogitsHead(logits_)
    log_p, entropy_ = head.log_probs(x, targets_, head.options(
        x, targets_, with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=lead.temperature(temperature),
        tp_group=tp, chunk_size=chunk_size, support=support, entropy_over=entropy_over, softcap=softcap,
        vocab_size=vocab_size, invariant=invariant))
    return lead.restore(log_p), lead.restore(entropy_)


def entropy(
    logits: TensorArg, *, temperature: TemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None, support: SupportArg = None, entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None, vocab_size: IntArg | None = None, invariant: bool = False,
) -> PerPosition:
    """The entropy of each row's ``softmax(logits / temperature)`` over the full (possibly
    tensor-parallel) vocabulary, without targets: ``log_probs_and_entropy``'s entropy,
    with its gradient, and no log-prob computed.

    Args:
        logits: ``[..., V_local]`` (``[T, V_local]``, a model's ``[B, S, V_local]``) as
            ``log_probs_and_entropy``'s: its rows the flattened leading dimensions; never
            modified, saved for backward by reference; or a DTensor sharded ``Shard(-1)``
            over the TP mesh dimension.
        temperature, tp_group, chunk_size, softcap, vocab_size: as
            ``log_probs_and_entropy`` (a per-row temperature ``[...]`` or flattened
            ``[T]``).
        support, entropy_over: with ``entropy_over="support"``, a row with a non-empty
            set ``S_t`` (a ``Support`` over the ``T`` flattened rows, the same on every
            rank of ``tp_group``) takes the entropy of the softmax restricted to ``S_t``
            alone (there is no target to add), with no full pass over it; its gradient
            zero outside ``S_t``. With ``"full"`` (default) every row's entropy is the
            whole vocabulary's: a support is checked and changes nothing, as it leaves
            ``log_probs_and_entropy``'s entropy unchanged.
        invariant: as ``log_probs_and_entropy``: the same bits as its entropy with the
            same options, whatever the batch, chunking and TP size.

    Returns:
        ``[...]`` (the leading shape; ``[T]`` for 2-D logits) float32 (float64 for
        float64 logits), the same on every rank of ``tp_group``. Differentiable w.r.t.
        ``logits`` (under ``torch.no_grad()`` nothing is saved: a detached metric).
        Memory: as ``log_probs_and_entropy``: ``[T]`` statistics and the chunk work
        buffers in forward, the one ``[T, V_local]`` gradient in backward.

    Collectives: with ``tp_group``, exactly one ``all_gather`` of a ``[3, T]`` tensor in
    forward (each row's max, sum of exp and entropy sum; with ``entropy_over="support"``
    and a support 3 more; invariant: each statistic once per local tile), entered by
    every rank whatever its inputs (T = 0 too); backward enters none.

    Raises:
        TypeError, LayoutError: as ``log_probs_and_entropy`` for every argument. Raised
            before any collective.
    """
    logits_, tp, lead = args.logits_rows(logits, tp_group)
    x = LogitsHead(logits_)
    return lead.restore(head.entropy(
        x, temperature=lead.temperature(temperature), tp_group=tp, chunk_size=chunk_size, support=support,
        entropy_over=entropy_over, softcap=softcap, vocab_size=vocab_size, invariant=invariant))


def log_probs_at(
    logits: TensorArg, ids: TensorArg, *, temperature: TemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None, softcap: RealArg | None = None, vocab_size: IntArg | None = None,
    invariant: bool = False,
) -> Tensor:
    """``log_softmax(logits / temperature)`` over the full (possibly tensor-parallel)
    vocabulary, at ``k`` given ids per row: a student's log-probs at its teacher's top-k.

    Args:
        logits: ``[T, V_local]`` as ``log_probs_and_entropy``'s (never modified; saved for
            backward by reference), or a DTensor sharded ``Shard(-1)`` over the TP mesh
            dimension, as there; or ``[..., V_local]``, its rows the flattened leading
            dimensions, as there.
        ids: ``[T, k]`` int64 *global* token ids (``[..., k]``), any ``k >= 1``, repeats
            allowed; an id in another rank's shard takes its logit from that rank (a
            replicated DTensor: its local tensor).
        temperature, tp_group, chunk_size, softcap, vocab_size, invariant: as
            ``log_probs_and_entropy`` (an id ``>= vocab_size`` is refused).

    Returns:
        ``[T, k]`` (``[..., k]``) float32 (float64 for float64 logits), the same on every
        rank of ``tp_group``; differentiable w.r.t. ``logits`` (a repeated id's entry gathers the
        gradient of every copy). Memory: ``O(T * k)`` saved beyond the logits, no
        ``[T, V]`` work buffer (the chunk kernels, compiled where ``CPSLICE_BACKEND``
        says so), and in backward the one ``[T, V_local]`` gradient.

    Collectives: with ``tp_group``, exactly one ``all_gather`` of ``[2 + k, T]`` in forward
    (each row's max, sum of exp and the logits at the ids this shard holds), entered by
    every rank (T = 0 too); backward enters none. Without ``tp_group``, none.

    Raises:
        TypeError: logits not a floating-point tensor, ids not an int64 tensor; as
            ``log_probs_and_entropy`` for temperature and chunk_size.
        LayoutError: logits not at least 2-D or with 0 columns, ids not ``[T, k]``
            (``[..., k]``) with ``k >= 1``,
            tensors on different devices, a CPU id outside ``[0, tp_size * V_local)``
            (on a device, where checking would cost a sync, that entry is NaN); as
            ``log_probs_and_entropy`` otherwise. Raised before any collective.
    """
    logits_, ids_, tp, lead = args.logits_and_targets(logits, ids, "ids", tp_group=tp_group)
    x = LogitsHead(logits_)
    options = head.options(x, ids_, temperature=lead.temperature(temperature), tp_group=tp, chunk_size=chunk_size,
                           softcap=softcap, vocab_size=vocab_size, invariant=invariant)
    return lead.restore(head.log_probs(x, ids_, options)[0])


def topk_log_probs(
    logits: TensorArg, k: IntArg, *, temperature: TemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None, softcap: RealArg | None = None, vocab_size: IntArg | None = None,
    invariant: bool = False,
) -> tuple[Tensor, Tensor]:
    """Each row's ``k`` most likely ids over the full (possibly tensor-parallel)
    vocabulary and their log-probs: the teacher's side of top-k distillation.

    Equal to ``torch.topk(log_softmax(full_logits / temperature), k)`` (ties broken as
    ``torch.topk`` may), differentiable like it: the gradient reaches the chosen
    entries through the log-softmax (``log_probs_at`` at the chosen ids).

    Args:
        logits, temperature, tp_group, chunk_size, softcap: as ``log_probs_and_entropy``
            (DTensor logits sharded ``Shard(-1)`` over the TP mesh dimension, and
            ``[..., V_local]`` logits, included).
        k: ids per row, ``1 <= k <=`` the vocabulary (``vocab_size``).
        vocab_size: as ``log_probs_and_entropy``: no padded id is ever chosen.
        invariant: as ``log_probs_and_entropy``; ties are broken by the smaller id.

    Returns:
        ``(log_probs, ids)``: ``[T, k]`` float32 (float64 for float64 logits), descending,
        and ``[T, k]`` int64 global ids (each ``[..., k]`` for ``[..., V_local]`` logits),
        the same on every rank of ``tp_group``.

    Collectives: with ``tp_group``, exactly one ``all_gather`` in forward: each rank's
    local top-k candidates (values and ids) ride with its row statistics, and the top-k
    of all candidates is taken; backward enters none.

    Raises:
        TypeError, LayoutError: as ``log_probs_and_entropy`` for logits, temperature and
            chunk_size; ``k`` not an integer (TypeError), ``k < 1`` or larger than the
            vocabulary (LayoutError), a vocabulary of more than 2^24 ids with logits
            other than float64. Raised before any collective.
    """
    logits_, tp, lead = args.logits_rows(logits, tp_group)
    k_ = args.k_best(k)
    x = LogitsHead(logits_)
    options = head.options(x, None, temperature=lead.temperature(temperature), tp_group=tp, chunk_size=chunk_size,
                           softcap=softcap, vocab_size=vocab_size, invariant=invariant)
    log_p, ids = head.topk(x, k_, options)
    return lead.restore(log_p), lead.restore(ids)
