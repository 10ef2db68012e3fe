"""The matmul blocks of the hidden-state driver (``hidden``): ``[rows, V_block]`` blocks of
``hidden @ weight.T`` (``Blocks``), the pieces the support elements are multiplied out in,
the block kernels' interface (``block_stats``, ``block_grad``: the first backend of the
selection's chain that takes the block, its ``KernelBackend`` block kernels) and the
forward's dense pass over the blocks (``dense_pass``), its vocabulary blocks merged as
TP shards merge. The backward (``hidden.backward``) walks the same blocks. (A "tile" is
invariant mode's ``spec.TILE`` columns; a block in invariant mode holds
``invariant.BLOCK_TILES`` of them.)
"""

import functools
import math
import operator
import os
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _probe
from .._types import HeadWeight, Hidden
from . import invariant, topk
from .backends import selection
from .backends.chunks import Chunks, Workspace, chunks_for, compiled_chunk_rows
from .backends.interface import Shape, Task
from .call import Options
from .gemm_settings import exact_if
from .gradient import RowGrad
from .invariant import BLOCK_ROWS, BLOCK_TILES
from .rows import At, gather, pieces, size
from .set_elements import Elements
from .shard import Shard
from .softmax import Softmax, reciprocals
from .spec import TILE, tiles
from .stats import Parts, RowStats, Stats, merge

MIN_BLOCK_ROWS = 2048
"""Blocks span at least this many rows (all rows if fewer): see ``Blocks``."""
SPLIT = 8192
"""On CUDA, a block's vocabulary columns (the last split of a shard fewer): a ``[T, H] x
[H, 8192]`` GEMM is large enough for cuBLAS's full rate and its ``[T, 8192]`` logits and
gradient small enough for a budget that holds all rows (docs/numbers.md)."""
DEVICE_ROWS = 1024
"""On CUDA in invariant mode, a block's rows: every GEMM is ``DEVICE_ROWS x SPLIT``
(zero rows and columns padding the last), whatever the rows and the shard."""
BLOCK_MIB = 512
"""On CUDA, the default budget of a block's buffers (its logits and its logit gradient,
both of the input dtype), in MiB: ``CPSLICE_BLOCK_MIB`` changes it. 512 MiB holds
``16384 x 8192`` of each in bfloat16, every row at once at the benchmark's size."""
ELEMENT_BYTES = 16 * 2**20
"""Support elements are multiplied out in pieces of one float32 ``[n, H]`` within this."""


