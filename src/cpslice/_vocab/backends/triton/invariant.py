"""Invariant mode (docs/invariance.md) in hand-written Triton: the spec's bits, the eager
kernels' (``invariant``; ``spec.exp``, ``spec.tree``, ``spec.merge_tiles``,
``spec.softcap``) on every device.

What makes a Triton kernel give the spec's bits:

- no contraction: every launch passes ``enable_fp_fusion=False``, so ``a * b + c`` is a
  multiplication and an addition, each rounded, as ATen computes them (the PTX for
  sm_90: ``mul.rn.f32``, ``add.rn.f32``, ``div.rn.f32``, no ``fma``; the floor is
  ``cvt.rmi.ftz``, whose argument ``d * log2(e) + 1/2`` is never subnormal);
- the spec's ``exp`` (``_exp``): additions, multiplications, a floor and the float's bits,
  IEEE on every device, never ``tl.exp`` (an approximation of the device's own);
- every sum a ``tree`` of pairwise halvings (``_tree``: ``x[:, :w/2] + x[:, w/2:]`` by a
  reshape to ``[rows, 2, w/2]``, a permute and a split), never ``tl.sum``, whose order
  is the compiler's;
- every division correctly rounded (``tl.math.div_rn``: ``/`` is an approximate
  division on the GPU); a max propagates NaN (``tl.maximum`` ignores one by default);
- bfloat16 logits widened exactly on load, by their bits (read as int16, shifted into
  the high half of a float32: the interpreter's own conversion gets subnormals wrong),
  and a bfloat16 gradient rounded once from float32 by the float's bits (to nearest,
  ties to even, a NaN the quiet NaN), as ``.to(torch.bfloat16)`` rounds;
- a tile's zero max is +0 (``spec.tile_max``), whatever order the max took;
- what stays in torch: ``r = 1 / tau`` (one division per row, ``softmax.reciprocals``),
  the per-row ``log S`` and the picked ids' one-hot entries (``invariant.picks``).

The kernels take their helpers as ``constexpr`` arguments (``EXP``, ``TREE``, ``PAD``:
``_exp``, ``_tree``, ``_pad``, compiled into each kernel as if called by name: a kernel
specialization per helper), so that ``_probe``'s steps ``triton_exp``, ``triton_tree``
and ``triton_pad`` can plant a wrong one for a test to catch; ``triton_scratch_rows`` sizes ``merged_stats``' chunks.

Through Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported:
numpy, IEEE float32) the kernels give the eager bits on the CPU, which the tests check
with ``torch.equal``. Every function takes ``rows``, an int64 index of the rows to compute
(None: all), so the work is the rows asked; every launch is recorded (``_probe``). Only
float32 and bfloat16 logits (the float32 compute dtype).
"""

from typing import no_type_check

import torch
import triton
import triton.language as tl
from torch import Tensor

from .... import _probe
from ...spec import EXP, FLOOR, LOG2E, TILE

_F32 = EXP[torch.float32]
assert _F32.degree == 7 and TILE == 128, "the kernels spell out the float32 spec"
_LOG2E = tl.constexpr(LOG2E)
_LN2_HI = tl.constexpr(_F32.ln2_hi)
_LN2_LO = tl.constexpr(_F32.ln2_lo)
_CUT = tl.constexpr(_F32.cut)
_LOW = tl.constexpr(1 - _F32.bias)
_BIAS = tl.constexpr(_F32.bias)
_MANTISSA = tl.constexpr(_F32.mantissa)
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7 = (tl.constexpr(1.0 / f) for f in (1, 1, 2, 6, 24, 120, 720, 5040))
_FLOOR = tl.constexpr(FLOOR)
_NEG_INF = tl.constexpr(float("-inf"))
_TILE = tl.constexpr(TILE)
_LOG_TILE = tl.constexpr(TILE.bit_length() - 1)
_NAN_BITS = tl.constexpr(0x7FC00000)  # bits.NAN_BITS: its bfloat16 rounding is bfloat16's NaN
SCRATCH_BYTES = 16 * 2**20
"""``merged_stats``' per-tile scratch (``m``, ``s``, ``a`` of a chunk of rows) within these
bytes."""
TILES_PER_PROGRAM = 8
"""Tiles a ``tile_stats`` program computes (a ``[8, 128]`` block)."""
GRAD_BLOCK = 1024
"""Columns a ``grad`` program computes."""
MERGE_BLOCK = 2048
"""Elements of a ``merge`` program's ``[rows, tiles]`` block (at least one row)."""


