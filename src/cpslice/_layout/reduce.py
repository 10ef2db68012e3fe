"""Per-sample reducers under CP. ``sum_of_sample_means`` and ``sum_of_tokens`` need
no communication: each rank's partial result sums over the CP group to exactly the
no-CP result. ``sample_means`` gives every rank each sample's complete means of ``m``
statistics, with one ``all_reduce`` of ``[n, m]`` floats forward and one backward;
``sample_max`` / ``sample_min`` each sample's complete masked maximum / minimum, with
one ``all_reduce`` (MAX / MIN) and no gradient.

Every sum accumulates in float32 (float64 for float64 values), whatever the values'
dtype, and returns the values' dtype: a bfloat16 sum of a thousand tokens would
otherwise stall where the spacing of bfloat16 numbers exceeds each addend. A maximum
accumulates nothing: it is taken and reduced in the values' dtype, exactly.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import Tensor

from .. import _checks as checks
from .. import _probe
from .._cache import cached
from .._errors import LayoutError
from .._types import Denominators, IntArg, Masks, Shares, compute_dtype
from .layout import Layout
from .plan import Local, predicted, resolve, response_base, selection_at

_I64 = torch.int64

# [n] for [r_i] values, [n, m] for [r_i, m] (any trailing shape, the values')
PerSample = Float[Tensor, "n *m"]
Scalar = Float[Tensor, ""]


class _Index(NamedTuple):
    """One layout's index tensors on one device (what every call would otherwise rebuild)."""

    counts: list[int]  # per sample: elements of this rank's share
    local: Tensor  # [m] each share element's index in all whole responses back to back
    local_sample: Tensor  # [m] each share element's sample
    whole_sample: Tensor  # [R] each whole-response element's sample
    predicted: Tensor | None  # [R] at depth d > 0: True where a position predicts the element


# A few (layout, device, depth) triples: one step reduces the same layout several times.
@cached(maxsize=8)
def _index(layout: Layout, length: int, device: torch.device, depth: int) -> _Index:
    sel = selection_at(layout, length, "response", depth)
    samples = torch.arange(layout.num_samples, dtype=_I64)
    # (output_size: no summing pass, which under load costs milliseconds on 2 threads)
    local_sample = torch.repeat_interleave(samples, torch.tensor(sel.counts, dtype=_I64),
                                           output_size=sum(sel.counts))
    whole_sample = torch.repeat_interleave(
        samples, torch.tensor(layout.response_lengths, dtype=_I64), output_size=sum(layout.response_lengths)
    )
    local = sel.sources(response_base(layout, concatenated=True, depth=depth))
    # at depth d the tokens no position predicts are in no share and weigh nothing
    keep = predicted(layout, depth).to(device) if depth else None
    return _Index(
        list(sel.counts), local.to(device), local_sample.to(device), whole_sample.to(device), keep
    )


def _check_shares(values: object, local: Local, *, columns: bool) -> list[Tensor]:
    """This rank's shares ``[r_i]``, or with ``columns`` ``[r_i, *m]``, of one dtype and
    one trailing shape."""
    counts = selection_at(local.layout, local.length, "response", local.depth).counts
    shares = checks.per_sample("values", values, counts, "this rank's share", floating=True)
    for i, v in enumerate(shares):
        if not columns and v.dim() != 1:
            raise LayoutError(
                f"sample {i}: values[{i}] has shape {tuple(v.shape)}; it must be 1-D "
                f"[this rank's share] = [{counts[i]}] (sum_of_sample_means and sum_of_tokens "
                "reduce one value per token to a loss part; sample_means, sample_max and "
                "sample_min take [r_i, m])"
            )
        if v.dtype != shares[0].dtype:
            raise LayoutError(
                f"sample {i}: values[{i}] is {v.dtype} but values[0] is {shares[0].dtype} "
                "(the shares of one call have one dtype)"
            )
        if v.shape[1:] != shares[0].shape[1:]:
            raise LayoutError(
                f"sample {i}: values[{i}] has shape {tuple(v.shape)} but values[0] has "
                f"{tuple(shares[0].shape)} (the shares of one call have one trailing shape: "
                "[r_i, m] for every sample, [0, m] where this rank holds none of it)"
            )
    return shares


