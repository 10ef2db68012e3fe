"""The dense kernels over a tile of logits: statistics forward, gradient backward.

A tile ``x`` is ``[n, V]`` logits of any float dtype (a row chunk of the logits, a
``[rows, V_block]`` matmul tile); the arithmetic runs in ``compute_dtype``. ``stats``
writes each row's ``m``, ``S`` and ``A`` into a ``stats.RowStats`` (the driver picks the
logits at the picked ids, one gather);
``grad`` writes each row's gradient ``p * (a log p + b)`` plus the one-hot terms of its
picked ids (``stats.RowGrad``) into ``out``, rounded once to ``out``'s dtype. Both
always do their job: with the compiled kernels where the backend (``CPSLICE_BACKEND``) and the tile
allow, else with the eager loop, chunk by chunk (``Chunks``).

The compiled kernels are two pure functions of one chunk, compiled by ``torch.compile``
into one fused loop each (one read of the logits forward, one read and one write
backward), with ``inv_tau`` the inverse temperature as a 0-d tensor (a multiply where the
eager loop divides: within an ulp, and a vector division costs as much as the exp):

- ``chunk_stats(x, inv_tau) -> (m, S, A)``, ``d = (x - m) / tau`` clamped at ``FLOOR``
  (an all -inf row has ``m = -inf`` and ``S = A = 0``);
- ``chunk_grad(x, inv_tau, m, log_s, a, b, out)`` writes ``p * (a * log p + b)``, ``log p
  = (x - m) / tau - log_s`` clamped at ``FLOOR``. The picked ids' columns are not in the
  loop (a per-column compare costs a third of it): ``grad`` overwrites those entries
  afterwards with ``stats.pick_grad``, also rounded once.

They run over all rows of a tile with a *fixed* chunk shape: full chunks of ``C`` rows,
the tail as one more chunk of ``C`` rows ending at the last row (overlapping the
previous chunk, whose rows it recomputes to the same values), and for fewer than ``C``
rows the largest power of two ``<=`` the rows in the same way. A new ``T`` therefore
compiles nothing new; each (kernel, dtype, V, chunk rows, strides, device type) is
compiled once per process, in a code object of its own so that dynamo's per-function
recompile limit never silently turns a variant eager. ``chunk_stats`` always computes
``A`` (with or without entropy: one variant, the extra multiply-add is free in a fused
loop). The compiled functions carry no jaxtyping annotations and are excluded from the
debug-mode import hook (``typing.no_type_check``): dynamo traces plain torch code.
"""

import math
import operator
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast, no_type_check

import torch
from torch import Tensor

from .._cache import boundary
from .._types import compute_dtype
from . import backend
from .memory import buffer as buffer  # the gradient's buffer, read here by tests/test_kernels.py
from .stats import FLOOR, RowGrad, RowStats, Softmax, Tau, pick_grad

CHUNK_BYTES = 64 * 2**20
CPU_CHUNK_BYTES = 8 * 2**20
"""Eager row chunks are sized so that the two work buffers of one chunk hold about this
many bytes together (at least one row). On the CPU a chunk small enough to stay in the
last-level cache makes the several elementwise passes over it cheap (measured: 8 MiB is
1.4x faster than 64 MiB at T=4096, V=32768); on an accelerator larger chunks amortize
the per-kernel launch cost (measured on an H200: 64 MiB within 10% of 1 GiB chunks,
8 MiB 5x slower)."""
CPU_COMPILED_CHUNK_BYTES = 32 * 2**20
COMPILED_CHUNK_BYTES = 2**30
"""Rows per compiled chunk: ``[C, V]`` of the compute dtype within these bytes (CPU /
other devices), rounded down to a power of two. A compiled chunk needs no work buffer,
so the size only trades per-call overhead (and, on a GPU, occupancy) against the
redundant overlap of the tail chunk: on a GPU a chunk of a few hundred rows of a large
vocabulary would leave most of the device idle (one row per program)."""
AUTO_MIN_ELEMENTS = 2**22
"""In ``auto``, the compiled kernels run only for tiles of at least this many elements
(about 16 MiB of float32 logits): below it the eager kernels cost little and a first
compile (seconds) would not pay for itself."""
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=compute_dtype(dtype)).element_size()


