"""Invariant mode (``invariant=True``): a row's statistics as a reduction whose order is a
function of the vocabulary alone, so that no batch, chunk, layout or TP size changes a bit.

The spec is ``spec`` (docs/invariance.md says it for a rollout engine to reproduce): the
distribution's columns ``[0, V)`` cut into ``spec.TILE``-column tiles of global ids (a
column ``>= V`` counts as a -inf logit); per tile, in the compute dtype, the capped
logits (``spec.softcap``), the tile's max (``spec.tile_max``), ``d = max((y - m_j') * r,
FLOOR)`` with ``r = 1 / tau`` (one division per row), ``e = spec.exp(d)`` and the
``spec.tree`` sums of ``e`` and ``e * d`` (``backends.eager.eager_tiles``); the tiles, in global order,
merged by ``spec.merge_tiles``; ``log p_t = (y_t - M) / tau - log S``, ``H = log S - A /
S``. This module runs it: eagerly, compiled, or by the Triton backend.

Under TP a shard's statistics are per tile (``TileStats``, fields ``[T, n_local]``,
written here), every shard's tiles travel in the one all-gather (``stats.combine``), and every
rank merges all of them (``spec.merge_tiles``); each shard must hold whole tiles
(``check``). Without TP there is nothing to gather: a chunk of rows' tiles are merged as
soon as they are computed (``merged_stats``), into ``RowStats``, so no ``[T, tiles]``
statistics exist. The kernels have compiled forms that give the eager bits: the same
elementwise operations in the same order, the ``exp`` built from additions and
multiplications, inductor's C++ with no contraction: ``row_kernel`` (a chunk's tiles and
their merge), ``tile_kernel`` (a chunk's tiles under TP), ``grad_kernel`` and, for
bfloat16 logits, ``pairs_kernel`` (two columns an int32, so that every lane is 32 bits
wide). They run on the CPU only, and each compiled shape's first result is checked bit
for bit against the eager kernel's (a difference warns and turns them off).
"""

import math
import warnings
from collections.abc import Sequence
from typing import cast, no_type_check

import torch
from torch import Tensor

from .. import _probe
from .._errors import LayoutError
from . import bits, kernels
from . import spec as _spec
from . import stats as _stats
from .backends import eager
from .backends import selection as backend
from .backends.chunks import Chunks, Workspace, compiled_chunk_rows
from .gradient import RowGrad
from .memory import buffer
from .rows import At, chunked, count, gather, numbers, pieces, size
from .shard import Shard
from .softmax import Softmax, Tau, reciprocals, taus
from .spec import FLOOR, TILE, exp, halve, tile_max, tiles
from .stats import RowStats, Stats, TileStats, write