def _check_masks(loss_masks: object, layout: Layout) -> list[Tensor]:
    return checks.per_sample(
        "loss_masks", loss_masks, layout.response_lengths, "response_length", one_dim=True
    )


def _denominators(
    denominators: object, layout: Layout, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """``denominators`` as a ``[n]`` tensor, or a TypeError/LayoutError naming the sample."""
    n = layout.num_samples
    if isinstance(denominators, Tensor):
        if denominators.dim() != 1 or denominators.shape[0] != n:
            raise LayoutError(
                f"denominators has shape {tuple(denominators.shape)} but the layout has {n} "
                "samples (one denominator per sample: [n])"
            )
        if denominators.dtype == torch.bool or denominators.is_complex():
            raise TypeError(f"denominators has dtype {denominators.dtype}; pass real numbers")
        if denominators.device.type == "cpu":  # checked where it costs no device sync
            bad = (denominators < 0) | torch.isnan(denominators)
            if n and bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                _refuse(i, float(denominators[i]))
        return denominators.to(device=device, dtype=dtype)
    if isinstance(denominators, (str, bytes)) or not isinstance(denominators, Sequence):
        raise TypeError(
            "denominators must be a [n] tensor or a list of floats, got "
            f"{type(denominators).__name__}"
        )
    if len(denominators) != n:
        raise LayoutError(
            f"denominators holds {len(denominators)} values but the layout has {n} samples "
            "(one denominator per sample)"
        )
    values = [checks.real(f"sample {i}: denominators[{i}]", x) for i, x in enumerate(denominators)]
    for i, x in enumerate(values):
        if math.isnan(x) or x < 0:
            _refuse(i, x)
    return torch.tensor(values, dtype=dtype, device=device)


def _refuse(i: int, value: float) -> None:
    raise LayoutError(
        f"sample {i}: denominators[{i}] is {value}; a denominator is a count or a weight "
        "sum, >= 0 (0 makes the sample's mean 0)"
    )


def _columns(x: Tensor, like: Tensor) -> Tensor:
    """A per-token ``[L]`` tensor viewed ``[L, 1, ...]``, to broadcast over ``like``'s
    trailing dimensions (the statistics)."""
    return x.view(-1, *[1] * (like.dim() - 1))


class _Sums(NamedTuple):
    local: Tensor  # [n, *m] this rank's masked sums, accumulation dtype, in the graph
    whole: Tensor  # [n] the whole masks' sums (the default denominators)
    dtype: torch.dtype  # the values' dtype


def _sums(values: object, loss_masks: object, layout: Layout, *, columns: bool, depth: object = 0) -> _Sums:
    """Per sample (and statistic): the sum of value * mask over this rank's share, and
    the whole mask sum (of the tokens predicted at ``depth``)."""
    at = resolve(layout, what="the layout", depth=checks.depth(depth))
    shares = _check_shares(values, at, columns=columns)
    masks = _check_masks(loss_masks, layout)
    n = layout.num_samples
    if not n:
        empty = torch.zeros(0)
        return _Sums(empty, empty, empty.dtype)
    dtype = shares[0].dtype
    acc = compute_dtype(dtype)
    device = shares[0].device
    index = _index(layout, at.length, device, at.depth)
    flat = torch.cat(shares).to(acc)
    whole_mask = torch.cat(masks).to(device=device, dtype=acc)
    mask = _columns(whole_mask.index_select(0, index.local), flat)
    # where, not a bare product: a masked -inf or NaN must not poison the sum (or its grad)
    masked = torch.where(mask != 0, flat * mask, torch.zeros_like(flat))
    local = flat.new_zeros((n, *flat.shape[1:])).index_add(0, index.local_sample, masked)
    if index.predicted is not None:
        whole_mask = torch.where(index.predicted, whole_mask, 0)
    whole = torch.zeros(n, dtype=acc, device=device).index_add(
        0, index.whole_sample, whole_mask
    )
    return _Sums(local, whole, dtype)


def _divide(sums: Tensor, denominators: Tensor) -> Tensor:
    """``sums / denominators``, 0 where a denominator is 0 (never NaN, never inf); one
    denominator per sample divides each of its statistics."""
    denominators = _columns(denominators, sums)
    zero = denominators == 0
    return torch.where(zero, torch.zeros_like(sums), sums / torch.where(zero, 1, denominators))


def sum_of_sample_means(
    values: Shares,
    loss_masks: Masks,
    layout: Layout,
    *,
    denominators: Denominators = None,
    depth: IntArg = 0,
) -> Scalar:
    """This rank's part of ``sum_i mean_i``, the masked mean of each sample's response.

    ``values[i]`` is this rank's share ``[r_i]`` (from ``extract_responses``), one value
    per token: a loss part is one number, and with no communication to share, a second
    statistic costs nothing more as a second call (``sample_means`` takes ``[r_i, m]``);
    ``loss_masks[i]`` is sample ``i``'s *whole* mask ``[R_i]`` (bool, int or float,
    the same on every rank; a fractional mask weights its token). Each sample's
    masked sum over the share is divided by the whole mask's sum, or by
    ``denominators[i]`` when given (``[n]`` tensor or list of floats, the same on
    every rank: e.g. a token count per rollout group), so the parts sum over the CP
    group to exactly the no-CP result; a sample whose denominator is 0 contributes
    zero, without dividing by zero, and masked positions never contribute, even
    when they hold -inf or NaN. Accumulates in float32 (float64 for float64 values),
    returns the values' dtype. No communication; the result is a scalar connected to
    every share, so every rank's backward reaches the same collectives. Divide by
    the number of samples for a sequence-mean loss.

    With ``depth=d`` the shares are those of a multi-token prediction head at depth
    ``d`` (``extract_responses(..., depth=d)``); ``loss_masks`` stay the whole masks
    ``[R_i]`` of the response tokens, each share element weighted by its predicted
    token's mask, and a token no position predicts at that depth (the first
    ``d + 1 - P_i`` of a sample whose prompt ``P_i`` is shorter than ``d + 1``) counts
    in no sum, the default denominator included.

    Raises:
        TypeError: values is not a list of floating-point tensors; a denominator is
            not a number; ``depth`` is not an int.
        LayoutError: a list or share length disagrees with the layout (at ``depth``);
            a share is not 1-D; denominators has the wrong length or a negative (or
            NaN) value; a negative depth.
    """
    sums = _sums(values, loss_masks, layout, columns=False, depth=depth)
    if denominators is None:
        d = sums.whole
    else:
        d = _denominators(denominators, layout, sums.local.device, sums.local.dtype)
    return _divide(sums.local, d).sum().to(sums.dtype)


def sum_of_tokens(values: Shares, loss_masks: Masks, layout: Layout, *, depth: IntArg = 0) -> Scalar:
    """This rank's part of ``sum`` of ``value * mask`` over every response token.

    Arguments as ``sum_of_sample_means``. The parts sum over the CP group to the no-CP
    token sum; divide by the global mask sum (every rank can compute it from the whole
    masks) for a token-mean loss. Accumulates in float32 (float64 for float64
    values), returns the values' dtype. No communication.

    Raises:
        TypeError, LayoutError: as ``sum_of_sample_means``.
    """
    sums = _sums(values, loss_masks, layout, columns=False, depth=depth)
    return sums.local.sum().to(sums.dtype)


class _AllReduceSum(torch.autograd.Function):
    """``all_reduce`` (sum) of a small tensor; backward all-reduces the gradient.

    The backward sum is what makes the gradient that of the sum over ranks of every
    rank's loss part: each rank's partial sums feed every rank's means.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        y = x.clone()
        if _probe.active is not None:
            _probe.active.collective("all_reduce", y.numel())
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        g = grad.clone()
        if _probe.active is not None:
            _probe.active.collective("all_reduce", g.numel())
        dist.all_reduce(g, group=ctx.group)
        return g, None


# torch leaves Function.apply untyped; typed once here, at the boundary.
_all_reduce_sum = cast(Callable[[Tensor, Any], Tensor], _AllReduceSum.apply)


def _check_group(what: str, layout: Layout, cp_group: dist.ProcessGroup | None) -> None:
    checks.cp_group(what, "the layout", layout.cp_rank, layout.cp_size, cp_group)


def sample_means(
    values: Shares,
    loss_masks: Masks,
    layout: Layout,
    *,
    cp_group: dist.ProcessGroup | None = None,
    denominators: Denominators = None,
    depth: IntArg = 0,
) -> PerSample:
    """Each sample's masked mean over its *whole* response, on every rank of the CP group.

    For sequence-level losses and corrections: GSPO's ratio ``exp(mean(log_prob -
    old_log_prob))``, off-policy sequence masking, sequence-level importance sampling
    (a sum: ``denominators`` of ones), mismatch metrics; several at once as columns.

    Args:
        values: this rank's shares ``[r_i]`` (from ``extract_responses``), floating
            point; or ``[r_i, m]``, ``m`` statistics per token (any trailing shape, the
            same for every share of the call: an empty share is ``[0, m]``).
        loss_masks: the *whole* masks ``[R_i]`` (bool, int or float; the same on every
            rank), one per token for all its statistics; a fractional mask weights its
            token.
        layout: this rank's layout.
        cp_group: the CP process group (megatron-core:
            ``parallel_state.get_context_parallel_group()``; ``dist.group.WORLD`` when
            every process is one CP group). ``None`` (the default) means no group, as
            ``tp_group=None`` means no TP: only a layout without CP may omit it.
        denominators: ``[n]`` tensor or list of floats, the same on every rank, in
            place of the whole masks' sums (e.g. a token count per rollout group), one
            per sample for all its statistics. A CPU tensor is checked for negative or
            NaN values (a device tensor is not: that would cost a sync).
        depth: the shares' target depth ``d >= 0``, as ``sum_of_sample_means``.

    Returns:
        ``[n]`` for ``[r_i]`` values, ``[n, m]`` for ``[r_i, m]``; the values' dtype
        (accumulated in float32, float64 for float64 values): sample ``i``'s masked
        sum over its whole response divided by its whole mask's sum (or
        ``denominators[i]``); 0 where that is 0, never NaN. A layout of no samples
        gives ``[0]``. Masked positions never contribute, even when they hold -inf or
        NaN. Differentiable: each rank's loss part may use the means anywhere, and
        the gradient is that of the **sum over the CP group** of the parts (as for
        ``sum_of_sample_means``), so every rank's loss part must be built from the
        result (a rank that holds nothing included) and every rank runs backward.

    Collectives: with CP (``cp_size > 1``), exactly one ``all_reduce`` of ``[n]`` (or
    ``[n, m]``) floats forward and, when the result is in a graph, one backward,
    whatever each rank holds (none for a layout of no samples, on every rank alike);
    every rank must call it (under ``torch.no_grad()``: only the forward one). Without
    CP (``cp_mode="none"`` or ``cp_size`` 1), none, and no process group is needed
    (``cp_group`` is then unused).

    Raises:
        RuntimeError: CP without torch.distributed initialized.
        TypeError, LayoutError: as ``sum_of_sample_means`` (but shares may have
            trailing dimensions); shares of different trailing shapes; CP with no
            ``cp_group``, or a group whose size or rank disagrees with the layout.
            Raised before any collective.
    """
    sums = _sums(values, loss_masks, layout, columns=True, depth=depth)
    if denominators is None:
        d = sums.whole
    else:
        d = _denominators(denominators, layout, sums.local.device, sums.local.dtype)
    local = sums.local
    if layout.cp_size > 1:
        _check_group("sample_means", layout, cp_group)
        if layout.num_samples:  # n is the same on every rank: all skip, or none
            local = _all_reduce_sum(local, cp_group)
    return _divide(local, d).to(sums.dtype)


class _Extreme(NamedTuple):
    identity: float  # what a sample with no unmasked token gets
    reduce: str  # scatter_reduce's name of the reduction
    op: dist.ReduceOp.RedOpType  # all_reduce's
    flag: float  # an unmasked NaN's mark in the reduction's direction (0 elsewhere)


_EXTREMES = {
    "sample_max": _Extreme(-math.inf, "amax", dist.ReduceOp.MAX, 1.0),
    "sample_min": _Extreme(math.inf, "amin", dist.ReduceOp.MIN, -1.0),
}


def _local_extreme(
    how: _Extreme, values: object, loss_masks: object, layout: Layout, depth: object = 0
) -> tuple[Tensor, Tensor]:
    """Per sample (and statistic): the extreme of this rank's unmasked share elements
    that are not NaN, ``how.identity`` where it holds none, and whether one of them is
    NaN; ``[n, *m]`` each, detached, the values' dtype and bool."""
    local = resolve(layout, what="the layout", depth=checks.depth(depth))
    shares = _check_shares(values, local, columns=True)
    masks = _check_masks(loss_masks, layout)
    n = layout.num_samples
    if not n:
        return torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    flat = torch.cat(shares).detach()
    index = _index(layout, local.length, flat.device, local.depth)
    kept = _columns((torch.cat(masks) != 0).to(flat.device).index_select(0, index.local), flat)
    samples = _columns(index.local_sample, flat).expand_as(flat)
    nan = kept & flat.isnan()
    # where: a masked position's value, -inf or NaN included, is never compared; an
    # unmasked NaN is not compared either, but flagged
    flat = torch.where(kept & ~nan, flat, how.identity)
    out = flat.new_full((n, *flat.shape[1:]), how.identity).scatter_reduce(0, samples, flat, how.reduce)
    flags = torch.zeros(out.shape, dtype=torch.int8, device=out.device)
    return out, flags.scatter_reduce(0, samples, nan.to(torch.int8), "amax").bool()


