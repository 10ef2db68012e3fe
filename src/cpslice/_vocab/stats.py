"""The arithmetic of one row: softmax statistics, how they merge, and the gradient's terms.

For a row of logits ``x`` over some of the vocabulary's columns (a chunk of the
logits, a ``[rows, V_block]`` tile of ``hidden @ weight.T``, one TP shard, a token
set) and temperature ``tau``, the statistics relative to their own max ``m``, with
``d = (x - m) / tau``, are

    S = sum exp(d)        A = sum exp(d) * d        and the logits at the row's picked ids

(``RowStats``). Statistics of disjoint columns merge exactly (``merge``): with the
union's max ``M`` and ``delta_b = (m_b - M) / tau``,

    S = sum_b e^delta_b S_b        A = sum_b e^delta_b (A_b + delta_b S_b)

so vocabulary blocks and TP shards combine alike (the shards' after one all-gather,
``combine``). From the merged statistics of the whole vocabulary (``totals``):

    log p_j = (x_j - M) / tau - log S        H = log S - A / S

and the gradient of ``sum_j g_j log p_j + g_H H`` w.r.t. a logit ``x_c`` of the row is
(``RowGrad``)

    p_c * (a log p_c + b) + sum of g_j / tau over the picked ids j at column c,
    a = -g_H / tau,   b = -(sum_j g_j + g_H H) / tau.

Everything is computed in ``compute_dtype`` (float32; float64 for float64 inputs).
"""

import math
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple, no_type_check

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _probe

FLOOR = -1.0e4
"""``exp`` of anything below this is exactly 0 in float32 and float64. Clamping ``d`` there
changes no ``p`` and no ``p * log p``, but turns the ``0 * (-inf)`` of a masked (-inf)
logit into ``0 * finite = 0`` in the entropy sums."""