BLOCK_ROWS = 64
"""Rows of the hidden-state path's matmul tiles in invariant mode, always this many
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


def merge_tiles(m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> tuple[Tensor, Tensor, Tensor | None]:
    """``spec.merge_tiles`` (``[n, R]`` tiles in global order to ``[R]`` fields) by the
    backend of the tiles: the Triton kernel's where it computes (the same bits), else
    torch's. ``stats.combine``'s merger in invariant mode."""
    if isinstance(tau, Tensor) and backend.triton_for(m, invariant=True):
        from .backends.triton import invariant as tri

        return tri.merge(m.t(), s.t(), None if a is None else a.t(), tau)
    return eager.merge_step(m, s, a, tau)


def merge_into(out: RowStats, at: At, parts: TileStats, tau: Tau) -> None:
    """Rows ``at`` of the merged ``[T]`` statistics ``out`` from ``parts``, those rows'
    statistics per tile (``[rows, n]``, all of the distribution's tiles), merged in the
    spec's order (``spec.merge_tiles``); their picked logits added."""
    write(out, at, *eager.merge_step(parts.max.t(), parts.sum.t(), None if parts.ent is None else parts.ent.t(),
                                  tau))
    out.picked[at] += parts.picked


@no_type_check
def tile_kernel(x, r):
    """``(m, s, a)`` ``[R, n]`` of ``x`` ``[R, n * TILE]`` (whole tiles, any float dtype,
    uncapped) with ``r`` ``[R]``: the compiled form of ``eager_tiles``. The tile is cut
    into 8 slices of 16 columns; the halving tree's first 3 levels add slices (``i`` and
    ``i + 4``, ...: columns ``c`` and ``c + 64``, ``c + 32``, ``c + 16``), the last 4 the
    16 lanes, so inductor fuses the whole tile into one loop with no ``[R, V]``
    intermediate. The same elementwise operations in the same order as ``tree``."""
    y = x.to(r.dtype)
    y = y.view(y.shape[0], -1, TILE)
    m = tile_max(y)  # a zero max is +0, as in eager_tiles
    shift = torch.where(m == -math.inf, 0.0, m)[..., None]
    rr = r[:, None, None]
    es, des = [], []
    for i in range(0, TILE, LANES):
        d = ((y[..., i : i + LANES] - shift) * rr).clamp(min=FLOOR)
        e = exp(d)
        es.append(e)
        des.append(d * e)
    s, a = halve(es), halve(des)
    # [n, R]: each tile's row of statistics contiguous, as the placeholders hold them
    return (m.t().contiguous(), halve(list(s.unbind(-1))).t().contiguous(),
            halve(list(a.unbind(-1))).t().contiguous())


LANES = 16
STATS_CHUNK_BYTES = 4 * 2**20
"""Rows per compiled ``row_kernel`` and ``tile_kernel`` call: ``[C, V]`` float32 within
these bytes, a power of two. Measured at T=4096, V=32768, bfloat16: 8 MiB chunks 1.2x
faster than 32 MiB ones (the chunk stays in the cache while its tiles are read), but
their ``[C, tiles, 16]`` partial sums leave 8-10 MiB of freed heap that the backward's
peak then includes; 4 MiB chunks leave 2-3 MiB for a forward 1.06x as long, 2 MiB ones
about 1 MiB for 1.2x."""


def compiled_ok(part: Tensor, rows: Tensor | None = None) -> bool:
    """Whether invariant mode may run its compiled kernels on the ``rows`` of ``part``
    (None: all): the default kernels' conditions (``kernels.use_compiled``), on the CPU only (inductor's C++ with
    no contraction of ``a * b + c``: its Triton kernels contract, so an accelerator runs
    the eager kernels), inductor's floating-point contraction and unsafe-math flags off,
    and no compiled result ever found to differ from the eager one."""
    if backend.selected.disagree is not None or part.device.type != "cpu" or not kernels.use_compiled(part, rows):
        return False
    from torch._inductor import config  # imported by torch.compile anyway

    return config.cpp.enable_floating_point_contract_flag == "off" and not config.cpp.enable_unsafe_math_opt_flag


def _checked(name: str, got: Sequence[Tensor], want: Sequence[Tensor], key: tuple[object, ...]) -> bool:
    """A compiled kernel's first result (per ``key``) against the eager one's, bit for
    bit: a difference warns once and turns invariant mode's compiled kernels off."""
    state = backend.selected
    if not bits.same(got, want):
        state.disagree = f"the compiled {name} differs from the eager one in some bit ({key})"
        warnings.warn(f"cpslice: invariant mode: {state.disagree}; using the eager kernels from now on",
                      RuntimeWarning, stacklevel=4)
        return False
    state.verified.add(key)
    return True


def _compiled_stats(x: Tensor, rows: Tensor | None, r: Tensor, out: TileStats, first: int) -> bool:
    """``tile_kernel`` over the ``rows`` of ``x`` (whole tiles) into tiles ``first`` on of
    ``out``, in chunks of a fixed number of rows (``rows.chunk_starts``); False if
    it failed to compile (auto) or disagreed with the eager kernel."""
    n = x.shape[1] // TILE
    chunks, buf = chunked(x, rows, stats_chunk_rows(x.shape[1]))
    for at in chunks:
        part = gather(x, at, buf)
        ok, result = kernels._call(tile_kernel, part, r[at], invariant=True)
        if not ok:
            return False
        got = cast(tuple[Tensor, Tensor, Tensor], result)
        key = ("tile_kernel", part.dtype, part.shape, part.stride())
        if key not in backend.selected.verified and not _checked(
                "tile_kernel", got,
                [t.t() for t in eager.eager_tiles(part.to(r.dtype).view(-1, n, TILE), r[at], True) if t is not None],
                key):
            return False
        write(out, (at, slice(first, first + n)), got[0].t(), got[1].t(), got[2].t())
    return True


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
    if backend.triton_for(x, invariant=True):
        _triton_stats(x, softmax, valid, out, rows, first)
        return
    if isinstance(out, RowStats):
        assert first == 0, "merged statistics of a block of columns"
        merged_stats(x[:, :valid], softmax, out, rows, chunk)
        return
    r = reciprocals(softmax.tau, x.shape[0], out.sum.dtype, x.device)
    whole = valid // TILE * TILE if softmax.cap is None else 0
    part = x[:, :whole]
    start = whole if whole and compiled_ok(part, rows) and _compiled_stats(part, rows, r, out, first) else 0
    eager.tile_stats(x, softmax.cap, r, valid, out, rows, chunk, first, start, tiles(x.shape[1]))


def _triton_stats(x: Tensor, softmax: Softmax, valid: int, out: Stats, rows: Tensor | None, first: int) -> None:
    """``stats`` by the Triton backend's invariant kernels (the same bits): per tile into
    ``TileStats``, or each row's tiles merged into ``RowStats``."""
    from .backends.triton import invariant as tri

    cdt = out.sum.dtype
    if isinstance(out, TileStats):
        tri.tile_stats(x, rows, reciprocals(softmax.tau, x.shape[0], cdt, x.device), softmax.cap, valid,
                       out.max, out.sum, out.ent, first)
        return
    assert first == 0, "merged statistics of a block of columns"
    tau = taus(softmax.tau, x.shape[0], cdt, x.device)
    r = reciprocals(tau, x.shape[0], cdt, x.device)
    big, total, ent = tri.merged_stats(x, rows, r, tau, softmax.cap, valid, out.ent is not None)
    at = slice(None) if rows is None else rows
    write(out, at, big, total, ent)


def merged_stats(x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunk: int) -> None:
    """Each row's ``(M, S, A)`` over all of ``x``'s columns (``[n, V]``, the distribution's),
    for the ``rows`` of ``x`` (None: all), into ``out``'s ``[T]`` fields: a chunk's tiles
    (the last one -inf padded) are merged as soon as they are computed
    (``spec.merge_tiles``), so the work is a chunk's, never ``[T, tiles]``. Uncapped
    logits by the compiled ``row_kernel`` where ``compiled_ok``, else eagerly
    (``eager_rows``) ``chunk`` rows at a time."""
    cdt = out.sum.dtype
    tau = taus(softmax.tau, x.shape[0], cdt, x.device)
    r = reciprocals(tau, x.shape[0], cdt, x.device)
    if softmax.cap is None and compiled_ok(x, rows) and _compiled_rows(x, rows, r, tau, out):
        return
    eager.merged_stats(x, softmax.cap, r, tau, out, rows, chunk)


@no_type_check
def row_kernel(x, r, tau):
    """``(M, S, A)`` ``[R]`` of uncapped ``x`` ``[R, w]`` (any width: the last tile -inf
    padded) with ``r = 1 / tau`` and ``tau`` ``[R]``: ``tile_kernel`` then
    ``merge_tiles``, compiled into one graph (``eager_rows``'s bits)."""
    pad = -x.shape[1] % TILE
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=-math.inf)
    m, s, a = tile_kernel(x, r)
    return _spec.merge_tiles(m, s, a, tau)


