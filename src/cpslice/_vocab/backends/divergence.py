"""The divergence's kernels (``vocab_divergence``, ``pairs``) on any torch device: one body
per pass, built from named steps, that the eager backend runs as it is and the compiled
backend compiles into one fused loop per chunk (``backends.compiled``), and the loops over
chunks of rows both run (``stats``, ``mix``, ``grad``, given a ``Runner``).

The steps, on a chunk of both sides' logits (``xw`` the weight side, ``xo`` the other;
``r = 1 / tau`` ``[c, 1]`` or 0-d; per-row terms ``[c]``), each written once:

- ``side``: the logits as the softmax reads them, widened to the compute dtype and capped;
- ``exps``: a side's exponentials ``exp((y - m') r)`` relative to its max (``S`` their sum);
- ``cross``: ``C = sum e_w (y_w - y_o) r``, 0 where ``e_w`` is;
- ``log_probs``: ``log p = (y - M') r - log S`` clamped at ``FLOOR`` (a 0 probability, a
  -inf logit, is ``exp(FLOOR) = 0`` with a finite log);
- ``log_mixture``: ``log m``, ``m = bw w + bo o``, pivoted on the larger side
  (``hi + log1p(b expm1(lo - hi))``: exactly ``log w`` where ``w == o``, so identical
  sides give exactly 0), bounded below by each side's own share (invariant mode's, the
  Triton kernels'); ``direct_mixture``, the default bodies': ``log(bw w + bo o)`` of the
  probabilities the step has already computed (one ``log`` where the pivot takes an
  ``expm1`` and a ``log1p``), ``log w`` itself where ``w == o``;
- ``kl_grads``, ``jsd_grads``: each side's gradient from the normalized sides.

``Ops`` says which ``exp``, ``expm1``, ``log1p``, cap and mixture the steps use: torch's
(the default reduction, ``DEFAULT``; the cap by one ``exp``, as the compiled log-prob
kernels), the same with the spec's ``exp`` of ``d <= 0`` (``COMPILED``: the compiled
bodies', whose polynomial inductor vectorizes into a quarter fewer cycles than its call of
the vector library's ``exp``, within 2 ulp), or the spec's (invariant mode,
``INVARIANT``: docs/invariance.md, every IEEE device the same bits). The default bodies
(``default_*``) are the ones the compiled backend compiles, each given its ``Ops`` by the
``Runner``; invariant mode's loops (``invariant_*``) run eagerly, per 128-column tile
(``spec.TILE``) for the statistics, the tiles merged in global order.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, no_type_check, runtime_checkable

import torch
from torch import Tensor

from ... import _probe
from .. import softmax as cap_forms
from .. import spec
from ..pairs import Mix, PairGrad, PairOut, PairStats, PairTiles, Sides, Weights, merge_tiles
from ..rows import At, gather, pieces, size
from ..softmax import Softmax, reciprocal, reciprocals, taus
from ..spec import FLOOR, LOG2E, TILE, tile_max, tiles, tree


@no_type_check
def _exp_sloped(y, cap):
    s = cap_forms.exp_complement(y, cap[1])
    return cap_forms.from_complement(s, cap[0]), cap_forms.complement_slope(s)


@no_type_check
def _spec_capped(y, cap):
    return spec.softcap(y, cap)[0]


@no_type_check
def _spec_sloped(y, cap):
    y, t = spec.softcap(y, cap)
    return y, spec.softcap_slope(t)


class Ops(NamedTuple):
    """The functions the steps call: ``exp`` (of log-probs and shifted logits: ``<= 0`` up
    to rounding), ``expm1``, ``log1p``, the cap (``capped(y, cap)``), the cap with its
    derivative (``sloped(y, cap) -> (y, dy/dx)``) and the mixture's log (``mixture(lw, lo,
    w, o, mix)``, from both sides' log-probs and probabilities)."""

    exp: Callable[..., Any]
    expm1: Callable[..., Any]
    log1p: Callable[..., Any]
    capped: Callable[..., Any]
    sloped: Callable[..., Any]
    mixture: Callable[..., Any]


