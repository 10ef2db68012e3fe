"""A divergence's Triton kernels, default reduction (``vocab_divergence``: ``pairs``), the
arithmetic of ``backends.divergence``'s steps spelled out (a Triton kernel cannot call
Python): one program per row of both sides' logits, a loop over blocks of columns.

- ``stats``: each block read once per side, widened to float32 and capped; each side's
  online ``(m, S)`` (a block's max rescales the running sum by ``e^delta``) and, for
  ``KL(w || o)``, the cross term ``C``, rescaled with the weight side's sum alone;
- ``mix``: ``"jsd"``'s second pass, ``Q = sum w (log w - log m)`` and ``P`` from both
  sides normalized (``log_mixture`` pivoted on the larger side, as the step);
- ``grad``: each wanted side's gradient, computed in float32 and written once in its
  dtype (through the cap's derivative).

The cap is the one-``exp`` form of the compiled kernels (``softmax.exp_capped``,
``exp_complement``); ``expm1(d)`` is ``exp(d) - 1`` and ``log1p(u)`` is ``log(w) + (u - (w -
1)) / w``, ``w = 1 + u``: exactly 0 at 0, so identical sides give exactly 0. Every
launch is a ``launch`` event of ``_probe`` (``pair.stats``, ``pair.mix``, ``pair.grad``).
Invariant mode declines (``backends.triton``): its divergence runs the eager spec.
"""

from typing import no_type_check

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...pairs import Mix, PairGrad, PairStats, Sides, Weights
from ...softmax import Softmax
from .default import FLOOR, _config, _row_and_r, _softmax_args

PAIR_BLOCK = 4096
"""Columns per iteration of a row's loop on a GPU (two sides read: half the log-prob
kernels' block), and its warps."""
PAIR_WARPS = 8
PAIR_STAGES = 1


