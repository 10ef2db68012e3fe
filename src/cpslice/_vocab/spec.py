"""The executable spec of docs/invariance.md: invariant mode's arithmetic, written once.

docs/invariance.md says in words (and a rollout engine's transcription) what this module
says in code; every kernel of invariant mode, eager (``backends.eager``), compiled
(``backends.compiled``) or Triton (``backends.triton.invariant``), computes these
operations in this order:

- ``TILE``: the columns of a tile, ``[j * TILE, (j + 1) * TILE)`` of global ids (step 1);
- ``tiles``: the tiles of a number of columns, the last one partial;
- ``FLOOR``: the clamp of ``d`` (step 3; the default mode clamps there too);
- ``exp``: the spec's ``exp`` of ``d <= 0``, from additions, multiplications, a floor and
  the float's exponent bits (every IEEE device gives the same bits);
- ``tanh`` and ``softcap``: the cap (step 2), ``y = t * c`` with ``t = tanh(x / c)``, the
  spec's ``tanh`` from its ``exp`` and correctly rounded divisions, and its derivative
  ``1 - t * t`` (``softcap_slope``);
- ``tile_max``: a tile's max, a zero max ``+0`` (step 3);
- ``tree`` (and ``halve``, the same over a list): sums by pairwise halving, an order no
  backend's reduction kernel decides;
- ``merge_tiles``: the tiles of a row, in global order, into its ``(M, S, A)`` (step 4);
- ``largest`` and ``best``: the top-k rule, ``k`` largest values with ties broken by the
  smaller id, a NaN counted as the largest.

Nothing here reads an option or a backend: the functions are the spec, and tests plant
another order here (``merge_tiles``) to see invariant mode's results change.
"""

import math
from collections.abc import Callable
from typing import NamedTuple, no_type_check

import torch
from torch import Tensor

TILE = 128
"""Columns per tile of invariant mode: megatron pads the LM head to a multiple of 128 per
TP rank (``make_vocab_size_divisible_by``), so every padded shard holds whole tiles."""


