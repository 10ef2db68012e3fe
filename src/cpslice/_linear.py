"""Log-probs and entropy straight from the final hidden states and the LM-head weight.

``logits = hidden @ weight.T`` is never built whole. Both passes walk ``[rows,
V_block]`` tiles (``_tiles``). Forward computes each tile's logits, reduces them to the
per-row statistics of ``_logprob`` (its chunk kernels, compiled where
``CPSLICE_COMPILE`` says so), merges those of a row's vocabulary blocks (``_merge``)
and drops the logits; ``_logprob.finish`` (one all-gather of the ``[k, T]``
statistics) gives the global ``M``, ``log S``, log-probs and entropy, exactly as
``log_probs_and_entropy`` on the materialized logits. Backward walks the same tiles
vocabulary block by vocabulary block: each tile's logits are recomputed by the same
matmul, so bit for bit those the statistics came from (a row sure of its target gets
a gradient of exactly 0), turned into the tile's logit gradient ``G`` (the same
kernels as ``_logprob``'s backward) and multiplied out at once:

    d hidden += G @ weight[block]          (a [T, H] sum over blocks; over TP by one all-reduce)
    d weight[block] = sum over tiles of G.T @ hidden[rows]   (written once per block)

so the weight gradient is summed over the rows by matmuls (their own float32
accumulation for bfloat16) and stored once: no float32 ``[V_local, H]`` accumulator.
Memory beyond the inputs and their gradients is ``O(T)`` statistics, the ``[T, H]``
hidden-gradient accumulator (the gradient itself in float32) and a few tiles.

A support (``Support``) restricts rows to their sets as on the logits path: each set
element's logit is ``hidden[row] . weight[col]`` (``O(K H)``), rows with a set need no
tile unless the full entropy is asked for, and their gradient reaches ``d hidden``
and each block of ``d weight`` as ``O(K H)`` index-adds in float32.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, cast, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _checks as checks
from . import _kernels, _support
from ._errors import LayoutError
from ._layout import Layout
from ._logprob import (
    ChunkArg,
    EntropyOver,
    FloatArg,
    SupportArg,
    TensorArg,
    _check,
    _check_range,
    _compute_dtype,
    _local_stats,
    _local_targets,
    _pieces,
    backward_terms,
    check_sets,
    finish,
    probs_and_factor,
    save_outputs,
)
from ._pack import response_rows, shifted_targets
from ._plan import resolve_length
from ._support import Sparse, Support
from ._types import AnyShare, HeadWeight, Hidden, PerRow, Share, Targets

# Module-level, so that a test can count the collectives.
_all_reduce: Callable[..., object] = dist.all_reduce

# Rows per chunk when chunk_size is None: one float32 [rows, V_local] block holds about
# this many bytes; a tile (_tiles) holds half as many elements. Larger than the logits
# path's chunks (CHUNK_BYTES, CPU_CHUNK_BYTES): each tile runs a matmul, and a matmul
# of few rows is slow (measured on the CPU, T=4096, H=1024, V=32768: 32-row chunks
# 3.1x the time of one whole matmul, 256-row chunks 1.2x).
LINEAR_CHUNK_BYTES = 32 * 2**20
TILE_ROWS = 2048
"""Tiles span at least this many rows (all rows if fewer): see ``_tiles``."""
ELEMENT_BYTES = 16 * 2**20
"""Support elements are multiplied out in pieces of one float32 ``[n, H]`` within this."""


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


def _tiles(rows: int, vocab: int, chunk: int) -> tuple[int, int]:
    """``(rows, columns)`` of a tile, forward and backward: half as many elements as one
    chunk of ``chunk`` rows (``chunk * vocab``; a backward tile holds its logits, its
    gradient and the eager kernels' two work tiles) over at least ``TILE_ROWS`` rows
    (all of them if fewer), so that a tile's weight-gradient block sums many rows in
    one matmul."""
    tile_rows = max(1, min(rows, max(chunk, TILE_ROWS)))
    return tile_rows, max(1, min(vocab, chunk * vocab // (2 * tile_rows)))


def _blocks(size: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, size)) for s in range(0, size, block)]


def _element_logits(hidden: Tensor, weight: Tensor, sp: Sparse, cdt: torch.dtype) -> Tensor:
    """``[E]``: the logit of each support element, ``hidden[row] . weight[col]``, rounded
    to the inputs' dtype as the materialized head's logits are; ``[chunk, H]`` pieces."""
    x = torch.empty(sp.row.numel(), dtype=cdt, device=hidden.device)
    for s, e in _blocks(sp.row.numel(), _element_rows(hidden.shape[1])):
        prod = hidden[sp.row[s:e]].to(cdt) * weight[sp.col[s:e]].to(cdt)
        x[s:e] = prod.sum(1).to(hidden.dtype).to(cdt)
    return x


def _element_rows(width: int) -> int:
    """Support elements per piece: one float32 ``[n, width]`` product within
    ``ELEMENT_BYTES``."""
    return max(1, ELEMENT_BYTES // (4 * max(width, 1)))


class _LinearLogProbEntropy(torch.autograd.Function):
    """Forward: row chunks of logits -> ``[k, T]`` statistics -> one all-gather under
    TP. Backward: ``[rows, V_block]`` tiles of logits again -> tile gradient -> ``d
    hidden`` (accumulated over vocabulary blocks) and ``d weight`` (each block written
    once); one all-reduce of ``d hidden`` under TP."""

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
        support: Support | None = None,
        entropy_over_support: bool = False,
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
        sp_part = None
        runs = [(0, rows)]
        if support is not None:
            sp = _support.plan(support, targets, rank * vocab, vocab, world * vocab)
            sp_x = _element_logits(hidden, weight, sp, cdt)
            sp_part = (sp, _support.stats_of(sp_x, sp, rows, tau, with_entropy and entropy_over_support), sp_x)
            if not (with_entropy and not entropy_over_support):
                # rows with a set need no logits row: their log-prob (and entropy) is sparse
                runs = _support.dense_runs(~sp.host_has_set, chunk)
                # their placeholders, as _local_stats gives them; the target logit is
                # the row's candidate, the last T elements
                stats[0], stats[1] = 0.0, 1.0
                stats[2] = torch.where(owned, sp_x[sp_x.numel() - rows :], 0.0)
                if with_entropy:
                    stats[3] = 0.0
        tile_rows, tile_cols = _tiles(rows, vocab, chunk)
        pieces = _pieces(runs, tile_rows)
        compiled_chunk = _kernels.compiled_chunk_rows(tile_cols, hidden.dtype, hidden.device)
        blocks = _blocks(vocab, tile_cols)
        for s, e in pieces:
            merged = None
            for v0, v1 in blocks:
                # the same [rows, V_block] tiles, by the same matmuls, as backward: its
                # recomputed logits are these bit for bit, so the gradient's p and the
                # forward's max and sum agree (a row sure of its target gets exactly 0)
                x = torch.mm(hidden[s:e], weight[v0:v1].t())
                own_b = owned[s:e] & (column[s:e] >= v0) & (column[s:e] < v1)
                col_b = torch.where(own_b, column[s:e] - v0, 0)
                part = _local_stats(x, col_b, own_b, tau, with_entropy, e - s, compiled_chunk)
                del x
                merged = part if merged is None else _merge(torch.stack([merged, part]), tau, with_entropy)
            assert merged is not None
            stats[:, s:e] = merged
        big_m, log_s, log_p, entropy, restricted = finish(
            stats, sp_part, targets, world * vocab, tau, with_entropy, tp_group
        )

        save_outputs(
            ctx, (hidden, weight, targets), big_m, log_s, entropy, entropy_grad, restricted,
            entropy_over_support, tau, rank * vocab,
        )
        ctx.chunk, ctx.tp_group, ctx.pieces = chunk, tp_group, pieces
        return log_p, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, g_logp: PerRow | None, g_entropy: PerRow | None
    ) -> tuple[Hidden | None, HeadWeight | None, None, None, None, None, None, None, None, None]:
        saved: tuple[Tensor, ...] = ctx.saved_tensors
        hidden, weight, targets, big_m, log_s = saved[:5]
        tau: float = ctx.tau
        chunk: int = ctx.chunk
        tp_group: dist.ProcessGroup | None = ctx.tp_group
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 8
        if not (want_h or want_w):
            return (None, None, *none)
        rows, vocab = hidden.shape[0], weight.shape[0]
        dtype, cdt = hidden.dtype, _compute_dtype(hidden.dtype)
        terms = backward_terms(
            ctx, targets, log_s, saved[5] if len(saved) > 5 else None, g_logp, g_entropy,
            vocab, cdt, chunk,
        )
        column, onehot, a, b, runs = terms.column, terms.onehot, terms.a, terms.b, terms.runs
        # Sums over vocabulary blocks and support elements in the compute dtype: the
        # hidden gradient in a [T, H] accumulator (the gradient itself in float32), the
        # weight gradient one [V_block, H] block at a time, each rounded once.
        acc_h = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        tile_rows, tile_cols = _tiles(rows, vocab, chunk)
        # forward's tiles (see there) that hold a row needing the dense pass
        need = [(0, rows)] if runs is None else runs
        pieces = [(s, e) for s, e in ctx.pieces if any(lo < e and s < hi for lo, hi in need)]
        sp_blocks = None
        if ctx.restricted is not None:
            sp, sp_x, m_u, s_u, h_u = ctx.restricted
            assert terms.g_lp_u is not None
            coef = _support.coefficients(sp, sp_x, m_u, s_u, h_u, terms.g_lp_u, terms.g_h_u, tau)
            if acc_h is not None:
                for s, e in _blocks(coef.numel(), _element_rows(hidden.shape[1])):
                    part = coef[s:e, None] * weight[sp.col[s:e]].to(cdt)
                    acc_h.index_add_(0, sp.row[s:e], part)
            if grad_w is not None:
                sp_blocks = _by_block(sp, coef, vocab, tile_cols)
        compiled_chunk = _kernels.compiled_chunk_rows(tile_cols, dtype, hidden.device)
        tile = tile_rows * tile_cols
        g_buf = torch.empty(tile if pieces else 0, dtype=dtype, device=hidden.device)
        work = expd = None
        for i, (v0, v1) in enumerate(_blocks(vocab, tile_cols)):
            w_b = weight[v0:v1]
            acc_w = None
            if grad_w is not None:
                acc_w = grad_w[v0:v1] if dtype == cdt else torch.zeros(w_b.shape, dtype=cdt, device=w_b.device)
                if dtype == cdt:
                    acc_w.zero_()
            in_block = (column >= v0) & (column < v1)
            col_b = torch.where(in_block, column - v0, 0)
            hot_b = None if g_logp is None else torch.where(in_block, onehot, 0.0)
            for s, e in pieces:
                x = torch.mm(hidden[s:e], w_b.t())
                g = g_buf[: x.numel()].view(x.shape)
                if not _kernels.grad(
                    x, big_m[s:e], log_s[s:e], tau, None if a is None else a[s:e], b[s:e],
                    col_b[s:e], None if hot_b is None else hot_b[s:e], compiled_chunk, g,
                ):
                    if work is None or expd is None:
                        work = torch.empty(tile, dtype=cdt, device=x.device)
                        expd = torch.empty(tile, dtype=cdt, device=x.device)
                    _eager_tile(x, big_m, log_s, tau, a, b, col_b, hot_b, s, e, work, expd, g)
                del x
                # The matmuls run in the inputs' dtype, as the materialized head's would.
                if acc_h is not None:
                    if dtype == cdt:
                        acc_h[s:e].addmm_(g, w_b)
                    else:
                        acc_h[s:e].add_(torch.mm(g, w_b))
                if acc_w is not None:
                    if dtype == cdt:
                        acc_w.addmm_(g.t(), hidden[s:e])
                    else:
                        acc_w.add_(torch.mm(g.t(), hidden[s:e]))
            if acc_w is not None and sp_blocks is not None:
                _add_elements(acc_w, sp_blocks, i, v0, hidden, cdt)
            if grad_w is not None and acc_w is not None and dtype != cdt:
                grad_w[v0:v1] = acc_w
        grad_h = None
        if acc_h is not None:
            grad_h = acc_h if dtype == cdt else acc_h.to(dtype)
            if tp_group is not None:
                # hidden is the same on every TP rank; its gradient is the sum of the shards'.
                _all_reduce(grad_h, group=tp_group)
        return grad_h, grad_w, *none


def _merge(parts: Tensor, tau: float, with_entropy: bool) -> Tensor:
    """``[k, n]``: the statistics of ``_local_stats`` over the union of the vocabulary
    blocks whose statistics ``parts`` (``[B, k, n]``) holds: the max, the sum of exp
    relative to it (rescaled as ``_combine`` rescales the shards'), the owned target
    logit (at most one block owns it) and, with entropy, the sum of exp * exponent. A
    row that is -inf in every block keeps ``_local_stats``' ``(-inf, 0, ., 0)``."""
    m, s = parts[:, 0], parts[:, 1]
    big_m = m.amax(0)
    delta = (m - torch.where(big_m == -math.inf, 0.0, big_m)) / tau
    scale = torch.exp(delta)
    merged = [big_m, (scale * s).sum(0), parts[:, 2].sum(0)]
    if with_entropy:
        # a block with S = 0 (all -inf) adds nothing; delta * S would be -inf * 0
        merged.append(torch.where(s > 0, scale * (parts[:, 3] + delta * s), 0.0).sum(0))
    return torch.stack(merged)


def _eager_tile(
    x: Tensor, big_m: Tensor, log_s: Tensor, tau: float, a: Tensor | None, b: Tensor,
    col_b: Tensor, hot_b: Tensor | None, s: int, e: int, work: Tensor, expd: Tensor,
    out: Tensor,
) -> None:
    """The eager kernels on one ``[e - s, V_block]`` tile of logits ``x``: its gradient
    into ``out`` (rounded once to its dtype)."""
    n = x.numel()
    d = torch.sub(x, big_m[s:e, None], out=work[:n].view(x.shape))
    p, factor = probs_and_factor(d, log_s, tau, a, b, s, e, expd[:n].view(x.shape))
    g = p.mul_(factor)
    if hot_b is not None:
        g.scatter_add_(1, col_b[s:e, None], hot_b[s:e, None])
    out.copy_(g)


class _Blocks(NamedTuple):
    """Support elements sorted by their local column, with each vocabulary block's
    range among them (host ints, one read of ``V_local / V_block + 1`` values)."""

    col: Tensor
    row: Tensor
    coef: Tensor
    bounds: list[int]


def _by_block(sp: Sparse, coef: Tensor, vocab: int, block: int) -> _Blocks:
    """The elements that count on this shard, by vocabulary block (those that do not
    sort past the last block)."""
    key = torch.where(sp.member, sp.col, vocab)
    order = torch.argsort(key)
    edges = torch.tensor([*range(0, vocab, block), vocab], device=key.device)
    bounds = torch.searchsorted(key[order], edges).tolist()
    return _Blocks(sp.col[order], sp.row[order], coef[order], bounds)


def _add_elements(
    acc_w: Tensor, blocks: _Blocks, i: int, v0: int, hidden: Tensor, cdt: torch.dtype
) -> None:
    """Add the support elements of block ``i`` (its first column ``v0``) into its weight
    gradient ``acc_w`` (compute dtype): ``coef * hidden[row]`` at each column."""
    lo, hi = blocks.bounds[i], blocks.bounds[i + 1]
    for s, e in _blocks(hi - lo, _element_rows(hidden.shape[1])):
        part = blocks.coef[lo + s : lo + e, None] * hidden[blocks.row[lo + s : lo + e]].to(cdt)
        acc_w.index_add_(0, blocks.col[lo + s : lo + e] - v0, part)


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
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
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
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
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
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
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
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
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
        targets, with_entropy, entropy_grad, temperature, tp_group, support,
            entropy_over: as ``log_probs_and_entropy`` (a support's rows are the ``T``
            rows of ``hidden``; each set element's logit is ``hidden[t] . weight[id]``).
        chunk_size: sizes the tiles, forward and backward: each holds half the
            elements of ``chunk_size`` rows of ``V_local`` columns, over at least
            ``TILE_ROWS`` rows (all rows if fewer). None picks
            ``default_linear_chunk_rows(V_local)``: ``chunk_size`` rows of float32
            within 32 MiB.

    Returns:
        ``(log_probs, entropy)`` as ``log_probs_and_entropy`` on the materialized logits
        (each ``[T]`` float32, float64 for float64 inputs; the statistics accumulate in
        float32 for bfloat16/float16). Differentiable w.r.t. ``hidden`` and ``weight``:
        ``weight``'s gradient is this shard's; ``hidden``'s is the *full* gradient,
        summed over the TP group, so everything below the head gets correct gradients.
        Memory beyond the inputs and their gradients: ``[T]`` statistics and a few
        tiles (a tile's logits and work buffers) in forward; in backward a few
        tiles, a float32 ``[T, H]`` sum of the hidden gradient (bfloat16/float16
        inputs) and one float32 ``[V_block, H]`` block of the weight gradient at a
        time, never a float32 ``[V_local, H]`` copy; with a support ``O(K + T)``
        more and ``[n, H]`` pieces of its elements. Backward recomputes the logits
        (one more matmul).

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
    support = check_sets(support, entropy_over, hidden_.shape[0], world * weight_.shape[0], "hidden")
    if chunk is None:
        chunk = default_linear_chunk_rows(weight_.shape[0])
    return _apply(
        hidden_, weight_, targets_, with_entropy, entropy_grad, tau, tp_group, chunk,
        support, entropy_over == "support",
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
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
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
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
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
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
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
    support: SupportArg = None,
    entropy_over: EntropyOver = "full",
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
    ``support`` is over the ``T`` rows of ``hidden``, as ``response_log_probs`` takes it
    (``Support.from_responses``); the response rows' sets are taken from it, and its
    errors name its own rows.

    Collectives: those of ``linear_log_probs_and_entropy`` (one all-gather over
    ``tp_group`` forward, one all-reduce backward); no CP communication.

    Raises:
        TypeError, LayoutError: as ``shifted_targets`` and
            ``linear_log_probs_and_entropy``; ``hidden`` of a length the layout cannot
            hold; a support over another number of rows than ``hidden``'s.
    """
    if checks.tensor("hidden", hidden, "a torch.Tensor [T, H]").dim() != 2:
        raise LayoutError(
            f"hidden has shape {tuple(hidden.shape)}; it must be 2-D [T, H] (flatten the "
            "batch first: hidden.reshape(-1, hidden.shape[-1]))"
        )
    length = resolve_length(layout, int(hidden.shape[0]), "hidden")
    local = layout.with_local_length(length)
    host_rows, counts = response_rows(local)
    rows = host_rows.to(hidden.device)
    targets = shifted_targets(tokens, local).to(hidden.device)
    if support is not None:
        # the whole support against the whole hidden (its errors name the caller's
        # rows), then the response rows' sets
        _, weight_, _, _, _ = _check_linear(hidden, weight, targets, temperature, chunk_size)
        world = 1 if tp_group is None else dist.get_world_size(tp_group)
        whole = check_sets(support, entropy_over, length, world * weight_.shape[0], "hidden")
        assert whole is not None
        support = _support.take_rows(whole, host_rows)
    targets = targets[rows]
    log_probs, entropy = linear_log_probs_and_entropy(
        hidden[rows],
        weight,
        targets,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        temperature=temperature,
        tp_group=tp_group,
        chunk_size=chunk_size,
        support=support,
        entropy_over=entropy_over,
    )
    shares = list(torch.split(log_probs, counts))
    return shares, None if entropy is None else list(torch.split(entropy, counts))