@triton.jit
@no_type_check  # a Triton function: checked by running it, not by mypy
def _load(ptr, cols, inside, cap, two_over_cap, HAS_CAP: tl.constexpr):
    """A block of one side's logits as the softmax reads them: float32, capped, -inf
    outside the row."""
    x = tl.load(ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_CAP:
        x = cap - 2.0 * cap / (tl.exp(x * two_over_cap) + 1.0)
    return tl.where(inside, x, -float("inf"))


@triton.jit
@no_type_check  # a Triton function
def _online(m, s, y, r):
    """A side's running ``(m, S)`` with the block ``y``: the new max, the new sum, the
    block's exponentials and the running sums' scale."""
    m_new = tl.maximum(m, tl.max(y, 0))
    shift = tl.where(m_new == -float("inf"), 0.0, m_new)
    e = tl.exp(tl.maximum((y - shift) * r, FLOOR))
    scale = tl.where(m != -float("inf"), tl.exp((m - shift) * r), 0.0)
    return m_new, scale * s + tl.sum(e, 0), e, scale


@triton.jit
@no_type_check  # a Triton kernel
def _stats_kernel(
    w_ptr, stride_w, o_ptr, stride_o, rows_ptr, r_ptr, r_scalar, mw_ptr, sw_ptr, mo_ptr, so_ptr, c_ptr, n_cols,
    cap, two_over_cap,
    HAS_ROWS: tl.constexpr, PER_ROW: tl.constexpr, HAS_CAP: tl.constexpr, CROSS: tl.constexpr,
    BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    row, r = _row_and_r(rows_ptr, r_ptr, r_scalar, HAS_ROWS, PER_ROW)
    mw = -float("inf")
    sw = 0.0
    mo = -float("inf")
    so = 0.0
    c = 0.0
    for start in tl.range(0, n_cols, BLOCK, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        yw = _load(w_ptr + row * stride_w, cols, inside, cap, two_over_cap, HAS_CAP)
        yo = _load(o_ptr + row * stride_o, cols, inside, cap, two_over_cap, HAS_CAP)
        mw, sw, ew, scale = _online(mw, sw, yw, r)
        mo, so, _, _ = _online(mo, so, yo, r)
        if CROSS:
            term = tl.where(ew > 0, ew * ((yw - yo) * r), 0.0)
            c = tl.where(scale == 0, 0.0, scale * c) + tl.sum(term, 0)
    tl.store(mw_ptr + row, mw)
    tl.store(sw_ptr + row, sw)
    tl.store(mo_ptr + row, mo)
    tl.store(so_ptr + row, so)
    if CROSS:
        tl.store(c_ptr + row, c)


@triton.jit
@no_type_check  # a Triton function
def _log_probs(ptr, cols, inside, big_m, log_s, r, cap, two_over_cap, HAS_CAP: tl.constexpr):
    """A block of one side's log-probs, clamped at ``FLOOR`` (``FLOOR`` outside the row),
    and the cap's derivative there (1 uncapped)."""
    x = tl.load(ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_CAP:
        t = 2.0 / (tl.exp(x * two_over_cap) + 1.0)  # 1 - tanh(x / cap)
        y = (1.0 - t) * cap
        slope = t * (2.0 - t)
    else:
        y = x
        slope = 1.0
    y = tl.where(inside, y, -float("inf"))
    return tl.maximum((y - big_m) * r - log_s, FLOOR), slope


@triton.jit
@no_type_check  # a Triton function
def _log_mixture(lw, lo, bw, bo, log_bw, log_bo):
    """``log(bw w + bo o)``, ``backends.divergence.log_mixture``'s arithmetic."""
    hi = tl.maximum(lw, lo)
    weight = tl.where(lw >= lo, bo, bw)
    u = weight * (tl.exp(tl.minimum(lw, lo) - hi) - 1.0)
    v = 1.0 + u
    safe = tl.where(v == 0, 1.0, v)
    lp1 = tl.where(v == 0, -float("inf"), tl.log(safe) + (u - (v - 1.0)) / safe)
    return tl.maximum(hi + lp1, tl.maximum(lw + log_bw, lo + log_bo))


@triton.jit
@no_type_check  # a Triton kernel
def _mix_kernel(
    w_ptr, stride_w, o_ptr, stride_o, rows_ptr, r_ptr, r_scalar, mw_ptr, lw_ptr, mo_ptr, lo_ptr, q_ptr, p_ptr,
    n_cols, cap, two_over_cap, bw, bo, log_bw, log_bo,
    HAS_ROWS: tl.constexpr, PER_ROW: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row, r = _row_and_r(rows_ptr, r_ptr, r_scalar, HAS_ROWS, PER_ROW)
    mw, lsw = tl.load(mw_ptr + row), tl.load(lw_ptr + row)
    mo, lso = tl.load(mo_ptr + row), tl.load(lo_ptr + row)
    q = 0.0
    p = 0.0
    for start in tl.range(0, n_cols, BLOCK, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        lw, _ = _log_probs(w_ptr + row * stride_w, cols, inside, mw, lsw, r, cap, two_over_cap, HAS_CAP)
        lo, _ = _log_probs(o_ptr + row * stride_o, cols, inside, mo, lso, r, cap, two_over_cap, HAS_CAP)
        lm = _log_mixture(lw, lo, bw, bo, log_bw, log_bo)
        q += tl.sum(tl.exp(lw) * (lw - lm), 0)
        p += tl.sum(tl.exp(lo) * (lo - lm), 0)
    tl.store(q_ptr + row, q)
    tl.store(p_ptr + row, p)


@triton.jit
@no_type_check  # a Triton kernel
def _grad_kernel(
    w_ptr, stride_w, o_ptr, stride_o, gw_ptr, stride_gw, go_ptr, stride_go, rows_ptr, r_ptr, r_scalar,
    mw_ptr, lw_ptr, mo_ptr, lo_ptr, kw_ptr, ko_ptr, cw_ptr, co_ptr, n_cols, cap, two_over_cap,
    bw, bo, log_bw, log_bo,
    HAS_ROWS: tl.constexpr, PER_ROW: tl.constexpr, HAS_CAP: tl.constexpr, JSD: tl.constexpr,
    WANT_W: tl.constexpr, WANT_O: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr,
):
    row, r = _row_and_r(rows_ptr, r_ptr, r_scalar, HAS_ROWS, PER_ROW)
    mw, lsw = tl.load(mw_ptr + row), tl.load(lw_ptr + row)
    mo, lso = tl.load(mo_ptr + row), tl.load(lo_ptr + row)
    kw, ko = tl.load(kw_ptr + row), tl.load(ko_ptr + row)
    cw, co = tl.load(cw_ptr + row), tl.load(co_ptr + row)
    for start in tl.range(0, n_cols, BLOCK, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        lw, slope_w = _log_probs(w_ptr + row * stride_w, cols, inside, mw, lsw, r, cap, two_over_cap, HAS_CAP)
        lo, slope_o = _log_probs(o_ptr + row * stride_o, cols, inside, mo, lso, r, cap, two_over_cap, HAS_CAP)
        w = tl.exp(lw)
        o = tl.exp(lo)
        if JSD:
            lm = _log_mixture(lw, lo, bw, bo, log_bw, log_bo)
            gw = cw * (w * (lw - lm - kw))
            go = co * (o * (lo - lm - ko))
        else:
            gw = cw * tl.where(w > 0, w * (lw - lo - kw), 0.0)
            go = co * (o - w)
        if WANT_W:
            tl.store(gw_ptr + row * stride_gw + cols, (gw * slope_w).to(gw_ptr.dtype.element_ty), mask=inside)
        if WANT_O:
            tl.store(go_ptr + row * stride_go + cols, (go * slope_o).to(go_ptr.dtype.element_ty), mask=inside)


def _contiguous(*xs: Tensor | None) -> None:
    for x in xs:
        assert x is None or x.stride(-1) == 1 or x.shape[1] <= 1, "the kernels read and write contiguous columns"


def _mixture(weights: Weights | None) -> tuple[float, float, float, float]:
    """The mixture's weights and logs as the kernels take them (float32 numbers: the
    weights rounded as ``backends.divergence.mixture`` rounds them)."""
    if weights is None:
        return 0.0, 0.0, 0.0, 0.0
    return tuple(float(torch.tensor(v, dtype=torch.float32)) for v in weights)  # type: ignore[return-value]


def stats(xw: Tensor, xo: Tensor, softmax: Softmax, out: PairStats, rows: Tensor | None) -> bool:
    """Each side's ``(m, S)`` and (``out.cross``) ``C`` of the ``rows`` (None: all) of ``xw``,
    ``xo`` ``[T, V]`` into ``out``'s float32 ``[T]`` fields, one program a row; True."""
    _contiguous(xw, xo)
    n = xw.shape[0] if rows is None else rows.numel()
    if n == 0:
        return True
    r_t, r_s, per_row, c, two = _softmax_args("pair.stats", n, softmax.tau, softmax.cap, xw)
    fields = [f.contiguous() for f in (out.wmax, out.wsum, out.omax, out.osum)]
    cross = None if out.cross is None else out.cross.contiguous()
    _stats_kernel[(n,)](
        xw, xw.stride(0), xo, xo.stride(0), fields[0] if rows is None else rows, r_t, r_s, *fields,
        fields[0] if cross is None else cross, xw.shape[1], c, two,
        HAS_ROWS=rows is not None, PER_ROW=per_row, HAS_CAP=softmax.cap is not None, CROSS=cross is not None,
        **_config(PAIR_BLOCK, PAIR_WARPS, PAIR_STAGES),
    )
    for field, dense in zip(out, (*fields, cross)):
        if field is not None and dense is not None and dense is not field:
            field.copy_(dense)
    return True


def mix(
    xw: Tensor, xo: Tensor, softmax: Softmax, both: Sides, weights: Weights, out: Mix, rows: Tensor | None
) -> bool:
    """``"jsd"``'s ``Q`` and ``P`` of the ``rows`` into ``out`` (float32 ``[T]``); True."""
    _contiguous(xw, xo)
    n = xw.shape[0] if rows is None else rows.numel()
    if n == 0:
        return True
    r_t, r_s, per_row, c, two = _softmax_args("pair.mix", n, softmax.tau, softmax.cap, xw)
    q, p = out.wsum.contiguous(), out.osum.contiguous()
    _mix_kernel[(n,)](
        xw, xw.stride(0), xo, xo.stride(0), q if rows is None else rows, r_t, r_s,
        *(f.contiguous() for f in both), q, p, xw.shape[1], c, two, *_mixture(weights),
        HAS_ROWS=rows is not None, PER_ROW=per_row, HAS_CAP=softmax.cap is not None,
        **_config(PAIR_BLOCK, PAIR_WARPS, PAIR_STAGES),
    )
    for field, dense in zip(out, (q, p)):
        if dense is not field:
            field.copy_(dense)
    return True


def grad(
    xw: Tensor, xo: Tensor, softmax: Softmax, terms: PairGrad, out_w: Tensor | None, out_o: Tensor | None,
    rows: Tensor | None,
) -> bool:
    """Each wanted side's gradient of the ``rows`` into ``out_w`` / ``out_o`` (``[T, V]``,
    contiguous columns, their dtypes; the other rows left as they are); True."""
    _contiguous(xw, xo, out_w, out_o)
    n = xw.shape[0] if rows is None else rows.numel()
    if n == 0 or xw.shape[1] == 0:
        return True
    r_t, r_s, per_row, c, two = _softmax_args("pair.grad", n, softmax.tau, softmax.cap, xw)
    row_terms = [f.contiguous() for f in (*terms.sides, terms.kw, terms.ko, terms.cw, terms.co)]
    gw = xw if out_w is None else out_w
    go = xw if out_o is None else out_o
    _grad_kernel[(n,)](
        xw, xw.stride(0), xo, xo.stride(0), gw, gw.stride(0), go, go.stride(0),
        row_terms[0] if rows is None else rows, r_t, r_s, *row_terms, xw.shape[1], c, two,
        *_mixture(terms.weights),
        HAS_ROWS=rows is not None, PER_ROW=per_row, HAS_CAP=softmax.cap is not None, JSD=terms.kind == "jsd",
        WANT_W=out_w is not None, WANT_O=out_o is not None, **_config(PAIR_BLOCK, PAIR_WARPS, PAIR_STAGES),
    )
    return True

