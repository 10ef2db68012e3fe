"""Log-probs and entropy straight from the final hidden states and the LM-head weight.

``logits = hidden @ weight.T`` is never built whole. Forward computes each row chunk's
logits, reduces them to the per-row statistics of ``_logprob`` and drops them; one
all-gather of the ``[k, T]`` statistics and ``_combine`` give the global ``M``,
``log S``, log-probs and entropy, exactly as ``log_probs_and_entropy`` on the
materialized logits. Backward recomputes each chunk's logits, turns them into the
chunk's logit gradient ``G`` (the same formula as ``_logprob``'s backward) and
multiplies it out at once:

    d hidden = G @ weight           (this shard's part; summed over TP by one all-reduce)
    d weight = G.T @ hidden         (accumulated over chunks, this shard's rows)

so memory beyond the inputs and their gradients is ``O(T)`` statistics plus a few
``[chunk, V_local]`` blocks, forward and backward.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _checks as checks
from . import _logprob
from ._errors import LayoutError
from ._layout import Layout
from ._logprob import (
    ChunkArg,
    FloatArg,
    TensorArg,
    _check,
    _check_range,
    _chunks,
    _combine,
    _compute_dtype,
    _local_stats,
    _local_targets,
    coefficients,
    probs_and_factor,
)
from ._pack import response_rows, shifted_targets
from ._plan import resolve_length
from ._types import AnyShare, HeadWeight, Hidden, PerRow, Share, Targets

# Module-level, so that a test can count the collectives.
_all_reduce: Callable[..., object] = dist.all_reduce

# Rows per chunk when chunk_size is None: one float32 [rows, V_local] block holds about
# this many bytes. Larger than the logits path's chunks (CHUNK_BYTES, CPU_CHUNK_BYTES):
# each chunk runs a [rows, H] x [H, V_local] matmul, and a matmul of few rows is slow
# (measured on the CPU, T=4096, H=1024, V=32768: 32-row chunks 3.1x the time of one
# whole matmul, 256-row chunks 1.2x). Forward and backward each hold about three such
# blocks at a time.
LINEAR_CHUNK_BYTES = 32 * 2**20


def default_linear_chunk_rows(vocab: int) -> int:
    """Rows per chunk when ``chunk_size`` is None: one float32 ``[rows, vocab]`` block
    within ``LINEAR_CHUNK_BYTES``; at least one row."""
    return max(1, LINEAR_CHUNK_BYTES // (4 * max(vocab, 1)))


def _check_linear(
    hidden: object, weight: object, targets: object, temperature: object, chunk_size: object
) -> tuple[Tensor, Tensor, Tensor, float, int | None]:
    for name, given, shape in (("hidden", hidden, "[T, H]"), ("weight", weight, "[V_local, H]")):
        x = checks.tensor(name, given, f"a torch.Tensor {shape}")
        if not x.is_floating_point():
            raise TypeError(
                f"{name} has dtype {x.dtype}; pass floating-point tensors (float32 or "
                "bfloat16; float16 and float64 are accepted too)"
            )
        if x.dim() != 2:
            raise LayoutError(
                f"{name} has shape {tuple(x.shape)}; it must be 2-D {shape}"
                + (" (flatten the batch first: hidden.reshape(-1, hidden.shape[-1]))"
                   if name == "hidden" else "")
            )
    assert isinstance(hidden, Tensor) and isinstance(weight, Tensor)
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden has dtype {hidden.dtype} but weight {weight.dtype}; pass both in the "
            "same dtype (the LM head's matmul runs in it)"
        )
    if weight.shape[0] == 0:
        raise LayoutError(
            f"weight has shape {tuple(weight.shape)}: 0 vocabulary rows; a vocabulary "
            "shard needs at least one"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise LayoutError(
            f"hidden has shape {tuple(hidden.shape)} and weight {tuple(weight.shape)}: "
            f"the hidden sizes {hidden.shape[1]} and {weight.shape[1]} must agree "
            "(logits = hidden @ weight.T)"
        )
    if weight.device != hidden.device:
        raise LayoutError(
            f"weight is on {weight.device} but hidden on {hidden.device}; put them on the "
            "same device"
        )
    rows = hidden.shape[0]
    if isinstance(targets, Tensor):
        if tuple(targets.shape) != (rows,) and targets.dtype == torch.int64:
            raise LayoutError(
                f"targets has shape {tuple(targets.shape)} but hidden has {rows} rows; "
                f"targets must be [T] = [{rows}], one token id per row"
            )
        if targets.device != hidden.device:
            raise LayoutError(
                f"targets is on {targets.device} but hidden on {hidden.device}; put them "
                "on the same device"
            )
    # The targets' kind, temperature and chunk_size: log_probs_and_entropy's own checks
    # and messages, on a stand-in of the logits' shape (no [T, V_local] storage).
    stand_in = hidden.new_zeros(()).expand(rows, weight.shape[0])
    _, targets_, tau, chunk = _check(stand_in, targets, temperature, chunk_size)
    return hidden, weight, targets_, tau, chunk


def _gathered_stats(stats: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    """``[W, k, T]``: every shard's statistics, by one all-gather under TP."""
    if tp_group is None:
        return stats[None]
    world = dist.get_world_size(tp_group)
    # The concatenation form [W * k, T]: gloo refuses the stacked [W, k, T].
    flat = stats.new_empty((world * stats.shape[0], stats.shape[1]))
    _logprob._all_gather(flat, stats, group=tp_group)
    return flat.view(world, *stats.shape)