def tiles(columns: int) -> int:
    """Tiles of ``columns`` columns (the last one partial)."""
    return -(-columns // TILE)


FLOOR = -1.0e4
"""``exp`` of anything below this is exactly 0 in float32 and float64. Clamping ``d`` there
changes no ``p`` and no ``p * log p``, but turns the ``0 * (-inf)`` of a masked (-inf)
logit into ``0 * finite = 0`` in the entropy sums (both modes clamp there)."""


class ExpConstants(NamedTuple):
    """The constants of ``exp`` for one float dtype."""

    ln2_hi: float  # ln 2 to a few bits, so that n * ln2_hi is exact
    ln2_lo: float  # ln 2 - ln2_hi
    degree: int  # of the Taylor polynomial on [-ln 2 / 2, ln 2 / 2]
    bits: torch.dtype  # the integer type of the float's bits
    mantissa: int
    bias: int
    cut: float  # below this, 0 (the results stay normal numbers above it)


EXP = {
    torch.float32: ExpConstants(0.693359375, -2.1219444005469057e-4, 7, torch.int32, 23, 127, -87.0),
    torch.float64: ExpConstants(0.6931471803691238, 1.9082149292705877e-10, 13, torch.int64, 52, 1023, -708.0),
}
"""``exp``'s constants by dtype (the Triton kernels spell out the float32 ones)."""
LOG2E = 1.4426950408889634


@no_type_check  # traced by dynamo inside invariant mode's kernels: no debug-mode wrapper
def exp(d: Tensor) -> Tensor:
    """Invariant mode's ``exp`` of ``d <= 0`` (float32 or float64), from additions,
    multiplications, a floor and the float's exponent bits only: every IEEE backend
    (ATen on any device, inductor's C++ without contraction) gives the same bits, where
    each backend's own ``exp`` differs in the last bit. ``n = floor(d * log2(e) + 1/2)``,
    ``r = (d - n * ln2_hi) - n * ln2_lo``, the Taylor polynomial of ``e^r`` by Horner's
    rule (``p = p * r + 1/k!``, the coefficients rounded to the dtype), times ``2^n`` built
    from its bits; 0 below ``cut`` (-87 in float32), NaN stays NaN. Within 2 ulp of
    ``e^d`` (docs/invariance.md)."""
    k = EXP[d.dtype]
    # in place on the temporaries: the same operations, a quarter of the fresh memory
    n = torch.mul(d, LOG2E).add_(0.5).floor_()
    r = torch.sub(d, n * k.ln2_hi).sub_(n * k.ln2_lo)
    p = torch.mul(r, 1.0 / math.factorial(k.degree)).add_(1.0 / math.factorial(k.degree - 1))
    for i in range(k.degree - 2, -1, -1):
        p.mul_(r).add_(1.0 / math.factorial(i))
    scale = n.clamp_(min=1 - k.bias).to(k.bits).add_(k.bias).bitwise_left_shift_(k.mantissa).view(d.dtype)
    return p.mul_(scale).masked_fill_(d < k.cut, 0.0)


def tanh(z: Tensor) -> Tensor:
    """Invariant mode's ``tanh`` of ``z`` (float32 or float64), from the spec's ``exp`` and
    correctly rounded divisions, so that every IEEE device gives the same bits (each
    backend's ``tanh`` differs in the last bit): ``e = exp(-2 |z|)`` (0 for ``|z| > 43.5``
    in float32, where ``tanh`` rounds to 1), ``t = (1 - e) / (1 + e)``, ``z``'s sign
    restored (``copysign``); NaN stays NaN. Within ``2^-23`` of ``tanh(z)`` (measured:
    1.7 ulp of 1), not relatively: the cancellation in ``1 - e`` costs precision near 0,
    where ``cap * t`` is still within a few ``cap * eps`` of the capped logit, the rounding
    of a logit of that size."""
    e: Tensor = exp(z.abs().mul_(-2.0))
    return (1.0 - e).div_(e.add_(1.0)).copysign_(z)


def softcap(x: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Invariant mode's soft cap of ``x`` (the compute dtype): ``(y, t)`` with ``t = tanh(x
    / cap)`` (the spec's ``tanh``) and ``y = t * cap``; ``cap`` rounded to the dtype, and
    a true division by it (a 0-d tensor on ``x``'s device: on CUDA torch multiplies by the
    reciprocal of a Python-number divisor)."""
    c = torch.tensor(cap, dtype=x.dtype, device=x.device)
    t = tanh(x / c)
    return t * c, t


def softcap_slope(t: Tensor) -> Tensor:
    """The soft cap's derivative ``dy / dx = 1 - t * t`` from ``softcap``'s ``t``."""
    return 1.0 - t * t


@no_type_check  # traced inside invariant mode's compiled tile kernel
def tile_max(y: Tensor) -> Tensor:
    """The max of each tile (the last dimension), a zero max ``+0``: the max of ``+0`` and
    ``-0`` has no order-free sign (docs/invariance.md, step 3)."""
    m = y.amax(-1)
    return torch.where(m == 0, 0.0, m)


def tree(x: Tensor) -> Tensor:
    """The sum over the last dimension by pairwise halving: zero-padded to a power of two
    ``w``, then ``x[..., :w/2] + x[..., w/2:]`` until one element is left (in place on
    ``x`` where its width is a power of two, else on a padded copy). Every step is an
    elementwise add, so the order is fixed whatever the backend's reduction kernels."""
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length() if n > 1 else 1
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 8:
        width //= 2
        x[..., :width].add_(x[..., width : 2 * width])
    # the last levels on the transposed 8 (the same adds, contiguous rather than strided)
    x = x[..., :width].movedim(-1, 0).contiguous()
    while width > 1:
        width //= 2
        x[:width].add_(x[width : 2 * width])
    return x[0]


@no_type_check  # traced inside invariant mode's compiled tile kernel
def halve(parts: list[Tensor]) -> Tensor:
    """``tree`` over a list of a power-of-two length: ``parts[i] + parts[i + h]`` until one
    is left."""
    while len(parts) > 1:
        h = len(parts) // 2
        parts = [parts[i] + parts[i + h] for i in range(h)]
    return parts[0]


def scales(m: Tensor, tau: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(M, delta, exp(delta))`` of every tile's max ``m`` (``[n, R]``, tiles in global
    order): ``M`` the row's max, ``delta_j = (m_j - M') / tau`` a true division (``M' = 0``
    where ``M = -inf``), ``exp`` the spec's: how the tiles of step 4 are rescaled."""
    big = m.amax(0)
    delta = (m - torch.where(big == -math.inf, 0.0, big)) / tau
    return big, delta, exp(delta)


def merge_tiles(m: Tensor, s: Tensor, a: Tensor | None, tau: float | Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """A row's ``(M, S, A)`` ``[R]`` of the whole distribution from every tile's ``m``,
    ``s`` and ``a`` (``[n, R]``: tiles in global order; ``a`` None without entropy), in
    the spec's fixed order (step 4): ``M`` the max, each tile rescaled by
    ``exp(delta_j)``, ``delta_j = (m_j - M') / tau`` a true division, the tiles' sums by
    ``tree`` (a tile with ``s_j = 0`` adding 0). Eager, and traced into invariant mode's
    compiled row kernel."""
    big, delta, scale = scales(m, tau)
    total = tree((scale * s).t().contiguous())
    if a is None:
        return big, total, None
    terms = torch.where(s > 0, scale * (a + delta * s), 0.0)
    return big, total, tree(terms.t().contiguous())


def merge_cross(m: Tensor, c: Tensor, tau: float | Tensor) -> Tensor:
    """A row's cross term ``C`` ``[R]`` of a divergence (``vocab_divergence``,
    docs/invariance.md) from every tile's ``c_j`` (``[n, R]``, tiles in global order),
    rescaled by the tiles of its weight distribution alone (their maxima ``m``, as
    ``merge_tiles`` rescales them) and summed by ``tree``; a tile whose scale is 0 adds 0
    (its weights are 0 at the row's scale, whatever its ``c_j``)."""
    scale = scales(m, tau)[2]
    return tree(torch.where(scale == 0, 0.0, scale * c).t().contiguous())


class LogConstants(NamedTuple):
    """The constants of ``log`` for one float dtype."""

    bits: torch.dtype
    mantissa: int
    bias: int
    degree: int  # of the series of atanh in s^2
    tiny: float  # the smallest normal number


LOG = {
    torch.float32: LogConstants(torch.int32, 23, 127, 4, 2.0**-126),
    torch.float64: LogConstants(torch.int64, 52, 1023, 9, 2.0**-1022),
}
"""``log``'s constants by dtype (the ``ln 2`` split is ``EXP``'s)."""
SQRT2 = 1.4142135623730951


def log(x: Tensor) -> Tensor:
    """Invariant mode's ``log`` of ``x >= 0`` (float32 or float64), from additions,
    multiplications, correctly rounded divisions, a compare and the float's bits, so that
    every IEEE device gives the same bits (each backend's ``log`` differs in the last bit,
    and torch's vectorized and scalar paths may too): ``x = 2^e f`` from its bits, ``f``
    in ``[sqrt(1/2), sqrt(2))``, ``s = (f - 1) / (f + 1)``, ``log f = 2 atanh(s)`` by its
    series in ``s^2`` (Horner's rule, the coefficients ``1 / (2k + 1)`` rounded to the
    dtype), ``log x = e ln2_hi + (log f + e ln2_lo)``. A subnormal ``x`` is scaled by
    ``2^24`` first; ``log 0 = -inf``, ``log inf = inf``, NaN (and a negative ``x``) NaN.
    Within a few ulp of ``log x`` (docs/invariance.md)."""
    k, e_k = LOG[x.dtype], EXP[x.dtype]
    small = x < k.tiny
    y = torch.where(small, x * 16777216.0, x)
    b = y.view(k.bits)
    e = ((b >> k.mantissa) - k.bias).to(x.dtype) - torch.where(small, 24.0, 0.0)
    f = ((b & ((1 << k.mantissa) - 1)) | (k.bias << k.mantissa)).view(x.dtype)
    big = f > SQRT2
    f = torch.where(big, f * 0.5, f)
    e = torch.where(big, e + 1.0, e)
    s = (f - 1.0) / (f + 1.0)
    z = s * s
    p = torch.full_like(z, 1.0 / (2 * k.degree + 1))
    for i in range(k.degree - 1, -1, -1):
        p = p * z + 1.0 / (2 * i + 1)
    out = e * e_k.ln2_hi + ((s + s) * p + e * e_k.ln2_lo)
    out = torch.where(x == 0, -math.inf, torch.where(x == math.inf, math.inf, out))
    return torch.where((x < 0) | (x != x), math.nan, out)


def log1p(u: Tensor) -> Tensor:
    """Invariant mode's ``log(1 + u)`` of ``u >= -1``: ``w = 1 + u``, ``log(w) + (u - (w -
    1)) / w`` (the rounding of ``w`` corrected to first order), ``log`` the spec's; exactly
    0 at ``u = 0`` and ``-inf`` at ``u = -1``."""
    w = 1.0 + u
    safe = torch.where(w == 0, 1.0, w)
    out: Tensor = torch.where(w == 0, -math.inf, log(w) + (u - (w - 1.0)) / safe)
    return out


def expm1(d: Tensor) -> Tensor:
    """Invariant mode's ``exp(d) - 1`` of ``d <= 0``, the spec's ``exp``: exactly 0 at ``d = 0``
    (to an absolute ``2^-24``, all the mixture of a divergence needs)."""
    out: Tensor = exp(d) - 1.0
    return out


Merger = Callable[[Tensor, Tensor, Tensor | None, float | Tensor], tuple[Tensor, Tensor, Tensor | None]]
"""``merge_tiles``' signature: ``(m, s, a, tau)`` ``[n, R]`` tiles to ``(M, S, A)`` ``[R]``."""


def largest(y: Tensor, k: int) -> Tensor:
    """``[R, k]``: the columns of the ``k`` largest values of each row of ``y`` (``[R, V]``,
    ``k <= V``, no NaN: count a NaN as ``+inf`` first), ties broken by the smaller column,
    in ascending column order. The top-k rule's first step (``best`` orders them)."""
    kth = torch.topk(y, k, dim=1).values[:, -1:]
    above = y > kth
    tie = y == kth
    take = above | (tie & (tie.cumsum(1) <= k - above.sum(1, keepdim=True)))
    return take.nonzero()[:, 1].view(y.shape[0], k)


def best(values: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The first ``k`` of each row's ``(values, ids)`` (``[R, n]``) by value, descending,
    ties broken by the smaller id, a NaN counted as the largest: a stable sort by id, then
    a stable sort by value. The top-k rule: the ids are a function of the row's values."""
    by_id = torch.sort(ids, dim=1, stable=True).indices
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = torch.sort(values.nan_to_num(nan=math.inf), dim=1, descending=True, stable=True).indices[:, :k]
    return values.gather(1, order), ids.gather(1, order)
