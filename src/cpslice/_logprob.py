"""Log-probs of targets and entropy under (vocab-parallel) logits, row chunk by row chunk.

The arithmetic, for one row with tempered logits ``z = x / tau`` over the full
vocabulary (all TP shards), ``M = max x`` and ``S = sum exp((x - M) / tau)``:

    log p_t = (x_t - M) / tau - log S
    H       = log S - A / S,          A = sum exp((x - M) / tau) * (x - M) / tau

Each shard ``r`` holds ``[m_r, S_r, x_t or 0, A_r]`` relative to its own max
``m_r``; with ``d_r = (m_r - M) / tau`` the global sums are
``S = sum_r e^d_r S_r`` and ``A = sum_r e^d_r (A_r + d_r S_r)``. Only these
``[T]`` statistics cross ranks (one all-gather); the backward pass recomputes
``p`` chunk by chunk from the saved logits and the global ``M`` and ``log S``:

    d log p_t / d x_j = (onehot_j - p_j) / tau
    d H / d x_j       = -p_j (log p_j + H) / tau

The per-chunk work runs eagerly here or through the compiled chunk kernels of
``_kernels`` (``CPSLICE_COMPILE``); both give the same results, memory and collective.
"""

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _checks as checks
from . import _kernels, _support
from ._cache import boundary
from ._errors import LayoutError
from ._support import Sparse, Support
from ._types import Logits, PerRow, Targets

# One call's restricted sets: the plan, the gathered logits, and the global restricted
# max, log of the sum of exp and entropy (None without it) per row.
_Restricted = tuple[Sparse, Tensor, Tensor, Tensor, Tensor | None]

# Row chunks are sized so that the two work buffers of one chunk hold about this
# many bytes together (at least one row). On the CPU a chunk small enough to stay
# in the last-level cache makes the several elementwise passes over it cheap
# (measured: 8 MiB is 1.4x faster than 64 MiB at T=4096, V=32768); on an
# accelerator larger chunks amortize the per-kernel launch cost (measured on an
# H200: 64 MiB within 10% of 1 GiB chunks, 8 MiB 5x slower).
CHUNK_BYTES = 64 * 2**20
CPU_CHUNK_BYTES = 8 * 2**20

# exp() of anything below this is exactly 0 in float32 and float64. Clamping
# there changes no p and no p * log p, but turns the 0 * (-inf) of a masked
# (-inf) logit into 0 * finite = 0 in the entropy sums.
_FLOOR = _kernels.FLOOR

if TYPE_CHECKING:
    from typing import SupportsFloat, SupportsIndex

    TensorArg = Tensor
    FloatArg = SupportsFloat
    ChunkArg = SupportsIndex | None
    EntropyOver = Literal["full", "support"]
    SupportArg = Support | None
else:
    # Checked by _check below, whose TypeError/LayoutError names the value and the
    # rule; a beartype error raised first would say less.
    TensorArg = object
    FloatArg = object
    ChunkArg = object
    EntropyOver = object
    SupportArg = object