@no_type_check
def _mixture(lw, lo, w, o, mix, log):
    tiny = torch.finfo(w.dtype).tiny
    return torch.where(lw == lo, lw, log((mix[0] * w + mix[1] * o).clamp(min=tiny)))


@no_type_check
def direct_mixture(lw, lo, w, o, mix):
    """``log(bw w + bo o)`` of both sides' probabilities, ``mix`` the weights ``(bw, bo, log
    bw, log bo)``: ``lw`` where ``lw == lo`` (the mixture of equal sides is exactly either);
    the sum floored at the smallest normal number, where both sides underflow (their terms
    are then 0 to the dtype's resolution, and no log is -inf). torch's ``log``."""
    return _mixture(lw, lo, w, o, mix, torch.log)


@no_type_check
def spec_mixture(lw, lo, w, o, mix):
    """``direct_mixture`` with the spec's ``log`` (a polynomial of the mantissa: in inductor's
    C++ two thirds of the vector library's ``log``, within a few ulp)."""
    return _mixture(lw, lo, w, o, mix, spec.log)


@no_type_check
def _pivot_mixture(lw, lo, w, o, mix):
    return log_mixture(lw, lo, mix, INVARIANT)


DEFAULT = Ops(torch.exp, torch.expm1, torch.log1p, lambda y, cap: cap_forms.exp_capped(y, *cap), _exp_sloped,
              direct_mixture)
"""The default reduction's, eagerly: torch's functions, the cap ``(cap, 2 / cap)`` by one
``exp``, the mixture's log direct."""
@no_type_check
def exp_by_exp2(d):
    """``e^d`` as ``2^(d log2 e)``: the vector library's ``exp2`` costs half its ``exp`` in
    inductor's C++ (measured on the CPU), within a few ulp of ``e^d`` (the argument's one
    rounding, times its size)."""
    return torch.exp2(d * LOG2E)


COMPILED = DEFAULT._replace(exp=exp_by_exp2, mixture=spec_mixture)
"""The default reduction's, compiled: the spec's ``exp`` (a polynomial and the exponent's
bits, within 2 ulp), faster than torch's there; the rest ``DEFAULT``'s."""
INVARIANT = Ops(spec.exp, spec.expm1, spec.log1p, _spec_capped, _spec_sloped, _pivot_mixture)
"""Invariant mode's: the spec's, the cap a number, the mixture pivoted."""


# --- the named steps


@no_type_check
def side(x, r, cap, ops):
    """A chunk's logits as the softmax reads them: the compute dtype (``r``'s), capped."""
    y = x.to(r.dtype)
    return y if cap is None else ops.capped(y, cap)


@no_type_check
def exps(y, m, r, ops):
    """A side's exponentials relative to its rows' max ``m`` (``m'``: 0 where ``m = -inf``)."""
    shift = torch.where(m == -math.inf, 0.0, m)
    return ops.exp(((y - shift[:, None]) * r).clamp(min=FLOOR))


@no_type_check
def cross(e, yw, yo, r):
    """``C = sum e_w (y_w - y_o) r``: 0 where ``e_w == 0`` (+inf where ``y_o = -inf`` under
    weight)."""
    return torch.where(e > 0, e * ((yw - yo) * r), 0.0).sum(1)


@no_type_check
def log_probs(y, m, log_s, r):
    """``log p = (y - M') r - log S`` clamped at ``FLOOR`` (``[c, w]``; the row terms ``[c]``)."""
    return ((y - m[:, None]) * r - log_s[:, None]).clamp(min=FLOOR)


@no_type_check
def log_mixture(lw, lo, mix, ops):
    """``log(bw w + bo o)`` of both sides' log-probs, ``mix`` the weights ``(bw, bo, log bw,
    log bo)``: ``hi + log1p(b expm1(lo - hi))``, ``hi`` the larger side and ``b`` the
    other's weight, so the mixture of equal sides is exactly either; at least each side's
    own share (``log bw + log w``, ``log bo + log o``), where the pivot's weight rounds to
    1 and ``log1p`` would meet -1."""
    first = lw >= lo
    hi = torch.maximum(lw, lo)
    low = torch.minimum(lw, lo)
    weight = torch.where(first, mix[1], mix[0])
    mixed = hi + ops.log1p(weight * ops.expm1(low - hi))
    return torch.maximum(mixed, torch.maximum(lw + mix[2], lo + mix[3]))


