"""The eager backend: torch operations, chunk by chunk, of both reductions (any device,
any float dtype): ``interface.KernelBackend``, taking every task (the last line of the
registry). ``backends.compiled`` compiles the same arithmetic; the Triton kernels
(``backends.triton``) give it by hand. Its block kernels are ``interface``'s shared default.

The default reduction (``kernels``): ``stats`` and ``grad``, the loops over chunks of
rows (``chunks.Chunks``'s ``eager`` rows each), a piece of rows that are not consecutive
gathered into the work buffers (``chunks.Workspace``), each step an in-place torch
operation on them.

Invariant mode (``invariant``): the spec's steps (``spec``) on a chunk's tiles,
``eager_tiles`` (a chunk's ``-inf`` padded, capped tiles by ``padded_tiles``), their
merge (``merge_step``, ``eager_rows``), and the loops over chunks of rows
(``tile_stats`` per tile under TP, ``merged_stats`` each row's tiles merged,
``invariant_grad``). The gradient's body ``grad_kernel`` (``values``) is the one that
``backends.compiled`` compiles as it is: a body that both backends run lives here,
with the eager loops that define the bits, so that the compiled backend imports it
(and checks its compiled results against the eager ones) and never the other way
round. The bodies only the compiled backend runs (``tile_kernel``, ``row_kernel``,
``pairs_kernel``, the default reduction's ``chunk_*``) are there. A divergence's kernels
(``pair_stats``, ``pair_mix``, ``pair_grad``) run ``backends.divergence``'s bodies, one per
pass, which the compiled backend compiles.
"""

import math
from collections.abc import Iterator
from typing import no_type_check

import torch
from torch import Tensor

from ... import _probe
from .. import spec as _spec
from ..gradient import RowGrad
from ..pairs import Mix, PairGrad, PairOut, PairStats, Sides, Weights
from ..rows import At, gather, pieces, size
from ..softmax import Softmax, Tau, capped_, divide_, reciprocals, slope_, tanh_, taus, times_cap
from ..spec import FLOOR, TILE, exp, softcap, softcap_slope, tile_max, tiles, tree
from ..stats import RowStats, TileStats, write
from . import divergence, interface
from .chunks import Chunks, Workspace
from .interface import Merged, Task

block_stats, block_grad = interface.block_stats, interface.block_grad  # the shared default block kernels
NAME = "eager"


def takes(task: Task) -> bool:
    """Every task: any device, any float dtype, both modes."""
    return True


def stats(
    x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunks: Chunks, work: Workspace
) -> bool:
    """``kernels.stats`` eagerly: ``m``, ``S`` and (``out.ent``) ``A`` of the ``rows`` of
    ``x`` (None: all) into ``out``, ``chunks.eager`` rows at a time in ``work``'s buffers."""
    vocab = x.shape[1]
    m, s, a = out.max, out.sum, out.ent
    if vocab == 0:  # a shard of padded ids only: no mass, nothing to merge wrong
        every = slice(None) if rows is None else rows
        m[every], s[every] = -math.inf, 0.0
        if a is not None:
            a[every] = 0.0
        return True
    for at in pieces(rows, x.shape[0], chunks.eager):
        if _probe.active is not None:
            _probe.active.launch("eager", "stats", size(at))
        buf, expd = work.take((size(at), vocab), m.dtype, x.device)
        y = gather(x, at, buf)  # a view of a slice's rows; an index's in buf
        if softmax.cap is not None:
            # copy first, then divide: torch.div(x, cap, out=buf) divides in x's dtype
            # (bfloat16: 2e-2 off) and only then widens
            y = capped_(y if y is buf else buf.copy_(y), softmax.cap)
        top = y.amax(1).to(m.dtype)
        m[at] = top
        # A row all -inf contributes S = 0 (and A = 0), not NaN.
        shift = torch.where(top == -math.inf, 0.0, top)
        d = torch.sub(y, shift[:, None], out=buf)
        divide_(d, softmax.tau, at)
        if a is not None:
            d.clamp_(min=FLOOR)
        p = torch.exp(d, out=expd)
        s[at] = p.sum(1)
        if a is not None:
            a[at] = p.mul_(d).sum(1)
    return True


def grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, out: Tensor, rows: Tensor | None,
    chunks: Chunks, work: Workspace,
) -> bool:
    """``kernels.grad`` eagerly: the gradient of the ``rows`` of ``x`` (None: all) with
    the one-hot terms of ``row`` into ``out``, ``chunks.eager`` rows at a time in
    ``work``'s buffers, rounded once to ``out``'s dtype."""
    vocab = x.shape[1]
    cdt = row.b.dtype
    capped = softmax.cap is not None
    for at in pieces(rows, x.shape[0], chunks.eager) if vocab else []:
        if _probe.active is not None:
            _probe.active.launch("eager", "grad", size(at))
        bufs = work.take((size(at), vocab), cdt, x.device, 3 if capped else 2)
        buf, expd = bufs[0], bufs[1]
        m = big_m[at]
        if softmax.cap is None:
            d = torch.sub(gather(x, at, buf), m[:, None], out=buf)
        else:  # t = tanh(x / cap) kept for the chain rule, d = cap * t - M
            y = gather(x, at, bufs[2])
            t = tanh_(y if y is bufs[2] else bufs[2].copy_(y), softmax.cap)  # in cdt, as in stats
            d = times_cap(t, softmax.cap, out=buf).sub_(m[:, None])
        divide_(d, softmax.tau, at)
        d.sub_(log_s[at][:, None])
        if row.a is not None:
            d.clamp_(min=FLOOR)
        p = torch.exp(d, out=expd)
        b = row.b[at][:, None]
        factor = b if row.a is None else d.mul_(row.a[at][:, None]).add_(b)
        # Write the float result straight into the gradient when the dtypes agree (and no
        # chain rule follows); otherwise round once, after the one-hot terms are in.
        direct = isinstance(at, slice) and out.dtype == cdt and not capped
        target = out[at] if direct else p
        torch.mul(p, factor, out=target)
        if row.hot is not None:
            target.scatter_add_(1, row.column[at], row.hot[at].to(target.dtype))
        if capped:  # d(cap * tanh(x / cap)) / dx = 1 - t^2
            target.mul_(slope_(t))
        if isinstance(at, slice) and not direct:
            out[at].copy_(p)
        elif not isinstance(at, slice):
            out.index_copy_(0, at, p.to(out.dtype))
    return True