_Gather = Callable[..., object]
# all_gather_single replaces the deprecated all_gather_into_tensor (torch >= 2.13).
_all_gather: _Gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_chunk_rows(
    vocab: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> int:
    """Rows per chunk when ``chunk_size`` is None: two ``[rows, vocab]`` work buffers of
    the compute dtype fit in ``CPU_CHUNK_BYTES`` on the CPU and in ``CHUNK_BYTES`` on
    any other device; at least one row."""
    budget = CPU_CHUNK_BYTES if torch.device(device).type == "cpu" else CHUNK_BYTES
    itemsize = torch.empty((), dtype=_compute_dtype(dtype)).element_size()
    return max(1, budget // (2 * max(vocab, 1) * itemsize))


def _check(
    logits: object, targets: object, temperature: object, chunk_size: object
) -> tuple[Tensor, Tensor, float, int | None]:
    logits_ = checks.tensor("logits", logits, "a torch.Tensor [T, V_local]")
    if not logits_.is_floating_point():
        raise TypeError(
            f"logits has dtype {logits_.dtype}; pass floating-point logits (float32 or "
            "bfloat16; float16 and float64 are accepted too)"
        )
    targets_ = checks.tensor("targets", targets, "a torch.Tensor [T] of int64 token ids")
    if targets_.dtype != torch.int64:
        raise TypeError(
            f"targets has dtype {targets_.dtype}; pass int64 token ids (targets.long())"
        )
    if logits_.dim() != 2:
        raise LayoutError(
            f"logits has shape {tuple(logits_.shape)}; it must be 2-D [T, V_local] "
            "(flatten the batch first: logits.reshape(-1, logits.shape[-1]))"
        )
    rows, vocab = logits_.shape
    if vocab == 0:
        raise LayoutError(
            f"logits has shape {tuple(logits_.shape)}: 0 vocabulary columns; a vocabulary "
            "shard needs at least one"
        )
    if tuple(targets_.shape) != (rows,):
        raise LayoutError(
            f"targets has shape {tuple(targets_.shape)} but logits has {rows} rows; targets "
            f"must be [T] = [{rows}], one token id per row"
        )
    if targets_.device != logits_.device:
        raise LayoutError(
            f"targets is on {targets_.device} but logits on {logits_.device}; put them on "
            "the same device"
        )
    tau = checks.temperature(temperature)
    chunk: int | None = None
    if chunk_size is not None:
        chunk = checks.integer("chunk_size", chunk_size)
        if chunk < 1:
            raise LayoutError(
                f"chunk_size={chunk} is not allowed: it must be >= 1 (rows per "
                "chunk), or None for the default (about CHUNK_BYTES of work buffers)"
            )
    return logits_, targets_, tau, chunk


@boundary  # data-dependent (nonzero): not for a compiled caller to trace
def _check_range(targets: Tensor, vocab_total: int) -> None:
    """On the CPU, where it costs no device sync, refuse a target outside the vocabulary."""
    if targets.device.type != "cpu" or targets.numel() == 0:
        return
    bad = ((targets < 0) | (targets >= vocab_total)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise LayoutError(
            f"targets[{i}] = {int(targets[i])} is outside the vocabulary [0, {vocab_total}) "
            f"({bad.numel()} such rows); padding rows need an id in range too, e.g. 0"
        )


def _local_targets(targets: Targets, offset: int, vocab: int) -> tuple[Targets, Tensor]:
    """Column of each target in this shard (0 where not owned), and whether it is owned."""
    local = targets - offset
    owned = (local >= 0) & (local < vocab)
    return torch.where(owned, local, 0), owned


def _chunk_rows(chunk_size: int | None, logits: Tensor) -> tuple[int, int]:
    """Rows per chunk of the eager loop and of the compiled kernels: ``chunk_size`` for
    both when given, else ``default_chunk_rows`` and ``_kernels.compiled_chunk_rows``."""
    if chunk_size is not None:
        return chunk_size, chunk_size
    vocab, dtype, device = logits.shape[1], logits.dtype, logits.device
    return (
        default_chunk_rows(vocab, dtype, device),
        _kernels.compiled_chunk_rows(vocab, dtype, device),
    )


def _chunks(rows: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, rows)) for s in range(0, rows, chunk)]


def _pieces(runs: list[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """The chunks of each run of rows ``[lo, hi)``."""
    return [(s, min(s + chunk, hi)) for lo, hi in runs for s in range(lo, hi, chunk)]


def _local_stats(
    logits: Logits,
    column: Targets,
    owned: Tensor,
    tau: float,
    with_entropy: bool,
    chunk: int,
    compiled_chunk: int | None,
    runs: list[tuple[int, int]] | None = None,
) -> Tensor:
    """``[k, T]``: this shard's max, sum of exp relative to it, owned target logit (else
    0) and, with entropy, sum of exp * exponent; ``k`` is 4 with entropy, else 3. The
    compiled kernels (``_kernels.stats``, chunks of ``compiled_chunk`` rows) where they
    run, else (and always with ``compiled_chunk`` None) the eager loop (chunks of
    ``chunk`` rows).

    Only the rows of ``runs`` (default: all) are read in full; the others get the
    placeholders ``(0, 1, x_t, 0)``, the same on every shard. The compiled kernels
    read every row, so they run only when ``runs`` covers them all."""
    cdt = _compute_dtype(logits.dtype)
    rows, vocab = logits.shape
    runs = [(0, rows)] if runs is None else runs
    stats = torch.empty((4 if with_entropy else 3, rows), dtype=cdt, device=logits.device)
    covered = sum(hi - lo for lo, hi in runs) == rows
    target = logits.gather(1, column[:, None]).squeeze(1).to(cdt)
    stats[2] = torch.where(owned, target, 0.0)
    compiled = None
    if covered and compiled_chunk is not None:
        compiled = _kernels.stats(logits, tau, compiled_chunk)
    if compiled is not None:
        stats[0], stats[1] = compiled[0], compiled[1]
        if with_entropy:
            stats[3] = compiled[2]
        return stats
    if not covered:
        stats[0], stats[1] = 0.0, 1.0
        if with_entropy:
            stats[3] = 0.0
    for lo, hi in runs:
        stats[0, lo:hi] = logits[lo:hi].amax(1)
    m = stats[0]
    # A shard whose row is all -inf contributes S_r = 0 (and A_r = 0), not NaN.
    shift = torch.where(m == -math.inf, 0.0, m)
    pieces = _pieces(runs, chunk)
    n = min(chunk, rows) if pieces else 0
    work = torch.empty((n, vocab), dtype=cdt, device=logits.device)
    expd = torch.empty((n, vocab), dtype=cdt, device=logits.device)
    for s, e in pieces:
        d = torch.sub(logits[s:e], shift[s:e, None], out=work[: e - s])
        if tau != 1.0:
            d.div_(tau)
        if with_entropy:
            d.clamp_(min=_FLOOR)
        p = torch.exp(d, out=expd[: e - s])
        torch.sum(p, 1, out=stats[1, s:e])
        if with_entropy:
            torch.sum(p.mul_(d), 1, out=stats[3, s:e])
    return stats


def _combine(
    gathered: Tensor, tau: float, with_entropy: bool
) -> tuple[PerRow, PerRow, PerRow, PerRow | None]:
    """Global ``(M, log S, log p before the target-range mask, H or None)`` from the
    ``[W, k, T]`` statistics of all shards (``W = 1`` without TP)."""
    m, s = gathered[:, 0], gathered[:, 1]
    big_m = m.amax(0)
    delta = (m - big_m) / tau
    scale = torch.exp(delta)
    s_total = (scale * s).sum(0)
    log_s = torch.log(s_total)
    log_p = (gathered[:, 2].sum(0) - big_m) / tau - log_s
    if not with_entropy:
        return big_m, log_s, log_p, None
    # A shard with S_r = 0 (its row all -inf) adds nothing; d_r * S_r would be -inf * 0.
    a = torch.where(s > 0, scale * (gathered[:, 3] + delta * s), 0.0).sum(0)
    return big_m, log_s, log_p, log_s - a / s_total


def coefficients(
    g_lp: Tensor,
    g_entropy: Tensor | None,
    entropy: Tensor | None,
    tau: float,
    cdt: torch.dtype,
    *,
    placeholders: bool = False,
) -> tuple[Tensor | None, Tensor]:
    """The per-row ``(a, b)`` of the backward pass: ``d/d x = p * (a log p + b)`` plus
    the one-hot term, with ``a = -g_H / tau`` (None without an entropy gradient) and
    ``b = -(g_lp + g_H H) / tau``. With ``placeholders``, a row whose ``g_H`` is 0 adds
    no ``g_H H`` term even where ``H`` is not finite (a placeholder)."""
    if g_entropy is None:
        return None, -g_lp / tau
    assert entropy is not None
    g_h = g_entropy.to(cdt)
    h_term = g_h * entropy
    if placeholders:
        h_term = torch.where(g_h != 0, h_term, 0.0)
    return -g_h / tau, -(g_lp + h_term) / tau


def probs_and_factor(
    d: Tensor, log_s: Tensor, tau: float, a: Tensor | None, b: Tensor, s: int, e: int,
    expd: Tensor,
) -> tuple[Tensor, Tensor]:
    """Rows ``[s, e)``: from ``d = x - M`` (overwritten), ``p`` (into ``expd``) and the
    factor ``a log p + b`` (in ``d``, or ``b``'s column without entropy), so that the
    chunk's gradient is ``p * factor`` plus the one-hot term."""
    if tau != 1.0:
        d.div_(tau)
    d.sub_(log_s[s:e, None])
    if a is not None:
        d.clamp_(min=_FLOOR)
    p = torch.exp(d, out=expd[: e - s])
    factor = b[s:e, None] if a is None else d.mul_(a[s:e, None]).add_(b[s:e, None])
    return p, factor


def gather_stats(stats: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    """``[W, k, T]``: every shard's ``[k, T]`` statistics, by one all-gather under TP."""
    if tp_group is None:
        return stats[None]
    world = dist.get_world_size(tp_group)
    # The concatenation form [W * k, T]: gloo refuses the stacked [W, k, T].
    flat = stats.new_empty((world * stats.shape[0], stats.shape[1]))
    _all_gather(flat, stats, group=tp_group)
    return flat.view(world, *stats.shape)


def finish(
    stats: Tensor,
    sp_part: tuple[Sparse, Tensor, Tensor] | None,
    targets: Targets,
    vocab_total: int,
    tau: float,
    with_entropy: bool,
    tp_group: dist.ProcessGroup | None,
) -> tuple[PerRow, PerRow, PerRow, PerRow | None, _Restricted | None]:
    """From this shard's dense ``[k, T]`` statistics (``_local_stats``) and, with a
    support, ``(plan, [k', T] restricted statistics, [E] element logits)``: the one
    all-gather, then ``(M, log S, log-probs, entropy or None, restricted)``, the rows
    with a set taking their restricted log-prob (and entropy, where computed), NaN where
    a target (or a set's id) is outside the vocabulary. ``restricted`` is what the
    backward needs of the sets: ``(plan, x, M_u, log S_u, H_u or None)``."""
    k_dense = stats.shape[0]
    if sp_part is not None:
        stats = torch.cat([stats, sp_part[1]])
    gathered = gather_stats(stats, tp_group)
    big_m, log_s, log_p, entropy = _combine(gathered[:, :k_dense], tau, with_entropy)
    valid = (targets >= 0) & (targets < vocab_total)
    restricted = None
    if sp_part is not None:
        sp, sp_stats, sp_x = sp_part
        sp_with_h = sp_stats.shape[0] == 3
        # the restricted rows in _combine's order: max, sum, target logit, [A]
        order = [k_dense, k_dense + 1, 2] + ([k_dense + 2] if sp_with_h else [])
        m_u, s_u, lp_u, h_u = _combine(gathered[:, order], tau, sp_with_h)
        log_p = torch.where(sp.has_set, lp_u, log_p)
        if h_u is not None:
            assert entropy is not None
            entropy = torch.where(sp.has_set, h_u, entropy)
        restricted = (sp, sp_x, m_u, s_u, h_u)
        valid = valid & ~sp.bad_row
    return big_m, log_s, torch.where(valid, log_p, math.nan), entropy, restricted


def split_restricted(
    restricted: _Restricted | None,
    g_lp: Tensor,
    g_entropy: Tensor | None,
    entropy_over_support: bool,
    gap: int,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, list[tuple[int, int]] | None]:
    """The upstream gradients split into the dense part and the restricted rows' part:
    ``(g_lp, g_entropy, g_lp_u, g_h_u, runs)``; ``runs`` are the rows that still need
    the dense pass (None: all). Without sets, the inputs and None."""
    if restricted is None:
        return g_lp, g_entropy, None, None, None
    # rows with a set: the log-prob's gradient is sparse, and so is the entropy's with
    # entropy_over="support" (or no entropy gradient)
    sp, _, _, _, h_u = restricted
    g_lp_u = torch.where(sp.has_set, g_lp, 0.0)
    g_lp = g_lp - g_lp_u
    g_h_u = None
    if g_entropy is not None and h_u is not None:
        g_h_u = torch.where(sp.has_set, g_entropy.to(g_lp.dtype), 0.0)
        g_entropy = g_entropy.to(g_lp.dtype) - g_h_u
    runs = None
    if g_entropy is None or entropy_over_support:
        runs = _support.dense_runs(~sp.host_has_set, gap)
    return g_lp, g_entropy, g_lp_u, g_h_u, runs


def check_sets(
    support: object, entropy_over: object, rows: int, vocab_total: int, what: str = "logits"
) -> Support | None:
    """``support`` checked against the ``rows`` of ``what`` and the vocabulary (see
    ``_support.check_support``), after ``entropy_over``."""
    if entropy_over not in ("full", "support"):
        raise LayoutError(
            f"entropy_over={entropy_over!r} is not one of 'full' (entropy over the whole "
            "vocabulary) or 'support' (over each row's set plus its target)"
        )
    if support is None:
        return None
    return _support.check_support(support, rows, vocab_total, what)


def save_outputs(
    ctx: Any,
    inputs: tuple[Tensor, ...],
    big_m: PerRow,
    log_s: PerRow,
    entropy: PerRow | None,
    entropy_grad: bool,
    restricted: _Restricted | None,
    entropy_over_support: bool,
    tau: float,
    offset: int,
) -> None:
    """What both log-prob Functions' backward reads (``backward_terms``): the tensors
    ``(*inputs, M, log S[, H])`` (H only when its gradient is wanted, else the entropy
    is marked non-differentiable) and the sets, temperature and shard offset."""
    ctx.set_materialize_grads(False)
    ctx.restricted = restricted
    ctx.entropy_over_support = entropy_over_support
    ctx.tau, ctx.offset = tau, offset
    ctx.entropy_grad = entropy is not None and entropy_grad
    if entropy is not None and not entropy_grad:
        ctx.mark_non_differentiable(entropy)
    ctx.save_for_backward(*inputs, big_m, log_s, *((entropy,) if ctx.entropy_grad else ()))


class _Terms(NamedTuple):
    """The per-row terms of a backward pass: each row's target column in the shard and
    its one-hot coefficient (0 where the shard does not own the target), the dense
    coefficients ``(a, b)`` of ``coefficients``, the restricted rows' upstream
    gradients (None without sets) and the rows that need the dense pass (None: all)."""

    column: Targets
    onehot: PerRow
    a: PerRow | None
    b: PerRow
    g_lp_u: PerRow | None
    g_h_u: PerRow | None
    runs: list[tuple[int, int]] | None


def backward_terms(
    ctx: Any,
    targets: Targets,
    log_s: PerRow,
    entropy: PerRow | None,
    g_logp: PerRow | None,
    g_entropy: PerRow | None,
    vocab: int,
    cdt: torch.dtype,
    gap: int,
) -> _Terms:
    """``_Terms`` from the upstream gradients and what ``save_outputs`` kept
    (``entropy`` the saved H, None when it was not saved); ``gap`` merges dense runs
    closer than it (``_support.dense_runs``)."""
    tau: float = ctx.tau
    if not ctx.entropy_grad:
        g_entropy = None
    column, owned = _local_targets(targets, ctx.offset, vocab)
    g_lp = torch.zeros_like(log_s) if g_logp is None else g_logp.to(cdt)
    restricted: _Restricted | None = ctx.restricted
    g_lp, g_entropy, g_lp_u, g_h_u, runs = split_restricted(
        restricted, g_lp, g_entropy, ctx.entropy_over_support, gap
    )
    # H may be a placeholder where a row's set took its entropy gradient
    h = None if g_entropy is None else entropy
    a, b = coefficients(g_lp, g_entropy, h, tau, cdt, placeholders=restricted is not None)
    return _Terms(column, torch.where(owned, g_lp / tau, 0.0), a, b, g_lp_u, g_h_u, runs)


class _LogProbEntropy(torch.autograd.Function):
    """Forward: chunked statistics and one all-gather under TP. Backward: no
    communication; the gradient is written once into one ``[T, V_local]`` buffer."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Logits,
        targets: Targets,
        with_entropy: bool,
        entropy_grad: bool,
        tau: float,
        tp_group: dist.ProcessGroup | None,
        chunk_size: int | None,
        support: Support | None = None,
        entropy_over_support: bool = False,
    ) -> tuple[PerRow, PerRow | None]:
        rows, vocab = logits.shape
        chunk, compiled_chunk = _chunk_rows(chunk_size, logits)
        if tp_group is None:
            rank, world = 0, 1
        else:
            rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        column, owned = _local_targets(targets, rank * vocab, vocab)
        sp = None
        if support is not None:
            sp = _support.plan(support, targets, rank * vocab, vocab, world * vocab)
        runs = None
        if sp is not None and not (with_entropy and not entropy_over_support):
            # rows with a set need no full pass: their log-prob (and entropy) is sparse
            runs = _support.dense_runs(~sp.host_has_set, chunk)
        stats = _local_stats(
            logits, column, owned, tau, with_entropy, chunk, compiled_chunk, runs
        )
        sp_part = None
        if sp is not None:
            sp_stats, sp_x = _support.sparse_stats(
                logits, sp, tau, with_entropy and entropy_over_support, stats.dtype
            )
            sp_part = (sp, sp_stats, sp_x)
        big_m, log_s, log_p, entropy, restricted = finish(
            stats, sp_part, targets, world * vocab, tau, with_entropy, tp_group
        )

        save_outputs(
            ctx, (logits, targets), big_m, log_s, entropy, entropy_grad, restricted,
            entropy_over_support, tau, rank * vocab,
        )
        ctx.chunk = chunk_size
        return log_p, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, g_logp: PerRow | None, g_entropy: PerRow | None
    ) -> tuple[Logits | None, None, None, None, None, None, None, None, None]:
        saved: tuple[Tensor, ...] = ctx.saved_tensors
        logits, targets, big_m, log_s = saved[:4]
        tau: float = ctx.tau
        chunk, compiled_chunk = _chunk_rows(ctx.chunk, logits)
        nones = (None,) * 8
        if not ctx.needs_input_grad[0]:
            return (None, *nones)
        rows, vocab = logits.shape
        cdt = _compute_dtype(logits.dtype)
        terms = backward_terms(
            ctx, targets, log_s, saved[4] if len(saved) > 4 else None, g_logp, g_entropy,
            vocab, cdt, chunk,
        )
        column, onehot, a, b = terms.column, terms.onehot, terms.a, terms.b
        runs = [(0, rows)] if terms.runs is None else terms.runs
        covered = sum(hi - lo for lo, hi in runs) == rows
        grad = _kernels.buffer(logits.shape, logits.dtype, logits.device, zero=not covered)
        hot = None if g_logp is None else onehot
        # the compiled kernels write every row: only when every row needs the dense pass
        if covered and _kernels.grad(
            logits, big_m, log_s, tau, a, b, column, hot, compiled_chunk, grad
        ):
            pieces = []
        else:
            pieces = _pieces(runs, chunk)
        n = min(chunk, rows) if pieces else 0
        work = torch.empty((n, vocab), dtype=cdt, device=logits.device)
        expd = torch.empty((n, vocab), dtype=cdt, device=logits.device)
        for s, e in pieces:
            d = torch.sub(logits[s:e], big_m[s:e, None], out=work[: e - s])
            p, factor = probs_and_factor(d, log_s, tau, a, b, s, e, expd)
            # Write the float result straight into the gradient when the dtypes agree;
            # otherwise round once, after the one-hot term is in.
            out = grad[s:e] if grad.dtype == cdt else p
            torch.mul(p, factor, out=out)
            if g_logp is not None:
                out.scatter_add_(1, column[s:e, None], onehot[s:e, None].to(out.dtype))
            if out is p:
                grad[s:e].copy_(p)
        if ctx.restricted is not None:
            sp, sp_x, m_u, s_u, h_u = ctx.restricted
            assert terms.g_lp_u is not None
            coef = _support.coefficients(sp, sp_x, m_u, s_u, h_u, terms.g_lp_u, terms.g_h_u, tau)
            _support.sparse_grad(grad, sp, coef)
        return (grad, *nones)


# torch leaves Function.apply untyped; typed once here, at the boundary.
_apply = cast(Callable[..., tuple[Tensor, Tensor | None]], _LogProbEntropy.apply)


@overload
def log_probs_and_entropy(
    logits: TensorArg,
    targets: TensorArg,
    *,
    with_entropy: Literal[False] = False,
    entropy_grad: bool = True,
    temperature: FloatArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
) -> tuple[PerRow, None]: ...
@overload
def log_probs_and_entropy(
    logits: TensorArg,
    targets: TensorArg,
    *,
    with_entropy: Literal[True],
    entropy_grad: bool = True,
    temperature: FloatArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
) -> tuple[PerRow, PerRow]: ...
@overload
def log_probs_and_entropy(
    logits: TensorArg,
    targets: TensorArg,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: FloatArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
) -> tuple[PerRow, PerRow | None]: ...
def log_probs_and_entropy(
    logits: TensorArg,
    targets: TensorArg,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: FloatArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
) -> tuple[PerRow, PerRow | None]:
    """Log-prob of each row's target, and optionally its entropy, under ``softmax(logits /
    temperature)`` over the full (possibly tensor-parallel) vocabulary.

    Args:
        logits: ``[T, V_local]`` float32 or bfloat16 (float16, float64 accepted), this
            rank's vocabulary shard: TP rank ``r`` holds token ids
            ``[r * V_local, (r + 1) * V_local)``, all shards of equal size. Never
            modified; saved for backward by reference (do not modify it in place
            before backward).
        targets: ``[T]`` int64 *global* token ids; a target in another rank's shard
            takes its logit from that rank. Padding rows need some id in range.
        with_entropy: also return the entropy of each row's distribution.
        entropy_grad: with False the entropy is a detached metric (no gradient,
            nothing saved for it).
        temperature: finite, > 0; the logits are divided by it.
        tp_group: the tensor-parallel group the vocabulary is split over; None means
            the whole vocabulary is local.
        chunk_size: rows per chunk of work; None picks ``default_chunk_rows``: two
            ``[rows, V_local]`` float32 work buffers within 8 MiB on the CPU (cache
            resident), 64 MiB elsewhere. With the compiled kernels
            (``CPSLICE_COMPILE``, see ``_kernels``) it is their fixed chunk's rows; None
            picks ``[C, V_local]`` within 32 MiB on the CPU, 1 GiB elsewhere.
        support: per-row token sets (top-p / top-k replay), the same on every rank of
            ``tp_group``. A row with a non-empty set ``S_t`` takes its log-prob under
            the softmax restricted to ``S_t`` plus its target (a target outside the
            set still gets a finite log-prob); its gradient is zero outside that set.
            A row with an empty set is unrestricted. ``O(K)`` work on those rows: the
            logits are gathered at the set's ids, never masked or copied.
        entropy_over: ``"full"`` (default): the entropy over the whole vocabulary,
            one full pass over every row. ``"support"``: rows with a set take the
            entropy of their restricted distribution, with no full pass over them.

    Returns:
        ``(log_probs, entropy)``, each ``[T]`` float32 (float64 for float64 logits,
        which are computed in float64; every other dtype in float32), entropy None
        unless ``with_entropy``. Differentiable w.r.t. ``logits``. Memory: beyond the
        logits, only ``[T]`` statistics and the chunk work buffers in forward, and
        in backward the one ``[T, V_local]`` gradient (dtype of logits); with a
        support, ``O(K + T)`` more. Rows with a set skip the chunked full pass unless
        the full entropy is asked for.

    Collectives: with ``tp_group``, exactly one ``all_gather`` of a ``[k, T]`` tensor
    in forward (``k`` = 4 with entropy, else 3; with a support 2 more, 3 more with
    ``entropy_over="support"``), entered by every rank whatever its inputs or sets
    (T = 0 too); ``T``, ``with_entropy``, ``entropy_over`` and whether a support is
    given must agree across the group. Backward enters none. Without ``tp_group``,
    no communication.

    Raises:
        TypeError: logits not a floating-point tensor, targets not an int64 tensor,
            temperature not a real number, chunk_size not an integer.
        LayoutError: logits not 2-D or with 0 columns, targets not ``[T]``, tensors on
            different devices, temperature not finite and > 0, chunk_size < 1, a CPU
            target outside ``[0, tp_size * V_local)`` (checked only on the CPU, where
            it costs no device sync; elsewhere that row's log-prob is NaN), a support
            over another number of rows or with a CPU id outside the vocabulary (on
            a device such a row's log-prob is NaN),
            ``entropy_over`` not ``"full"`` or ``"support"``. Raised before any
            collective. (``support`` not a ``Support``: TypeError.)

    A row whose logits are all -inf, or hold NaN or +inf, gives NaN; single -inf
    logits (masked tokens) are fine.
    """
    logits_, targets_, tau, chunk = _check(logits, targets, temperature, chunk_size)
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    if tp_group is not None and dist.get_rank(tp_group) < 0:
        raise LayoutError("this process is not a member of tp_group")
    _check_range(targets_, world * logits_.shape[1])
    support = check_sets(support, entropy_over, logits_.shape[0], world * logits_.shape[1])
    return _apply(
        logits_, targets_, with_entropy, entropy_grad, tau, tp_group, chunk, support,
        entropy_over == "support",
    )