@triton.jit
@no_type_check
def _exp(d):
    """``spec.exp`` of float32 ``d <= 0``, operation for operation."""
    n = tl.floor(d * _LOG2E + 0.5)
    r = (d - n * _LN2_HI) - n * _LN2_LO
    p = r * _C7 + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + _C1
    p = p * r + _C0
    scale = ((tl.maximum(n, _LOW).to(tl.int32) + _BIAS) << _MANTISSA).to(tl.float32, bitcast=True)
    return tl.where(d < _CUT, 0.0, p * scale)


@triton.jit
@no_type_check
def _tree(x, ROWS: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """``spec.tree`` of each row of ``x`` ``[ROWS, W]`` (``W = 2^LOG_W``): ``x[:, :h] +
    x[:, h:]`` for ``h = W / 2``, ..., 1; ``[ROWS]``."""
    for k in tl.static_range(LOG_W):
        lo, hi = tl.split(tl.permute(tl.reshape(x, [ROWS, 2, W >> (k + 1)]), [0, 2, 1]))
        x = lo + hi
    return tl.reshape(x, [ROWS])


@triton.jit
@no_type_check
def _max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
@no_type_check
def _load(ptr, mask, X_BF16: tl.constexpr):
    """Float32 logits at ``ptr`` (0 where not ``mask``): bfloat16 ones (``ptr`` an int16
    view) widened exactly by their bits."""
    v = tl.load(ptr, mask=mask, other=0)
    if X_BF16:
        v = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v


@triton.jit
@no_type_check
def _pad(y, inside):
    """``y`` where ``inside``, -inf elsewhere (after the cap: the cap of -inf is ``-cap``)."""
    return tl.where(inside, y, _NEG_INF)


@triton.jit
@no_type_check
def _softcap(x, c, EXP: tl.constexpr):
    """``spec.softcap``: ``(t * c, t)``, ``t = copysign((1 - e) / (1 + e), z)``, ``e =
    exp(-2 |z|)``, ``z = x / c``, the divisions correctly rounded."""
    z = tl.math.div_rn(x, c)
    e = EXP(tl.abs(z) * -2.0)
    t = tl.math.div_rn(1.0 - e, e + 1.0)
    sign = (z.to(tl.int32, bitcast=True) >> 31) << 31
    t = (t.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return t * c, t


@triton.jit
@no_type_check
def invariant_tiles(x_ptr, x_stride, rows_ptr, dest_ptr, r_ptr, m_ptr, m_s0, m_s1, s_ptr, s_s0, s_s1,
                    a_ptr, a_s0, a_s1, valid, n_tiles, first, cap,
                    X_BF16: tl.constexpr, HAS_CAP: tl.constexpr, HAS_A: tl.constexpr, BT: tl.constexpr,
                    EXP: tl.constexpr, TREE: tl.constexpr, PAD: tl.constexpr):
    """The spec's step 3 for ``BT`` tiles of one row: program ``(i, b)`` reads row
    ``rows[i]``'s tiles ``b * BT`` on (columns ``>= valid`` -inf after the cap) and writes
    ``(m, s, a)`` at row ``dest[i]``, tiles ``first + j`` of the fields."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    dest = tl.load(dest_ptr + i)
    j = tl.program_id(1) * BT + tl.arange(0, BT)
    cols = j[:, None] * _TILE + tl.arange(0, _TILE)[None, :]
    inside = cols < valid
    y = _load(x_ptr + row * x_stride + cols, inside, X_BF16)
    if HAS_CAP:
        y, _ = _softcap(y, cap, EXP)
    y = PAD(y, inside)
    m = tl.reduce(y, 1, _max)
    m = tl.where(m == 0, 0.0, m)
    shift = tl.where(m == _NEG_INF, 0.0, m)
    r = tl.load(r_ptr + row)
    d = tl.maximum((y - shift[:, None]) * r, _FLOOR, propagate_nan=tl.PropagateNan.ALL)
    e = EXP(d)
    keep = j < n_tiles
    tile = first + j
    tl.store(m_ptr + dest * m_s0 + tile * m_s1, m, mask=keep)
    tl.store(s_ptr + dest * s_s0 + tile * s_s1, TREE(e, BT, _TILE, _LOG_TILE), mask=keep)
    if HAS_A:
        tl.store(a_ptr + dest * a_s0 + tile * a_s1, TREE(d * e, BT, _TILE, _LOG_TILE), mask=keep)


@triton.jit
@no_type_check
def invariant_merge(m_ptr, m_s0, m_s1, s_ptr, s_s0, s_s1, a_ptr, a_s0, a_s1, tau_ptr, big_ptr, total_ptr,
                    ent_ptr, rows, n, HAS_A: tl.constexpr, BR: tl.constexpr, NP: tl.constexpr,
                    LOG_NP: tl.constexpr, EXP: tl.constexpr, TREE: tl.constexpr):
    """The spec's step 4 for ``BR`` rows: their ``n`` tiles (``-inf``, 0, 0 padded to ``NP =
    2^LOG_NP``) merged into ``M``, ``S``, ``A``."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.arange(0, NP)
    live = i < rows
    keep = live[:, None] & (j < n)[None, :]
    m = tl.load(m_ptr + i[:, None] * m_s0 + j[None, :] * m_s1, mask=keep, other=_NEG_INF)
    s = tl.load(s_ptr + i[:, None] * s_s0 + j[None, :] * s_s1, mask=keep, other=0.0)
    big = tl.reduce(m, 1, _max)
    shift = tl.where(big == _NEG_INF, 0.0, big)
    tau = tl.load(tau_ptr + i, mask=live, other=1.0)
    delta = tl.math.div_rn(m - shift[:, None], tau[:, None])
    scale = EXP(delta)
    tl.store(big_ptr + i, big, mask=live)
    tl.store(total_ptr + i, TREE(tl.where(keep, scale * s, 0.0), BR, NP, LOG_NP), mask=live)
    if HAS_A:
        a = tl.load(a_ptr + i[:, None] * a_s0 + j[None, :] * a_s1, mask=keep, other=0.0)
        terms = tl.where(keep & (s > 0), scale * (a + delta * s), 0.0)
        tl.store(ent_ptr + i, TREE(terms, BR, NP, LOG_NP), mask=live)


@triton.jit
@no_type_check
def invariant_grad(x_ptr, x_stride, rows_ptr, r_ptr, m_ptr, log_s_ptr, a_ptr, b_ptr, out_ptr, out_stride,
                   width, cap, X_BF16: tl.constexpr, HAS_CAP: tl.constexpr, OUT_BF16: tl.constexpr,
                   BLOCK: tl.constexpr, EXP: tl.constexpr):
    """``backends.eager.values`` of ``BLOCK`` columns of row ``rows[i]``, rounded once to the
    output's dtype (bfloat16: its bits, as ``bits.bfloat16_bits`` rounds)."""
    row = tl.load(rows_ptr + tl.program_id(0))
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    y = _load(x_ptr + row * x_stride + cols, inside, X_BF16)
    if HAS_CAP:
        y, t = _softcap(y, cap, EXP)
    d = (y - tl.load(m_ptr + row)) * tl.load(r_ptr + row) - tl.load(log_s_ptr + row)
    d = tl.maximum(d, _FLOOR, propagate_nan=tl.PropagateNan.ALL)
    value = EXP(d) * (tl.load(a_ptr + row) * d + tl.load(b_ptr + row))
    if HAS_CAP:
        value = value * (1.0 - t * t)
    at = out_ptr + row * out_stride + cols
    if OUT_BF16:
        bits = tl.where(value != value, _NAN_BITS, value.to(tl.int32, bitcast=True))
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        tl.store(at, bits.to(tl.int16), mask=inside)
    else:
        tl.store(at, value, mask=inside)


def scratch_rows(tiles: int) -> int:
    """Rows of ``merged_stats``' chunks: as many as keep the ``[rows, tiles]`` scratch of
    ``m``, ``s``, ``a`` within ``SCRATCH_BYTES`` (at least one)."""
    return max(1, SCRATCH_BYTES // (12 * max(tiles, 1)))


def _pow2(n: int) -> int:
    """The least power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def _rows(rows: Tensor | None, x: Tensor) -> Tensor:
    """The int64 index of the rows to compute (``rows``, or every row of ``x``), checked."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the Triton invariant kernels take float32 or bfloat16 logits, not x of {x.dtype}")
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise TypeError(f"x must be [T, w] with column stride 1, not shape {tuple(x.shape)} strides {x.stride()}")
    if rows is None:
        return torch.arange(x.shape[0], device=x.device)
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise TypeError(f"rows must be a [R] int64 index, not {rows.dtype} of shape {tuple(rows.shape)}")
    return rows.contiguous()


def _bits(x: Tensor) -> Tensor:
    """``x`` as the kernels read it: bfloat16 as its int16 bits (``_load`` widens them)."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _f32(name: str, t: Tensor) -> None:
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (the compute dtype), not {t.dtype}")


def tile_stats(x: Tensor, rows: Tensor | None, r: Tensor, cap: float | None, valid: int, m: Tensor, s: Tensor,
               a: Tensor | None, first: int = 0) -> None:
    """Per-tile ``(m_j, s_j, a_j)`` (the spec's steps 1 to 3) of the rows ``rows`` of ``x``
    (``[T, w]``, column stride 1, any row stride; float32 or bfloat16; its columns ``>=
    valid`` count as -inf, after the cap) with ``r = 1 / tau`` ``[T]`` float32 and the soft
    cap ``cap`` (None: none), written into the float32 fields ``m``, ``s``, ``a`` (``[T,
    n_local]``, any strides: ``invariant.tile_placeholders``' ``[n, T]`` storage seen
    transposed; ``a`` None: no entropy) at those rows, tiles ``first`` to ``first +
    ceil(w / TILE)``; every other entry left as it is. ``invariant.stats``' bits (under
    TP)."""
    index = _rows(rows, x)
    for name, t in (("r", r), ("m", m), ("s", s), ("a", a)):
        if t is not None:
            _f32(name, t)
    _tiles(x, index, index, r, cap, valid, -(-x.shape[1] // TILE), m, s, a, first)


def _tiles(x: Tensor, index: Tensor, dest: Tensor, r: Tensor, cap: float | None, valid: int, n: int, m: Tensor,
           s: Tensor, a: Tensor | None, first: int) -> None:
    """One ``invariant_tiles`` launch: rows ``index`` of ``x``'s ``n`` tiles into rows
    ``dest`` of the fields."""
    if index.numel() == 0 or n == 0:
        return
    bt = min(TILES_PER_PROGRAM, _pow2(n))
    ent = s if a is None else a  # not written without entropy
    if _probe.active is not None:
        _probe.active.launch("triton", "invariant_tiles", index.numel(), True)
    invariant_tiles[(index.numel(), -(-n // bt))](
        _bits(x), x.stride(0), index, dest, r, m, m.stride(0), m.stride(1), s, s.stride(0), s.stride(1),
        ent, ent.stride(0), ent.stride(1), valid, n, first, 1.0 if cap is None else float(cap),
        X_BF16=x.dtype == torch.bfloat16, HAS_CAP=cap is not None, HAS_A=a is not None, BT=bt,
        EXP=_probe.step("triton_exp", _exp), TREE=_probe.step("triton_tree", _tree),
        PAD=_probe.step("triton_pad", _pad), enable_fp_fusion=False,
    )


def merge(m: Tensor, s: Tensor, a: Tensor | None, tau: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """``spec.merge_tiles`` of ``R`` rows' tiles: ``m``, ``s``, ``a`` ``[R, n]`` float32 (any
    strides; tiles in global order; ``a`` None: no entropy), ``tau`` ``[R]`` float32;
    ``(M, S, A)`` ``[R]`` (``A`` None without ``a``). The tiles are padded to the next power
    of two (``-inf``, 0, 0), as ``spec.tree`` pads their terms with zeros."""
    for name, t in (("m", m), ("s", s), ("a", a), ("tau", tau)):
        if t is not None:
            _f32(name, t)
    rows, n = m.shape
    big, total = m.new_empty(rows), m.new_empty(rows)
    ent = None if a is None else m.new_empty(rows)
    if rows == 0:
        return big, total, ent
    np_ = _pow2(n)
    br = min(_pow2(rows), max(1, MERGE_BLOCK // np_))
    aa = s if a is None else a
    if _probe.active is not None:
        _probe.active.launch("triton", "invariant_merge", rows, True)
    invariant_merge[(-(-rows // br),)](
        m, m.stride(0), m.stride(1), s, s.stride(0), s.stride(1), aa, aa.stride(0), aa.stride(1),
        tau.contiguous(), big, total, total if ent is None else ent, rows, n,
        HAS_A=a is not None, BR=br, NP=np_, LOG_NP=np_.bit_length() - 1,
        EXP=_probe.step("triton_exp", _exp), TREE=_probe.step("triton_tree", _tree), enable_fp_fusion=False,
    )
    return big, total, ent


def merged_stats(x: Tensor, rows: Tensor | None, r: Tensor, tau: Tensor, cap: float | None, valid: int,
                 with_entropy: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(M, S, A)`` ``[R]`` of the rows ``rows`` of ``x`` (``R`` of them, in that order) over
    its first ``valid`` columns (the distribution: ``ceil(valid / TILE)`` tiles, the last
    -inf padded): ``tile_stats`` then ``merge``, in chunks of rows whose ``[rows, tiles]``
    scratch stays within ``SCRATCH_BYTES``; ``r`` and ``tau`` ``[T]`` float32.
    ``invariant.merged_stats``' bits (without TP)."""
    index = _rows(rows, x)
    _f32("r", r)
    _f32("tau", tau)
    n = -(-valid // TILE)
    count_rows = index.numel()
    big, total = r.new_empty(count_rows), r.new_empty(count_rows)
    ent = r.new_empty(count_rows) if with_entropy else None
    chunk = _probe.step("triton_scratch_rows", scratch_rows)(n)
    scratch = r.new_empty((3, min(chunk, count_rows), n))
    dest = torch.arange(scratch.shape[1], device=x.device)
    for lo in range(0, count_rows, chunk):
        hi = min(lo + chunk, count_rows)
        m, s, a = (f[: hi - lo] for f in scratch)
        _tiles(x, index[lo:hi], dest[: hi - lo], r, cap, valid, n, m, s, a if with_entropy else None, 0)
        got = merge(m, s, a if with_entropy else None, tau[index[lo:hi]])
        big[lo:hi], total[lo:hi] = got[0], got[1]
        if ent is not None and got[2] is not None:
            ent[lo:hi] = got[2]
    return big, total, ent


def grad(x: Tensor, rows: Tensor | None, r: Tensor, m: Tensor, log_s: Tensor, a: Tensor | None, b: Tensor,
         cap: float | None, out: Tensor) -> None:
    """The gradient w.r.t. the raw logits of the rows ``rows`` of ``x`` (``[T, w]``, column
    stride 1), every column: ``p * (a * log p + b)`` with ``log p = max((y - M) * r - log
    S, FLOOR)``, ``y`` the capped logits, times the cap's derivative ``1 - t * t``, rounded
    once into ``out`` (``[T, w]``, float32 or bfloat16, column stride 1) at those rows
    only. ``r``, ``m`` (``M``), ``log_s``, ``a`` (None: 0) and ``b`` are ``[T]`` float32.
    The picked ids' one-hot entries are ``invariant.picks``' (torch), afterwards.
    ``backends.eager.grad_kernel``'s bits."""
    index = _rows(rows, x)
    if out.dtype not in (torch.float32, torch.bfloat16) or out.shape != x.shape or (
            x.shape[1] > 1 and out.stride(1) != 1):
        raise TypeError(f"out must be float32 or bfloat16 of x's shape {tuple(x.shape)} with column stride 1, "
                        f"not {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    for name, t in (("r", r), ("m", m), ("log_s", log_s), ("a", a), ("b", b)):
        if t is not None:
            _f32(name, t)
    if index.numel() == 0 or x.shape[1] == 0:
        return
    bf16 = out.dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out
    if _probe.active is not None:
        _probe.active.launch("triton", "invariant_grad", index.numel(), True)
    invariant_grad[(index.numel(), -(-x.shape[1] // GRAD_BLOCK))](
        _bits(x), x.stride(0), index, r, m, log_s, torch.zeros_like(b) if a is None else a, b, dst, dst.stride(0),
        x.shape[1], 1.0 if cap is None else float(cap),
        X_BF16=x.dtype == torch.bfloat16, HAS_CAP=cap is not None, OUT_BF16=bf16, BLOCK=GRAD_BLOCK,
        EXP=_probe.step("triton_exp", _exp), enable_fp_fusion=False,
    )