@no_type_check
def kl_grads(lw, lo, k, cw, co, want_w, want_o, ops):
    """``KL(w || o)``'s gradients: ``o``'s ``co (o - w)``, ``w``'s ``cw w (log w - log o - k)``
    (0 where ``w`` is); None where not wanted."""
    w, o = ops.exp(lw), ops.exp(lo)
    go = co[:, None] * (o - w) if want_o else None
    gw = cw[:, None] * torch.where(w > 0, w * (lw - lo - k[:, None]), 0.0) if want_w else None
    return gw, go


@no_type_check
def jsd_grads(lw, lo, kw, ko, cw, co, mix, want_w, want_o, ops):
    """The jsd's gradients: each side's ``c p (log p - log m - k)``."""
    w, o = ops.exp(lw), ops.exp(lo)
    lm = ops.mixture(lw, lo, w, o, mix)
    gw = cw[:, None] * (w * (lw - lm - kw[:, None])) if want_w else None
    go = co[:, None] * (o * (lo - lm - ko[:, None])) if want_o else None
    return gw, go


# --- the bodies: one chunk each, pure torch (the compiled backend compiles the default ones)


@no_type_check
def stats_body(xw, r, xo, cap, with_cross, ops):
    """``(m_w, S_w, m_o, S_o, C)`` ``[c]`` of a chunk (``C`` None without ``with_cross``)."""
    yw, yo = side(xw, r, cap, ops), side(xo, r, cap, ops)
    # both maxima first, then every sum over the exponentials (one fused loop compiled)
    mw, mo = yw.amax(1), yo.amax(1)
    ew, eo = exps(yw, mw, r, ops), exps(yo, mo, r, ops)
    return mw, ew.sum(1), mo, eo.sum(1), cross(ew, yw, yo, r) if with_cross else None


@no_type_check
def mix_body(xw, r, xo, mw, lw_s, mo, lo_s, mix, cap, ops):
    """``(Q, P)`` ``[c]``: ``sum w (log w - log m)`` and ``sum o (log o - log m)``."""
    lw = log_probs(side(xw, r, cap, ops), mw, lw_s, r)
    lo = log_probs(side(xo, r, cap, ops), mo, lo_s, r)
    w, o = ops.exp(lw), ops.exp(lo)
    lm = ops.mixture(lw, lo, w, o, mix)
    return (w * (lw - lm)).sum(1), (o * (lo - lm)).sum(1)


@no_type_check
def grad_body(xw, r, xo, terms, out_w, out_o, mix, cap, kind, ops):
    """Each wanted side's gradient of a chunk into ``out_w`` / ``out_o`` (None: not wanted),
    through the cap's derivative, rounded once to the out's dtype. ``terms``: the row
    terms ``(M'_w, log S_w, M'_o, log S_o, k_w, k_o, c_w, c_o)`` ``[c]``."""
    mw, lsw, mo, lso, kw, ko, cw, co = terms
    yw, sw = side(xw, r, None, ops), None
    yo, so = side(xo, r, None, ops), None
    if cap is not None:
        yw, sw = ops.sloped(yw, cap)
        yo, so = ops.sloped(yo, cap)
    lw, lo = log_probs(yw, mw, lsw, r), log_probs(yo, mo, lso, r)
    want_w, want_o = out_w is not None, out_o is not None
    if kind == "kl":
        gw, go = kl_grads(lw, lo, kw, cw, co, want_w, want_o, ops)
    else:
        gw, go = jsd_grads(lw, lo, kw, ko, cw, co, mix, want_w, want_o, ops)
    if want_w:
        out_w.copy_((gw if sw is None else gw * sw).to(out_w.dtype))
    if want_o:
        out_o.copy_((go if so is None else go * so).to(out_o.dtype))


