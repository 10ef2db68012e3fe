"""The default reduction's Triton kernels: a row's statistics forward, its gradient backward.

``stats`` is one program per row (of all rows, or of the rows of an index): a loop over
blocks of ``BLOCK`` columns that reads each logit once, widened to float32 on load, and
keeps the online ``(m, S, A)`` of ``stats.RowStats`` (``d = (y - m) / tau`` clamped at
``FLOOR``; each block's max rescales the running sums by ``e^delta``, ``A`` by ``e^delta
(A + delta S)``, as ``stats.merge`` merges parts). ``grad`` is the same grid: each logit
read once, ``p * (a log p + b)`` (times the cap's derivative) computed in float32 and
written once in the gradient's dtype (one rounding). The picked ids' one-hot terms are
not in the loop: the caller overwrites those few entries (``gradient.pick_grad``), as the
compiled kernels' caller does.

The soft cap is ``cap - 2 cap / (exp(2 x / cap) + 1)``, as in the compiled kernels (one
exp, within ``cap * eps`` of ``cap * tanh(x / cap)``); a temperature is a multiplication
by ``r = 1 / tau`` (a number, or one per row).
"""

from typing import cast, no_type_check

import torch
import triton
import triton.language as tl
from torch import Tensor

from .... import _probe
from ...gradient import RowGrad, pick_grad
from ...softmax import Softmax, exp_constants, reciprocal
from ...spec import FLOOR as _FLOOR
from ...stats import RowStats

STATS_BLOCK = 8192
"""Columns per iteration of a row's forward loop on a GPU (16 KiB of bfloat16 logits per
program in flight), and its warps: the fastest of the sweep of ``benchmarks/gpu_bench.py
--sweep`` on an H200 (docs/numbers.md)."""
STATS_WARPS = 4
STATS_STAGES = 1
"""Software pipelining stages of the forward loop's loads (1: none)."""
GRAD_BLOCK = 8192
"""The same three for the gradient's loop."""
GRAD_WARPS = 4
GRAD_STAGES = 1
FLOOR = tl.constexpr(_FLOOR)
"""``spec.FLOOR`` as a constant the kernels can read."""
INTERPRETED_BLOCK = 256
"""Columns per iteration under the interpreter: numpy handles any width, and small blocks
exercise the online merge across blocks in small tests."""


@triton.jit
@no_type_check  # a Triton function: checked by running it, not by mypy
def _row_and_r(rows_ptr, r_ptr, r_scalar, HAS_ROWS: tl.constexpr, PER_ROW: tl.constexpr):
    """This program's row (its index entry, or the program id) and its ``1 / tau``."""
    pid = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + pid).to(tl.int64)
    else:
        row = pid.to(tl.int64)
    if PER_ROW:
        r = tl.load(r_ptr + row)
    else:
        r = r_scalar
    return row, r