def merge_step(m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> Merged:
    """``spec.merge_tiles`` with torch, or the step substituted for it
    (``_probe.substitute("merge_tiles", fn)``, a planted reduction order)."""
    merge = _probe.step("merge_tiles", _spec.merge_tiles)
    return merge(m, s, a, tau)


def eager_tiles(y: Tensor, r: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(m, s, a)`` ``[n, tiles]`` of ``y``, ``[n, tiles, TILE]`` capped logits of the
    compute dtype (-inf at excluded columns), ``r`` ``[n]``: the spec's step 3 (a zero max
    is +0: the max of +0 and -0 has no order-free sign)."""
    m = tile_max(y)
    shift = torch.where(m == -math.inf, 0.0, m)
    d = ((y - shift[..., None]) * r[:, None, None]).clamp(min=FLOOR)
    e = exp(d)
    a = tree(d.mul_(e)) if with_entropy else None
    return m, tree(e), a


def padded_tiles(
    x: Tensor, cap: float | None, r: Tensor, buf: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``eager_tiles`` ``[n, tiles(w)]`` of the rows of ``x`` ``[n, w]`` (whose first column
    starts a tile): capped and -inf padded into ``buf`` (``[n, tiles(w) * TILE]``, the
    compute dtype) first."""
    w = x.shape[1]
    buf[:, :w].copy_(x)
    if cap is not None:
        buf[:, :w] = softcap(buf[:, :w], cap)[0]
    buf[:, w:] = -math.inf
    return eager_tiles(buf.view(x.shape[0], -1, TILE), r, with_entropy)


def eager_rows(
    x: Tensor, cap: float | None, r: Tensor, tau: Tensor, buf: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(M, S, A)`` ``[n]`` of the rows of ``x`` ``[n, w]``: ``padded_tiles`` into ``buf``,
    then ``merge_tiles``."""
    m, s, a = padded_tiles(x, cap, r, buf, with_entropy)
    return merge_step(m.t(), s.t(), None if a is None else a.t(), tau)


def _buffers(pieces: list[At], width: int, dtype: torch.dtype, device: torch.device) -> Iterator[tuple[At, Tensor]]:
    """Each piece of rows with a ``[rows, width]`` work buffer, all of them views of one
    buffer for the call."""
    work = torch.empty(max((size(at) for at in pieces), default=0) * width, dtype=dtype, device=device)
    for at in pieces:
        if _probe.active is not None:  # one chunk of the eager forward
            _probe.active.launch("eager", "stats", size(at), invariant=True)
        yield at, work[: size(at) * width].view(size(at), width)


def merge_tiles(m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> Merged:
    """``merge_step``: the interface's merge of ``[n, R]`` tiles, by torch."""
    return merge_step(m, s, a, tau)


def tile_stats(
    x: Tensor, softmax: Softmax, valid: int, out: TileStats, rows: Tensor | None, chunk: int, first: int
) -> bool:
    """Invariant mode's per-tile statistics of the ``rows`` of ``x`` (columns ``>= valid``
    -inf) into tiles ``first`` on of ``out``, ``chunk`` rows at a time (``tiles_from``
    column 0)."""
    r = reciprocals(softmax.tau, x.shape[0], out.sum.dtype, x.device)
    tiles_from(x, softmax.cap, r, valid, out, rows, chunk, first, 0, tiles(x.shape[1]))
    return True


def tiles_from(
    x: Tensor, cap: float | None, r: Tensor, valid: int, out: TileStats, rows: Tensor | None,
    chunk: int, first: int, start: int, n_tiles: int,
) -> None:
    """``eager_tiles`` of columns ``start`` (a tile edge) on of the ``rows`` of ``x`` (the
    compiled backend's whole tiles before ``start``)."""
    n = n_tiles - start // TILE
    if n == 0:
        return
    cols = slice(first + start // TILE, first + n_tiles)
    for at, buf in _buffers(pieces(rows, x.shape[0], chunk), n * TILE, out.sum.dtype, x.device):
        part = gather(x[:, start:valid], at, None)
        write(out, (at, cols), *padded_tiles(part, cap, r[at], buf, out.ent is not None))


def merged_stats(x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunk: int) -> bool:
    """Each row's ``(M, S, A)`` of the ``rows`` of ``x`` (None: all) into ``out``'s ``[T]``
    fields, ``chunk`` rows at a time: ``eager_rows``, a chunk's tiles merged as soon as
    they are computed."""
    cdt = out.sum.dtype
    tau = taus(softmax.tau, x.shape[0], cdt, x.device)
    r = reciprocals(tau, x.shape[0], cdt, x.device)
    for at, buf in _buffers(pieces(rows, x.shape[0], chunk), tiles(x.shape[1]) * TILE, cdt, x.device):
        write(out, at, *eager_rows(gather(x, at, None), softmax.cap, r[at], tau[at], buf, out.ent is not None))
    return True


@no_type_check
def values(x, r, m, log_s, a, b, cap=None, hot=None):
    """``p * (a * d + b)`` of ``x`` ``[R, w]`` widened to the compute dtype and capped
    (``spec.softcap``; ``cap`` None: uncapped) into ``y``, ``d = ((y - M) * r - log S)``
    clamped at ``FLOOR``, ``p`` the spec's ``exp(d)``; the row terms ``[R]``; ``hot``
    ``[R, w]`` added (None: nothing), and with a cap the whole times its derivative
    ``1 - t * t``."""
    y, t = (x.to(r.dtype), None) if cap is None else softcap(x.to(r.dtype), cap)
    d = ((y - m[:, None]) * r[:, None] - log_s[:, None]).clamp(min=FLOOR)
    value = exp(d) * (a[:, None] * d + b[:, None])
    value = value if hot is None else value + hot
    return value if t is None else value * softcap_slope(t)


@no_type_check
def grad_kernel(x, r, m, log_s, a, b, out, cap=None):
    """``out = values(...)``, rounded once to ``out``'s dtype: eager, and (uncapped)
    compiled into one fused loop."""
    out.copy_(values(x, r, m, log_s, a, b, cap).to(out.dtype))


def invariant_grad(
    x: Tensor, rows: Tensor | None, r: Tensor, big_m: Tensor, log_s: Tensor, a: Tensor, b: Tensor,
    cap: float | None, chunks: Chunks, out: Tensor,
) -> bool:
    """``grad_kernel`` over every column of the ``rows`` of ``x`` (None: all) into ``out``,
    ``chunks.eager`` rows at a time (a piece of rows that are not consecutive gathered, its
    gradient written back at its rows); the row terms ``[T]``."""
    for at in pieces(rows, x.shape[0], chunks.eager):
        if _probe.active is not None:
            _probe.active.launch("eager", "grad", size(at), invariant=True)
        dst = out[at] if isinstance(at, slice) else out.new_empty((size(at), out.shape[1]))
        grad_kernel(gather(x, at, None), r[at], big_m[at], log_s[at], a[at], b[at], dst, cap)
        if not isinstance(at, slice):
            out.index_copy_(0, at, dst)
    return True


def pair_stats(
    xw: Tensor, xo: Tensor, softmax: Softmax, out: PairOut, rows: Tensor | None, chunks: Chunks, first: int
) -> bool:
    """A divergence's statistics eagerly (``backends.divergence``): the default body chunk by
    chunk, or invariant mode's tiles."""
    chunk = chunks.eager
    if softmax.invariant:
        return divergence.invariant_stats(xw, xo, softmax, out, rows, chunk, first)
    assert isinstance(out, PairStats), "per-tile statistics out of invariant mode"
    return divergence.stats(divergence.Eager(chunk), xw, xo, softmax, out, rows)


def pair_mix(
    xw: Tensor, xo: Tensor, softmax: Softmax, sides: Sides, weights: Weights, out: Mix, rows: Tensor | None,
    chunks: Chunks, first: int,
) -> bool:
    """``"jsd"``'s second pass eagerly: the default body, or invariant mode's tiles."""
    chunk = chunks.eager
    if softmax.invariant:
        return divergence.invariant_mix(xw, xo, softmax, sides, weights, out, rows, chunk, first)
    return divergence.mix(divergence.Eager(chunk), xw, xo, softmax, sides, weights, out, rows)


def pair_grad(
    xw: Tensor, xo: Tensor, softmax: Softmax, terms: PairGrad, out_w: Tensor | None, out_o: Tensor | None,
    rows: Tensor | None, chunks: Chunks,
) -> bool:
    """A divergence's gradient eagerly: the default body, or with the spec's ops."""
    chunk = chunks.eager
    if softmax.invariant:
        return divergence.invariant_grad(xw, xo, softmax, terms, out_w, out_o, rows, chunk)
    return divergence.grad(divergence.Eager(chunk), xw, xo, softmax, terms, out_w, out_o, rows)
