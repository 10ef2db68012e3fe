"""Invariant mode (``invariant=True``): a row's statistics as a reduction whose order is a
function of the vocabulary alone, so that no batch, chunk, layout or TP size changes a bit.

The spec (docs/invariance.md says it for a rollout engine to reproduce):

- the distribution's columns ``[0, V)`` (``vocab_size``) are cut into ``TILE``-column
  tiles of global ids, ``ceil(V / TILE)`` of them; a column ``>= V`` of the last tile
  (and of a padded vocabulary) counts as a -inf logit;
- per tile ``j`` of a row, in the compute dtype: ``y = cap * tanh(x / cap)`` (or ``x``),
  ``m_j = max y``, ``d = max((y - m_j') / tau, FLOOR)`` with ``m_j' = m_j`` (0 where
  ``m_j = -inf``), ``e = exp(d)``, and ``s_j``, ``a_j`` the ``tree`` sums of ``e`` and
  ``e * d`` over the tile's ``TILE`` slots;
- the tiles, in global order: ``M = max_j m_j``, ``delta_j = (m_j - M') / tau``,
  ``S = tree(exp(delta_j) * s_j)``, ``A = tree(exp(delta_j) * (a_j + delta_j * s_j))``
  (a tile with ``s_j = 0`` adding 0);
- ``log p_t = (y_t - M) / tau - log S`` at the target's capped logit ``y_t``,
  ``H = log S - A / S``.

``tree`` sums the last dimension by pairwise halving: zero-padded to a power of two
``w``, then ``x[:w/2] + x[w/2:]`` until one element is left. Every step is an
elementwise operation, so the order is fixed whatever the backend's reduction kernels.

A shard's statistics are per tile (``RowStats`` fields ``[T, n_local]``, written here),
every shard's tiles travel in the one all-gather (``stats.combine``), and every rank
merges all of them (``stats.merge_tiles``). With TP, each shard must hold whole tiles (``check``).
Only the eager kernels run in this mode (the compiled ones divide by the temperature
otherwise and have another ``exp``).
"""

import math

import torch
from torch import Tensor

from .._errors import LayoutError
from .stats import FLOOR, TILE, RowStats, Shard, Softmax, Tau, tree

BLOCK_ROWS = 64
"""Rows of the hidden-state path's matmul tiles in invariant mode, always this many
(zero rows pad the last): a matmul of fixed shape gives a row the same bits whatever
the other rows (measured with MKL: 1 or 2 rows take another kernel)."""
BLOCK_TILES = 8
"""Tiles per column block of those matmuls (``BLOCK_TILES * TILE`` columns, zero weight
rows padding a shard's last block)."""


def tiles(columns: int) -> int:
    """Tiles of ``columns`` columns (the last one partial)."""
    return -(-columns // TILE)


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
) -> RowStats:
    """Per-tile statistics of ``rows`` rows of the shard's tiles holding ``(0, 1, ., 0)``
    (rows whose pass is skipped: finite, the same on every shard); a shard that does not
    hold whole tiles is refused (``check``)."""
    check(shard)
    n = tiles(shard.size)
    return RowStats(
        torch.zeros((rows, n), dtype=dtype, device=device),
        torch.ones((rows, n), dtype=dtype, device=device),
        torch.zeros((rows, k), dtype=dtype, device=device),
        torch.zeros((rows, n), dtype=dtype, device=device) if with_entropy else None,
    )


def reduce_tiles(y: Tensor, tau: Tau, with_entropy: bool, spare: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(m, s, a)`` ``[n, tiles]`` of ``y``, ``[n, tiles, TILE]`` capped logits of the
    compute dtype (-inf at excluded columns), overwritten; ``spare`` a buffer like it;
    ``tau`` a float or ``[n]``."""
    m = y.amax(-1)
    shift = torch.where(m == -math.inf, 0.0, m)
    d = y.sub_(shift[..., None])
    if not isinstance(tau, float):
        d.div_(tau[:, None, None])
    elif tau != 1.0:
        d.div_(tau)
    d.clamp_(min=FLOOR)
    e = torch.exp(d, out=spare)
    a = tree(d.mul_(e)) if with_entropy else None
    return m, tree(e), a


def stats(
    x: Tensor, softmax: Softmax, valid: int, out: RowStats, runs: list[tuple[int, int]], chunk: int, first: int = 0
) -> None:
    """Write the per-tile statistics of the rows of ``runs`` of ``x`` (``[n, w]`` logits
    whose columns start local tile ``first``; the first ``valid`` are the distribution's)
    into ``out`` (fields ``[n, n_local]``: tiles ``first`` to ``first + tiles(w)``), chunk
    by chunk of rows. The other rows are left as they are."""
    n_tiles = tiles(x.shape[1])
    cdt = out.sum.dtype
    cols = slice(first, first + n_tiles)
    pieces = [(s, min(s + chunk, e)) for s, e in runs for s in range(s, e, chunk)]
    most = max((hi - lo for lo, hi in pieces), default=0)
    # two work buffers for the whole call (fresh ones per chunk cost a page fault a page)
    work = torch.empty((2, most * n_tiles * TILE), dtype=cdt, device=x.device)
    for lo, hi in pieces:
        buf = work[0, : (hi - lo) * n_tiles * TILE].view(hi - lo, n_tiles * TILE)
        buf[:, :valid].copy_(x[lo:hi, :valid])
        if softmax.cap is not None:
            buf[:, :valid].div_(softmax.cap).tanh_().mul_(softmax.cap)
        buf[:, valid:] = -math.inf
        y = buf.view(hi - lo, n_tiles, TILE)
        tau = softmax.tau if isinstance(softmax.tau, float) else softmax.tau[lo:hi]
        spare = work[1, : y.numel()].view(y.shape)
        m, s, a = reduce_tiles(y, tau, out.ent is not None, spare)
        out.max[lo:hi, cols], out.sum[lo:hi, cols] = m, s
        if out.ent is not None:
            assert a is not None
            out.ent[lo:hi, cols] = a


def capped(x: Tensor, softmax: Softmax) -> Tensor:
    """The capped logits of ``x`` in ``x``'s dtype (the compute dtype), as ``stats`` caps
    them: divide, tanh, multiply."""
    return x if softmax.cap is None else torch.tanh(x / softmax.cap) * softmax.cap


def set_stats(x: Tensor, row: Tensor, col: Tensor, member: Tensor, rows: int, n_local: int,
              tau: Tau, with_entropy: bool) -> RowStats:
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
    tau_p = tau
    if not isinstance(tau, float):
        first_row = torch.zeros(uniq.numel(), dtype=torch.int64, device=x.device).scatter_(0, pair, row)
        tau_p = tau[first_row]
    m, s, a = reduce_tiles(y[:, None], tau_p, with_entropy, torch.empty_like(y[:, None]))
    out = RowStats(
        torch.full((flat + 1,), -math.inf, dtype=cdt, device=x.device),
        torch.zeros(flat + 1, dtype=cdt, device=x.device),
        x.new_zeros((0,)),
        torch.zeros(flat + 1, dtype=cdt, device=x.device) if with_entropy else None,
    )
    out.max[uniq], out.sum[uniq] = m[:, 0], s[:, 0]
    if out.ent is not None and a is not None:
        out.ent[uniq] = a[:, 0]
    return RowStats(out.max[:flat].view(rows, n_local), out.sum[:flat].view(rows, n_local), out.picked,
                    None if out.ent is None else out.ent[:flat].view(rows, n_local))