def _extreme(
    what: str, values: object, loss_masks: object, layout: Layout,
    cp_group: dist.ProcessGroup | None, depth: object,
) -> Tensor:
    """``sample_max`` or ``sample_min`` (``what``): see there."""
    how = _EXTREMES[what]
    local, nan = _local_extreme(how, values, loss_masks, layout, depth)
    if layout.cp_size > 1:
        _check_group(what, layout, cp_group)
        if layout.num_samples:  # n is the same on every rank: all enter it, or none
            # the NaN flags ride in the same all_reduce, marked in its direction (1 for
            # MAX, -1 for MIN), so that NaN never meets the backend's comparison
            both = torch.stack([local, nan.to(local.dtype) * how.flag])
            if _probe.active is not None:
                _probe.active.collective("all_reduce", both.numel())
            dist.all_reduce(both, op=how.op, group=cp_group)
            local, nan = both[0], both[1] != 0
    return torch.where(nan, math.nan, local)


def sample_max(
    values: Shares, loss_masks: Masks, layout: Layout, *, cp_group: dist.ProcessGroup | None = None, depth: IntArg = 0
) -> PerSample:
    """Each sample's masked maximum over its *whole* response, on every rank of the CP
    group: e.g. rejection of a sequence by its largest per-token log-ratio (verl's
    ``seq_max_k*``).

    Arguments as ``sample_means`` (``values`` ``[r_i]`` or ``[r_i, m]``): a token
    counts where its mask is nonzero, at its value (a fractional mask keeps its token
    but does not scale it); masked positions never count, even when they hold -inf or
    NaN. An unmasked NaN makes that sample's result (that statistic's, for
    ``[r_i, m]``) NaN on every rank, whichever rank holds it, as ``torch.max``
    propagates NaN: NaN is flagged beside the values, never left to the backend's
    comparison.

    Returns:
        ``[n]`` or ``[n, m]``, the values' dtype (taken and reduced in it: exact);
        ``-inf`` for a sample with no unmasked token (the identity of the maximum);
        ``[0]`` for a layout of no samples. No gradient: the result is detached (for
        masks and metrics), whether or not the values require grad.

    Collectives: with CP (``cp_size > 1``), exactly one ``all_reduce`` (MAX) of ``[2, n]``
    (or ``[2, n, m]``: the values and their NaN flags), whatever each rank holds (none for a layout of no samples, on
    every rank alike); every rank must call it. Without CP, none, and no process group
    is needed.

    Raises:
        RuntimeError, TypeError, LayoutError: as ``sample_means``.
    """
    return _extreme("sample_max", values, loss_masks, layout, cp_group, depth)


def sample_min(
    values: Shares, loss_masks: Masks, layout: Layout, *, cp_group: dist.ProcessGroup | None = None, depth: IntArg = 0
) -> PerSample:
    """Each sample's masked minimum over its *whole* response, on every rank of the CP
    group: ``sample_max``'s twin, with an all_reduce (MIN) and ``+inf`` (the identity
    of the minimum) for a sample with no unmasked token. Arguments, result, collectives
    and errors as ``sample_max``.
    """
    return _extreme("sample_min", values, loss_masks, layout, cp_group, depth)
