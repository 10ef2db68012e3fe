"""The tiles of the hidden-state driver (``hidden``): ``[rows, V_block]`` tiles of
``hidden @ weight.T`` (``Tiles``), the pieces the support elements are multiplied out in,
and the forward's dense pass over the tiles (``dense_pass``), its vocabulary blocks
merged as TP shards merge. The backward (``hidden.backward``) walks the same tiles.
"""

import math
import operator
from typing import NamedTuple

import torch
from torch import Tensor

from .._types import HeadWeight, Hidden
from . import invariant, kernels, topk
from .engine import Options
from .gradient import RowGrad
from .invariant import BLOCK_ROWS, BLOCK_TILES
from .rows import At, gather, pieces, size
from .shard import Shard
from .sparse import Elements
from .spec import TILE
from .stats import RowStats, merge

TILE_ROWS = 2048
"""Tiles span at least this many rows (all rows if fewer): see ``Tiles``."""
ELEMENT_BYTES = 16 * 2**20
"""Support elements are multiplied out in pieces of one float32 ``[n, H]`` within this."""


def spans(size: int, block: int) -> list[tuple[int, int]]:
    """``[0, size)`` in spans ``[s, e)`` of ``block`` (the last one shorter)."""
    return [(s, min(s + block, size)) for s in range(0, size, block)]