def _compiled_rows(x: Tensor, rows: Tensor | None, r: Tensor, tau: Tensor, out: RowStats) -> bool:
    """``row_kernel`` over the ``rows`` of ``x`` into ``out`` (``[T]`` fields), in chunks of
    a fixed number of rows (``rows.chunk_starts``), each compiled shape's first
    result checked against ``eager_rows``; False if it failed to compile (auto) or
    disagreed."""
    width = x.shape[1]
    chunks, buf = chunked(x, rows, stats_chunk_rows(width))
    for at in chunks:
        part = gather(x, at, buf)
        kernel = row_kernel if _probe.active is None else _probe.active.step("row_kernel", row_kernel)
        ok, result = kernels._call(kernel, part, r[at], tau[at], invariant=True)
        if not ok:
            return False
        got = cast(tuple[Tensor, Tensor, Tensor], result)
        key = ("row_kernel", x.dtype, tuple(part.shape), part.stride())
        if key not in backend.selected.verified:
            work = torch.empty((part.shape[0], tiles(width) * TILE), dtype=r.dtype, device=x.device)
            want = eager.eager_rows(part, None, r[at], tau[at], work, True)
            if not _checked("row_kernel", got, [t for t in want if t is not None], key):
                return False
        write(out, at, *got)
    return True


