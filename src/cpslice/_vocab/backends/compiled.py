"""The compiled backend: the kernels of both reductions compiled by ``torch.compile``
(inductor) into one fused loop per chunk, the CPU's fast path, and the machinery that
compiles them (``use_compiled``, ``_call``: one code object per variant, a failure in
``auto`` warned once and turned eager, ``selection.BackendState`` holding what it
learns): ``interface.KernelBackend``, its block kernels ``interface``'s shared default. It takes a
task where ``use_compiled`` (invariant mode: ``compiled_ok``) allows; every kernel
returns False where it did not finish (a compile failure in ``auto``, a compiled result
found to differ, a soft cap invariant mode's compiled kernels do not take), and the
selection then runs the next backend, the eager one (``backends.eager``), on the same
rows.

The default reduction's compiled kernels are two pure functions of one chunk, compiled by ``torch.compile``
into one fused loop each (one read of the logits forward, one read and one write
backward), with ``inv_tau`` the inverse temperature as a 0-d tensor (a multiply where the
eager loop divides: within an ulp, and a vector division costs as much as the exp):

- ``chunk_stats(x, inv_tau) -> (m, S, A)``, ``d = (x - m) / tau`` clamped at ``FLOOR``
  (an all -inf row has ``m = -inf`` and ``S = A = 0``);
- ``chunk_grad(x, inv_tau, m, log_s, a, b, out)`` writes ``p * (a * log p + b)``, ``log p
  = (x - m) / tau - log_s`` clamped at ``FLOOR``. The picked ids' columns are not in the
  loop (a per-column compare costs a third of it): ``grad`` overwrites those entries
  afterwards with ``gradient.pick_grad``, also rounded once.

They run over the rows to compute with a *fixed* chunk shape: full chunks of ``C``
of those rows, the tail as one more chunk of ``C`` rows ending at the last one
(overlapping the previous chunk, whose rows it recomputes to the same values), and for
fewer than ``C`` rows the largest power of two ``<=`` the rows in the same way. Every
row: chunks of the block. The rows of an index: their ``_at`` forms (``chunk_stats_at(x,
at, inv_tau)``, ``chunk_grad_at(..., out)``) take the whole block and a chunk's ``[C]``
index, read those rows where they are and write their gradient rows there (the block's
rows a dynamic size), so the work is that of the rows, whatever the length of their
runs (short responses between prompts), with no gathered copy. A new ``T`` therefore
compiles nothing new; each (kernel, dtype, V, chunk rows, strides, device type) is
compiled once per process, in a code object of its own so that dynamo's per-function
recompile limit never silently turns a variant eager. ``chunk_stats`` always computes
``A`` (with or without entropy: one variant, the extra multiply-add is free in a fused
loop). The compiled functions carry no jaxtyping annotations and are excluded from the
debug-mode import hook (``typing.no_type_check``): dynamo traces plain torch code.

Invariant mode's compiled forms give the eager bits (``backends.eager``): the same
elementwise operations in the same order, the ``exp`` built from additions and
multiplications, inductor's C++ with no contraction: ``row_kernel`` (a chunk's tiles and
their merge, ``merged_stats``), ``tile_kernel`` (a chunk's tiles under TP,
``tile_stats``), the eager backend's ``grad_kernel`` and, for bfloat16 logits,
``pairs_kernel`` (two columns an int32, so that every lane is 32 bits wide;
``invariant_grad``). They run on the CPU only (``compiled_ok``), and each compiled
shape's first result is checked bit for bit against the eager kernel's (``_checked``: a
difference warns and turns them off).
"""

import math
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast, no_type_check

import torch
from torch import Tensor