# the default reduction's bodies, as the compiled backend compiles them (one per pass),
# ``ops`` the runner's (``DEFAULT`` eagerly, ``COMPILED`` compiled: a constant of the graph)
@no_type_check
def default_stats(xw, r, xo, cap, with_cross, ops):
    return stats_body(xw, r, xo, cap, with_cross, ops)


@no_type_check
def default_mix(xw, r, xo, mw, lw_s, mo, lo_s, mix, cap, ops):
    return mix_body(xw, r, xo, mw, lw_s, mo, lo_s, mix, cap, ops)


@no_type_check
def default_grad(xw, r, xo, terms, out_w, out_o, mix, cap, kind, ops):
    grad_body(xw, r, xo, terms, out_w, out_o, mix, cap, kind, ops)


# --- the loops over chunks of rows, default reduction


@runtime_checkable
class Runner(Protocol):
    """How a backend runs a default body on chunks of rows: which chunks (``pieces``), how a
    body is called (``call``: ``(done, result)``; not done: it declined, e.g. a compile
    failure in ``auto``) and the ``Ops`` its bodies take (``ops``)."""

    @property
    def ops(self) -> Ops: ...

    def pieces(self, rows: Tensor | None, total: int, width: int) -> Sequence[At]: ...

    def call(self, fn: Callable[..., Any], xw: Tensor, r: Tensor, xo: Tensor, *args: object) -> tuple[bool, Any]: ...


