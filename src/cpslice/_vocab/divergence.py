"""A divergence over the full (vocab-parallel) vocabulary between a student's and a
teacher's distributions, per row: its driver over a *pair head*, the autograd shell, and
``vocab_divergence`` (the logits' pair head).

A pair head (``PairHead``) is where both models' logits come from, over the same rows and
the same vocabulary columns of this TP shard: this rank's ``[T, V_local]`` logits of each
(``LogitsPair``), or, a head to come, each model's hidden states and LM-head shard, whose
logits are GEMM blocks over the same column splits. The driver never asks more of it than
a walk of blocks: its row ``pieces`` (each a slice or an index of its rows, with the rows
of the piece to compute), its column ``splits``, each block's ``(student, teacher)``
logits, and in backward a ``Sink`` that hands out where each block's gradients go and
takes them back (the logits' head writes into its ``[T, V_local]`` gradients in place; a
hidden-state head would multiply them into its hidden states' and weights' gradients).

Forward (``forward``): each block's pair statistics (``pair_kernels.stats``: each side's max
and sum, and ``C`` for a KL), a piece's splits merged as TP shards merge (``pairs.merge``;
per tile in invariant mode), one all-gather of ``O(T)`` statistics under TP
(``pairs.combine``), then the closed form of ``KL`` (``pairs.kl``); ``"jsd"`` walks the blocks
again (``pair_kernels.mix``: ``Q`` and ``P`` from both normalized sides) and takes a second
collective under TP (``pairs.combine_mix``). Backward (``backward``): the per-row terms
(``pairs.grad_terms``), then one walk writing each wanted side's gradient once
(``pair_kernels.grad``). No collective backward.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _checks as checks
from .. import _probe
from .._types import ChunkArg, DivergenceArg, IntArg, PerPosition, RealArg, TemperatureArg, TensorArg
from . import args, invariant, pair_kernels, pairs, spec
from .backends.chunks import Chunks, chunks_for
from .call import Options
from .memory import buffer
from .pairs import Mix, PairOut, PairStats, Plan, Sides
from .rows import At, index_of
from .shard import Shard, shard_of
from .softmax import Softmax

Span = tuple[int, int]
"""A split of this shard's columns, ``[v0, v1)``."""


class Piece(NamedTuple):
    """Some rows of a pair head: ``at``, the head's rows whose results it holds (a slice, or
    an index), ``size`` of them, and ``rows``, the rows of the piece's blocks to compute
    (an ascending index into them; None: all)."""

    at: At
    size: int
    rows: Tensor | None


@runtime_checkable
class Sink(Protocol):
    """Where a backward's gradients go, block by block: ``outs`` gives the ``[n, v]``
    tensors a block's gradients are written into (None where a side's is not wanted),
    ``take`` takes them back once written, ``result`` is the head's tensors' gradients."""

    def outs(self, piece: Piece, span: Span) -> tuple[Tensor | None, Tensor | None]: ...

    def take(self, piece: Piece, span: Span, student: Tensor | None, teacher: Tensor | None) -> None: ...

    def result(self) -> tuple[Tensor | None, ...]: ...


@runtime_checkable
class PairHead(Protocol):
    """Both models' logits over the same rows and the same vocabulary shard, block by block
    (the module docstring): its ``tensors`` (the autograd inputs; its class called with
    them rebuilds it), ``x`` (a ``[T, ...]`` tensor of its rows: their number and device),
    the pair's compute ``dtype``, this shard's ``vocab_local`` ids, its walk of blocks, and
    a ``Sink`` for its gradients."""

    @property
    def tensors(self) -> tuple[Tensor, ...]: ...

    @property
    def x(self) -> Tensor: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def vocab_local(self) -> int: ...

    def pieces(self, rows: Tensor | None, chunks: Chunks) -> Sequence[Piece]:
        """The row pieces of both passes: the rows ``rows`` (an ascending index, None: all)."""
        ...

    def splits(self, valid: int) -> Sequence[Span]:
        """The column splits of the shard's first ``valid`` columns, the same for every piece
        (in invariant mode each starts at a tile)."""
        ...

    def block(self, piece: Piece, span: Span) -> tuple[Tensor, Tensor]:
        """The ``(student, teacher)`` ``[n, v]`` logits of a piece's rows at a split."""
        ...

    def sink(self, want: Sequence[bool], rows: Tensor | None, valid: int) -> Sink:
        """The backward's ``Sink`` for the ``tensors`` ``want`` says (the ``rows`` computed,
        the shard's ``valid`` columns: every other entry's gradient is 0)."""
        ...