from ... import _probe
from .. import bits
from .. import spec as _spec
from ..gradient import RowGrad, pick_grad
from ..memory import buffer
from ..pairs import Mix, PairGrad, PairOut, PairStats, Sides, Weights
from ..rows import At, chunk_starts, chunked, count, gather, numbers, places, size
from ..softmax import (
    Softmax,
    Tau,
    complement_slope,
    exp_capped,
    exp_complement,
    exp_constants,
    from_complement,
    reciprocal,
    reciprocals,
    taus,
)
from ..spec import FLOOR, TILE, exp, halve, tile_max, tiles
from ..stats import RowStats, TileStats, write
from . import divergence, interface
from . import selection as backend
from .chunks import Chunks, Workspace, compiled_chunk_rows
from .eager import eager_rows, eager_tiles, grad_kernel, tiles_from, values
from .interface import Merged, Task

block_stats, block_grad = interface.block_stats, interface.block_grad  # the shared default block kernels
NAME = "compiled"

AUTO_MIN_ELEMENTS = 2**22
"""In ``auto``, the compiled kernels run only for blocks of at least this many elements
(about 16 MiB of float32 logits): below it the eager kernels cost little and a first
compile (seconds) would not pay for itself."""

LANES = 16
STATS_CHUNK_BYTES = 4 * 2**20
"""Rows per compiled ``row_kernel`` and ``tile_kernel`` call: ``[C, V]`` float32 within
these bytes, a power of two. Measured at T=4096, V=32768, bfloat16: 8 MiB chunks 1.2x
faster than 32 MiB ones (the chunk stays in the cache while its tiles are read), but
their ``[C, tiles, 16]`` partial sums leave 8-10 MiB of freed heap that the backward's
peak then includes; 4 MiB chunks leave 2-3 MiB for a forward 1.06x as long, 2 MiB ones
about 1 MiB for 1.2x."""