def stats_chunk_rows(width: int) -> int:
    """Rows per compiled forward chunk (and widened gradient chunk): ``[C, width]``
    float32 within ``STATS_CHUNK_BYTES``, a power of two."""
    return 1 << (max(1, STATS_CHUNK_BYTES // (4 * width)).bit_length() - 1)


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
    chunk = max(chunks.eager, chunks.compiled)
    if backend.triton_for(x, invariant=True):
        from .backends.triton import invariant as tri

        tri.grad(x, rows, r, big_m, log_s, row.a, row.b, softmax.cap, out)
        picks(x, r, big_m, log_s, softmax.cap, row._replace(a=a), out, rows, chunk)
        return
    if not (softmax.cap is None and compiled_ok(x, rows) and _compiled_grad(x, rows, r, big_m, log_s, a, row.b, out)):
        eager.invariant_grad(x, rows, r, big_m, log_s, a, row.b, softmax.cap, chunks.eager, out)
    picks(x, r, big_m, log_s, softmax.cap, row._replace(a=a), out, rows, chunk)


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


def _compiled_grad(
    x: Tensor, rows: Tensor | None, r: Tensor, m: Tensor, log_s: Tensor, a: Tensor, b: Tensor, out: Tensor,
) -> bool:
    """``grad_kernel`` compiled over the ``rows`` of ``x`` in chunks of a fixed number of
    rows (as ``kernels``: a chunk whose rows are not consecutive gathered into a buffer,
    its gradient written back at its rows), its first call checked against the eager
    one; False if it failed to compile (auto) or disagreed. bfloat16 logits go two
    columns at a time (``pairs_kernel``) where ``x`` and ``out`` allow it (``bits.pairs``);
    other logits narrower than the compute dtype are widened chunk by chunk into one
    buffer first (exactly). Either way the compiled loop runs on 32-bit lanes: one that
    reads bfloat16 runs at twice the lanes, where inductor builds the exp's ``2^n`` from
    its bits one element at a time (measured at T=4096, V=32768: the gradient 1.5x
    slower than with pairs)."""
    width = x.shape[1]
    pairs = bits.pairs(x) is not None and bits.pairs(out) is not None
    widen = x.dtype != r.dtype and not pairs
    chunk = stats_chunk_rows(width) if widen else compiled_chunk_rows(width, x.dtype, x.device)
    chunks, buf = chunked(x, rows, chunk)
    most = max((size(at) for at in chunks), default=0)
    wide = torch.empty((most, width), dtype=r.dtype, device=x.device) if widen and chunks else None
    into = None if buf is None else buffer((buf.shape[0], width), out.dtype, out.device, zero=False)
    for at in chunks:
        c = size(at)
        src, dst = gather(x, at, buf), out[at] if into is None or isinstance(at, slice) else into[:c]
        terms = (r[at], m[at], log_s[at], a[at], b[at])
        if pairs:
            v, o = bits.pairs(src), bits.pairs(dst)
            assert v is not None and o is not None
            ok, _ = kernels._call(pairs_kernel, v, *terms, o, invariant=True)
            key: tuple[object, ...] = ("pairs_kernel", (c, width), src.stride(), dst.stride())
        else:
            part = src if wide is None else wide[:c].copy_(src)
            ok, _ = kernels._call(eager.grad_kernel, part, *terms, dst, invariant=True)
            key = ("grad_kernel", part.dtype, dst.dtype, (c, width), part.stride(), dst.stride())
        if not ok:
            return False
        if key not in backend.selected.verified:
            want = torch.empty_like(dst)
            eager.grad_kernel(src, *terms, want)
            if not _checked(str(key[0]), [dst], [want], key):
                return False
        if not isinstance(at, slice):
            out.index_copy_(0, at, dst)
    return True


@no_type_check
def pairs_kernel(v, r, m, log_s, a, b, out):
    """``grad_kernel`` of bfloat16 logits two columns at a time: ``v`` and ``out`` are
    ``bits.pairs`` views. Each column is widened exactly (its bits in the high half),
    ``eager.values`` computed, rounded to bfloat16 as ``.to(torch.bfloat16)`` rounds (ties to
    even; a NaN the quiet NaN) and packed back: all lanes 32 bits wide."""
    even = eager.values((v << 16).view(torch.float32), r, m, log_s, a, b)
    odd = eager.values((v & -65536).view(torch.float32), r, m, log_s, a, b)
    out.copy_(bits.bfloat16_bits(odd) | ((bits.bfloat16_bits(even) >> 16) & 0xFFFF))