class LogitsSink:
    """The logits' gradients: one ``[T, V_local]`` buffer per wanted side, written in place
    (0 at a padded vocabulary's columns and at the rows not computed)."""

    def __init__(self, student: Tensor, teacher: Tensor, want: Sequence[bool], rows: Tensor | None,
                 valid: int) -> None:
        def grad(x: Tensor, wanted: bool) -> Tensor | None:
            if not wanted:
                return None
            g = buffer(x.shape, x.dtype, x.device, zero=rows is not None)
            if rows is None and valid < x.shape[1]:
                g[:, valid:].zero_()
            return g

        self.grads = (grad(student, want[0]), grad(teacher, want[1]))

    def outs(self, piece: Piece, span: Span) -> tuple[Tensor | None, Tensor | None]:
        s, t = (None if g is None else g[piece.at, span[0] : span[1]] for g in self.grads)
        return s, t

    def take(self, piece: Piece, span: Span, student: Tensor | None, teacher: Tensor | None) -> None:
        """Nothing: the blocks' gradients were written where they belong."""

    def result(self) -> tuple[Tensor | None, ...]:
        return self.grads


class LogitsPair:
    """The logits' pair head: this rank's ``[T, V_local]`` logits of the student and of the
    teacher (the same shape, any float dtypes), one piece of every row (the kernels chunk
    it, reading the rows of an index where they are) and one split of every column. A
    ``split`` (columns) walks the columns in splits, as a hidden-state head would."""

    def __init__(self, student: Tensor, teacher: Tensor, split: int | None = None) -> None:
        self.student, self.teacher, self.split = student, teacher, split
        self.tensors = (student, teacher)
        self.x = student
        self.dtype = pairs.cdt_of(student, teacher)
        self.vocab_local = int(student.shape[1])

    def pieces(self, rows: Tensor | None, chunks: Chunks) -> Sequence[Piece]:
        return [Piece(slice(None), self.student.shape[0], rows)]

    def splits(self, valid: int) -> Sequence[Span]:
        step = valid if self.split is None else self.split
        return [(v0, min(v0 + step, valid)) for v0 in range(0, valid, max(step, 1))] or [(0, 0)]

    def block(self, piece: Piece, span: Span) -> tuple[Tensor, Tensor]:
        return self.student[piece.at, span[0] : span[1]], self.teacher[piece.at, span[0] : span[1]]

    def sink(self, want: Sequence[bool], rows: Tensor | None, valid: int) -> Sink:
        return LogitsSink(self.student, self.teacher, want, rows, valid)


class Call(NamedTuple):
    """A divergence call's settings: what it computes (``plan``) and the softmax's and the
    engine's options (``options``)."""

    plan: Plan
    options: Options


@dataclass(frozen=True)
class Saved:
    """What a forward leaves for its backward beyond its tensors: this shard, both sides
    normalized (``sides``), the per-row ``kw`` (``KL``; ``"jsd"``'s ``Q``) and ``ko``
    (``"jsd"``'s ``P``), the call, and the rows computed (``rows``: an index, None: all)."""

    shard: Shard
    sides: Sides
    kw: Tensor
    ko: Tensor
    call: Call
    rows: Tensor | None


class _Walk(NamedTuple):
    """What every block of one pass shares."""

    pair: PairHead
    call: Call
    shard: Shard
    chunks: Chunks
    splits: Sequence[Span]
    per_tile: bool
    """Invariant mode's statistics kept per tile: under TP (the all-gather sends them), or
    a piece of several splits (merged when the splits are done)."""