def stats_chunk_rows(width: int) -> int:
    """Rows per compiled forward chunk (and widened gradient chunk): ``[C, width]``
    float32 within ``STATS_CHUNK_BYTES``, a power of two."""
    return 1 << (max(1, STATS_CHUNK_BYTES // (4 * width)).bit_length() - 1)


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
def _grad_values(x, inv_tau, m, log_s, a, b):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = ((x.to(cdt) - m[:, None]) * inv_tau - log_s[:, None]).clamp(min=FLOOR)
    p = torch.exp(d)
    return p * (a[:, None] * d + b[:, None])


@no_type_check
def chunk_grad(x, inv_tau, m, log_s, a, b, out):
    out.copy_(_grad_values(x, inv_tau, m, log_s, a, b).to(out.dtype))


# The capped kernels compute cap * tanh(x / cap) by one exp (``softmax.exp_capped``,
# ``softmax.exp_complement``) where a vectorized tanh costs three times as much on the CPU
# (measured: the capped gradient kernel 3.9x the uncapped one with tanh), within cap * eps
# of it, the rounding of a float32 logit of that size. The cap is monotone, so the capped
# row max is the cap of the row max: no capped [n, V] copy to reduce over.
@no_type_check
def chunk_stats_capped(x, inv_tau, cap, two_over_cap):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(cdt)
    m = exp_capped(xf.amax(1), cap, two_over_cap)
    y = exp_capped(xf, cap, two_over_cap)
    d = ((y - m[:, None]) * inv_tau).clamp(min=FLOOR)
    p = torch.exp(d)
    return m, p.sum(1), (p * d).sum(1)


@no_type_check
def _grad_values_capped(x, inv_tau, m, log_s, a, b, cap, two_over_cap):
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = exp_complement(x.to(cdt), two_over_cap)  # 1 - tanh(x / cap)
    d = ((from_complement(s, cap) - m[:, None]) * inv_tau - log_s[:, None]).clamp(min=FLOOR)
    p = torch.exp(d)
    return p * (a[:, None] * d + b[:, None]) * complement_slope(s)


@no_type_check
def chunk_grad_capped(x, inv_tau, m, log_s, a, b, cap, two_over_cap, out):
    out.copy_(_grad_values_capped(x, inv_tau, m, log_s, a, b, cap, two_over_cap).to(out.dtype))


# The same kernels of the rows ``at`` of a whole block (an index of a fixed length, the
# block's rows a dynamic size): the compiled loop reads each row where it is (an indirect
# load) and writes its gradient there, with no gathered copy (measured on the CPU: as
# fast as a chunk of consecutive rows, where a gather into a buffer first costs 1.3x).
@no_type_check
def chunk_stats_at(x, at, inv_tau):
    return chunk_stats(x[at], inv_tau)


@no_type_check
def chunk_grad_at(x, at, inv_tau, m, log_s, a, b, out):
    out.index_put_((at,), _grad_values(x[at], inv_tau, m, log_s, a, b).to(out.dtype))


@no_type_check
def chunk_stats_capped_at(x, at, inv_tau, cap, two_over_cap):
    return chunk_stats_capped(x[at], inv_tau, cap, two_over_cap)


@no_type_check
def chunk_grad_capped_at(x, at, inv_tau, m, log_s, a, b, cap, two_over_cap, out):
    out.index_put_((at,), _grad_values_capped(x[at], inv_tau, m, log_s, a, b, cap, two_over_cap).to(out.dtype))


def use_compiled(x: Tensor, rows: Tensor | None = None) -> bool:
    """Whether ``stats``/``grad`` run the compiled kernels on the ``rows`` of this block
    (None: all): ``pays`` of its task."""
    return pays(Task.of(x, rows))


def pays(task: Task) -> bool:
    """Whether the compiled kernels run on ``task``: always in mode ``1``; never in ``0``;
    in ``auto`` when no compile has failed, the block's rows are contiguous (a padded
    vocabulary's valid columns are a view of them) and its rows to compute hold at least
    ``AUTO_MIN_ELEMENTS`` elements."""
    mode = backend.compile_mode()
    if mode == "0" or task.rows == 0 or task.columns == 0:
        return False
    if mode == "1":
        return True
    return (
        backend.selected.broken is None
        and task.contiguous
        and task.rows * task.columns >= AUTO_MIN_ELEMENTS
        and not torch.compiler.is_compiling()
    )


def takes(task: Task) -> bool:
    """The default reduction's tasks where ``pays``, invariant mode's where ``compiled_ok``."""
    return _exact(task) if task.invariant else pays(task)


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own: dynamo keeps its cache, and its
    recompile limit, per code object, so each variant gets exactly one entry."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _kernel(
    fn: Callable[..., Any], x: Tensor, per_row: bool, at: Tensor | None = None, variant: tuple[object, ...] = ()
) -> tuple[tuple[object, ...], Callable[..., Any]]:
    # a per-row temperature is another variant: its own code object, never a recompile;
    # the rows of an index: the index's length fixed, the block's rows any number
    rows = x.shape[0] if at is None else ("at", at.numel())
    state = backend.selected
    key = (fn.__name__, x.dtype, rows, x.shape[1], x.stride(), x.device.type, per_row, state.compiler, *variant)
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


def _call(
    fn: Callable[..., Any], x: Tensor, inv_tau: Tensor, *args: object, at: Tensor | None = None,
    invariant: bool = False, variant: tuple[object, ...] = (),
) -> tuple[bool, object]:
    """``(True, result)`` of the compiled ``fn`` on one chunk ``x`` of a fixed shape, or
    (an ``_at`` kernel) on the rows ``at`` of the block ``x``, its rows (and the gradient
    block's, among ``args``) marked dynamic; ``(False, None)`` if its first call (the
    compilation) failed in ``auto``, which warns once and turns ``auto`` eager.
    ``invariant``: invariant mode's kernel (for ``_probe``'s launch events); ``variant``:
    what else makes another variant, a code object of its own (``_kernel``)."""
    state = backend.selected
    key, compiled = _kernel(fn, x, inv_tau.dim() > 0, at, variant)
    args = (inv_tau, *args)
    if at is not None:
        import torch._dynamo  # imported by torch.compile already

        for t in (x, *args):
            if isinstance(t, Tensor) and t.dim() == 2 and t.shape[0] == x.shape[0] and t is not inv_tau:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        args = (at, *args)
    if key in state.ready:
        if _probe.active is not None:
            _probe.active.launch("compiled", fn.__name__, x.shape[0] if at is None else at.numel(), invariant)
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
    if _probe.active is not None:
        _probe.active.launch("compiled", fn.__name__, x.shape[0] if at is None else at.numel(), invariant)
    return True, result


def _inv_tau(softmax: Softmax, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The inverse temperature as a kernel input: 0-d, or ``[T, 1]`` for one per row."""
    r = reciprocal(softmax.tau, dtype)
    return torch.full((), r, dtype=dtype, device=device) if isinstance(r, float) else r[:, None]


def _capped(softmax: Softmax, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """The cap and ``2 / cap`` as kernel inputs (0-d tensors, so that no value compiles
    anew), if any."""
    if softmax.cap is None:
        return ()
    return tuple(torch.full((), v, dtype=dtype, device=device) for v in exp_constants(softmax.cap))


def stats(
    x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunks: Chunks, work: Workspace
) -> bool:
    """``m``, ``S``, ``A`` of the ``rows`` of ``x`` into ``out`` by the compiled
    ``chunk_stats`` (or ``chunk_stats_capped``; their ``_at`` forms for an index),
    ``chunks.compiled`` rows each; False (``out`` not fully written) if it failed to
    compile (in ``auto``). ``work`` is the eager loop's: the compiled kernels take none."""
    chunk = chunks.compiled
    cdt = out.max.dtype
    inv_tau = _inv_tau(softmax, cdt, x.device)
    cap = _capped(softmax, cdt, x.device)
    fn = chunk_stats if softmax.cap is None else chunk_stats_capped
    fn_at = chunk_stats_at if softmax.cap is None else chunk_stats_capped_at
    c, starts = chunk_starts(count(rows, x.shape[0]), chunk)
    for s in starts:
        at: At = slice(s, s + c) if rows is None else rows[s : s + c]
        tau = inv_tau if inv_tau.dim() == 0 else inv_tau[at]
        ok, result = _call(fn, x[at], tau, *cap) if isinstance(at, slice) else _call(fn_at, x, tau, *cap, at=at)
        if not ok:
            return False
        m, total, a = cast(tuple[Tensor, Tensor, Tensor], result)
        out.max[at], out.sum[at] = m, total
        if out.ent is not None:
            out.ent[at] = a
    return True


def grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, out: Tensor, rows: Tensor | None,
    chunks: Chunks, work: Workspace,
) -> bool:
    """``chunk_grad`` (or ``chunk_grad_capped``; their ``_at`` forms for an index) of the
    ``rows`` of ``x`` into ``out``, ``chunks.compiled`` rows each, then the picked ids'
    entries; False (``out`` not fully written) if the kernel failed to compile (in
    ``auto``)."""
    chunk = chunks.compiled
    vocab = x.shape[1]
    cdt = row.b.dtype
    inv_tau = _inv_tau(softmax, cdt, x.device)
    cap = _capped(softmax, cdt, x.device)
    fn = chunk_grad if softmax.cap is None else chunk_grad_capped
    fn_at = chunk_grad_at if softmax.cap is None else chunk_grad_capped_at
    a = torch.zeros_like(row.b) if row.a is None else row.a
    c, starts = chunk_starts(count(rows, x.shape[0]), chunk)
    for s in starts:
        at: At = slice(s, s + c) if rows is None else rows[s : s + c]
        terms = (inv_tau if inv_tau.dim() == 0 else inv_tau[at], big_m[at], log_s[at], a[at], row.b[at], *cap)
        ok, _ = _call(fn, x[at], *terms, out[at]) if isinstance(at, slice) else _call(fn_at, x, *terms, out, at=at)
        if not ok:
            return False
        if row.hot is not None:
            # the picked entries chunk by chunk: the [rows, k] temporaries of a whole
            # block (the repeated ids' dedup above all) would add ~10 % to the peak of
            # bf16 logits at k = 64
            rows_s = row.rows(at)
            at_rows = numbers(at, x.device)[:, None].expand_as(rows_s.column)
            entry = pick_grad(x[at_rows, rows_s.column], big_m[at], log_s[at], softmax.rows(at), rows_s, vocab)
            # the entries by (row, column) index: a scatter_ into a bfloat16 tensor takes
            # a slow path that costs as much as the kernel
            out.index_put_((at_rows.reshape(-1), rows_s.column.reshape(-1)), entry.reshape(-1).to(out.dtype))
    return True


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


@no_type_check
def pairs_kernel(v, r, m, log_s, a, b, out):
    """``grad_kernel`` of bfloat16 logits two columns at a time: ``v`` and ``out`` are
    ``bits.pairs`` views. Each column is widened exactly (its bits in the high half),
    ``values`` computed, rounded to bfloat16 as ``.to(torch.bfloat16)`` rounds (ties to
    even; a NaN the quiet NaN) and packed back: all lanes 32 bits wide."""
    even = values((v << 16).view(torch.float32), r, m, log_s, a, b)
    odd = values((v & -65536).view(torch.float32), r, m, log_s, a, b)
    out.copy_(bits.bfloat16_bits(odd) | ((bits.bfloat16_bits(even) >> 16) & 0xFFFF))


def compiled_ok(part: Tensor, rows: Tensor | None = None) -> bool:
    """Whether invariant mode may run its compiled kernels on the ``rows`` of ``part``
    (None: all): ``_exact`` of its task."""
    return _exact(Task.of(part, rows, True))


def _exact(task: Task) -> bool:
    """Whether invariant mode's compiled kernels give the eager bits on ``task``: the
    default kernels' conditions (``pays``), on the CPU only (inductor's C++ with no
    contraction of ``a * b + c``: its Triton kernels contract, so an accelerator runs the
    eager kernels), inductor's floating-point contraction and unsafe-math flags off, and
    no compiled result ever found to differ from the eager one."""
    if backend.selected.disagree is not None or task.device.type != "cpu" or not pays(task):
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


def tile_stats(
    x: Tensor, softmax: Softmax, valid: int, out: TileStats, rows: Tensor | None, chunk: int, first: int
) -> bool:
    """Invariant mode's per-tile statistics of the ``rows`` of ``x`` (columns ``>= valid``
    -inf) into tiles ``first`` on of ``out``: the whole tiles of uncapped logits by the
    compiled ``tile_kernel`` where ``compiled_ok``, the rest (a partial last tile) by the
    eager backend's loop (``eager.tiles_from``), ``chunk`` rows at a time; False (the
    eager backend then computes every tile) where the compiled kernels do not run."""
    r = reciprocals(softmax.tau, x.shape[0], out.sum.dtype, x.device)
    whole = valid // TILE * TILE if softmax.cap is None else 0
    part = x[:, :whole]
    if not (whole and compiled_ok(part, rows) and _tile_chunks(part, rows, r, out, first)):
        return False
    tiles_from(x, softmax.cap, r, valid, out, rows, chunk, first, whole, tiles(x.shape[1]))
    return True


def _tile_chunks(x: Tensor, rows: Tensor | None, r: Tensor, out: TileStats, first: int) -> bool:
    """``tile_kernel`` over the ``rows`` of ``x`` (whole tiles) into tiles ``first`` on of
    ``out``, in chunks of a fixed number of rows (``rows.chunk_starts``); False if
    it failed to compile (auto) or disagreed with the eager kernel."""
    n = x.shape[1] // TILE
    chunks, buf = chunked(x, rows, stats_chunk_rows(x.shape[1]))
    for at in chunks:
        part = gather(x, at, buf)
        ok, result = _call(tile_kernel, part, r[at], invariant=True)
        if not ok:
            return False
        got = cast(tuple[Tensor, Tensor, Tensor], result)
        key = ("tile_kernel", part.dtype, part.shape, part.stride())
        if key not in backend.selected.verified and not _checked(
                "tile_kernel", got,
                [t.t() for t in eager_tiles(part.to(r.dtype).view(-1, n, TILE), r[at], True) if t is not None], key):
            return False
        write(out, (at, slice(first, first + n)), got[0].t(), got[1].t(), got[2].t())
    return True


def merged_stats(x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None, chunk: int) -> bool:
    """``row_kernel`` over the ``rows`` of ``x`` (uncapped: False for capped logits) into
    ``out`` (``[T]`` fields), in chunks of a fixed number of rows
    (``rows.chunk_starts``; ``chunk`` is the eager loop's), each compiled shape's first
    result checked against ``eager_rows``; False if it failed to compile (auto) or
    disagreed."""
    if softmax.cap is not None:
        return False
    cdt = out.sum.dtype
    tau = taus(softmax.tau, x.shape[0], cdt, x.device)
    r = reciprocals(tau, x.shape[0], cdt, x.device)
    width = x.shape[1]
    chunks, buf = chunked(x, rows, stats_chunk_rows(width))
    for at in chunks:
        part = gather(x, at, buf)
        kernel = _probe.step("row_kernel", row_kernel)
        ok, result = _call(kernel, part, r[at], tau[at], invariant=True)
        if not ok:
            return False
        got = cast(tuple[Tensor, Tensor, Tensor], result)
        key = ("row_kernel", x.dtype, tuple(part.shape), part.stride())
        if key not in backend.selected.verified:
            work = torch.empty((part.shape[0], tiles(width) * TILE), dtype=r.dtype, device=x.device)
            want = eager_rows(part, None, r[at], tau[at], work, True)
            if not _checked("row_kernel", got, [t for t in want if t is not None], key):
                return False
        write(out, at, *got)
    return True


def merge_tiles(m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> Merged | None:
    """None: no compiled merge (the next backend's, the eager one, merges)."""
    return None


def invariant_grad(
    x: Tensor, rows: Tensor | None, r: Tensor, m: Tensor, log_s: Tensor, a: Tensor, b: Tensor,
    cap: float | None, chunks: Chunks, out: Tensor,
) -> bool:
    """``grad_kernel`` compiled over the ``rows`` of ``x`` (uncapped: False for capped
    logits) in chunks of a fixed number of rows (as ``kernels``: a chunk whose rows are
    not consecutive gathered into a buffer, its gradient written back at its rows), its
    first call checked against the eager one; False if it failed to compile (auto) or
    disagreed. ``chunks`` is the eager loop's: the compiled chunks are a fixed number of
    rows of the width. bfloat16 logits go two
    columns at a time (``pairs_kernel``) where ``x`` and ``out`` allow it (``bits.pairs``);
    other logits narrower than the compute dtype are widened chunk by chunk into one
    buffer first (exactly). Either way the compiled loop runs on 32-bit lanes: one that
    reads bfloat16 runs at twice the lanes, where inductor builds the exp's ``2^n`` from
    its bits one element at a time (measured at T=4096, V=32768: the gradient 1.5x
    slower than with pairs)."""
    if cap is not None:
        return False
    width = x.shape[1]
    pairs = bits.pairs(x) is not None and bits.pairs(out) is not None
    widen = x.dtype != r.dtype and not pairs
    chunk = stats_chunk_rows(width) if widen else compiled_chunk_rows(width, x.dtype, x.device)
    parts, buf = chunked(x, rows, chunk)
    most = max((size(at) for at in parts), default=0)
    wide = torch.empty((most, width), dtype=r.dtype, device=x.device) if widen and parts else None
    into = None if buf is None else buffer((buf.shape[0], width), out.dtype, out.device, zero=False)
    for at in parts:
        c = size(at)
        src, dst = gather(x, at, buf), out[at] if into is None or isinstance(at, slice) else into[:c]
        terms = (r[at], m[at], log_s[at], a[at], b[at])
        if pairs:
            v, o = bits.pairs(src), bits.pairs(dst)
            assert v is not None and o is not None
            ok, _ = _call(pairs_kernel, v, *terms, o, invariant=True)
            key: tuple[object, ...] = ("pairs_kernel", (c, width), src.stride(), dst.stride())
        else:
            part = src if wide is None else wide[:c].copy_(src)
            ok, _ = _call(grad_kernel, part, *terms, dst, invariant=True)
            key = ("grad_kernel", part.dtype, dst.dtype, (c, width), part.stride(), dst.stride())
        if not ok:
            return False
        if key not in backend.selected.verified:
            want = torch.empty_like(dst)
            grad_kernel(src, *terms, want)
            if not _checked(str(key[0]), [dst], [want], key):
                return False
        if not isinstance(at, slice):
            out.index_copy_(0, at, dst)
    return True


def _shape_of(arg: object) -> object:
    """What of a compiled body's argument makes another variant: a tensor's dtype and
    strides, None, or a constant's value; a tuple of them, each."""
    if isinstance(arg, Tensor):
        return (arg.dtype, arg.stride())
    if isinstance(arg, tuple):
        return tuple(_shape_of(a) for a in arg)
    return arg


class _Runner:
    """The compiled backend's ``divergence.Runner``: chunks of a fixed number of the rows
    (``rows.chunk_starts``, the last one overlapping the one before), each body compiled
    once per variant (``_call``: its other arguments' dtypes, strides and constants in
    the key)."""

    ops = divergence.COMPILED

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def pieces(self, rows: Tensor | None, total: int, width: int) -> Sequence[At]:
        c, starts = chunk_starts(count(rows, total), self.chunk)
        return places(rows, [(s, s + c) for s in starts])

    def call(self, fn: Callable[..., Any], xw: Tensor, r: Tensor, xo: Tensor, *args: object) -> tuple[bool, Any]:
        return _call(fn, xw, r, xo, *args, variant=tuple(_shape_of(a) for a in (xo, *args)))


def pair_stats(
    xw: Tensor, xo: Tensor, softmax: Softmax, out: PairOut, rows: Tensor | None, chunks: Chunks, first: int
) -> bool:
    """``divergence.default_stats`` compiled, chunk by chunk; False in invariant mode (its
    tiles run eagerly) or where a compile failed (auto)."""
    if softmax.invariant:
        return False
    assert isinstance(out, PairStats), "per-tile statistics out of invariant mode"
    return divergence.stats(_Runner(chunks.compiled), xw, xo, softmax, out, rows)


def pair_mix(
    xw: Tensor, xo: Tensor, softmax: Softmax, sides: Sides, weights: Weights, out: Mix, rows: Tensor | None,
    chunks: Chunks, first: int,
) -> bool:
    """``divergence.default_mix`` compiled; False in invariant mode or where a compile failed."""
    run = _Runner(chunks.compiled)
    return not softmax.invariant and divergence.mix(run, xw, xo, softmax, sides, weights, out, rows)


def pair_grad(
    xw: Tensor, xo: Tensor, softmax: Softmax, terms: PairGrad, out_w: Tensor | None, out_o: Tensor | None,
    rows: Tensor | None, chunks: Chunks,
) -> bool:
    """``divergence.default_grad`` compiled; False in invariant mode or where a compile failed."""
    run = _Runner(chunks.compiled)
    return not softmax.invariant and divergence.grad(run, xw, xo, softmax, terms, out_w, out_o, rows)