class Tiles(NamedTuple):
    """The ``[rows, columns]`` tiles of both passes: half as many elements as one chunk of
    ``chunk`` rows (``chunk * V_local``; a backward tile holds its logits, its gradient and
    the eager kernels' two work tiles) over at least ``TILE_ROWS`` rows (all of them if
    fewer), so that a tile's weight-gradient block sums many rows in one matmul."""

    rows: int
    columns: int

    @classmethod
    def of(cls, rows: int, vocab: int, chunk: int, fixed: bool = False) -> "Tiles":
        """The tiles of ``rows`` rows of a ``vocab``-column shard; ``fixed`` (invariant
        mode): always ``BLOCK_ROWS x BLOCK_TILES * TILE``, whatever the rows (``logits``
        pads a smaller one)."""
        if fixed:
            return cls(BLOCK_ROWS, BLOCK_TILES * TILE)
        tile_rows = max(1, min(rows, max(chunk, TILE_ROWS)))
        return cls(tile_rows, max(1, min(vocab, chunk * vocab // (2 * tile_rows))))

    def logits(self, hidden: Tensor, weight: Tensor, fixed: bool) -> Tensor:
        """``hidden @ weight.T`` of one tile (``[n, H]`` rows, ``[v, H]`` columns); ``fixed``:
        by a matmul of exactly this tile's shape, zero rows padding both (a BLAS picks
        its kernel by shape, and a row's bits with it)."""
        if not fixed:
            return torch.mm(hidden, weight.t())
        n, v = hidden.shape[0], weight.shape[0]
        if n < self.rows:
            hidden = torch.cat([hidden, hidden.new_zeros((self.rows - n, hidden.shape[1]))])
        if v < self.columns:
            weight = torch.cat([weight, weight.new_zeros((self.columns - v, weight.shape[1]))])
        return torch.mm(hidden, weight.t())[:n, :v]

    def product(self, grad: Tensor, weight: Tensor, fixed: bool) -> Tensor:
        """``grad @ weight`` of one tile (``[n, v]`` logit gradients, ``[v, H]`` columns),
        ``[n, H]``; ``fixed``: by a matmul of the tile's shape, as ``logits``."""
        if not fixed:
            return torch.mm(grad, weight)
        n, v = grad.shape
        padded = grad.new_zeros((self.rows, self.columns))
        padded[:n, :v] = grad
        if v < self.columns:
            weight = torch.cat([weight, weight.new_zeros((self.columns - v, weight.shape[1]))])
        return torch.mm(padded, weight)[:n]

    def blocks(self, vocab: int) -> list[tuple[int, int]]:
        """The vocabulary blocks ``[v0, v1)``."""
        return spans(vocab, self.columns)

    def chunks(self, rows: int, dtype: torch.dtype, device: torch.device) -> kernels.Chunks:
        """The kernels' chunks on one tile of ``rows`` rows: the whole tile at once eagerly,
        the compiled kernels' rows for its block width."""
        return kernels.Chunks(rows, kernels.compiled_chunk_rows(self.columns, dtype, device))


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
    """``row`` on the tile columns ``[v0, v1)``: the picked ids held there, by their column
    in the block."""
    inside = held & (row.column >= v0) & (row.column < v1)
    hot = None if row.hot is None else torch.where(inside, row.hot, 0.0)
    return row._replace(hot=hot, column=torch.where(inside, row.column - v0, 0))


def dense_pass(
    hidden: Hidden,
    weight: HeadWeight,
    column: Tensor,
    held: Tensor,
    dense: RowStats,
    rows: Tensor | None,
    shard: Shard,
    options: Options,
    best: int | None = None,
) -> topk.Candidates | None:
    """Fill the ``rows`` (an ascending index, None: all) of ``dense`` (the picked ids'
    ``column``/``held`` ``[T, k]`` included) from tiles of ``Tiles.rows`` of those rows of
    ``hidden @ weight.T`` over the shard's valid columns; with ``best``, also return each
    row's ``best`` largest logits and their global ids, -inf padded to ``min(best, V_local)``
    (the other rows: -inf only)."""
    assert options.chunk_size is not None
    total, vocab = hidden.shape[0], weight.shape[0]
    cdt = dense.max.dtype
    fixed = options.invariant
    merged = fixed and dense.max.dim() == 1
    tiles = Tiles.of(total, vocab, options.chunk_size, fixed)
    blocks = tiles.blocks(shard.valid)
    width = 0 if best is None else min(best, vocab)
    found = topk.Candidates(
        torch.full((total, width), -math.inf, dtype=cdt, device=hidden.device),
        torch.full((total, width), shard.total, dtype=torch.int64, device=hidden.device),
    )
    work = kernels.Workspace()
    for at in pieces(rows, total, tiles.rows):
        n, h = size(at), gather(hidden, at, None)
        if not blocks and not fixed:  # a shard of padded ids only: no mass, nothing to merge wrong
            dense.max[at], dense.sum[at] = -math.inf, 0.0
            if dense.ent is not None:
                dense.ent[at] = 0.0
            continue
        chunks = tiles.chunks(n, hidden.dtype, hidden.device)
        softmax = options.softmax.rows(at)
        # slot 0: the blocks so far, merged; slot 1: this block (one buffer, any V_block);
        # invariant mode writes each block's tiles in place, into these rows' own tiles
        # where ``dense`` is merged already (no TP: ``invariant.placeholders``)
        if merged:
            parts = invariant.tile_placeholders(invariant.tiles(shard.valid), n, dense.picked.shape[1], cdt,
                                                hidden.device, dense.ent is not None)
        else:  # (``fixed``, an index's rows: a copy of them, written back below)
            parts = dense.map(operator.itemgetter(at)) if fixed else _two_slots(dense, n)
        running: topk.Candidates | None = None
        for b, (v0, v1) in enumerate(blocks):
            # the same [rows, V_block] tiles, by the same matmuls, as backward: its
            # recomputed logits are these bit for bit, so the gradient's p and the
            # forward's max and sum agree (a row sure of its target gets exactly 0)
            x = tiles.logits(h, weight[v0:v1], fixed)
            slot = min(b, 1)
            part = parts if fixed else parts.map(operator.itemgetter(slot))
            if fixed:
                invariant.stats(x, softmax, v1 - v0, part, None, n, first=v0 // TILE)
            else:
                kernels.stats(x, softmax, part, chunks=chunks, work=work)
            inside = held[at] & (column[at] >= v0) & (column[at] < v1)
            local = torch.where(inside, column[at] - v0, 0)
            picked = torch.where(inside, softmax.logits(x.gather(1, local).to(cdt)), 0.0)
            if fixed:
                part.picked.add_(picked)  # placeholders hold 0; one block holds each id
            else:
                part.picked.copy_(picked)
            if best is not None:
                tile = (topk.exact(x, shard.offset + v0, best, cdt, 0, shard.total) if fixed
                        else topk.of_tile(x, shard.offset + v0, best, cdt, width=0))  # padded below
                running = tile if running is None else topk.merge(running, tile, best, fixed)
            del x
            if slot and not fixed:
                _write(parts, 0, merge(parts, softmax.tau))
        if merged:
            invariant.merge_into(dense, at, parts, softmax.tau)
        elif not fixed or not isinstance(at, slice):
            _write(dense, at, parts if fixed else parts.map(operator.itemgetter(0)))
        if running is not None:
            c = running.values.shape[1]
            found.values[at, :c], found.ids[at, :c] = running
    return None if best is None else found


def _two_slots(like: RowStats, rows: int) -> RowStats:
    """New ``[2, rows, ...]`` buffers for the fields of ``like``."""
    return like.map(lambda f: f.new_empty((2, rows, *f.shape[1:])))


def _write(into: RowStats, at: int | At, stats: RowStats) -> None:
    """``into[at] = stats``, field by field."""
    for field, value in zip(into, stats):
        if field is not None and value is not None:
            field[at] = value
