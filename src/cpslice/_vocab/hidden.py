"""The hidden-state driver: log-probs and entropy straight from the final hidden states
and the LM-head weight, ``logits = hidden @ weight.T`` never built whole.

Its blocks are ``[rows, V_block]`` matmul blocks (``blocks.Blocks``), walked the same way
forward and backward: cache-sized on the CPU, on CUDA ``blocks.SPLIT`` columns by as many
rows as a budget holds (``blocks.sizes``, ``CPSLICE_BLOCK_MIB``). Forward
(``blocks.dense_pass``) computes each block's logits and statistics (``blocks.block_stats``:
the selection's backend), merges a row's vocabulary blocks (``stats.merge``, as TP shards
merge) and drops the logits; ``call.finish`` (one all-gather under TP) gives the global
``M``, ``log S``, log-probs and entropy, exactly as ``log_probs_and_entropy`` on the
materialized logits. Backward walks the same blocks vocabulary block by vocabulary block:
each block's logits are recomputed by the same matmul, so bit for bit those the
statistics came from (a row sure of its target gets a gradient of exactly 0), turned into
the block's logit gradient ``G`` (``blocks.block_grad``) and multiplied out at once:

    d hidden += G @ weight[block]          (a [T, H] sum over blocks; over TP by one all-reduce)
    d weight[block] = sum over row blocks of G.T @ hidden[rows]   (written once per block)

so the weight gradient is summed over the rows by matmuls (their own float32
accumulation for bfloat16) and stored once: no float32 ``[V_local, H]`` accumulator
(``_Sum``), and on CUDA, where one block holds every row, none at all (one GEMM per
split, written straight into the weight's gradient). Memory beyond the inputs and their
gradients is ``O(T)`` statistics, the ``[T, H]`` hidden-gradient sum (the gradient itself
in float32) and a few blocks.

A support restricts rows to their sets as on the logits path: each set element's logit
is ``hidden[row] . weight[col]`` (``O(K H)``), rows with a set need no block unless the
full entropy is asked for, and their gradient reaches ``d hidden`` and each block of
``d weight`` as ``O(K H)`` index-adds in float32.
"""

from collections.abc import Sequence
from typing import Literal, NamedTuple, Unpack, overload

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _probe
from .._types import (
    ChunkArg,
    EntropyOverArg,
    HeadWeight,
    Hidden,
    IntArg,
    PerRow,
    RealArg,
    TemperatureArg,
    TensorArg,
    compute_dtype,
)
from . import args, head, invariant, sequence, spec, topk
from .backends.chunks import Workspace
from .backends.interface import product
from .blocks import (
    Blocks,
    block_grad,
    default_hidden_chunk,
    dense_pass,
    element_logits,
    element_rows,
    grid,
    in_block,
    spans,
)
from .call import Options, Saved, Sets, finish, row_terms, tile_count
from .gemm_settings import exact_if
from .gradient import RowGrad
from .rows import At, count, gather, holding, index_of, places
from .set_elements import Elements, Split, element_grad, elements, set_stats
from .shard import Shard, shard_of
from .stats import Stats, placeholders
from .token_sets import SupportArg