def inv_tau(softmax: Softmax, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``1 / tau`` as a body's input: 0-d, or ``[T, 1]`` for one per row."""
    r = reciprocal(softmax.tau, dtype)
    return torch.full((), r, dtype=dtype, device=device) if isinstance(r, float) else r[:, None]


def cap_of(softmax: Softmax, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """The default bodies' cap: ``(cap, 2 / cap)`` as 0-d tensors (no value compiles anew)."""
    if softmax.cap is None:
        return None
    c, two = cap_forms.exp_constants(softmax.cap)
    return torch.full((), c, dtype=dtype, device=device), torch.full((), two, dtype=dtype, device=device)


def mixture(weights: Weights | None, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """The mixture's ``(bw, bo, log bw, log bo)`` as a ``[4]`` tensor of ``dtype``."""
    return None if weights is None else torch.tensor(list(weights), dtype=dtype, device=device)


def _rows_of(r: Tensor, at: At) -> Tensor:
    return r if r.dim() == 0 else r[at]


def stats(
    run: Runner, xw: Tensor, xo: Tensor, softmax: Softmax, out: PairStats, rows: Tensor | None
) -> bool:
    """The default statistics of the ``rows`` of a block of both sides into ``out``'s
    ``[T]`` fields (``C`` where ``out.cross`` is not None), chunk by chunk."""
    cdt, device = out.wmax.dtype, xw.device
    r, cap = inv_tau(softmax, cdt, device), cap_of(softmax, cdt, device)
    for at in run.pieces(rows, xw.shape[0], xw.shape[1]):
        done, got = run.call(default_stats, gather(xw, at, None), _rows_of(r, at), gather(xo, at, None), cap,
                             out.cross is not None, run.ops)
        if not done:
            return False
        for field, value in zip(out, got):
            if field is not None:
                field[at] = value
    return True


def mix(
    run: Runner, xw: Tensor, xo: Tensor, softmax: Softmax, both: Sides, weights: Weights, out: Mix,
    rows: Tensor | None,
) -> bool:
    """The default second pass of ``"jsd"``: ``Q`` and ``P`` of the ``rows`` into ``out``."""
    cdt, device = out.wsum.dtype, xw.device
    r, cap, w = inv_tau(softmax, cdt, device), cap_of(softmax, cdt, device), mixture(weights, cdt, device)
    for at in run.pieces(rows, xw.shape[0], xw.shape[1]):
        terms = [f[at] for f in both]
        done, got = run.call(default_mix, gather(xw, at, None), _rows_of(r, at), gather(xo, at, None), *terms, w,
                             cap, run.ops)
        if not done:
            return False
        out.wsum[at], out.osum[at] = got
    return True


def grad(
    run: Runner, xw: Tensor, xo: Tensor, softmax: Softmax, terms: PairGrad, out_w: Tensor | None,
    out_o: Tensor | None, rows: Tensor | None,
) -> bool:
    """The default gradient of the ``rows`` into ``out_w`` / ``out_o`` (None: not wanted;
    ``[n, V]``, contiguous columns), a chunk whose rows are an index written back there."""
    cdt, device = terms.cw.dtype, xw.device
    r, cap, w = inv_tau(softmax, cdt, device), cap_of(softmax, cdt, device), mixture(terms.weights, cdt, device)
    for at in run.pieces(rows, xw.shape[0], xw.shape[1]):
        row = terms.rows(at)
        dst = [None if o is None else (o[at] if isinstance(at, slice) else o.new_empty((size(at), o.shape[1])))
               for o in (out_w, out_o)]
        done, _ = run.call(default_grad, gather(xw, at, None), _rows_of(r, at), gather(xo, at, None),
                           (*row.sides, row.kw, row.ko, row.cw, row.co), *dst, w, cap, terms.kind, run.ops)
        if not done:
            return False
        for o, d in zip((out_w, out_o), dst):
            if o is not None and d is not None and not isinstance(at, slice):
                o.index_copy_(0, at, d)
    return True


class Eager:
    """The eager backend's ``Runner``: ``chunk`` rows a piece (``rows.pieces``), each body
    called as it is (a ``launch`` event of ``_probe`` each)."""

    ops = DEFAULT

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def pieces(self, rows: Tensor | None, total: int, width: int) -> Sequence[At]:
        return pieces(rows, total, self.chunk)

    def call(self, fn: Callable[..., Any], xw: Tensor, r: Tensor, xo: Tensor, *args: object) -> tuple[bool, Any]:
        if _probe.active is not None:
            _probe.active.launch("eager", fn.__name__, xw.shape[0])
        return True, fn(xw, r, xo, *args)


# --- invariant mode: the spec's steps per tile, eagerly


def _padded(x: Tensor, cap: float | None, n: int, dtype: torch.dtype) -> Tensor:
    """``[c, n, TILE]``: the rows of ``x`` ``[c, w]`` in ``dtype``, capped (the spec's cap),
    -inf past ``w`` to whole tiles."""
    y = torch.full((x.shape[0], n * TILE), -math.inf, dtype=dtype, device=x.device)
    y[:, : x.shape[1]] = x if cap is None else spec.softcap(x.to(dtype), cap)[0]
    return y.view(x.shape[0], n, TILE)


def tile_sums(y: Tensor, r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(m_j, d_j-shifted exp e, shift)`` of ``y`` ``[c, n, TILE]``: the spec's step 3 per
    tile (a zero max is +0), before the sums."""
    m = tile_max(y)
    shift = torch.where(m == -math.inf, 0.0, m)
    e = spec.exp(((y - shift[..., None]) * r[:, None, None]).clamp(min=FLOOR))
    return m, e, shift


def tile_stats(yw: Tensor, yo: Tensor, r: Tensor, with_cross: bool) -> PairTiles:
    """Per tile ``[c, n]``: both sides' ``m_j``, ``s_j = tree(e)`` and (``with_cross``) ``c_j =
    tree(e_w (y_w - y_o) r)``, 0 where ``e_w`` is."""
    mw, ew, _ = tile_sums(yw, r)
    mo, eo, _ = tile_sums(yo, r)
    c = tree(torch.where(ew > 0, ew * ((yw - yo) * r[:, None, None]), 0.0)) if with_cross else None
    return PairTiles(mw, tree(ew), mo, tree(eo), c)


def _launch(name: str, rows: int) -> None:
    if _probe.active is not None:
        _probe.active.launch("eager", name, rows, invariant=True)


def invariant_stats(
    xw: Tensor, xo: Tensor, softmax: Softmax, out: PairOut, rows: Tensor | None, chunk: int, first: int
) -> bool:
    """Invariant mode's statistics of the ``rows`` of a block (its columns the
    distribution's, starting local tile ``first``) into ``out``: per tile (``PairTiles``,
    tiles ``first`` on), or each row's tiles merged in global order (``PairStats``),
    ``chunk`` rows at a time."""
    cdt = out.wmax.dtype
    tau = taus(softmax.tau, xw.shape[0], cdt, xw.device)
    r = reciprocals(tau, xw.shape[0], cdt, xw.device)
    n = tiles(xw.shape[1])
    for at in pieces(rows, xw.shape[0], chunk):
        _launch("pair_stats", size(at))
        yw, yo = (_padded(gather(x, at, None), softmax.cap, n, cdt) for x in (xw, xo))
        got = tile_stats(yw, yo, r[at], out.cross is not None)
        if isinstance(out, PairTiles):
            for field, value in zip(out, got):
                if field is not None and value is not None:
                    field[at, first : first + n] = value
        else:
            merged = merge_tiles(got.map(lambda f: f.t()), tau[at])
            for field, value in zip(out, merged):
                if field is not None and value is not None:
                    field[at] = value
    return True


def _mix_tiles(yw: Tensor, yo: Tensor, r: Tensor, both: Sides, mix: Tensor) -> tuple[Tensor, Tensor]:
    """Per tile ``[c, n]``: ``Q_j = tree(w (log w - log m))`` and ``P_j``, the spec's ops."""
    c, n = yw.shape[0], yw.shape[1]
    lw = log_probs(yw.view(c, -1), both.wmax, both.wlog, r[:, None])
    lo = log_probs(yo.view(c, -1), both.omax, both.olog, r[:, None])
    lm = log_mixture(lw, lo, mix, INVARIANT)
    q = (spec.exp(lw) * (lw - lm)).view(c, n, TILE)
    p = (spec.exp(lo) * (lo - lm)).view(c, n, TILE)
    return tree(q), tree(p)


def invariant_mix(
    xw: Tensor, xo: Tensor, softmax: Softmax, both: Sides, weights: Weights, out: Mix, rows: Tensor | None,
    chunk: int, first: int,
) -> bool:
    """Invariant mode's second pass: per tile (``[T, n]`` fields, tiles ``first`` on) or each
    row's tiles summed by ``tree`` in global order (``[T]``), ``chunk`` rows at a time."""
    cdt = out.wsum.dtype
    r = reciprocals(softmax.tau, xw.shape[0], cdt, xw.device)
    w = torch.tensor(list(weights), dtype=cdt, device=xw.device)
    n = tiles(xw.shape[1])
    for at in pieces(rows, xw.shape[0], chunk):
        _launch("pair_mix", size(at))
        yw, yo = (_padded(gather(x, at, None), softmax.cap, n, cdt) for x in (xw, xo))
        q, p = _mix_tiles(yw, yo, r[at], Sides(*(f[at] for f in both)), w)
        if out.wsum.dim() == 2:
            out.wsum[at, first : first + n], out.osum[at, first : first + n] = q, p
        else:
            out.wsum[at], out.osum[at] = tree(q.contiguous()), tree(p.contiguous())
    return True


def invariant_grad(
    xw: Tensor, xo: Tensor, softmax: Softmax, terms: PairGrad, out_w: Tensor | None, out_o: Tensor | None,
    rows: Tensor | None, chunk: int,
) -> bool:
    """Invariant mode's gradient: ``grad_body`` with the spec's ops, ``chunk`` rows at a time
    (every element alone: no sum, as invariant as its row terms)."""
    cdt = terms.cw.dtype
    r = reciprocals(softmax.tau, xw.shape[0], cdt, xw.device)[:, None]
    w = mixture(terms.weights, cdt, xw.device)
    for at in pieces(rows, xw.shape[0], chunk):
        _launch("pair_grad", size(at))
        row = terms.rows(at)
        dst = [None if o is None else (o[at] if isinstance(at, slice) else o.new_empty((size(at), o.shape[1])))
               for o in (out_w, out_o)]
        grad_body(gather(xw, at, None), r[at], gather(xo, at, None), (*row.sides, row.kw, row.ko, row.cw, row.co),
                  *dst, w, softmax.cap, terms.kind, INVARIANT)
        for o, d in zip((out_w, out_o), dst):
            if o is not None and d is not None and not isinstance(at, slice):
                o.index_copy_(0, at, d)
    return True