def pair_chunks(chunk_size: int | None, vocab: int, dtype: torch.dtype, device: torch.device) -> Chunks:
    """Rows per chunk of a pair's kernels: ``chunk_size`` when given; else a quarter of the
    log-prob loop's eager rows (a pair body's temporaries are about eight ``[rows, V]``
    buffers where the log-prob loop holds two) and half its compiled rows (two sides
    read), at least one row."""
    chunks = chunks_for(chunk_size, vocab, dtype, device)
    if chunk_size is not None:
        return chunks
    return Chunks(max(1, chunks.eager // 4), max(1, chunks.compiled // 2))


def _walk(pair: PairHead, call: Call, shard: Shard) -> _Walk:
    opts = call.options
    chunks = pair_chunks(opts.chunk_size, pair.vocab_local, pair.x.dtype, pair.x.device)
    splits = pair.splits(shard.valid)
    return _Walk(pair, call, shard, chunks, splits, opts.invariant and (shard.world > 1 or len(splits) > 1))


def _softmax(walk: _Walk, piece: Piece) -> Softmax:
    return walk.call.options.softmax.rows(piece.at)


def _piece_stats(walk: _Walk, piece: Piece) -> PairOut:
    """A piece's statistics over the shard: each split's, merged (per tile in invariant
    mode where ``walk.per_tile``; merged in the spec's order without TP)."""
    cdt, device, cross = walk.pair.dtype, walk.pair.x.device, walk.call.plan.kind == "kl"
    softmax = _softmax(walk, piece)
    tiled = (pairs.tile_placeholders(spec.tiles(walk.shard.size), piece.size, cross, cdt, device)
             if walk.per_tile else None)
    parts: list[PairStats] = []
    for span in walk.splits:
        xw, xo = walk.call.plan.order(*walk.pair.block(piece, span))
        part: PairOut = tiled if tiled is not None else pairs.placeholders(piece.size, cross, cdt, device)
        pair_kernels.stats(xw, xo, softmax, part, chunks=walk.chunks, rows=piece.rows, first=span[0] // spec.TILE)
        if isinstance(part, PairStats):
            parts.append(part)
    if tiled is not None:
        if walk.shard.world > 1:
            return tiled
        return pairs.merge_tiles(tiled.map(lambda f: f[:, : spec.tiles(walk.shard.valid)].t()), softmax.tau)
    if len(parts) == 1:
        return parts[0]
    return pairs.merge(pairs.stacked(parts), softmax.tau)


def _write(out: PairOut | Mix, at: At, got: PairOut | Mix) -> None:
    for field, value in zip(out, got):
        if field is not None and value is not None:
            field[at] = value


def _stats_pass(walk: _Walk, rows: Tensor | None) -> PairOut:
    """This shard's statistics of every row (placeholders at rows not computed)."""
    t, cdt, device = walk.pair.x.shape[0], walk.pair.dtype, walk.pair.x.device
    cross = walk.call.plan.kind == "kl"
    out: PairOut = (pairs.tile_placeholders(spec.tiles(walk.shard.size), t, cross, cdt, device)
                    if walk.per_tile and walk.shard.world > 1 else pairs.placeholders(t, cross, cdt, device))
    for piece in walk.pair.pieces(rows, walk.chunks):
        got = _piece_stats(walk, piece)
        if got is not out:
            _write(out, piece.at, got)
    return out


def _piece_mix(walk: _Walk, piece: Piece, both: Sides) -> Mix:
    """A piece's ``Q`` and ``P`` over the shard: the splits' sums added (invariant mode: per
    tile, summed by ``tree`` in global order without TP)."""
    cdt, device = walk.pair.dtype, walk.pair.x.device
    weights = walk.call.plan.weights
    assert weights is not None
    n_tiles = spec.tiles(walk.shard.size)
    shape = (piece.size, n_tiles) if walk.per_tile else (piece.size,)
    total = Mix(torch.zeros(shape, dtype=cdt, device=device), torch.zeros(shape, dtype=cdt, device=device))
    sides = Sides(*(f[piece.at] for f in both))
    for span in walk.splits:
        xw, xo = walk.call.plan.order(*walk.pair.block(piece, span))
        part = total if walk.per_tile or len(walk.splits) == 1 else Mix(torch.empty_like(total.wsum),
                                                                         torch.empty_like(total.osum))
        pair_kernels.mix(xw, xo, _softmax(walk, piece), sides, weights, part, chunks=walk.chunks, rows=piece.rows,
                         first=span[0] // spec.TILE)
        if part is not total:
            total.wsum.add_(part.wsum)
            total.osum.add_(part.osum)
    if walk.per_tile and walk.shard.world == 1:
        valid = spec.tiles(walk.shard.valid)
        return Mix(*(spec.tree(f[:, :valid].contiguous()) for f in total))
    return total


def _mix_pass(walk: _Walk, rows: Tensor | None, both: Sides) -> Mix:
    """``"jsd"``'s second pass over every row, then its collective (``pairs.combine_mix``)."""
    t, cdt, device = walk.pair.x.shape[0], walk.pair.dtype, walk.pair.x.device
    shape = (t, spec.tiles(walk.shard.size)) if walk.per_tile and walk.shard.world > 1 else (t,)
    out = Mix(torch.zeros(shape, dtype=cdt, device=device), torch.zeros(shape, dtype=cdt, device=device))
    for piece in walk.pair.pieces(rows, walk.chunks):
        _write(out, piece.at, _piece_mix(walk, piece, both))
    tiles = spec.tiles(walk.shard.vocab) if walk.call.options.invariant else None
    return pairs.combine_mix(out, walk.shard.group, tiles)


def forward(pair: PairHead, call: Call) -> tuple[Tensor, Saved]:
    """Each row's divergence ``[T]`` (the pair's compute dtype) and what the backward needs.
    Collectives: under TP one all-gather (``"jsd"``: two), entered whatever the rows."""
    opts = call.options
    shard = shard_of(opts.tp_group, pair.vocab_local, opts.vocab_size)
    if opts.invariant:
        invariant.check(shard)
    rows = None if opts.rows is None else index_of(opts.rows, pair.x.device)
    walk = _walk(pair, call, shard)
    tiles = spec.tiles(shard.vocab) if opts.invariant else None
    total = pairs.combine(_stats_pass(walk, rows), opts.tau, shard.group, tiles)
    both = pairs.sides(total, opts.invariant)
    if call.plan.kind == "kl":
        value = pairs.kl(total, both, opts.tau)
        return value, Saved(shard, both, value, value, call, rows)
    assert call.plan.weights is not None
    mix = _mix_pass(walk, rows, both)
    return pairs.jsd(mix, call.plan.weights, pair.dtype), Saved(shard, both, mix.wsum, mix.osum, call, rows)


def backward(pair: PairHead, saved: Saved, g: Tensor, want: Sequence[bool]) -> tuple[Tensor | None, ...]:
    """The gradients w.r.t. the pair head's tensors where ``want`` says: one walk of the
    blocks, each wanted side's gradient written once (no collective)."""
    plan, opts = saved.call.plan, saved.call.options
    terms = pairs.grad_terms(plan, saved.sides, saved.kw, saved.ko, g, opts.tau)
    walk = _walk(pair, saved.call, saved.shard)
    sink = pair.sink(want, saved.rows, saved.shard.valid)
    for piece in pair.pieces(saved.rows, walk.chunks):
        part = terms.rows(piece.at)
        for span in walk.splits:
            xw, xo = plan.order(*pair.block(piece, span))
            gs, gt = sink.outs(piece, span)
            out_w, out_o = plan.order(gs, gt)
            pair_kernels.grad(xw, xo, _softmax(walk, piece), part, out_w, out_o, chunks=walk.chunks,
                              rows=piece.rows)
            sink.take(piece, span, gs, gt)
    return sink.result()


class _Divergence(torch.autograd.Function):
    """A thin shell over ``forward`` and ``backward`` (``kind``: the pair head's class, its
    ``tensors`` the last inputs): the tensors through ``save_for_backward``, the rest as
    one ``Saved``."""

    @staticmethod
    def forward(ctx: Any, kind: Any, call: Call, *tensors: Tensor) -> Tensor:
        value, saved = forward(kind(*tensors), call)
        if _probe.active is not None:
            _probe.active.save("_Divergence", len(tensors))
        ctx.save_for_backward(*tensors)
        ctx.kind, ctx.saved = kind, saved
        ctx.set_materialize_grads(False)
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor | None) -> tuple[Tensor | None, ...]:
        want = ctx.needs_input_grad[2:]
        if g is None or not any(want):
            return None, None, *(None for _ in want)
        return None, None, *backward(ctx.kind(*ctx.saved_tensors), ctx.saved, g, want)


_apply = cast(Callable[..., Tensor], _Divergence.apply)  # torch leaves Function.apply untyped


def divergence(pair: PairHead, call: Call) -> Tensor:
    """Each row's divergence, differentiable w.r.t. the pair head's tensors; where none
    needs a gradient (under ``torch.no_grad()``, or none requiring one), the forward alone
    (the same values) and nothing kept."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in pair.tensors)):
        with torch.no_grad():
            return forward(pair, call)[0]
    return _apply(type(pair), call, *pair.tensors)


def vocab_divergence(
    student: TensorArg, teacher: TensorArg, *, kind: DivergenceArg = "forward", beta: RealArg = 0.5,
    temperature: TemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None,
    softcap: RealArg | None = None, vocab_size: IntArg | None = None, invariant: bool = False,
) -> PerPosition:
    """Per-row divergence between a student's and a teacher's distributions over the full
    (possibly tensor-parallel) vocabulary: GKD / on-policy distillation's loss from both
    models' logits, with no ``[T, V]`` buffer beyond the gradients.

    With ``p = softmax(student / temperature)`` and ``q = softmax(teacher / temperature)``
    (each capped first with ``softcap``): ``"forward"`` is ``KL(q || p)``, ``"reverse"``
    ``KL(p || q)``, ``"jsd"`` ``beta KL(q || m) + (1 - beta) KL(p || m)`` with ``m = beta q
    + (1 - beta) p`` (TRL's ``generalized_jsd_loss``; ``beta = 0`` is ``"forward"`` and 1
    ``"reverse"``, computed as those kinds).

    Args:
        student: ``[..., V_local]`` float32 or bfloat16 (float16, float64 accepted) logits,
            this rank's vocabulary shard (TP rank ``r`` holds ids ``[r * V_local, (r + 1)
            * V_local)``), as ``log_probs_and_entropy``'s: its rows the flattened leading
            dimensions, a view where they merge (else one copy); never modified, saved for
            backward by reference. Or a ``DTensor`` ``Shard(-1)`` over the TP mesh dimension.
        teacher: the teacher's logits over the same rows and the same vocabulary shard: the
            student's shape (any float dtype; a DTensor as the student's). Differentiable
            when it requires grad (frameworks pass it detached).
        kind: ``"forward"``, ``"reverse"`` or ``"jsd"``.
        beta: ``"jsd"``'s teacher weight, ``0 <= beta <= 1`` (checked for every kind).
        temperature, tp_group, chunk_size, softcap, vocab_size, invariant: as
            ``log_probs_and_entropy`` (the same temperature for both models; a per-row
            ``[...]`` or flattened ``[T]`` tensor; ``vocab_size`` excludes a padded
            vocabulary's ids from both distributions, and their gradients are 0).
            ``invariant``: each row's divergence and both gradients are a function of that
            row's logits and the options alone, bit for bit, whatever the batch, the
            chunking and the TP size (docs/invariance.md).

    Returns:
        ``[...]`` (the leading shape; ``[T]`` for 2-D logits) float32 (float64 when either
        input is float64), the same on every rank of ``tp_group``. Differentiable w.r.t.
        ``student``, and w.r.t. ``teacher`` where it requires grad; under
        ``torch.no_grad()`` (or neither requiring grad) nothing is saved. Memory: ``[T]``
        statistics and the chunk kernels' buffers forward; backward, one gradient per
        differentiable input (its shape and dtype), written once: with float32 logits,
        forward + backward peaks within 1.15x one ``[T, V]`` buffer per gradient
        (docs/numbers.md). A probability of 0 (a
        -inf logit on either side, a padded id) adds nothing: no NaN; a KL is ``+inf``
        where the weighing side has mass on an id the other gives -inf (its true value),
        ``"jsd"`` is finite. Identical student and teacher give exactly 0 (and zero
        gradients). A row whose logits are all -inf on a side, or hold NaN or +inf, gives
        NaN.

    Collectives: with ``tp_group``, ``"forward"`` and ``"reverse"`` enter exactly one
    ``all_gather`` of a ``[5, T]`` tensor in forward (each side's max and sum of exp, and
    the cross term; invariant: each once per local tile); ``"jsd"`` needs each element's
    mixture ``m``, so both sides' global normalizers first: one ``all_gather`` of ``[4,
    T]``, then a second of the ``[2, T]`` sums ``KL(q || m)`` and ``KL(p || m)`` (per local
    tile in invariant mode), summed in rank order on every rank. Entered by every rank
    whatever its inputs (T = 0 too); ``T`` and the options must agree across the group.
    Backward enters none; without ``tp_group``, nothing does.

    Raises:
        TypeError: student or teacher not a floating-point tensor; beta, temperature,
            softcap not real numbers; chunk_size, vocab_size not integers.
        LayoutError: student not at least 2-D or with 0 columns, teacher of another shape
            or on another device, ``kind`` not one of the three, ``beta`` outside
            ``[0, 1]``; as ``log_probs_and_entropy`` for the other options (a DTensor
            placed otherwise; invariant mode's TP shard not whole tiles). Before any
            collective.
    """
    student_, teacher_, tp, lead = args.logits_pair(student, teacher, tp_group)
    computed = checks.kind_at(checks.divergence_kind(kind), b := checks.mixture_beta(beta))
    pair = LogitsPair(student_, teacher_)
    options = args.options(student_, pair.vocab_local, None, temperature=lead.temperature(temperature), tp_group=tp,
                           chunk_size=chunk_size, softcap=softcap, vocab_size=vocab_size, invariant=invariant)
    return lead.restore(divergence(pair, Call(Plan.of(computed, b), options)))