def _all_reduce(grad_h: Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``grad_h`` over the TP ``group`` in place: one ``all_reduce`` (a ``_probe`` event)."""
    if _probe.active is not None:
        _probe.active.collective("all_reduce", grad_h.numel())
    dist.all_reduce(grad_h, group=group)


def forward(
    hidden: Hidden, weight: HeadWeight, ids: Tensor, options: Options
) -> tuple[Tensor, Tensor | None, Saved]:
    """The log-probs of ``ids`` (``[T]`` targets or ``[T, k]``), the entropy (None without
    it) and what the backward needs."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    shard = shard_of(options.tp_group, vocab, options.vocab_size)
    cdt = compute_dtype(hidden.dtype)
    column, held = shard.columns(ids[:, None] if ids.dim() == 1 else ids)
    dense = _placeholders(rows, column.shape[1], cdt, hidden.device, shard, options)
    sets = None
    need = options.rows
    if options.support is not None:
        el = elements(options.support, ids, shard, options.rows)
        x_el = options.softmax.logits(element_logits(hidden, weight, el, cdt))
        if not options.dense_entropy:
            # rows with a set need no logits row: their log-prob (and entropy) is sparse;
            # their target logit is their candidate element's, the last T elements
            need = ~el.host_has_set if need is None else ~el.host_has_set & need
            if ids.dim() == 1:  # an entropy alone ([T, 0] ids) has no candidate
                dense.picked[:, 0] = torch.where(held[:, 0], x_el[x_el.numel() - rows :], 0.0)
        with_set_h = options.with_entropy and options.over_support
        tiles = spec.tiles(shard.size) if options.invariant else None
        sets = Sets(el, x_el, set_stats(x_el, el, dense.picked, options.tau, with_set_h, tiles))
    dense_pass(hidden, weight, column, held, dense, None if need is None else index_of(need, hidden.device),
               shard, options)
    return finish(dense, sets, ids, shard, options, need)


def topk_forward(
    hidden: Hidden, weight: HeadWeight, k: int, options: Options
) -> tuple[Tensor, Tensor, Saved]:
    """The ``[T, k]`` largest log-probs, descending, their ``[T, k]`` global ids, and what
    the backward (``backward`` at those ids) needs."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    shard = shard_of(options.tp_group, vocab, options.vocab_size)
    cdt = compute_dtype(hidden.dtype)
    none = torch.zeros((rows, 0), dtype=torch.int64, device=hidden.device)
    options = options._replace(with_entropy=False)
    dense = _placeholders(rows, 0, cdt, hidden.device, shard, options)
    found = dense_pass(hidden, weight, none, none.bool(), dense, None, shard, options, best=k)
    assert found is not None
    log_p, ids, totals = topk.choose(dense, found, k, shard, options.softmax, tile_count(shard, options))
    return log_p, ids, Saved(shard, totals.max, totals.log_sum, None, options, None)


def _placeholders(
    rows: int, k: int, cdt: torch.dtype, device: torch.device, shard: Shard, options: Options
) -> Stats:
    """The dense statistics' placeholders: ``[T]`` fields, or per tile in invariant mode
    (whose shard must hold whole tiles)."""
    if not options.invariant:
        return placeholders(rows, k, cdt, device, options.with_entropy)
    return invariant.placeholders(shard, rows, k, cdt, device, options.with_entropy)


class _Sum:
    """A sum in the compute dtype, rounded once into ``out``: ``out`` itself (zeroed) when
    it has the compute dtype, else a float32 sum copied into it by ``done``. The matmuls
    run in the inputs' dtype, as the materialized head's would."""

    def __init__(self, out: Tensor, cdt: torch.dtype) -> None:
        self.out = out
        self.acc = out.zero_() if out.dtype == cdt else torch.zeros(out.shape, dtype=cdt, device=out.device)

    def add_mm(self, at: At, a: Tensor, b: Tensor) -> None:
        """Rows ``at`` of the sum ``+= a @ b``."""
        if not isinstance(at, slice):
            self.acc.index_add_(0, at, torch.mm(a, b).to(self.acc.dtype))
        elif self.acc.dtype == a.dtype:
            self.acc[at].addmm_(a, b)
        else:
            self.acc[at].add_(torch.mm(a, b))

    def index_add(self, index: Tensor, values: Tensor) -> None:
        self.acc.index_add_(0, index, values)

    def done(self) -> Tensor:
        if self.acc is not self.out:
            self.out.copy_(self.acc)
        return self.out


class _ByBlock(NamedTuple):
    """Support elements sorted by their local column, with each vocabulary block's
    range among them (host ints, one read of ``V_local / V_block + 1`` values)."""

    col: Tensor
    row: Tensor
    coef: Tensor
    bounds: list[int]

    @classmethod
    def of(cls, el: Elements, coef: Tensor, vocab: int, block: int) -> "_ByBlock":
        """The elements that count on this shard, by vocabulary block (those that do not
        sort past the last block)."""
        key = torch.where(el.member, el.col, vocab)
        order = torch.argsort(key)
        edges = torch.tensor([*range(0, vocab, block), vocab], device=key.device)
        if _probe.active is not None:
            _probe.active.host_read("tolist")
        bounds = torch.searchsorted(key[order], edges).tolist()
        return cls(el.col[order], el.row[order], coef[order], bounds)

    def add(self, acc: _Sum, i: int, v0: int, hidden: Tensor) -> None:
        """Add the elements of block ``i`` (its first column ``v0``) into its weight
        gradient: ``coef * hidden[row]`` at each column."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        cdt = acc.acc.dtype
        for s, e in spans(hi - lo, element_rows(hidden.shape[1])):
            part = self.coef[lo + s : lo + e, None] * hidden[self.row[lo + s : lo + e]].to(cdt)
            acc.index_add(self.col[lo + s : lo + e] - v0, part)


def _pieces(
    forward: Tensor | None, need: Tensor | None, total: int, block_rows: int, device: torch.device
) -> list[At]:
    """The forward's blocks of rows (``forward``, CPU bool ``[T]``, None: all, in pieces of
    ``block_rows``: the same matmuls, so the same logits bit for bit) that hold a row the
    backward needs (``need``, CPU bool ``[T]``; None: every row the forward read)."""
    index = None if forward is None else index_of(forward, device)
    if need is not None:
        return places(index, holding(forward, need, total, block_rows))
    n = count(index, total)
    return places(index, [(s, min(s + block_rows, n)) for s in range(0, n, block_rows)])


def _set_grads(
    saved: Saved, parts: Split, hidden: Hidden, weight: HeadWeight, acc_h: _Sum | None, want_weight: bool, block: int
) -> _ByBlock | None:
    """A support's share of the gradients: its elements' added into the hidden gradient's
    sum at once (``O(K H)``), and, where the weight's is wanted, sorted by vocabulary
    block (``block`` columns each) for each block's sum (None without a support)."""
    if saved.restricted is None:
        return None
    el = saved.restricted.elements
    assert parts.set_lp is not None
    coef = element_grad(saved.restricted, parts.set_lp, parts.set_entropy, saved.options.softmax)
    if acc_h is not None:
        for s, e in spans(coef.numel(), element_rows(hidden.shape[1])):
            acc_h.index_add(el.row[s:e], coef[s:e, None] * weight[el.col[s:e]].to(acc_h.acc.dtype))
    return _ByBlock.of(el, coef, saved.shard.valid, block) if want_weight else None


class _Walk:
    """The backward's walk over the forward's blocks (``pieces`` of rows by each vocabulary
    block): each block's logits recomputed by the same matmul, turned into its logit
    gradient ``G`` (``blocks.block_grad``) and multiplied out at once."""

    def __init__(
        self, hidden: Hidden, ids: Tensor, saved: Saved, row: RowGrad, grid: Blocks, pieces: list[At]
    ) -> None:
        self.hidden, self.saved, self.row, self.grid, self.pieces = hidden, saved, row, grid, pieces
        self.held = saved.shard.columns(ids[:, None] if ids.dim() == 1 else ids)[1]
        self.g_buf = torch.empty(grid.rows * grid.columns if pieces else 0, dtype=hidden.dtype, device=hidden.device)
        self.work = Workspace()

    def block(
        self, w_b: HeadWeight, v0: int, acc_h: _Sum | None, acc_w: _Sum | None, grad_w: Tensor | None = None
    ) -> None:
        """Every row block of the vocabulary block ``w_b`` (its first column ``v0``): ``d hidden
        += G @ w_b`` into ``acc_h``, ``d w_b += G.T @ hidden[rows]`` into ``acc_w`` (each
        where wanted), or ``d w_b = G.T @ hidden[rows]`` written into ``grad_w`` by one GEMM
        (one row block of every row)."""
        row_b = in_block(self.row, self.held, v0, v0 + w_b.shape[0])
        for at in self.pieces:
            h = gather(self.hidden, at, None)
            g = self._grad(h, w_b, at, row_b)
            if acc_h is not None:
                self._add_hidden(acc_h, at, g, w_b)
            if acc_w is not None:
                acc_w.add_mm(slice(0, w_b.shape[0]), g.t(), h)
            if grad_w is not None:
                torch.mm(g.t(), h, out=grad_w)

    def _grad(self, h: Tensor, w_b: HeadWeight, at: At, row_b: RowGrad) -> Tensor:
        """The block's logit gradient ``G`` (rows ``at``, in the reused buffer); its logits
        recomputed, bit for bit those of the forward, and dropped (``blocks.block_grad``)."""
        opts = self.saved.options
        n, v = h.shape[0], w_b.shape[0]
        g = self.g_buf[: n * v].view(n, v)
        block_grad(h, w_b, self.saved.max[at], self.saved.log_sum[at], opts.softmax.rows(at), row_b.rows(at), g,
                   self.grid.shape(opts.invariant), self.grid.chunks(n, self.hidden.dtype, self.hidden.device),
                   self.work)
        return g

    def _add_hidden(self, acc_h: _Sum, at: At, g: Tensor, w_b: HeadWeight) -> None:
        """``G @ w_b`` into rows ``at`` of the hidden gradient's sum."""
        if not self.saved.options.invariant:
            acc_h.add_mm(at, g, w_b)
            return
        # a row's sum whatever the others (an index's rows: one add each, as add_)
        fixed = product(g, w_b, self.grid.shape(True))
        if isinstance(at, slice):
            acc_h.acc[at].add_(fixed)
        else:
            acc_h.acc.index_add_(0, at, fixed.to(acc_h.acc.dtype))


def _full(grad_h: Tensor, tp_group: dist.ProcessGroup | None) -> Tensor:
    """The full hidden gradient: ``hidden`` is the same on every TP rank, its gradient
    the sum of the shards' (one all-reduce; None: no sum here)."""
    if tp_group is not None:
        _all_reduce(grad_h, group=tp_group)
    return grad_h


def backward(
    hidden: Hidden, weight: HeadWeight, ids: Tensor, entropy: Tensor | None, saved: Saved,
    g_lp: Tensor | None, g_entropy: Tensor | None, want_hidden: bool, want_weight: bool, all_reduce: bool = True,
) -> tuple[Hidden | None, HeadWeight | None]:
    """The gradients w.r.t. ``hidden`` and ``weight`` (this shard's), where wanted:
    ``hidden``'s the full one (one all-reduce under TP), or with ``all_reduce`` False
    this shard's part, which the caller sums (sequence parallelism's reduce-scatter)."""
    opts = saved.options
    rows, cdt, valid = hidden.shape[0], compute_dtype(hidden.dtype), saved.shard.valid
    row, parts = row_terms(saved, ids, entropy, g_lp, g_entropy)
    blocks = grid(hidden, weight.shape[0], opts)
    pieces = _pieces(saved.dense_rows, parts.dense, rows, blocks.rows, hidden.device)
    walk = _Walk(hidden, ids, saved, row, blocks, pieces)
    acc_h = _Sum(torch.empty_like(hidden), cdt) if want_hidden else None
    grad_w = torch.empty_like(weight) if want_weight else None
    if grad_w is not None:
        grad_w[valid:].zero_()  # a padded vocabulary's rows: no ids of the distribution
    by_block = _set_grads(saved, parts, hidden, weight, acc_h, want_weight, blocks.columns)
    with exact_if(opts.invariant):  # invariant mode: GEMMs without reduced precision
        _walk_splits(walk, blocks, weight, valid, acc_h, grad_w, by_block)
    return None if acc_h is None else _full(acc_h.done(), opts.tp_group if all_reduce else None), grad_w


def _walk_splits(
    walk: _Walk, blocks: Blocks, weight: HeadWeight, valid: int, acc_h: _Sum | None, grad_w: Tensor | None,
    by_block: _ByBlock | None,
) -> None:
    """The backward's walk, vocabulary split by split: ``d hidden`` into ``acc_h`` and each
    split's weight gradient into ``grad_w`` (a support's elements added by ``by_block``)."""
    cdt = compute_dtype(weight.dtype)
    # one block of every row on a device: each split's weight gradient is one GEMM, written
    # straight into it (no float32 [V_block, H] sum)
    straight = blocks.device and len(walk.pieces) == 1 and by_block is None
    for i, (v0, v1) in enumerate(blocks.blocks(valid)):
        acc_w = None if grad_w is None or straight else _Sum(grad_w[v0:v1], cdt)
        walk.block(weight[v0:v1], v0, acc_h, acc_w, None if grad_w is None or not straight else grad_w[v0:v1])
        if acc_w is not None:
            if by_block is not None:
                by_block.add(acc_w, i, v0, walk.hidden)
            acc_w.done()


class HiddenHead:
    """The hidden-state head (``head.Head``): the ``[T, H]`` final hidden states and this
    rank's ``[V_local, H]`` LM-head shard, computed block by block by this module's
    ``forward``, ``backward`` and ``topk_forward``."""

    what = "hidden"
    in_place = False
    all_reduce = True
    """Whether backward sums the hidden gradient over the TP group (one all-reduce):
    ``hidden`` is the same on every TP rank. Not a ``GatheredHead``'s."""

    def __init__(self, hidden: Tensor, weight: Tensor) -> None:
        self.hidden = self.x = hidden
        self.weight = weight
        self.tensors = (hidden, weight)
        self.vocab_local = int(weight.shape[0])
        self.default_chunk = default_hidden_chunk(hidden, self.vocab_local)

    def whole(self) -> "HiddenHead":
        """The head that computes every row: this one (a ``SequenceShards``' gathers them)."""
        return self

    def take(self, index: Tensor) -> "HiddenHead":
        return type(self)(self.hidden.index_select(0, index), self.weight)

    def forward(self, ids: Tensor, options: Options) -> tuple[Tensor, Tensor | None, Saved]:
        return forward(self.hidden, self.weight, ids, options)

    def topk_forward(self, k: int, options: Options) -> tuple[Tensor, Tensor, Saved]:
        return topk_forward(self.hidden, self.weight, k, options)

    def backward(
        self, ids: Tensor, entropy: Tensor | None, saved: Saved, g_lp: Tensor | None, g_entropy: Tensor | None,
        want: Sequence[bool],
    ) -> tuple[Tensor | None, ...]:
        return backward(self.hidden, self.weight, ids, entropy, saved, g_lp, g_entropy, want[0], want[1],
                        all_reduce=self.all_reduce)


class GatheredHead(HiddenHead):
    """The hidden-state head over rows gathered from the TP ranks' sequence shards
    (``SequenceShards.whole``), or some of them (``take``): its hidden gradient is this TP
    rank's part, which the gather's backward sums over the group (one reduce-scatter),
    so its own backward enters no collective for it."""

    all_reduce = False


class SequenceShards(HiddenHead):
    """A hidden-state head under sequence parallelism, before its gather: ``hidden`` is
    this TP rank's contiguous ``[T / tp, H]`` shard of the rows (Megatron's
    ``--sequence-parallel``), ``group`` the TP group. ``x`` is a ``[T, 0]`` stand-in with
    no storage, so that every check of ``T`` (targets, temperatures, a support, the
    layout) runs before any collective; ``whole`` and ``take`` gather the rows
    (``sequence.gather``) into the ``GatheredHead`` that computes. Never computed on
    itself: the autograd shell, which rebuilds a head from its tensors, cannot rebuild
    this one (it needs its group)."""

    def __init__(self, hidden: Tensor, weight: Tensor, group: dist.ProcessGroup) -> None:
        super().__init__(hidden, weight)
        tp = dist.get_world_size(group)
        self.group = group
        self.x = hidden.new_empty((hidden.shape[0] * tp, 0))
        self.what = args.gathered(hidden.shape[0], tp)

    def whole(self) -> HiddenHead:
        return GatheredHead(sequence.gather(self.hidden, self.group), self.weight)

    def take(self, index: Tensor) -> HiddenHead:
        return self.whole().take(index)


def hidden_head(hidden: Tensor, weight: Tensor, sequence_group: dist.ProcessGroup | None) -> HiddenHead:
    """The head of checked ``hidden`` and ``weight``: with a ``sequence_group``
    (``args.sequence``), ``hidden`` is this rank's sequence shard (``SequenceShards``)."""
    return HiddenHead(hidden, weight) if sequence_group is None else SequenceShards(hidden, weight, sequence_group)


@overload
def log_probs_and_entropy_from_hidden(
    hidden: TensorArg, weight: TensorArg, targets: TensorArg, *, with_entropy: Literal[False] = False,
    **kwargs: Unpack[args.HiddenKeywords],
) -> tuple[PerRow, None]: ...
@overload
def log_probs_and_entropy_from_hidden(
    hidden: TensorArg, weight: TensorArg, targets: TensorArg, *, with_entropy: Literal[True],
    **kwargs: Unpack[args.HiddenKeywords],
) -> tuple[PerRow, PerRow]: ...
@overload
def log_probs_and_entropy_from_hidden(
    hidden: TensorArg, weight: TensorArg, targets: TensorArg, *, with_entropy: bool = False,
    **kwargs: Unpack[args.HiddenKeywords],
) -> tuple[PerRow, PerRow | None]: ...
def log_probs_and_entropy_from_hidden(
    hidden: TensorArg, weight: TensorArg, targets: TensorArg, *, with_entropy: bool = False,
    entropy_grad: bool = True, temperature: TemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None, support: SupportArg = None, entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None, vocab_size: IntArg | None = None, invariant: bool = False,
    sequence_parallel: bool = False,
) -> tuple[PerRow, PerRow | None]:
    """``log_probs_and_entropy(hidden @ weight.T, targets, ...)`` without ever building
    the ``[T, V_local]`` logits: chunk by chunk, forward and backward.

    Args:
        hidden: ``[T, H]`` final hidden states (after the final norm), the same on every
            TP rank (megatron's output layer input without sequence parallelism), or
            with ``sequence_parallel`` this TP rank's shard of them.
            float32 or bfloat16 (float16, float64 accepted); saved for backward by
            reference. A DTensor must be ``Replicate`` on every mesh dimension (its local
            tensor is used; its gradient is the full one).
        weight: ``[V_local, H]`` this TP rank's shard of the LM-head weight (rank ``r``
            holds token ids ``[r * V_local, (r + 1) * V_local)``; a tied embedding's
            shard too), the dtype of ``hidden``; saved for backward by reference. Or a
            ``DTensor`` of ``[V, H]`` sharded ``Shard(0)`` on one mesh dimension (the TP
            one, every other ``Replicate``), in equal shards: its local shard is computed
            on, its mesh dimension's group is the TP group (``tp_group`` None or that
            group; docs/recipes.md, "DTensor logits").
        targets, with_entropy, entropy_grad, temperature, tp_group, support,
            entropy_over, softcap, vocab_size: as ``log_probs_and_entropy`` (a support's
            rows are the ``T`` rows of ``hidden``; each set element's logit is
            ``hidden[t] . weight[id]``; a padded vocabulary's rows of ``weight`` are never
            multiplied out and get zero gradient).
        invariant: as ``log_probs_and_entropy``: a row's log-prob and entropy are the
            same bits whatever the other rows and the TP size, its logits computed by
            matmuls of one fixed shape per device whatever ``chunk_size`` (the CPU:
            ``invariant.BLOCK_ROWS`` rows, zero-padded, by ``BLOCK_TILES * 128``
            columns; CUDA: ``blocks.DEVICE_ROWS`` by ``blocks.SPLIT``). The gradients w.r.t.
            ``hidden`` and ``weight`` sum over the vocabulary and the rows (and the TP
            shards' all-reduce): not TP-invariant (docs/invariance.md).
        chunk_size: sizes the blocks, forward and backward: each holds half the
            elements of ``chunk_size`` rows of ``V_local`` columns, over at least
            ``blocks.MIN_BLOCK_ROWS`` rows (all rows if fewer). None picks
            ``default_hidden_chunk_rows(V_local)``: ``chunk_size`` rows of float32
            within 32 MiB. On CUDA a block is ``blocks.SPLIT`` (8192) columns by as
            many rows as ``CPSLICE_BLOCK_MIB`` (512 MiB: every row of 16384 in
            bfloat16) holds of its logits and gradient, at most ``chunk_size`` rows
            (None: no other cap; docs/dev/backends.md).
        sequence_parallel: Megatron's ``--sequence-parallel``: ``hidden`` is this TP
            rank's contiguous shard of the rows, ``[T / tp, H]`` (rank ``r`` of
            ``tp_group`` holds rows ``[r T / tp, (r + 1) T / tp)``, every rank as many), as
            the output layer receives it; needs ``tp_group`` (or a DTensor weight's).
            The shards are gathered once, in the graph; the results cover every row
            ``[T]`` on every TP rank, as without it (``targets`` is ``[T]``), and
            ``hidden``'s gradient is its shard's, summed over the TP group.

    Returns:
        ``(log_probs, entropy)`` as ``log_probs_and_entropy`` on the materialized logits
        (each ``[T]`` float32, float64 for float64 inputs; the statistics accumulate in
        float32 for bfloat16/float16). Differentiable w.r.t. ``hidden`` and ``weight``:
        ``weight``'s gradient is this shard's; ``hidden``'s is the *full* gradient,
        summed over the TP group, so everything below the head gets correct gradients.
        Memory beyond the inputs and their gradients: ``[T]`` statistics and a few
        blocks (a block's logits and work buffers) in forward; in backward a few
        blocks, a float32 ``[T, H]`` sum of the hidden gradient (bfloat16/float16
        inputs) and one float32 ``[V_block, H]`` block of the weight gradient at a
        time (none on CUDA when one block holds every row: each block of the weight
        gradient is one GEMM), never a float32 ``[V_local, H]`` copy; with a support ``O(K + T)``
        more and ``[n, H]`` pieces of its elements. Backward recomputes the logits
        (one more matmul).

    Collectives: with ``tp_group``, one ``all_gather`` of the ``[k, T]`` statistics in
    forward (as ``log_probs_and_entropy``) and, when ``hidden`` needs a gradient, one
    ``all_reduce`` of the ``[T, H]`` hidden gradient in backward (as megatron's
    ``copy_to_tensor_model_parallel_region``); every rank of the group must run backward
    through the results, T = 0 too. With ``sequence_parallel``: one ``all_gather`` of
    ``[T / tp, H]`` more in forward (first), and in backward one ``reduce_scatter`` of
    ``[T, H]`` instead of the all-reduce (as megatron's
    ``gather_from_sequence_parallel_region``). Without ``tp_group``, no communication.

    Raises:
        TypeError: hidden or weight not a floating-point tensor, or of different dtypes;
            sequence_parallel not a bool; as ``log_probs_and_entropy`` for targets,
            temperature and chunk_size.
        LayoutError: hidden or weight not 2-D, weight with 0 rows, hidden sizes that
            disagree, tensors on different devices, targets not ``[T]`` (``T`` the rows of
            hidden, times the TP size with ``sequence_parallel``: the message names
            sequence parallelism where that is what the targets' length says);
            ``sequence_parallel`` without a TP group; a DTensor weight placed otherwise
            than ``Shard(0)`` on the TP mesh dimension, a DTensor hidden not replicated;
            as ``log_probs_and_entropy`` otherwise. Raised before any collective.
    """
    hidden_, weight_, targets_, tp, shards = args.head_and_targets(
        hidden, weight, targets, tp_group=tp_group, sequence_parallel=sequence_parallel)
    x = hidden_head(hidden_, weight_, shards)
    return head.log_probs(x.whole(), targets_, head.options(
        x, targets_, with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=temperature, tp_group=tp,
        chunk_size=chunk_size, support=support, entropy_over=entropy_over, softcap=softcap, vocab_size=vocab_size,
        invariant=invariant))


def entropy_from_hidden(
    hidden: TensorArg, weight: TensorArg, *, temperature: TemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None, support: SupportArg = None,
    entropy_over: EntropyOverArg = "full", softcap: RealArg | None = None, vocab_size: IntArg | None = None,
    invariant: bool = False, sequence_parallel: bool = False,
) -> PerRow:
    """``entropy(hidden @ weight.T, ...)`` without ever building the ``[T, V_local]``
    logits: the hidden-state path's blocks, forward and backward, with no target.

    Args:
        hidden, weight, temperature, tp_group, chunk_size, softcap, vocab_size, invariant,
            sequence_parallel: as ``log_probs_and_entropy_from_hidden`` (``[T, H]`` hidden
            states, or with ``sequence_parallel`` this TP rank's ``[T / tp, H]``; a
            ``[V_local, H]`` LM-head shard or a DTensor weight sharded ``Shard(0)`` on the
            TP mesh dimension).
        support, entropy_over: as ``entropy``'s: with ``"support"``, a row with a set
            takes the entropy over its set alone (each element's logit ``hidden[t] .
            weight[id]``, ``O(K H)``), no block over it; with ``"full"`` a support
            changes nothing.

    Returns:
        ``[T]`` float32 (float64 for float64 inputs), as ``entropy`` on the materialized
        logits; differentiable w.r.t. ``hidden`` (the full gradient, summed over the TP
        group; with ``sequence_parallel`` its shard's) and ``weight`` (this shard's).
        Memory: as
        ``log_probs_and_entropy_from_hidden``'s.

    Collectives: with ``tp_group``, one ``all_gather`` of ``[3, T]`` in forward (as
    ``entropy``) and, when ``hidden`` needs a gradient, one ``all_reduce`` of the ``[T,
    H]`` hidden gradient in backward; every rank of the group must run backward through
    the result, T = 0 too. With ``sequence_parallel``: one ``all_gather`` of ``[T / tp,
    H]`` more in forward, one ``reduce_scatter`` of ``[T, H]`` in backward instead of the
    all-reduce.

    Raises:
        TypeError, LayoutError: as ``log_probs_and_entropy_from_hidden`` for every
            argument. Raised before any collective.
    """
    hidden_, weight_, tp = args.head(hidden, weight, tp_group)
    x = hidden_head(hidden_, weight_, args.sequence(sequence_parallel, tp))
    return head.entropy(
        x, temperature=temperature, tp_group=tp, chunk_size=chunk_size, support=support,
        entropy_over=entropy_over, softcap=softcap, vocab_size=vocab_size, invariant=invariant)


def log_probs_at_from_hidden(
    hidden: TensorArg, weight: TensorArg, ids: TensorArg, *, temperature: TemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None, softcap: RealArg | None = None,
    vocab_size: IntArg | None = None, invariant: bool = False, sequence_parallel: bool = False,
) -> Tensor:
    """``log_probs_at(hidden @ weight.T, ids, ...)`` without ever building the ``[T,
    V_local]`` logits: the hidden-state path's blocks, forward and backward.

    Args:
        hidden, weight, temperature, tp_group, chunk_size, softcap, vocab_size,
            sequence_parallel: as ``log_probs_and_entropy_from_hidden`` (a DTensor weight
            sharded ``Shard(0)`` on the TP mesh dimension included; with
            ``sequence_parallel``, ``hidden`` this TP rank's ``[T / tp, H]``).
        ids: ``[T, k]`` int64 global token ids, as ``log_probs_at``'s.

    Returns:
        ``[T, k]`` float32 (float64 for float64 inputs), as ``log_probs_at`` on the
        materialized logits; differentiable w.r.t. ``hidden`` (the full gradient, summed
        over the TP group; with ``sequence_parallel`` its shard's) and ``weight`` (this
        shard's).

    Collectives: with ``tp_group``, one ``all_gather`` of ``[2 + k, T]`` in forward and,
    when ``hidden`` needs a gradient, one ``all_reduce`` of ``[T, H]`` in backward. With
    ``sequence_parallel``: one ``all_gather`` of ``[T / tp, H]`` more in forward, one
    ``reduce_scatter`` of ``[T, H]`` in backward instead of the all-reduce.

    Raises:
        TypeError, LayoutError: as ``log_probs_and_entropy_from_hidden`` for hidden, weight
            and sequence_parallel, as ``log_probs_at`` for ids. Raised before any
            collective.
    """
    hidden_, weight_, ids_, tp, shards = args.head_and_targets(
        hidden, weight, ids, "ids", tp_group=tp_group, sequence_parallel=sequence_parallel)
    x = hidden_head(hidden_, weight_, shards)
    options = head.options(x, ids_, temperature=temperature, tp_group=tp, chunk_size=chunk_size, softcap=softcap,
                           vocab_size=vocab_size, invariant=invariant)
    return head.log_probs(x.whole(), ids_, options)[0]


def topk_log_probs_from_hidden(
    hidden: TensorArg, weight: TensorArg, k: IntArg, *, temperature: TemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None, softcap: RealArg | None = None,
    vocab_size: IntArg | None = None, invariant: bool = False, sequence_parallel: bool = False,
) -> tuple[Tensor, Tensor]:
    """``topk_log_probs(hidden @ weight.T, k, ...)`` without ever building the ``[T,
    V_local]`` logits: each block's top-k kept as a running best over the vocabulary
    blocks; the teacher's top-k straight from its hidden states. ``hidden``, ``weight``
    (or a DTensor weight sharded ``Shard(0)`` on the TP mesh dimension), ``tp_group`` and
    the other keywords as ``log_probs_and_entropy_from_hidden``'s (with
    ``sequence_parallel``, ``hidden`` this TP rank's ``[T / tp, H]``, every rank's of one
    length, and the results cover all ``T`` rows), ``k`` as ``topk_log_probs``'.

    Returns:
        ``(log_probs, ids)``, each ``[T, k]``, as ``topk_log_probs`` on the materialized
        logits; differentiable w.r.t. ``hidden`` and ``weight`` at the chosen entries.

    Collectives: with ``tp_group``, one ``all_gather`` in forward (candidates and
    statistics) and, when ``hidden`` needs a gradient, one ``all_reduce`` of ``[T, H]``
    in backward. With ``sequence_parallel``: one ``all_gather`` of ``[T / tp, H]`` more
    in forward, one ``reduce_scatter`` of ``[T, H]`` in backward instead of the all-reduce.

    Raises:
        TypeError, LayoutError: as ``log_probs_and_entropy_from_hidden`` for hidden, weight
            and sequence_parallel, as ``topk_log_probs`` for ``k``. Raised before any
            collective.
    """
    hidden_, weight_, tp = args.head(hidden, weight, tp_group)
    shards = args.sequence(sequence_parallel, tp)
    k_ = args.k_best(k)
    x = hidden_head(hidden_, weight_, shards)
    options = head.options(x, None, temperature=temperature, tp_group=tp, chunk_size=chunk_size, softcap=softcap,
                           vocab_size=vocab_size, invariant=invariant)
    head.check_topk(x, k_, options)  # before the gather
    return head.topk(x.whole(), k_, options)
