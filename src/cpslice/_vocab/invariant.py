"""Invariant mode (``invariant=True``): a row's statistics as a reduction whose order is a
function of the vocabulary alone, so that no batch, chunk, layout or TP size changes a bit.

The spec is ``spec`` (docs/invariance.md says it for a rollout engine to reproduce): the
distribution's columns ``[0, V)`` cut into ``spec.TILE``-column tiles of global ids (a
column ``>= V`` counts as a -inf logit); per tile, in the compute dtype, the capped
logits (``spec.softcap``), the tile's max (``spec.tile_max``), ``d = max((y - m_j') * r,
FLOOR)`` with ``r = 1 / tau`` (one division per row), ``e = spec.exp(d)`` and the
``spec.tree`` sums of ``e`` and ``e * d`` (``backends.eager.eager_tiles``); the tiles, in global order,
merged by ``spec.merge_tiles``; ``log p_t = (y_t - M) / tau - log S``, ``H = log S - A /
S``. This module is invariant mode's interface, the one the drivers call: each run goes
to the first backend of the selection's chain that takes the block and computes
(``backends.selection``): the Triton kernels (``backends.triton.invariant``), the
compiled kernels (``backends.compiled``) where they may run (``compiled_ok``), the eager
ones (``backends.eager``); the backends' code is theirs.

Under TP a shard's statistics are per tile (``TileStats``, fields ``[T, n_local]``,
written here), every shard's tiles travel in the one all-gather (``stats.combine``), and every
rank merges all of them (``spec.merge_tiles``); each shard must hold whole tiles
(``check``). Without TP there is nothing to gather: a chunk of rows' tiles are merged as
soon as they are computed (``merged_stats``), into ``RowStats``, so no ``[T, tiles]``
statistics exist. The compiled kernels give the eager bits: the same elementwise
operations in the same order, inductor's C++ with no contraction; they run on the CPU
only, and each compiled shape's first result is checked bit for bit against the eager
kernel's (a difference warns and turns them off: ``backends.compiled``).
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _probe
from .._errors import LayoutError
from . import stats as _stats
from .backends import eager, selection
from .backends.chunks import Chunks, Workspace
from .backends.interface import Merged, Task
from .gradient import RowGrad
from .rows import At, count, numbers, pieces, size
from .shard import Shard
from .softmax import Softmax, Tau, reciprocals
from .spec import TILE, tiles
from .stats import RowStats, Stats, TileStats, write

BLOCK_ROWS = 64
"""Rows of the hidden-state path's matmul blocks in invariant mode, always this many
(zero rows pad the last): a matmul of fixed shape gives a row the same bits whatever
the other rows (measured with MKL: 1 or 2 rows take another kernel)."""
BLOCK_TILES = 8
"""Tiles per column block of those matmuls (``BLOCK_TILES * TILE`` columns, zero weight
rows padding a shard's last block)."""


def check(shard: Shard) -> None:
    """Refuse a TP shard that does not hold whole tiles: its tiles would not be the
    global ones, and the bits would depend on the TP size."""
    if shard.world > 1 and shard.size % TILE:
        raise LayoutError(
            f"invariant=True needs every TP shard to hold whole {TILE}-column tiles, but "
            f"V_local = {shard.size} is not a multiple of {TILE} (TP size {shard.world}); pad "
            f"the LM head to a multiple of {TILE} * tp (megatron: make_vocab_size_divisible_by"
            f"={TILE}) and pass vocab_size"
        )


def placeholders(
    shard: Shard, rows: int, k: int, dtype: torch.dtype, device: torch.device, with_entropy: bool
) -> Stats:
    """The dense statistics of ``rows`` rows holding placeholders (rows whose pass is
    skipped: finite, the same on every shard): under TP per tile of the shard
    (``tile_placeholders``: ``TileStats``), for the all-gather; without TP ``RowStats``
    (``stats.placeholders``), which ``stats`` fills with each row's tiles already
    merged, so that no ``[T, tiles]`` statistics exist. A shard that does not hold
    whole tiles is refused (``check``)."""
    check(shard)
    if shard.world == 1:
        return _stats.placeholders(rows, k, dtype, device, with_entropy)
    return tile_placeholders(tiles(shard.size), rows, k, dtype, device, with_entropy)


def tile_placeholders(
    n: int, rows: int, k: int, dtype: torch.dtype, device: torch.device, with_entropy: bool
) -> TileStats:
    """Per-tile statistics ``[rows, n]`` holding ``(0, 1, ., 0)``."""
    # [n, rows] storage seen as [rows, n]: a tile's row of statistics is contiguous, as
    # the all-gather sends it (``stats.combine``)
    return TileStats(
        torch.zeros((n, rows), dtype=dtype, device=device).t(),
        torch.ones((n, rows), dtype=dtype, device=device).t(),
        torch.zeros((rows, k), dtype=dtype, device=device),
        torch.zeros((n, rows), dtype=dtype, device=device).t() if with_entropy else None,
    )


def merge_tiles(m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> Merged:
    """``spec.merge_tiles`` (``[n, R]`` tiles in global order to ``[R]`` fields) by the
    first backend of the tiles that merges them: the Triton kernel's where it computes
    (the same bits), else torch's. ``stats.combine``'s merger in invariant mode."""
    return selection.first(Task.of(m.t(), None, True), lambda b: b.merge_tiles(m, s, a, tau))


def merge_into(out: RowStats, at: At, parts: TileStats, tau: Tau) -> None:
    """Rows ``at`` of the merged ``[T]`` statistics ``out`` from ``parts``, those rows'
    statistics per tile (``[rows, n]``, all of the distribution's tiles), merged in the
    spec's order (``merge_tiles``: the Triton kernel where it takes them); their picked
    logits added."""
    write(out, at, *merge_tiles(parts.max.t(), parts.sum.t(), None if parts.ent is None else parts.ent.t(), tau))
    out.picked[at] += parts.picked


def stats(
    x: Tensor, softmax: Softmax, valid: int, out: Stats, rows: Tensor | Sequence[tuple[int, int]] | None,
    chunk: int, first: int = 0,
) -> None:
    """Write the statistics of the ``rows`` of ``x`` (``[n, w]`` logits whose columns start
    local tile ``first``; the first ``valid`` are the distribution's) into ``out``: per
    tile into ``TileStats`` (tiles ``first`` to ``first + tiles(w)``), or into
    ``RowStats`` (``placeholders`` without TP) each row's tiles merged
    (``merged_stats``). ``rows`` as ``kernels.stats`` takes them (an ascending index,
    None: every row; runs ``[lo, hi)`` are read as the index of their rows). Per tile:
    the whole tiles of uncapped logits by the compiled ``tile_kernel`` where
    ``compiled_ok``; the rest (a partial last tile, capped logits) chunk by chunk of
    rows, capped and -inf padded into a buffer, by ``eager_tiles``. The other rows are
    neither read nor written."""
    if rows is not None and not isinstance(rows, Tensor):
        rows = torch.cat([torch.arange(lo, hi) for lo, hi in rows] or [torch.zeros(0, dtype=torch.int64)])
        rows = rows.to(x.device)
    if _probe.active is not None:
        _probe.active.call("stats", count(rows, x.shape[0]), rows, invariant=True)
    if isinstance(out, RowStats):
        assert first == 0, "merged statistics of a block of columns"
        merged_stats(x[:, :valid], softmax, out, rows, chunk)
        return
    tiled = out
    selection.run(Task.of(x, rows, True), lambda b: b.tile_stats(x, softmax, valid, tiled, rows, chunk, first))


def merged_stats(x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunk: int) -> None:
    """Each row's ``(M, S, A)`` over all of ``x``'s columns (``[n, V]``, the distribution's),
    for the ``rows`` of ``x`` (None: all), into ``out``'s ``[T]`` fields: a chunk's tiles
    (the last one -inf padded) are merged as soon as they are computed
    (``spec.merge_tiles``), so the work is a chunk's, never ``[T, tiles]``: by the Triton
    kernels where they take the block, uncapped logits by the compiled ``row_kernel``
    where ``compiled_ok``, else eagerly (``eager_rows``) ``chunk`` rows at a time."""
    selection.run(Task.of(x, rows, True), lambda b: b.merged_stats(x, softmax, out, rows, chunk))


def grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, out: Tensor,
    *, chunks: Chunks, rows: Tensor | None = None, work: Workspace | None = None,
) -> None:
    """``kernels.grad`` in invariant mode: the gradient w.r.t. the raw logits of the ``rows``
    of ``x`` (as ``kernels.grad`` takes them) into ``out``: ``grad_kernel`` over every
    column (uncapped: compiled where ``compiled_ok``; else eager, chunk by chunk), then the
    picked ids' entries (``picks``); any other entry is the kernel's, whichever shard
    holds the ids. ``work`` is ``kernels.grad``'s: invariant mode's kernels take no
    workspace."""
    if _probe.active is not None:
        _probe.active.call("grad", count(rows, x.shape[0]), rows, invariant=True)
    r = reciprocals(softmax.tau, x.shape[0], row.b.dtype, x.device)
    a = torch.zeros_like(row.b) if row.a is None else row.a
    selection.run(Task.of(x, rows, True),
                  lambda b: b.invariant_grad(x, rows, r, big_m, log_s, a, row.b, softmax.cap, chunks, out))
    picks(x, r, big_m, log_s, softmax.cap, row._replace(a=a), out, rows, max(chunks.eager, chunks.compiled))


def picks(x: Tensor, r: Tensor, big_m: Tensor, log_s: Tensor, cap: float | None, row: RowGrad, out: Tensor,
          rows: Tensor | None, chunk: int) -> None:
    """Overwrite each picked id's entry of ``out`` with a one-hot term (``hot != 0``), of
    the ``rows`` (None: all), ``chunk`` rows at a time (``[rows, k]`` temporaries):
    ``eager.values`` at that column with the one-hot terms of every copy of the id added
    (before the cap's derivative), rounded once. ``row.a`` must be a tensor (zeros
    without entropy)."""
    if row.hot is None:
        return
    assert row.a is not None
    for at in pieces(rows, x.shape[0], chunk):
        column, hot = row.column[at], row.hot[at]
        if column.shape[1] > 1:  # every copy of a repeated id carries all copies' terms
            key = torch.arange(size(at), device=x.device)[:, None] * x.shape[1] + column
            _, copy = torch.unique(key, return_inverse=True)
            hot = hot.new_zeros(hot.numel()).index_add_(0, copy.view(-1), hot.reshape(-1))[copy]
        value = eager.values(x[numbers(at, x.device)[:, None], column], r[at], big_m[at], log_s[at], row.a[at],
                             row.b[at], cap, hot)
        write = hot != 0
        at_rows = numbers(at, x.device)[:, None].expand_as(column)
        out.index_put_((at_rows[write], column[write]), value[write].to(out.dtype))


def set_stats(x: Tensor, row: Tensor, col: Tensor, member: Tensor, rows: int, n_local: int,
              tau: Tau, with_entropy: bool) -> TileStats:
    """Per-tile statistics ``[rows, n_local]`` of a token set's elements (``[E]`` capped
    logits ``x`` at local columns ``col`` of rows ``row``, counting where ``member``): the
    dense tiles' arithmetic on each (row, tile) with members, every other column -inf,
    so a set's result is the dense one with the columns outside the set masked."""
    cdt = x.dtype
    flat = rows * n_local
    key = torch.where(member, row * n_local + torch.div(col, TILE, rounding_mode="floor"), flat)
    uniq, pair = torch.unique(key, return_inverse=True)
    y = torch.full((uniq.numel(), TILE), -math.inf, dtype=cdt, device=x.device)
    y[pair[member], col[member] % TILE] = x[member]
    first_row = torch.zeros(uniq.numel(), dtype=torch.int64, device=x.device).scatter_(0, pair, row)
    m, s, a = eager.eager_tiles(y[:, None], reciprocals(tau, rows, cdt, x.device)[first_row], with_entropy)
    # one slot per (row, tile), and one more that the non-members' key points at
    big = torch.full((flat + 1,), -math.inf, dtype=cdt, device=x.device)
    total = torch.zeros(flat + 1, dtype=cdt, device=x.device)
    ent = torch.zeros(flat + 1, dtype=cdt, device=x.device) if with_entropy else None
    big[uniq], total[uniq] = m[:, 0], s[:, 0]
    if ent is not None and a is not None:
        ent[uniq] = a[:, 0]
    return TileStats(big[:flat].view(rows, n_local), total[:flat].view(rows, n_local), x.new_zeros((0,)),
                     None if ent is None else ent[:flat].view(rows, n_local))