@triton.jit
@no_type_check  # a Triton kernel: checked by running it, not by mypy
def _stats_kernel(
    x_ptr, stride_x, rows_ptr, r_ptr, r_scalar, m_ptr, s_ptr, a_ptr, n_cols, cap, two_over_cap,
    HAS_ROWS: tl.constexpr, PER_ROW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_A: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    row, r = _row_and_r(rows_ptr, r_ptr, r_scalar, HAS_ROWS, PER_ROW)
    base = x_ptr + row * stride_x
    m = -float("inf")
    s = 0.0
    a = 0.0
    for start in tl.range(0, n_cols, BLOCK, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_CAP:
            x = cap - 2.0 * cap / (tl.exp(x * two_over_cap) + 1.0)
        y = tl.where(inside, x, -float("inf"))
        m_new = tl.maximum(m, tl.max(y, 0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        d = tl.maximum((y - shift) * r, FLOOR)
        e = tl.exp(d)
        # the running sums, relative to the old max, rescaled to the new one
        old = m != -float("inf")
        delta = tl.where(old, (m - shift) * r, 0.0)
        scale = tl.where(old, tl.exp(delta), 0.0)
        if HAS_A:
            a = scale * (a + delta * s) + tl.sum(d * e, 0)
        s = scale * s + tl.sum(e, 0)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    if HAS_A:
        tl.store(a_ptr + row, a)


@triton.jit
@no_type_check  # a Triton kernel: checked by running it, not by mypy
def _grad_kernel(
    x_ptr, stride_x, out_ptr, stride_out, rows_ptr, r_ptr, r_scalar, m_ptr, log_s_ptr, a_ptr, b_ptr,
    n_cols, cap, two_over_cap,
    HAS_ROWS: tl.constexpr, PER_ROW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_A: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    row, r = _row_and_r(rows_ptr, r_ptr, r_scalar, HAS_ROWS, PER_ROW)
    big_m = tl.load(m_ptr + row)
    log_s = tl.load(log_s_ptr + row)
    b = tl.load(b_ptr + row)
    if HAS_A:
        a = tl.load(a_ptr + row)
    else:
        a = 0.0
    base = x_ptr + row * stride_x
    dest = out_ptr + row * stride_out
    for start in tl.range(0, n_cols, BLOCK, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_CAP:
            t = 2.0 / (tl.exp(x * two_over_cap) + 1.0)  # 1 - tanh(x / cap)
            y = (1.0 - t) * cap
        else:
            y = x
        d = tl.maximum((y - big_m) * r - log_s, FLOOR)
        p = tl.exp(d)
        if HAS_A:
            g = p * (a * d + b)
        else:
            g = p * b
        if HAS_CAP:
            g = g * (t * (2.0 - t))  # d(cap tanh(x / cap)) / dx = 1 - tanh^2
        tl.store(dest + cols, g.to(out_ptr.dtype.element_ty), mask=inside)


def _launch(rows: Tensor | None, count_rows: int) -> tuple[tuple[int], Tensor | None]:
    """The grid (one program per row) and the row index as the kernels take it."""
    if rows is None:
        return (count_rows,), None
    return (rows.numel(),), rows


def _config(block: int, warps: int, stages: int) -> dict[str, int]:
    from .interpreter import check_interpreter, interpreted

    if interpreted():
        check_interpreter()
        return {"BLOCK": INTERPRETED_BLOCK, "STAGES": 1}
    return {"BLOCK": block, "STAGES": stages, "num_warps": warps}


def _temperature(tau: float | Tensor, x: Tensor) -> tuple[Tensor, float, bool]:
    """``(r_ptr, r_scalar, per_row)``: ``1 / tau`` one per row (a float32 ``[T]`` tensor),
    or a number."""
    r = reciprocal(tau, torch.float32)
    if isinstance(r, float):
        return x.new_empty((1,), dtype=torch.float32), r, False
    return r.contiguous(), 1.0, True


def _cap(cap: float | None) -> tuple[float, float]:
    return (1.0, 2.0) if cap is None else exp_constants(cap)


def _softmax_args(name: str, rows: int, tau: float | Tensor, cap: float | None, x: Tensor) -> tuple[object, ...]:
    """A launch's softmax arguments ``(r_ptr, r_scalar, per_row, cap, two_over_cap)``, the
    launch of ``rows`` programs of kernel ``name`` reported to ``_probe``."""
    if _probe.active is not None:
        _probe.active.launch("triton", name, rows)
    return (*_temperature(tau, x), *_cap(cap))


def stats(
    x: Tensor, tau: float | Tensor, cap: float | None, m: Tensor, s: Tensor, a: Tensor | None,
    rows: Tensor | None = None,
) -> None:
    """Write ``m``, ``S`` and (``a`` not None) ``A`` of the rows ``rows`` (an int64 index;
    None: every row) of ``x`` ``[T, V]`` (columns contiguous) into the float32 ``[T]``
    fields ``m``, ``s``, ``a`` at those rows; the other rows are left as they are. A row
    all -inf (or a block of no columns) gets ``(-inf, 0, 0)``."""
    assert x.stride(-1) == 1 or x.shape[1] <= 1, "the kernels read contiguous columns"
    assert m.dtype == torch.float32, "float32 statistics (float64 logits take another backend)"
    grid, index = _launch(rows, x.shape[0])
    if grid[0] == 0:
        return
    r_t, r_s, per_row, c, two = _softmax_args("default.stats", grid[0], tau, cap, x)
    _stats_kernel[grid](
        x, x.stride(0), m if index is None else index, r_t, r_s, m, s, m if a is None else a, x.shape[1], c, two,
        HAS_ROWS=index is not None, PER_ROW=per_row, HAS_CAP=cap is not None, HAS_A=a is not None,
        **_config(STATS_BLOCK, STATS_WARPS, STATS_STAGES),
    )


def grad(
    x: Tensor, tau: float | Tensor, cap: float | None, big_m: Tensor, log_s: Tensor, a: Tensor | None, b: Tensor,
    out: Tensor, rows: Tensor | None = None,
) -> None:
    """Write ``p * (a log p + b)`` (``a`` None: ``p * b``), through the cap's derivative,
    of the rows ``rows`` (None: every row) of ``x`` into ``out`` (``[T, V]``, contiguous
    columns, its dtype: computed in float32, rounded once); ``log p = (y - M) / tau -
    log S`` clamped at ``FLOOR``, the per-row terms float32 ``[T]``. The other rows of
    ``out`` are left as they are."""
    assert x.stride(-1) == 1 or x.shape[1] <= 1, "the kernels read contiguous columns"
    assert out.stride(-1) == 1 or out.shape[1] <= 1, "the kernels write contiguous columns"
    grid, index = _launch(rows, x.shape[0])
    if grid[0] == 0 or x.shape[1] == 0:
        return
    r_t, r_s, per_row, c, two = _softmax_args("default.grad", grid[0], tau, cap, x)
    _grad_kernel[grid](
        x, x.stride(0), out, out.stride(0), b if index is None else index, r_t, r_s, big_m, log_s,
        b if a is None else a, b, x.shape[1], c, two,
        HAS_ROWS=index is not None, PER_ROW=per_row, HAS_CAP=cap is not None, HAS_A=a is not None,
        **_config(GRAD_BLOCK, GRAD_WARPS, GRAD_STAGES),
    )


def row_stats(x: Tensor, softmax: Softmax, out: RowStats, rows: Tensor | None) -> None:
    """``kernels.stats`` by the Triton kernel: the rows ``rows`` (None: all) into ``out``'s
    ``[n]`` fields (through contiguous copies where a field is strided)."""
    fields = [out.max, out.sum, out.ent]
    dense = [None if f is None else (f if f.stride(0) == 1 else f.contiguous()) for f in fields]
    m, s, a = dense
    assert m is not None and s is not None
    stats(x, softmax.tau, softmax.cap, m, s, a, rows)
    for f, d in zip(fields, dense):
        if f is not None and d is not f:
            f.copy_(cast(Tensor, d))


def row_grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, row: RowGrad, out: Tensor, index: Tensor | None
) -> None:
    """``kernels.grad`` by the Triton kernel over the rows ``index`` (None: all), then the
    picked ids' entries (``pick_grad``, rounded once), as the compiled kernels' caller
    writes them."""
    grad(x, softmax.tau, softmax.cap, big_m, log_s, row.a, row.b, out, index)
    if row.hot is None or x.shape[1] == 0:
        return
    at = torch.arange(x.shape[0], device=x.device) if index is None else index
    if at.numel() == 0:
        return
    sub = RowGrad(None if row.a is None else row.a[at], row.b[at], row.hot[at], row.column[at])
    entry = pick_grad(x[at[:, None], sub.column],
                      big_m[at], log_s[at], softmax.rows(at), sub, x.shape[1])
    out.index_put_((at[:, None].expand_as(sub.column).reshape(-1), sub.column.reshape(-1)),
                   entry.reshape(-1).to(out.dtype))
