"""The dense kernels over a block of logits: statistics forward, gradient backward.

A block ``x`` is ``[n, V]`` logits of any float dtype (a row chunk of the logits, a
``[rows, V_block]`` matmul block); the arithmetic runs in ``compute_dtype``. ``stats``
writes each row's ``m``, ``S`` and ``A`` into a ``stats.RowStats`` (the driver picks the
logits at the picked ids, one gather);
``grad`` writes each row's gradient ``p * (a log p + b)`` plus the one-hot terms of its
picked ids (``gradient.RowGrad``) into ``out``, rounded once to ``out``'s dtype. Both take
the rows to compute as an index (``rows``, see ``_vocab.rows``; None: every row) and
never read or write another row. Both always do their job: with the compiled kernels
where the backend (``CPSLICE_BACKEND``) and the block allow, else with the eager loop (``backends.eager``), chunk by
chunk (``backends.chunks.Chunks``), a piece of rows that are not consecutive gathered into its work buffers.

The compiled kernels are two pure functions of one chunk, compiled by ``torch.compile``
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
"""

import math
import types
import warnings
from collections.abc import Callable
from typing import Any, cast, no_type_check

import torch
from torch import Tensor

from .. import _probe
from .backends import eager
from .backends import selection as backend
from .backends.chunks import Chunks, Workspace
from .gradient import RowGrad, pick_grad
from .rows import At, chunk_starts, count, numbers
from .softmax import (
    Softmax,
    complement_slope,
    exp_capped,
    exp_complement,
    exp_constants,
    from_complement,
    reciprocal,
)
from .spec import FLOOR
from .stats import RowStats

AUTO_MIN_ELEMENTS = 2**22
"""In ``auto``, the compiled kernels run only for blocks of at least this many elements
(about 16 MiB of float32 logits): below it the eager kernels cost little and a first
compile (seconds) would not pay for itself."""


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
    (None: all): always in mode ``1``; never in ``0``; in ``auto`` when no compile has
    failed, the block's rows are contiguous (a padded vocabulary's valid columns are a
    view of them) and its rows to compute hold at least ``AUTO_MIN_ELEMENTS`` elements."""
    mode = backend.compile_mode()
    n = count(rows, x.shape[0])
    if mode == "0" or n == 0 or x.shape[1] == 0:
        return False
    if mode == "1":
        return True
    return (
        backend.selected.broken is None
        and x.stride(-1) == 1
        and n * x.shape[1] >= AUTO_MIN_ELEMENTS
        and not torch.compiler.is_compiling()
    )


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own: dynamo keeps its cache, and its
    recompile limit, per code object, so each variant gets exactly one entry."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _kernel(
    fn: Callable[..., Any], x: Tensor, per_row: bool, at: Tensor | None = None
) -> tuple[tuple[object, ...], Callable[..., Any]]:
    # a per-row temperature is another variant: its own code object, never a recompile;
    # the rows of an index: the index's length fixed, the block's rows any number
    rows = x.shape[0] if at is None else ("at", at.numel())
    state = backend.selected
    key = (fn.__name__, x.dtype, rows, x.shape[1], x.stride(), x.device.type, per_row, state.compiler)
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
    invariant: bool = False,
) -> tuple[bool, object]:
    """``(True, result)`` of the compiled ``fn`` on one chunk ``x`` of a fixed shape, or
    (an ``_at`` kernel) on the rows ``at`` of the block ``x``, its rows (and the gradient
    block's, among ``args``) marked dynamic; ``(False, None)`` if its first call (the
    compilation) failed in ``auto``, which warns once and turns ``auto`` eager.
    ``invariant``: invariant mode's kernel (for ``_probe``'s launch events)."""
    state = backend.selected
    key, compiled = _kernel(fn, x, inv_tau.dim() > 0, at)
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



def _compiled_stats(x: Tensor, rows: Tensor | None, softmax: Softmax, chunk: int, out: RowStats) -> bool:
    """``m``, ``S``, ``A`` of the ``rows`` of ``x`` into ``out`` by the compiled
    ``chunk_stats`` (or ``chunk_stats_capped``; their ``_at`` forms for an index); False
    (``out`` not fully written) if it failed to compile (in ``auto``)."""
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


def stats(
    x: Tensor,
    softmax: Softmax,
    out: RowStats,
    *,
    chunks: Chunks,
    rows: Tensor | None = None,
    work: Workspace | None = None,
) -> None:
    """Write ``m``, ``S`` and, where ``out.ent`` is not None, ``A`` of the ``rows`` of the
    block ``x`` (an ascending int64 index on its device, ``_vocab.rows``; None: every
    row) into ``out`` (``[n]`` fields of the compute dtype; the other rows are neither
    read nor written, e.g. ``stats.placeholders``), of the logits as ``softmax`` reads
    them (capped, then tempered; the max is the capped logits'). A block of no columns
    (a shard of padded ids only) has ``m = -inf`` and ``S = A = 0``. The compiled
    kernels run on full chunks of the selected rows, whatever their runs."""
    if _probe.active is not None:
        _probe.active.call("stats", count(rows, x.shape[0]), rows)
    if backend.triton_for(x):
        from .backends.triton import default as tri

        tri.row_stats(x, softmax, out, rows)
        return
    if not (use_compiled(x, rows) and _compiled_stats(x, rows, softmax, chunks.compiled, out)):
        eager.stats(x, softmax, chunks.eager, rows, work or Workspace(), out)


def _compiled_grad(
    x: Tensor, rows: Tensor | None, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, chunk: int,
    out: Tensor,
) -> bool:
    """``chunk_grad`` (or ``chunk_grad_capped``; their ``_at`` forms for an index) of the
    ``rows`` of ``x`` into ``out``, then the picked ids' entries; False (``out`` not fully
    written) if the kernel failed to compile (in ``auto``)."""
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


def grad(
    x: Tensor,
    big_m: Tensor,
    log_s: Tensor,
    softmax: Softmax,
    row: RowGrad,
    out: Tensor,
    *,
    chunks: Chunks,
    rows: Tensor | None = None,
    work: Workspace | None = None,
    compiled: bool = True,
) -> None:
    """Write the gradient w.r.t. the raw logits of the ``rows`` of the block ``x`` (as
    ``stats`` takes them; None: every row) into ``out`` (``[n, V]`` with contiguous
    rows, its dtype; the other rows are neither read nor written): ``p * (a log p +
    b)`` with ``M``, ``log S`` the rows' totals, plus the one-hot terms of ``row``,
    through the cap's ``tanh``. ``compiled=False`` (invariant mode) runs the eager loop
    alone."""
    if _probe.active is not None:
        _probe.active.call("grad", count(rows, x.shape[0]), rows)
    if backend.triton_for(x):
        from .backends.triton import default as tri

        tri.row_grad(x, big_m, log_s, softmax, row, out, rows)
        return
    if not (compiled and use_compiled(x, rows)
            and _compiled_grad(x, rows, big_m, log_s, softmax, row, chunks.compiled, out)):
        eager.grad(x, rows, big_m, log_s, softmax, row, chunks.eager, work or Workspace(), out)