LINEAR_CHUNK_BYTES = 32 * 2**20
"""The hidden path's rows per chunk when chunk_size is None: one float32 ``[rows, V_local]`` block holds
about this many bytes; a block (``Blocks``) holds half as many elements. Larger than the
logits path's chunks: each block runs a matmul, and a matmul of few rows is slow
(measured on the CPU, T=4096, H=1024, V=32768: 32-row chunks 3.1x the time of one whole
matmul, 256-row chunks 1.2x)."""
def default_hidden_chunk_rows(vocab: int) -> int:
    """Rows per chunk when ``chunk_size`` is None: one float32 ``[rows, vocab]`` block
    within ``LINEAR_CHUNK_BYTES``; at least one row."""
    return max(1, LINEAR_CHUNK_BYTES // (4 * max(vocab, 1)))


def default_hidden_chunk(hidden: Tensor, vocab: int) -> int | None:
    """``chunk_size`` when the caller gives none: ``default_hidden_chunk_rows`` on the CPU
    (and any device but CUDA); None on CUDA, whose blocks the budget sizes
    (``blocks.sizes``)."""
    return None if hidden.device.type == "cuda" else default_hidden_chunk_rows(vocab)


def spans(size: int, block: int) -> list[tuple[int, int]]:
    """``[0, size)`` in spans ``[s, e)`` of ``block`` (the last one shorter)."""
    return [(s, min(s + block, size)) for s in range(0, size, block)]


class Blocks(NamedTuple):
    """The ``[rows, columns]`` matmul blocks of both passes: half as many elements as one
    chunk of ``chunk`` rows (``chunk * V_local``; a backward block holds its logits, its
    gradient and the eager kernels' two work buffers) over at least ``MIN_BLOCK_ROWS`` rows
    (all of them if fewer), so that a block's weight gradient sums many rows in one
    matmul."""

    rows: int
    columns: int
    device: bool = False
    """Sized for the device (CUDA: ``sizes``): the eager loop in chunks of its own size,
    and a split's weight gradient written by one GEMM when one block holds every row."""

    @classmethod
    def of(cls, rows: int, vocab: int, chunk: int, fixed: bool = False) -> "Blocks":
        """The blocks of ``rows`` rows of a ``vocab``-column shard; ``fixed`` (invariant
        mode): always ``BLOCK_ROWS x BLOCK_TILES * TILE``, whatever the rows (``logits``
        pads a smaller one)."""
        if fixed:
            return cls(BLOCK_ROWS, BLOCK_TILES * TILE)
        block_rows = max(1, min(rows, max(chunk, MIN_BLOCK_ROWS)))
        return cls(block_rows, max(1, min(vocab, chunk * vocab // (2 * block_rows))))

    def shape(self, fixed: bool) -> Shape:
        """The blocks' GEMM shape: ``fixed`` (invariant mode), exactly this block's, zero
        rows padding both operands (a BLAS picks its kernel by shape, and a row's bits
        with it; ``backends.interface.logits``); else each block's own (None)."""
        return (self.rows, self.columns) if fixed else None

    def blocks(self, vocab: int) -> list[tuple[int, int]]:
        """The vocabulary blocks ``[v0, v1)``."""
        return spans(vocab, self.columns)

    def chunks(self, rows: int, dtype: torch.dtype, device: torch.device) -> Chunks:
        """The kernels' chunks on one block of ``rows`` rows: the whole block at once
        eagerly (sized for the device: the eager loop's own chunks), the compiled
        kernels' rows for its width."""
        if self.device:
            return chunks_for(None, self.columns, dtype, device)
        return Chunks(rows, compiled_chunk_rows(self.columns, dtype, device))


def block_budget(value: str | None = None) -> int:
    """``CPSLICE_BLOCK_MIB`` (or ``value``) in bytes: a whole number of MiB >= 1, unset or
    empty meaning ``BLOCK_MIB``.

    Raises:
        ValueError: any other value; the message names the setting and says what it takes.
    """
    raw = os.environ.get("CPSLICE_BLOCK_MIB", "") if value is None else value
    if not raw:
        return BLOCK_MIB * 2**20
    mib = int(raw) if raw.isdecimal() else 0
    if mib < 1:
        raise ValueError(f"CPSLICE_BLOCK_MIB={raw!r} is not valid; use a whole number of MiB >= 1 (the "
                         f"hidden-state path's block buffers on CUDA; unset: {BLOCK_MIB})")
    return mib * 2**20


@functools.cache
def _budget() -> int:
    """``block_budget()``, read once, at the first block sized for CUDA."""
    return block_budget()


def sizes(
    device: str, dtype: torch.dtype, rows: int, vocab: int, chunk: int | None, invariant: bool,
    budget: int | None = None, split: int = SPLIT,
) -> Blocks:
    """The blocks of both passes over ``rows`` rows of a ``vocab``-column shard of ``dtype``
    inputs on a ``device`` (its type): on CUDA, ``split`` columns (fewer for a smaller
    shard) by as many rows as ``budget`` bytes (None: ``CPSLICE_BLOCK_MIB``) hold of a
    block's logits and gradient, at most ``chunk`` (None: no other cap); in invariant
    mode ``DEVICE_ROWS x split``, fixed. Elsewhere the CPU's tuned ``Blocks.of`` (which
    needs ``chunk``)."""
    if device != "cuda":
        assert chunk is not None, "the CPU's blocks are sized from chunk_size"
        return Blocks.of(rows, vocab, chunk, invariant)
    if invariant:
        return Blocks(DEVICE_ROWS, split, True)
    columns = max(1, min(vocab, split))
    per_row = 2 * columns * torch.empty((), dtype=dtype).element_size()
    fit = max(1, (_budget() if budget is None else budget) // per_row)
    return Blocks(max(1, min(rows, fit, fit if chunk is None else chunk)), columns, True)


def grid(hidden: Tensor, vocab: int, options: Options) -> Blocks:
    """The blocks of a call's forward and backward alike (the same shapes, so the
    backward's recomputed logits are the forward's bits): ``sizes``, the ``block_sizes``
    step (``_probe``)."""
    size_of = _probe.step("block_sizes", sizes)
    return size_of(hidden.device.type, hidden.dtype, hidden.shape[0], vocab, options.chunk_size, options.invariant)


def block_stats(
    h: Tensor, w: Tensor, softmax: Softmax, out: Stats, shape: Shape, first: int, chunks: Chunks, work: Workspace
) -> Tensor:
    """A block's statistics (``KernelBackend.block_stats``: its logits ``h @ w.T`` by a GEMM
    of ``shape``, then reduced into ``out``) by the first backend of the selection's
    chain that takes the block; its logits."""
    n, v = h.shape[0], w.shape[0]
    if _probe.active is not None:
        _probe.active.call("stats", n, None, invariant=softmax.invariant)
    task = Task(h.device, h.dtype, n, v, True, softmax.invariant)
    return selection.block(task, lambda b, chain: b.block_stats(chain, h, w, softmax, out, shape, first, chunks,
                                                                  work))


def block_grad(
    h: Tensor, w: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, out: Tensor, shape: Shape,
    chunks: Chunks, work: Workspace,
) -> None:
    """A block's logit gradient ``G`` into ``out`` (``KernelBackend.block_grad``: its logits
    recomputed by the forward's GEMM, then the gradient) by the first backend of the
    selection's chain that takes the block; in invariant mode the picked ids' entries
    after (``invariant.picks``)."""
    n, v = h.shape[0], w.shape[0]
    if _probe.active is not None:
        _probe.active.call("grad", n, None, invariant=softmax.invariant)
    task = Task(h.device, h.dtype, n, v, True, softmax.invariant)
    x = selection.block(task, lambda b, chain: b.block_grad(chain, h, w, big_m, log_s, softmax, row, out, shape,
                                                              chunks, work))
    if softmax.invariant:
        r = reciprocals(softmax.tau, n, row.b.dtype, h.device)
        a = torch.zeros_like(row.b) if row.a is None else row.a
        invariant.picks(x, r, big_m, log_s, softmax.cap, row._replace(a=a), out, None,
                        max(chunks.eager, chunks.compiled))


def element_rows(width: int) -> int:
    """Support elements per piece: one float32 ``[n, width]`` product within
    ``ELEMENT_BYTES``."""
    return max(1, ELEMENT_BYTES // (4 * max(width, 1)))


def element_logits(hidden: Tensor, weight: Tensor, el: Elements, cdt: torch.dtype) -> Tensor:
    """``[E]``: the logit of each support element, ``hidden[row] . weight[col]``, rounded
    to the inputs' dtype as the materialized head's logits are; ``[n, H]`` pieces."""
    x = torch.empty(el.row.numel(), dtype=cdt, device=hidden.device)
    for s, e in spans(el.row.numel(), element_rows(hidden.shape[1])):
        prod = hidden[el.row[s:e]].to(cdt) * weight[el.col[s:e]].to(cdt)
        x[s:e] = prod.sum(1).to(hidden.dtype).to(cdt)
    return x


def in_block(row: RowGrad, held: Tensor, v0: int, v1: int) -> RowGrad:
    """``row`` on the block's columns ``[v0, v1)``: the picked ids held there, by their column
    in the block."""
    inside = held & (row.column >= v0) & (row.column < v1)
    hot = None if row.hot is None else torch.where(inside, row.hot, 0.0)
    return row._replace(hot=hot, column=torch.where(inside, row.column - v0, 0))


class _Pass(NamedTuple):
    """What every piece of rows of one ``dense_pass`` shares."""

    hidden: Hidden
    weight: HeadWeight
    column: Tensor
    held: Tensor
    shard: Shard
    options: Options
    blocks: Blocks
    spans: list[tuple[int, int]]
    best: int | None
    cdt: torch.dtype
    work: Workspace


def dense_pass(
    hidden: Hidden,
    weight: HeadWeight,
    column: Tensor,
    held: Tensor,
    dense: Stats,
    rows: Tensor | None,
    shard: Shard,
    options: Options,
    best: int | None = None,
) -> topk.Candidates | None:
    """Fill the ``rows`` (an ascending index, None: all) of ``dense`` (the picked ids'
    ``column``/``held`` ``[T, k]`` included) from blocks of ``Blocks.rows`` of those rows of
    ``hidden @ weight.T`` over the shard's valid columns; with ``best``, also return each
    row's ``best`` largest logits and their global ids, -inf padded to ``min(best, V_local)``
    (the other rows: -inf only)."""
    total, vocab = hidden.shape[0], weight.shape[0]
    blocks = grid(hidden, vocab, options)
    run = _Pass(hidden, weight, column, held, shard, options, blocks, blocks.blocks(shard.valid), best,
                dense.max.dtype, Workspace())
    width = 0 if best is None else min(best, vocab)
    found = topk.Candidates(
        torch.full((total, width), -math.inf, dtype=run.cdt, device=hidden.device),
        torch.full((total, width), shard.total, dtype=torch.int64, device=hidden.device),
    )
    with exact_if(options.invariant):  # invariant mode: GEMMs without reduced precision
        for at in pieces(rows, total, blocks.rows):
            if options.invariant:
                running = _invariant_rows(run, dense, at)
            else:
                assert isinstance(dense, RowStats), "per-tile statistics out of invariant mode"
                running = _default_rows(run, dense, at)
            if running is not None:
                c = running.values.shape[1]
                found.values[at, :c], found.ids[at, :c] = running
    return None if best is None else found


def _default_rows(run: _Pass, dense: RowStats, at: At) -> topk.Candidates | None:
    """The rows ``at`` of ``dense``, block by block, each block's
    statistics merged into the blocks' so far as TP shards merge (``merge``); their
    running best candidates (None without ``best``)."""
    n, h = size(at), gather(run.hidden, at, None)
    if not run.spans:  # a shard of padded ids only: no mass, nothing to merge wrong
        dense.max[at], dense.sum[at] = -math.inf, 0.0
        if dense.ent is not None:
            dense.ent[at] = 0.0
        return None
    chunks = run.blocks.chunks(n, run.hidden.dtype, run.hidden.device)
    softmax = run.options.softmax.rows(at)
    parts = _two_slots(dense, n)  # slot 0: the blocks so far, merged; slot 1: this block
    running = None
    for b, (v0, v1) in enumerate(run.spans):
        # the same [rows, V_block] blocks, by the same matmuls, as backward: its
        # recomputed logits are these bit for bit, so the gradient's p and the
        # forward's max and sum agree (a row sure of its target gets exactly 0)
        part = parts.part(min(b, 1))
        x = block_stats(h, run.weight[v0:v1], softmax, part, None, 0, chunks, run.work)
        part.picked.copy_(_picked(run, x, at, v0, v1, softmax))
        running = _running_best(run, running, x, v0, False)
        del x
        if b:
            _write(parts, 0, merge(parts, softmax.tau))
    _write(dense, at, parts.part(0))
    return running


def _invariant_rows(run: _Pass, dense: Stats, at: At) -> topk.Candidates | None:
    """The rows ``at`` of ``dense`` in invariant mode: each block's tiles written in place,
    into these rows' own tiles (merged into ``dense`` at the end where it is ``RowStats``:
    no TP, ``invariant.placeholders``); their running best candidates (None without
    ``best``)."""
    n, h = size(at), gather(run.hidden, at, None)
    softmax = run.options.softmax.rows(at)
    if isinstance(dense, RowStats):
        parts = invariant.tile_placeholders(tiles(run.shard.valid), n, dense.picked.shape[1], run.cdt,
                                            run.hidden.device, dense.ent is not None)
    else:  # these rows' own tiles (an index's rows: a copy of them, written back below)
        parts = dense.map(operator.itemgetter(at))
    running = None
    chunks = run.blocks.chunks(n, run.hidden.dtype, run.hidden.device)
    for v0, v1 in run.spans:
        x = block_stats(h, run.weight[v0:v1], softmax, parts, run.blocks.shape(True), v0 // TILE, chunks, run.work)
        parts.picked.add_(_picked(run, x, at, v0, v1, softmax))  # placeholders hold 0; one block holds each id
        running = _running_best(run, running, x, v0, True)
        del x
    if isinstance(dense, RowStats):
        invariant.merge_into(dense, at, parts, softmax.tau)
    elif not isinstance(at, slice):
        _write(dense, at, parts)
    return running


def _picked(run: _Pass, x: Tensor, at: At, v0: int, v1: int, softmax: Softmax) -> Tensor:
    """``[n, k]``: the (capped) logits of the picked ids of the rows ``at`` that the block
    ``x`` (columns ``[v0, v1)``) holds, 0 elsewhere."""
    inside = run.held[at] & (run.column[at] >= v0) & (run.column[at] < v1)
    local = torch.where(inside, run.column[at] - v0, 0)
    return torch.where(inside, softmax.logits(x.gather(1, local).to(run.cdt)), 0.0)


def _running_best(run: _Pass, running: topk.Candidates | None, x: Tensor, v0: int,
                  fixed: bool) -> topk.Candidates | None:
    """The best candidates of the blocks so far and the block ``x`` (its first column
    ``v0``); in invariant mode (``fixed``) by the spec's rule. None without ``best``."""
    if run.best is None:
        return None
    first = run.shard.offset + v0
    mine = (topk.exact(x, first, run.best, run.cdt, 0, run.shard.total) if fixed
            else topk.of_columns(x, first, run.best, run.cdt, width=0))  # padded by dense_pass
    return mine if running is None else topk.merge(running, mine, run.best, fixed)


def _two_slots(like: RowStats, rows: int) -> Parts:
    """New ``[2, rows, ...]`` buffers for the fields of ``like``."""
    return Parts(*like.map(lambda f: f.new_empty((2, rows, *f.shape[1:]))))


def _write(into: Stats | Parts, at: int | At, stats: Stats) -> None:
    """``into[at] = stats``, field by field."""
    for field, value in zip(into, stats):
        if field is not None and value is not None:
            field[at] = value