class _LinearLogProbEntropy(torch.autograd.Function):
    """Forward: chunk logits -> ``[k, T]`` statistics -> one all-gather under TP.
    Backward: chunk logits again -> chunk gradient -> ``d hidden``, ``d weight``; one
    all-reduce of ``d hidden`` under TP."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Hidden,
        weight: HeadWeight,
        targets: Targets,
        with_entropy: bool,
        entropy_grad: bool,
        tau: float,
        tp_group: dist.ProcessGroup | None,
        chunk: int,
    ) -> tuple[PerRow, PerRow | None]:
        rows = hidden.shape[0]
        vocab = weight.shape[0]
        if tp_group is None:
            rank, world = 0, 1
        else:
            rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        column, owned = _local_targets(targets, rank * vocab, vocab)
        cdt = _compute_dtype(hidden.dtype)
        stats = torch.empty((4 if with_entropy else 3, rows), dtype=cdt, device=hidden.device)
        for s, e in _chunks(rows, chunk):
            logits = torch.mm(hidden[s:e], weight.t())
            # eager: the compiled kernels serve the logits path only (for now)
            stats[:, s:e] = _local_stats(
                logits, column[s:e], owned[s:e], tau, with_entropy, e - s, None
            )
            del logits
        big_m, log_s, log_p, entropy = _combine(_gathered_stats(stats, tp_group), tau, with_entropy)
        valid = (targets >= 0) & (targets < world * vocab)
        log_p = torch.where(valid, log_p, math.nan)

        ctx.set_materialize_grads(False)
        ctx.tau, ctx.offset, ctx.chunk, ctx.tp_group = tau, rank * vocab, chunk, tp_group
        ctx.entropy_grad = entropy is not None and entropy_grad
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        if ctx.entropy_grad:
            assert entropy is not None
            ctx.save_for_backward(hidden, weight, targets, big_m, log_s, entropy)
        else:
            ctx.save_for_backward(hidden, weight, targets, big_m, log_s)
        return log_p, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, g_logp: PerRow | None, g_entropy: PerRow | None
    ) -> tuple[Hidden | None, HeadWeight | None, None, None, None, None, None, None]:
        saved: tuple[Tensor, ...] = ctx.saved_tensors
        hidden, weight, targets, big_m, log_s = saved[:5]
        tau: float = ctx.tau
        chunk: int = ctx.chunk
        tp_group: dist.ProcessGroup | None = ctx.tp_group
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None, None, None, None, None, None)
        if not (want_h or want_w):
            return (None, None, *none)
        if not ctx.entropy_grad:
            g_entropy = None
        rows, vocab = hidden.shape[0], weight.shape[0]
        dtype, cdt = hidden.dtype, _compute_dtype(hidden.dtype)
        column, owned = _local_targets(targets, ctx.offset, vocab)
        g_lp = torch.zeros_like(log_s) if g_logp is None else g_logp.to(cdt)
        onehot = torch.where(owned, g_lp / tau, 0.0)[:, None]
        a, b = coefficients(g_lp, g_entropy, None if g_entropy is None else saved[5], tau, cdt)
        grad_h = torch.empty_like(hidden) if want_h else None
        # A low-precision weight gradient adds up over chunks in float32 (one [V_local, H]
        # partial product in the inputs' dtype at a time) and is rounded once.
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if want_w else None
        n = min(chunk, rows)
        work = torch.empty((n, vocab), dtype=cdt, device=hidden.device)
        expd = torch.empty((n, vocab), dtype=cdt, device=hidden.device)
        for s, e in _chunks(rows, chunk):
            if dtype == cdt:  # the chunk's logits straight into the work buffer
                d = torch.mm(hidden[s:e], weight.t(), out=work[: e - s]).sub_(big_m[s:e, None])
            else:
                d = torch.sub(torch.mm(hidden[s:e], weight.t()), big_m[s:e, None], out=work[: e - s])
            p, factor = probs_and_factor(d, log_s, tau, a, b, s, e, expd)
            g = p.mul_(factor)
            if g_logp is not None:
                g.scatter_add_(1, column[s:e, None], onehot[s:e])
            # The matmuls run in the inputs' dtype, as the materialized head's would.
            g_low = g if dtype == cdt else g.to(dtype)
            if grad_h is not None:
                torch.mm(g_low, weight, out=grad_h[s:e])
            if grad_w is None:
                continue
            if dtype == cdt:
                grad_w.addmm_(g_low.t(), hidden[s:e])
            else:
                grad_w.add_(torch.mm(g_low.t(), hidden[s:e]))
        if grad_h is not None and tp_group is not None:
            # hidden is the same on every TP rank; its gradient is the sum of the shards'.
            _all_reduce(grad_h, group=tp_group)
        return grad_h, None if grad_w is None else grad_w.to(dtype), *none


# torch leaves Function.apply untyped; typed once here, at the boundary.
_apply = cast(Callable[..., tuple[Tensor, Tensor | None]], _LinearLogProbEntropy.apply)


@overload
def linear_log_probs_and_entropy(
    hidden: TensorArg,
    weight: TensorArg,
    targets: TensorArg,
    *,
    with_entropy: Literal[False] = False,
    entropy_grad: bool = True,
    temperature: FloatArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
) -> tuple[PerRow, None]: ...
@overload
def linear_log_probs_and_entropy(
    hidden: TensorArg,
    weight: TensorArg,
    targets: TensorArg,
    *,
    with_entropy: Literal[True],
    entropy_grad: bool = True,
    temperature: FloatArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
) -> tuple[PerRow, PerRow]: ...
@overload
def linear_log_probs_and_entropy(
    hidden: TensorArg,
    weight: TensorArg,
    targets: TensorArg,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: FloatArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
) -> tuple[PerRow, PerRow | None]: ...
def linear_log_probs_and_entropy(
    hidden: TensorArg,
    weight: TensorArg,
    targets: TensorArg,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: FloatArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
) -> tuple[PerRow, PerRow | None]:
    """``log_probs_and_entropy(hidden @ weight.T, targets, ...)`` without ever building
    the ``[T, V_local]`` logits: chunk by chunk, forward and backward.

    Args:
        hidden: ``[T, H]`` final hidden states (after the final norm), the same on every
            TP rank (megatron's output layer input without sequence parallelism).
            float32 or bfloat16 (float16, float64 accepted); saved for backward by
            reference.
        weight: ``[V_local, H]`` this TP rank's shard of the LM-head weight (rank ``r``
            holds token ids ``[r * V_local, (r + 1) * V_local)``; a tied embedding's
            shard too), the dtype of ``hidden``; saved for backward by reference.
        targets, with_entropy, entropy_grad, temperature, tp_group: as
            ``log_probs_and_entropy``.
        chunk_size: rows per chunk; None picks ``default_linear_chunk_rows(V_local)``:
            one float32 ``[rows, V_local]`` block within 32 MiB.

    Returns:
        ``(log_probs, entropy)`` as ``log_probs_and_entropy`` on the materialized logits
        (each ``[T]`` float32, float64 for float64 inputs; the statistics accumulate in
        float32 for bfloat16/float16). Differentiable w.r.t. ``hidden`` and ``weight``:
        ``weight``'s gradient is this shard's; ``hidden``'s is the *full* gradient,
        summed over the TP group, so everything below the head gets correct gradients.
        Memory beyond the inputs and their gradients: ``[T]`` statistics and a few
        ``[chunk, V_local]`` blocks (the chunk's logits and work buffers), forward and
        backward; backward recomputes the chunk logits (one more matmul).

    Collectives: with ``tp_group``, one ``all_gather`` of the ``[k, T]`` statistics in
    forward (as ``log_probs_and_entropy``) and, when ``hidden`` needs a gradient, one
    ``all_reduce`` of the ``[T, H]`` hidden gradient in backward (as megatron's
    ``copy_to_tensor_model_parallel_region``); every rank of the group must run backward
    through the results, T = 0 too. Without ``tp_group``, no communication.

    Raises:
        TypeError: hidden or weight not a floating-point tensor, or of different dtypes;
            as ``log_probs_and_entropy`` for targets, temperature and chunk_size.
        LayoutError: hidden or weight not 2-D, weight with 0 rows, hidden sizes that
            disagree, tensors on different devices, targets not ``[T]``; as
            ``log_probs_and_entropy`` otherwise. Raised before any collective.
    """
    hidden_, weight_, targets_, tau, chunk = _check_linear(
        hidden, weight, targets, temperature, chunk_size
    )
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    if tp_group is not None and dist.get_rank(tp_group) < 0:
        raise LayoutError("this process is not a member of tp_group")
    _check_range(targets_, world * weight_.shape[0])
    if chunk is None:
        chunk = default_linear_chunk_rows(weight_.shape[0])
    return _apply(
        hidden_, weight_, targets_, with_entropy, entropy_grad, tau, tp_group, chunk
    )


@overload
def response_log_probs_from_hidden(
    hidden: TensorArg,
    weight: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: Literal[False] = False,
    entropy_grad: bool = True,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> tuple[list[Share], None]: ...
@overload
def response_log_probs_from_hidden(
    hidden: TensorArg,
    weight: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: Literal[True],
    entropy_grad: bool = True,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> tuple[list[Share], list[Share]]: ...
@overload
def response_log_probs_from_hidden(
    hidden: TensorArg,
    weight: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> tuple[list[Share], list[Share] | None]: ...
def response_log_probs_from_hidden(
    hidden: TensorArg,
    weight: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
) -> tuple[list[Share], list[Share] | None]:
    """``response_log_probs`` from the hidden states and the LM-head weight, computing
    only the response rows: ``R x V_local`` work instead of ``T x V_local``.

    ``hidden`` is this rank's ``[T, H]`` final hidden states in its layout (the same on
    every TP rank), ``weight`` its ``[V_local, H]`` LM-head shard, ``tokens`` the whole
    per-sample token tensors ``[L_i]``. The rows ``response_rows`` names are taken from
    ``hidden`` (an ``[R, H]`` copy), their targets from ``shifted_targets``, and
    ``linear_log_probs_and_entropy`` runs on them; the result is split per sample.
    Returns what ``response_log_probs(hidden @ weight.T, tokens, layout, ...)`` returns:
    one ``[r_i]`` float32 share per sample (an empty share is a zero-length view, in the
    graph) and the entropy shares aligned with them (None unless ``with_entropy``).

    Collectives: those of ``linear_log_probs_and_entropy`` (one all-gather over
    ``tp_group`` forward, one all-reduce backward); no CP communication.

    Raises:
        TypeError, LayoutError: as ``shifted_targets`` and
            ``linear_log_probs_and_entropy``; ``hidden`` of a length the layout cannot
            hold.
    """
    if checks.tensor("hidden", hidden, "a torch.Tensor [T, H]").dim() != 2:
        raise LayoutError(
            f"hidden has shape {tuple(hidden.shape)}; it must be 2-D [T, H] (flatten the "
            "batch first: hidden.reshape(-1, hidden.shape[-1]))"
        )
    length = resolve_length(layout, int(hidden.shape[0]), "hidden")
    local = layout.with_local_length(length)
    rows, counts = response_rows(local, hidden.device)
    targets = shifted_targets(tokens, local).to(hidden.device)[rows]
    log_probs, entropy = linear_log_probs_and_entropy(
        hidden[rows],
        weight,
        targets,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        temperature=temperature,
        tp_group=tp_group,
        chunk_size=chunk_size,
    )
    shares = list(torch.split(log_probs, counts))
    return shares, None if entropy is None else list(torch.split(entropy, counts))