_Gather = Callable[..., object]
# all_gather_single replaces the deprecated all_gather_into_tensor (torch >= 2.13).
_all_gather: _Gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Shard(NamedTuple):
    """This rank's piece of the vocabulary: global ids ``[offset, offset + size)`` of
    ``[0, size * world)`` (all shards of equal size), the TP group (None: no TP), and
    ``vocab``, the ids of the distribution: a padded vocabulary's rows ``>= vocab``
    (megatron pads the LM head to a multiple of ``make_vocab_size_divisible_by * tp``)
    are outside it, so this shard's first ``valid`` columns are its part of it."""

    rank: int
    world: int
    size: int
    group: dist.ProcessGroup | None
    vocab: int

    @property
    def offset(self) -> int:
        return self.rank * self.size

    @property
    def total(self) -> int:
        """The full vocabulary, all shards, padding included."""
        return self.world * self.size

    @property
    def valid(self) -> int:
        """This shard's columns inside the distribution (a prefix; 0 for a shard of padded
        ids only)."""
        return min(self.size, max(0, self.vocab - self.offset))

    def columns(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """For global ``ids`` (any shape): their column in this shard (0 where it does not
        hold them) and whether it holds them (among its valid columns)."""
        local = ids - self.offset
        held = (local >= 0) & (local < self.valid)
        return torch.where(held, local, 0), held


def shard_of(tp_group: dist.ProcessGroup | None, size: int, vocab: int | None = None) -> Shard:
    """The ``Shard`` of ``size`` columns this rank holds of ``tp_group``'s vocabulary, of
    which the distribution's ids are ``[0, vocab)`` (None: all of them)."""
    rank, world = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    return Shard(rank, world, size, tp_group, world * size if vocab is None else vocab)


Tau = float | Tensor
"""A temperature: one for every row, or a ``[T]`` tensor of one per row."""


def per_row(tau: Tau) -> Tau:
    """``tau`` against a row's columns: ``[T, 1]`` for one per row."""
    return tau if isinstance(tau, float) else tau[:, None]


def rows_of(tau: Tau, index: Tensor | slice) -> Tau:
    """``tau`` of some rows (a slice, or a row index per element)."""
    return tau if isinstance(tau, float) else tau[index]


class Softmax(NamedTuple):
    """What the softmax reads of a logit ``x``: ``cap * tanh(x / cap) / tau`` (soft-capping,
    Gemma's ``final_logit_softcapping``), or ``x / tau`` without a ``cap``; ``invariant``:
    the cap is invariant mode's (``softcap``: the spec's ``tanh``), not ``torch.tanh``."""

    tau: Tau
    cap: float | None = None
    invariant: bool = False

    def logits(self, x: Tensor) -> Tensor:
        """The (capped) logits ``x`` (the compute dtype), before the temperature."""
        if self.cap is None:
            return x
        return softcap(x, self.cap)[0] if self.invariant else torch.tanh(x / self.cap) * self.cap

    def rows(self, index: Tensor | slice) -> "Softmax":
        return Softmax(rows_of(self.tau, index), self.cap, self.invariant)


class RowStats(NamedTuple):
    """Per-row statistics of logits over some of the vocabulary's columns (see the module
    docstring): ``max`` ``m`` (-inf where every column is -inf), ``sum`` ``S`` (0 there),
    ``picked`` ``[..., T, k]`` the logits at each row's ``k`` picked ids where these
    columns hold them (else 0), ``ent`` ``A`` (None without entropy). Fields of merged
    parts (``merge``) carry a leading dimension."""

    max: Tensor
    sum: Tensor
    picked: Tensor
    ent: Tensor | None

    def map(self, fn: Callable[[Tensor], Tensor]) -> "RowStats":
        """``fn`` of every field (a None ``ent`` stays None): a slice, a view, a new buffer."""
        return RowStats(fn(self.max), fn(self.sum), fn(self.picked), None if self.ent is None else fn(self.ent))


def placeholders(
    rows: int, k: int, dtype: torch.dtype, device: torch.device, with_entropy: bool
) -> RowStats:
    """New statistics of ``rows`` rows holding the placeholders ``(0, 1, 0, 0)``: they merge
    to nothing wrong and are the same on every shard, for rows whose pass is skipped
    (their results come from a set). A pass then writes the rows it reads."""
    return RowStats(
        torch.zeros(rows, dtype=dtype, device=device),
        torch.ones(rows, dtype=dtype, device=device),
        torch.zeros((rows, k), dtype=dtype, device=device),
        torch.zeros(rows, dtype=dtype, device=device) if with_entropy else None,
    )


def merge(parts: RowStats, tau: Tau) -> RowStats:
    """The statistics over the union of the disjoint columns of ``parts`` (each field with
    a leading dimension of the parts): the max, the rescaled sums, the picked logits (at
    most one part holds each). A row that is -inf in every part keeps ``(-inf, 0, ., 0)``."""
    big = parts.max.amax(0)
    delta = (parts.max - torch.where(big == -math.inf, 0.0, big)) / tau
    scale = torch.exp(delta)
    ent = None
    if parts.ent is not None:
        # a part with S = 0 (all -inf) adds nothing; delta * S would be -inf * 0
        ent = torch.where(parts.sum > 0, scale * (parts.ent + delta * parts.sum), 0.0).sum(0)
    return RowStats(big, (scale * parts.sum).sum(0), parts.picked.sum(0), ent)


TILE = 128
"""Columns per tile of invariant mode (``invariant``): megatron pads the LM head to a
multiple of 128 per TP rank (``make_vocab_size_divisible_by``), so every padded shard
holds whole tiles."""


class _ExpConstants(NamedTuple):
    ln2_hi: float  # ln 2 to a few bits, so that n * ln2_hi is exact
    ln2_lo: float  # ln 2 - ln2_hi
    degree: int  # of the Taylor polynomial on [-ln 2 / 2, ln 2 / 2]
    bits: torch.dtype  # the integer type of the float's bits
    mantissa: int
    bias: int
    cut: float  # below this, 0 (the results stay normal numbers above it)


_EXP = {
    torch.float32: _ExpConstants(0.693359375, -2.1219444005469057e-4, 7, torch.int32, 23, 127, -87.0),
    torch.float64: _ExpConstants(0.6931471803691238, 1.9082149292705877e-10, 13, torch.int64, 52, 1023, -708.0),
}
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
    k = _EXP[d.dtype]
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


def merge_tiles(m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> tuple[Tensor, Tensor, Tensor | None]:
    """``merge`` in invariant mode: a row's ``(M, S, A)`` ``[R]`` of the whole distribution
    from every tile's ``m``, ``s`` and ``a`` (``[n, R]``: tiles in global order; ``a`` None
    without entropy), in the spec's fixed order: ``M`` the max, each tile rescaled by
    ``exp(delta_j)``, the tiles' sums by ``tree``. Eager, and traced into invariant mode's
    compiled row kernel."""
    big = m.amax(0)
    delta = (m - torch.where(big == -math.inf, 0.0, big)) / tau
    scale = exp(delta)
    total = tree((scale * s).t().contiguous())
    if a is None:
        return big, total, None
    terms = torch.where(s > 0, scale * (a + delta * s), 0.0)
    return big, total, tree(terms.t().contiguous())


Merger = Callable[[Tensor, Tensor, Tensor | None, Tau], tuple[Tensor, Tensor, Tensor | None]]
"""``merge_tiles``' signature: ``(m, s, a, tau)`` ``[n, R]`` tiles to ``(M, S, A)`` ``[R]``."""


def merge_step(m: Tensor, s: Tensor, a: Tensor | None, tau: Tau) -> tuple[Tensor, Tensor, Tensor | None]:
    """``merge_tiles``, or the step substituted for it (``_probe.substitute("merge_tiles", fn)``):
    invariant mode's merges with torch."""
    merge = merge_tiles if _probe.active is None else _probe.active.step("merge_tiles", merge_tiles)
    return merge(m, s, a, tau)


def write(out: RowStats, at: slice | Tensor | tuple[slice | Tensor, slice], m: Tensor, s: Tensor,
          a: Tensor | None) -> None:
    """``out``'s ``max``, ``sum`` and (where both are there) ``ent`` at ``at`` from ``m``,
    ``s`` and ``a``; ``picked`` left as it is."""
    out.max[at], out.sum[at] = m, s
    if out.ent is not None and a is not None:
        out.ent[at] = a


class Totals(NamedTuple):
    """A row's results over the whole vocabulary (or its restricted set): ``max`` ``M``,
    ``log_sum`` ``log S``, ``log_probs`` ``[T, k]`` of the picked ids, ``entropy`` ``[T]``
    or None."""

    max: Tensor
    log_sum: Tensor
    log_probs: Tensor
    entropy: Tensor | None


def totals(stats: RowStats, tau: Tau) -> Totals:
    """``Totals`` from the merged statistics of the whole vocabulary."""
    log_s = torch.log(stats.sum)
    log_p = (stats.picked - stats.max[:, None]) / per_row(tau) - log_s[:, None]
    entropy = None if stats.ent is None else log_s - stats.ent / stats.sum
    return Totals(stats.max, log_s, log_p, entropy)


def _rows(stats: RowStats, with_picked: bool) -> list[Tensor]:
    """The ``[T]`` rows of ``stats`` that travel in the all-gather."""
    def of(field: Tensor) -> list[Tensor]:
        return [field] if field.dim() == 1 else list(field.t())

    rows = [*of(stats.max), *of(stats.sum)]
    if with_picked:
        rows += list(stats.picked.t())
    return rows + ([] if stats.ent is None else of(stats.ent))


def all_gather_rows(local: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``[W, r, T]``: every shard's ``[r, T]`` rows, by one all-gather over ``group`` (``W`` 1
    and no communication without one)."""
    if group is None:
        return local[None]
    world = dist.get_world_size(group)
    # the concatenation form [W * r, T]: gloo refuses the stacked [W, r, T]
    flat = local.new_empty((world * local.shape[0], local.shape[1]))
    if _probe.active is not None:
        _probe.active.collective("all_gather", local.numel())
    _all_gather(flat, local, group=group)
    return flat.view(world, *local.shape)


MERGE_ROWS = 1024
"""Rows per piece of ``combine``'s tile merge: its temporaries are a few ``[tiles, rows]``
buffers of this many rows, not of ``T``."""


def combine(
    parts: Sequence[RowStats],
    tau: Tau,
    group: dist.ProcessGroup | None,
    extra: Tensor | None = None,
    tiles: int | None = None,
    merger: "Merger | None" = None,
) -> tuple[list[Totals], Tensor | None]:
    """``Totals`` of each of ``parts`` (this shard's statistics of the same rows, e.g. the
    full vocabulary and the token sets) over all shards of ``group``, by one all-gather.
    Every part after the first shares the first's picked logits (they are not sent
    again). ``extra`` ``[r, T]`` rows ride along unmerged: every shard's come back as
    ``[W, r, T]``. With ``tiles`` (invariant mode) a part's ``max``, ``sum`` and ``ent``
    are ``[T, n]`` per tile, and the first ``tiles`` of all shards' tiles, in global
    order, merge by ``merger`` (``merge_tiles`` if None; invariant mode's backend passes
    its own, of the same bits), ``MERGE_ROWS`` rows at a time; or, without a
    group, ``[T]`` fields already merged so (``invariant.stats``), read as they are.
    Collectives: one ``all_gather`` with ``group``, else none."""
    first = parts[0]
    k = first.picked.shape[1]
    rows = [r for i, p in enumerate(parts) for r in _rows(p, i == 0)]
    local = torch.stack(rows if extra is None else [*rows, *extra.to(first.max.dtype)])
    gathered = all_gather_rows(local, group)
    world = gathered.shape[0]
    out, at = [], 0
    picked = None
    for i, p in enumerate(parts):
        n = 1 if p.max.dim() == 1 else p.max.shape[1]
        at_m, at_s = at, at + n
        at += 2 * n
        if i == 0:
            picked, at = gathered[:, at : at + k].transpose(1, 2), at + k
        at_e = None
        if p.ent is not None:
            at_e, at = at, at + n
        assert picked is not None
        if tiles is None or p.max.dim() == 1:
            assert tiles is None or world == 1, "merged statistics under TP"
            stats = RowStats(gathered[:, at_m], gathered[:, at_s], picked,
                             None if at_e is None else gathered[:, at_e])
            out.append(totals(merge(stats, tau) if tiles is None else stats.map(lambda f: f[0]), tau))
        else:
            out.append(totals(_merge_gathered(gathered, (at_m, at_s, at_e), n, tiles, picked.sum(0), tau, merger),
                              tau))
    return out, None if extra is None else gathered[:, at:]


def _merge_gathered(
    gathered: Tensor, at: tuple[int, int, int | None], n: int, tiles: int, picked: Tensor, tau: Tau,
    merger: "Merger | None",
) -> RowStats:
    """``merge_tiles`` of the first ``tiles`` of every shard's ``n`` tiles of one part of
    ``combine``'s ``[W, r, T]`` rows (its ``max``, ``sum`` and ``ent`` rows at ``at``),
    ``MERGE_ROWS`` rows at a time, into ``[T]`` fields."""
    world, t = gathered.shape[0], gathered.shape[2]

    def new() -> Tensor:
        return gathered.new_empty(t)

    merged = RowStats(new(), new(), picked, None if at[2] is None else new())
    for lo in range(0, t, MERGE_ROWS):
        hi = min(lo + MERGE_ROWS, t)
        m, s, a = (None if i is None else gathered[:, i : i + n, lo:hi].reshape(world * n, hi - lo)[:tiles]
                   for i in at)
        assert m is not None and s is not None
        write(merged, slice(lo, hi), *(merger or merge_tiles)(m, s, a, rows_of(tau, slice(lo, hi))))
    return merged


class RowGrad(NamedTuple):
    """The per-row terms of the logits' gradient on one shard (module docstring): the
    coefficients ``a`` (None without an entropy gradient) and ``b``, and ``hot`` ``[T, k]``,
    ``g_j / tau`` at each picked id's ``column`` ``[T, k]`` where this shard holds it
    (else 0; None without a log-prob gradient)."""

    a: Tensor | None
    b: Tensor
    hot: Tensor | None
    column: Tensor

    def rows(self, index: Tensor | slice) -> "RowGrad":
        """The terms of some rows (a slice, or an index)."""
        return RowGrad(None if self.a is None else self.a[index], self.b[index],
                       None if self.hot is None else self.hot[index], self.column[index])


def row_grad(
    g_lp: Tensor,
    g_entropy: Tensor | None,
    entropy: Tensor | None,
    tau: Tau,
    column: Tensor,
    held: Tensor,
    *,
    with_hot: bool,
    placeholders: bool = False,
) -> RowGrad:
    """``RowGrad`` from the upstream gradients ``g_lp`` ``[T, k]`` and ``g_entropy`` ``[T]``
    (None: none) and the saved entropy. With ``placeholders``, a row whose ``g_entropy`` is
    0 adds no ``g_H H`` term even where ``H`` is not finite (a placeholder)."""
    g_sum = g_lp.sum(1)
    hot = torch.where(held, g_lp / per_row(tau), 0.0) if with_hot else None
    if g_entropy is None:
        return RowGrad(None, -g_sum / tau, hot, column)
    assert entropy is not None
    g_h = g_entropy.to(g_lp.dtype)
    h_term = g_h * entropy
    if placeholders:
        h_term = torch.where(g_h != 0, h_term, 0.0)
    return RowGrad(-g_h / tau, -(g_sum + h_term) / tau, hot, column)


def pick_grad(
    x: Tensor, big_m: Tensor, log_s: Tensor, softmax: Softmax, grad: RowGrad, vocab: int
) -> Tensor:
    """``[T, k]``: the whole gradient w.r.t. the raw logit at each picked id's column of a
    ``[T, vocab]`` tile (``x`` ``[T, k]`` the logits there), the one-hot terms of every
    picked id at that column included, through the cap's ``tanh``, in the compute dtype:
    the entries a kernel that leaves the one-hot terms out must overwrite."""
    b = grad.b[:, None]
    y = softmax.logits(x.to(b.dtype))
    d = ((y - big_m[:, None]) / per_row(softmax.tau) - log_s[:, None]).clamp(min=FLOOR)
    factor = b if grad.a is None else grad.a[:, None] * d + b
    value = torch.exp(d) * factor
    if grad.hot is not None and grad.hot.shape[1] == 1:
        value = value + grad.hot
    elif grad.hot is not None:
        # ids repeated in a row: every copy's entry holds the one-hot terms of all copies
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        _, copy = torch.unique(rows * vocab + grad.column, return_inverse=True)
        hot = grad.hot.new_zeros(x.numel()).index_add_(0, copy.view(-1), grad.hot.reshape(-1))
        value = value + hot[copy]
    if softmax.cap is None:
        return value
    return value * (1 - torch.square(y / softmax.cap))


# invariant mode's helpers that read no spec arithmetic (invariant.py uses them)


@no_type_check  # traced inside tile_kernel
def _halve(parts: list[Tensor]) -> Tensor:
    """``tree`` over a list: ``parts[i] + parts[i + h]`` until one is left."""
    while len(parts) > 1:
        h = len(parts) // 2
        parts = [parts[i] + parts[i + h] for i in range(h)]
    return parts[0]


def _bits(t: Tensor) -> Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(got: Sequence[Tensor], want: Sequence[Tensor]) -> bool:
    """Bit for bit (a zero's sign included), but a NaN's payload: NaN where the other is
    NaN is enough (ATen's own bfloat16 rounding gives a NaN one payload in its vector
    code and another in its scalar code)."""
    def one(g: Tensor, w: Tensor) -> bool:
        nan = g.isnan()
        return bool(torch.equal(nan, w.isnan()) and torch.equal(_bits(g)[~nan], _bits(w)[~nan]))

    return all(g.dtype == w.dtype and one(g, w) for g, w in zip(got, want))


def _pairs(t: Tensor) -> Tensor | None:
    """``[R, w / 2]`` int32 view of bfloat16 ``t`` ``[R, w]`` (two columns an element,
    the even one in the low half: little-endian), where its shape, strides and offset
    allow one; else None."""
    if (t.dtype != torch.bfloat16 or sys.byteorder != "little" or t.shape[1] % 2 or t.stride(1) != 1
            or t.stride(0) % 2 or t.storage_offset() % 2):
        return None
    return t.view(torch.int32)


NAN_BITS = 0x7FC00000
"""The float32 quiet NaN whose bfloat16 rounding is bfloat16's (0x7FC0)."""


@no_type_check
def _bfloat16_bits(g):
    """The bfloat16 rounding (to nearest, ties to even) of float32 ``g`` as int32 bits in
    the high half, the low half 0; a NaN the quiet NaN."""
    bits = torch.where(g != g, NAN_BITS, g.view(torch.int32))
    return (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