def default_chunk_rows(
    vocab: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> int:
    """Rows per eager chunk when ``chunk_size`` is None: two ``[rows, vocab]`` work buffers
    of the compute dtype within ``CPU_CHUNK_BYTES`` on the CPU and ``CHUNK_BYTES`` on any
    other device; at least one row."""
    budget = CPU_CHUNK_BYTES if torch.device(device).type == "cpu" else CHUNK_BYTES
    return max(1, budget // (2 * max(vocab, 1) * _itemsize(dtype)))


def compiled_chunk_rows(
    vocab: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> int:
    """Rows ``C`` of a compiled chunk: ``[C, vocab]`` of the compute dtype within
    ``CPU_COMPILED_CHUNK_BYTES`` on the CPU, ``COMPILED_CHUNK_BYTES`` elsewhere, rounded
    down to a power of two; at least 1."""
    budget = CPU_COMPILED_CHUNK_BYTES if torch.device(device).type == "cpu" else COMPILED_CHUNK_BYTES
    rows = max(1, budget // (max(vocab, 1) * _itemsize(dtype)))
    return 1 << (rows.bit_length() - 1)


class Chunks(NamedTuple):
    """Rows per chunk of the eager loop and of the compiled kernels."""

    eager: int
    compiled: int


def chunks_for(chunk_size: int | None, vocab: int, dtype: torch.dtype, device: torch.device) -> Chunks:
    """``chunk_size`` rows for both when given, else ``default_chunk_rows`` and
    ``compiled_chunk_rows`` of ``[*, vocab]`` tiles."""
    if chunk_size is not None:
        return Chunks(chunk_size, chunk_size)
    return Chunks(default_chunk_rows(vocab, dtype, device), compiled_chunk_rows(vocab, dtype, device))


def chunk_starts(rows: int, chunk: int) -> tuple[int, list[int]]:
    """``(c, starts)``: the fixed chunk rows used for ``rows`` rows (``chunk``, or for
    fewer rows the largest power of two ``<= rows``) and the first row of each chunk;
    the last chunk ends at ``rows`` and may overlap the one before it."""
    if rows <= 0:
        return chunk, []
    c = chunk if rows >= chunk else 1 << (rows.bit_length() - 1)
    starts = list(range(0, rows - c + 1, c))
    if starts[-1] + c < rows:
        starts.append(rows - c)
    return c, starts


def pieces(runs: list[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """The chunks of ``chunk`` rows of each run of rows ``[lo, hi)``."""
    return [(s, min(s + chunk, hi)) for lo, hi in runs for s in range(lo, hi, chunk)]


Runs = list[tuple[int, int]] | None
"""Row ranges ``[lo, hi)`` a pass reads, ascending and disjoint; None: every row."""


@boundary  # data-dependent (nonzero, tolist): not for a compiled caller to trace
def runs_of(need: Tensor, gap: int) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` covering every row where ``need`` (CPU bool ``[T]``) is
    True; runs closer than ``gap`` rows are merged, so that a chunked pass over them
    takes about as many chunks as the rows need."""
    rows = need.numel()
    if rows == 0 or bool(need.all()):
        return [(0, rows)] if rows else []
    edge = torch.nn.functional.pad(need.to(torch.int8), (1, 1)).diff()
    starts, ends = (edge == 1).nonzero()[:, 0], (edge == -1).nonzero()[:, 0]
    if starts.numel() == 0:
        return []
    keep = torch.ones_like(starts, dtype=torch.bool)
    keep[1:] = starts[1:] - ends[:-1] >= gap
    last = torch.ones_like(keep)
    last[:-1] = keep[1:]
    return list(zip(starts[keep].tolist(), ends[last].tolist()))


class Workspace:
    """The eager loop's work buffers of the compute dtype (two; three with a cap), made on
    first use at the largest size asked of them and reused for every chunk (and tile) of
    one pass."""

    def __init__(self) -> None:
        self._flat: list[Tensor] = []

    def take(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, count: int = 2) -> list[Tensor]:
        n = shape[0] * shape[1]
        if len(self._flat) < count or self._flat[0].numel() < n:
            size = max(n, self._flat[0].numel() if self._flat else 0)
            self._flat = [torch.empty(size, dtype=dtype, device=device) for _ in range(max(count, len(self._flat)))]
        return [buf[:n].view(shape) for buf in self._flat[:count]]


@no_type_check
def chunk_stats(x, inv_tau):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    m = xf.amax(1)
    shift = torch.where(m == -math.inf, 0.0, m)
    d = ((xf - shift[:, None]) * inv_tau).clamp(min=FLOOR)
    p = torch.exp(d)
    return m, p.sum(1), (p * d).sum(1)


@no_type_check
def chunk_grad(x, inv_tau, m, log_s, a, b, out):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = ((x.to(cdt) - m[:, None]) * inv_tau - log_s[:, None]).clamp(min=FLOOR)
    p = torch.exp(d)
    out.copy_((p * (a[:, None] * d + b[:, None])).to(out.dtype))


# The capped kernels compute cap * tanh(x / cap) as cap - 2 cap / (exp(2 x / cap) + 1): one
# exp where a vectorized tanh costs three times as much on the CPU (measured: the capped
# gradient kernel 3.9x the uncapped one with tanh), within cap * eps of it, the rounding
# of a float32 logit of that size. The cap is monotone, so the capped row max is the
# cap of the row max: no capped [n, V] copy to reduce over.
@no_type_check
def chunk_stats_capped(x, inv_tau, cap, two_over_cap):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    m = cap - 2 * cap / (torch.exp(xf.amax(1) * two_over_cap) + 1)
    y = cap - 2 * cap / (torch.exp(xf * two_over_cap) + 1)
    d = ((y - m[:, None]) * inv_tau).clamp(min=FLOOR)
    p = torch.exp(d)
    return m, p.sum(1), (p * d).sum(1)


@no_type_check
def chunk_grad_capped(x, inv_tau, m, log_s, a, b, cap, two_over_cap, out):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = 2 / (torch.exp(x.to(cdt) * two_over_cap) + 1)  # 1 - tanh(x / cap)
    d = (((1 - s) * cap - m[:, None]) * inv_tau - log_s[:, None]).clamp(min=FLOOR)
    p = torch.exp(d)
    # d(cap * tanh(x / cap)) / dx = 1 - tanh^2 = s (2 - s), exact where tanh is near 1
    out.copy_((p * (a[:, None] * d + b[:, None]) * (s * (2 - s))).to(out.dtype))


def use_compiled(x: Tensor) -> bool:
    """Whether ``stats``/``grad`` run the compiled kernels on this tile: always with the
    ``compiled`` backend selected (``CPSLICE_BACKEND``); never with ``eager``; in ``auto``
    (and for what ``triton`` does not take) when no compile has failed, the tile's rows
    are contiguous (a padded vocabulary's valid columns are a view of them) and it holds
    at least ``AUTO_MIN_ELEMENTS`` elements."""
    mode = backend.compile_mode()
    if mode == "0" or x.shape[0] == 0 or x.shape[1] == 0:
        return False
    if mode == "1":
        return True
    return (
        backend.selected.broken is None
        and x.stride(-1) == 1
        and x.numel() >= AUTO_MIN_ELEMENTS
        and not torch.compiler.is_compiling()
    )


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own: dynamo keeps its cache, and its
    recompile limit, per code object, so each variant gets exactly one entry."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _kernel(
    fn: Callable[..., Any], x: Tensor, per_row: bool
) -> tuple[tuple[object, ...], Callable[..., Any]]:
    # a per-row temperature is another variant: its own code object, never a recompile
    state = backend.selected
    key = (fn.__name__, x.dtype, x.shape[0], x.shape[1], x.stride(), x.device.type, per_row, state.compiler)
    compiled = state.compiled.get(key)
    if compiled is None:
        compiled = torch.compile(_own_code(fn), backend=state.compiler, dynamic=False, fullgraph=True)
        state.compiled[key] = compiled
    return key, compiled


def _reason(error: BaseException) -> str:
    """The innermost cause of a compile failure, on one line (dynamo wraps a backend's
    error in a BackendCompilerFailed with several lines of advice)."""
    inner = getattr(error, "inner_exception", None) or error.__cause__
    if isinstance(inner, BaseException) and inner is not error:
        return _reason(inner)
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0] if first else ''}"


def _call(fn: Callable[..., Any], x: Tensor, inv_tau: Tensor, *args: object) -> tuple[bool, object]:
    """``(True, result)`` of the compiled ``fn`` on one chunk ``x`` of a fixed shape;
    ``(False, None)`` if its first call (the compilation) failed in ``auto``, which
    warns once and turns ``auto`` eager."""
    state = backend.selected
    key, compiled = _kernel(fn, x, inv_tau.dim() > 0)
    args = (inv_tau, *args)
    if key in state.ready:
        return True, compiled(x, *args)
    try:
        result = compiled(x, *args)
    except Exception as error:
        if backend.compile_mode() == "1":
            raise RuntimeError(
                f"CPSLICE_BACKEND=compiled but torch.compile of cpslice's {fn.__name__} failed for "
                f"{x.dtype} [{x.shape[0]}, {x.shape[1]}] logits on {x.device.type} "
                f"({_reason(error)}); set CPSLICE_BACKEND=auto (falls back to eager) or eager"
            ) from error
        state.broken = _reason(error)
        warnings.warn(
            f"cpslice: torch.compile of the log-prob kernels failed ({state.broken}); using the "
            "eager kernels from now on (CPSLICE_BACKEND=eager skips compiling, =compiled makes "
            "this an error)",
            RuntimeWarning,
            stacklevel=4,
        )
        return False, None
    state.ready.add(key)
    return True, result


def _inv_tau(softmax: Softmax, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The inverse temperature as a kernel input: 0-d, or ``[T, 1]`` for one per row."""
    tau = softmax.tau
    if isinstance(tau, float):
        return torch.full((), 1.0 / tau, dtype=dtype, device=device)
    return (1.0 / tau.to(dtype))[:, None]


def _capped(softmax: Softmax, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """The cap and ``2 / cap`` as kernel inputs (0-d tensors, so that no value compiles
    anew), if any."""
    if softmax.cap is None:
        return ()
    return tuple(torch.full((), v, dtype=dtype, device=device) for v in (softmax.cap, 2.0 / softmax.cap))


def _compiled_stats(x: Tensor, softmax: Softmax, chunk: int, out: RowStats) -> bool:
    """``m``, ``S``, ``A`` of every row into ``out`` by the compiled ``chunk_stats`` (or
    ``chunk_stats_capped``); False (``out`` not fully written) if it failed to compile
    (in ``auto``)."""
    cdt = out.max.dtype
    inv_tau = _inv_tau(softmax, cdt, x.device)
    cap = _capped(softmax, cdt, x.device)
    fn = chunk_stats if softmax.cap is None else chunk_stats_capped
    c, starts = chunk_starts(x.shape[0], chunk)
    for s in starts:
        rows = slice(s, s + c)
        ok, result = _call(fn, x[rows], inv_tau if inv_tau.dim() == 0 else inv_tau[rows], *cap)
        if not ok:
            return False
        m, total, a = cast(tuple[Tensor, Tensor, Tensor], result)
        out.max[rows], out.sum[rows] = m, total
        if out.ent is not None:
            out.ent[rows] = a
    return True


def _divide(d: Tensor, tau: Tau, lo: int, hi: int) -> None:
    """``d /= tau`` of rows ``[lo, hi)`` (in place; nothing for a temperature of 1)."""
    if isinstance(tau, float):
        if tau != 1.0:
            d.div_(tau)
    else:
        d.div_(tau[lo:hi, None])


def _eager_stats(
    x: Tensor, softmax: Softmax, chunk: int, runs: list[tuple[int, int]], work: Workspace, out: RowStats
) -> None:
    vocab = x.shape[1]
    m, s, a = out.max, out.sum, out.ent
    if vocab == 0:  # a shard of padded ids only: no mass, nothing to merge wrong
        for lo, hi in runs:
            m[lo:hi], s[lo:hi] = -math.inf, 0.0
            if a is not None:
                a[lo:hi] = 0.0
        return
    for lo, hi in pieces(runs, chunk):
        buf, expd = work.take((hi - lo, vocab), m.dtype, x.device)
        if softmax.cap is None:
            y = x[lo:hi]
        else:
            # copy first, then divide: torch.div(x, cap, out=buf) divides in x's dtype
            # (bfloat16: 2e-2 off) and only then widens
            y = buf.copy_(x[lo:hi]).div_(softmax.cap).tanh_().mul_(softmax.cap)
        m[lo:hi] = y.amax(1)
        # A row all -inf contributes S = 0 (and A = 0), not NaN.
        shift = torch.where(m[lo:hi] == -math.inf, 0.0, m[lo:hi])
        d = torch.sub(y, shift[:, None], out=buf)
        _divide(d, softmax.tau, lo, hi)
        if a is not None:
            d.clamp_(min=FLOOR)
        p = torch.exp(d, out=expd)
        torch.sum(p, 1, out=s[lo:hi])
        if a is not None:
            torch.sum(p.mul_(d), 1, out=a[lo:hi])


def stats(
    x: Tensor,
    softmax: Softmax,
    out: RowStats,
    *,
    chunks: Chunks,
    runs: Runs = None,
    work: Workspace | None = None,
) -> None:
    """Write ``m``, ``S`` and, where ``out.ent`` is not None, ``A`` of the rows of ``runs``
    of the tile ``x`` into ``out`` (``[n]`` fields of the compute dtype; the other rows are
    left as they are, e.g. ``stats.placeholders``), of the logits as ``softmax`` reads
    them (capped, then tempered; the max is the capped logits'). A tile of no columns (a
    shard of padded ids only) has ``m = -inf`` and ``S = A = 0``. Each run of rows is a
    tile of its own for the compiled kernels (which read every row of a tile), so a pass
    over some rows (the response rows) runs them as a pass over all rows does."""
    if backend.triton_for(x):
        from .triton import default as tri

        tri.row_stats(x, softmax, out, row_index(runs, x.device))
        return
    eager = []
    for lo, hi in [(0, x.shape[0])] if runs is None else runs:
        part, rows = x[lo:hi], slice(lo, hi)
        if not (use_compiled(part) and _compiled_stats(part, softmax.rows(rows), chunks.compiled,
                                                       out.map(operator.itemgetter(rows)))):
            eager.append((lo, hi))
    _eager_stats(x, softmax, chunks.eager, eager, work or Workspace(), out)


def _compiled_grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, chunk: int, out: Tensor
) -> bool:
    """``chunk_grad`` (or ``chunk_grad_capped``) of every row into ``out``, then the picked
    ids' entries; False (``out`` not fully written) if the kernel failed to compile (in
    ``auto``)."""
    rows, vocab = x.shape
    cdt = row.b.dtype
    inv_tau = _inv_tau(softmax, cdt, x.device)
    cap = _capped(softmax, cdt, x.device)
    fn = chunk_grad if softmax.cap is None else chunk_grad_capped
    a = torch.zeros_like(row.b) if row.a is None else row.a
    c, starts = chunk_starts(rows, chunk)
    for s in starts:
        e = s + c
        tau_s = inv_tau if inv_tau.dim() == 0 else inv_tau[s:e]
        ok, _ = _call(fn, x[s:e], tau_s, big_m[s:e], log_s[s:e], a[s:e], row.b[s:e], *cap, out[s:e])
        if not ok:
            return False
        if row.hot is not None:
            # the picked entries chunk by chunk: the [rows, k] temporaries of a whole
            # tile (the repeated ids' dedup above all) would add ~10 % to the peak of
            # bf16 logits at k = 64
            rows_s = RowGrad(None if row.a is None else row.a[s:e], row.b[s:e],
                             row.hot[s:e], row.column[s:e])
            entry = pick_grad(x[s:e].gather(1, rows_s.column), big_m[s:e], log_s[s:e],
                              softmax.rows(slice(s, e)), rows_s, vocab)
            # the entries by (row, column) index: a scatter_ into a bfloat16 tensor takes
            # a slow path that costs as much as the kernel
            at = torch.arange(s, e, device=out.device)[:, None].expand_as(rows_s.column)
            out.index_put_((at.reshape(-1), rows_s.column.reshape(-1)), entry.reshape(-1).to(out.dtype))
    return True


def _eager_grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, chunk: int,
    runs: list[tuple[int, int]], work: Workspace, out: Tensor,
) -> None:
    vocab = x.shape[1]
    cdt = row.b.dtype
    capped = softmax.cap is not None
    for s, e in pieces(runs, chunk) if vocab else []:
        bufs = work.take((e - s, vocab), cdt, x.device, 3 if capped else 2)
        buf, expd = bufs[0], bufs[1]
        if softmax.cap is None:
            d = torch.sub(x[s:e], big_m[s:e, None], out=buf)
        else:  # t = tanh(x / cap) kept for the chain rule, d = cap * t - M
            t = bufs[2].copy_(x[s:e]).div_(softmax.cap).tanh_()  # in cdt, as in stats
            d = torch.mul(t, softmax.cap, out=buf).sub_(big_m[s:e, None])
        _divide(d, softmax.tau, s, e)
        d.sub_(log_s[s:e, None])
        if row.a is not None:
            d.clamp_(min=FLOOR)
        p = torch.exp(d, out=expd)
        factor = row.b[s:e, None] if row.a is None else d.mul_(row.a[s:e, None]).add_(row.b[s:e, None])
        # Write the float result straight into the gradient when the dtypes agree (and no
        # chain rule follows); otherwise round once, after the one-hot terms are in.
        target = out[s:e] if out.dtype == cdt and not capped else p
        torch.mul(p, factor, out=target)
        if row.hot is not None:
            target.scatter_add_(1, row.column[s:e], row.hot[s:e].to(target.dtype))
        if capped:  # d(cap * tanh(x / cap)) / dx = 1 - t^2
            target.mul_(t.mul_(t).neg_().add_(1.0))
        if target is p:
            out[s:e].copy_(p)


def grad(
    x: Tensor,
    big_m: Tensor,
    log_s: Tensor,
    softmax: Softmax,
    row: RowGrad,
    out: Tensor,
    *,
    chunks: Chunks,
    runs: Runs = None,
    work: Workspace | None = None,
    compiled: bool = True,
) -> None:
    """Write the gradient w.r.t. the raw logits of the rows of ``runs`` of the tile ``x``
    into ``out`` (``[n, V]`` with contiguous rows, its dtype; rows outside ``runs`` are
    left as they are): ``p * (a log p + b)`` with ``M``, ``log S`` the rows' totals, plus
    the one-hot terms of ``row``, through the cap's ``tanh``. Each run of rows is a tile
    of its own for the compiled kernels, as in ``stats``; ``compiled=False`` (invariant
    mode) runs the eager loop alone."""
    if backend.triton_for(x):
        from .triton import default as tri

        tri.row_grad(x, big_m, log_s, softmax, row, out, row_index(runs, x.device))
        return
    eager = []
    for s, e in [(0, x.shape[0])] if runs is None else runs:
        part = x[s:e]
        if not (compiled and use_compiled(part)
                and _compiled_grad(part, big_m[s:e], log_s[s:e], softmax.rows(slice(s, e)),
                                   _row_slice(row, s, e), chunks.compiled, out[s:e])):
            eager.append((s, e))
    _eager_grad(x, big_m, log_s, softmax, row, chunks.eager, eager, work or Workspace(), out)


def _row_slice(row: RowGrad, s: int, e: int) -> RowGrad:
    """The terms of rows ``[s, e)``."""
    return RowGrad(None if row.a is None else row.a[s:e], row.b[s:e],
                   None if row.hot is None else row.hot[s:e], row.column[s:e])


def row_index(runs: Runs, device: torch.device) -> Tensor | None:
    """The rows of ``runs`` as an int64 index on ``device`` (None for every row)."""
    if runs is None:
        return None
    return torch.cat([torch.arange(lo, hi, dtype=torch.int64) for lo, hi in runs] or
                     [torch.zeros(0, dtype=torch.int64)]).to(device)

