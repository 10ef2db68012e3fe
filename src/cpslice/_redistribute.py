"""Moving response shares between layouts over the CP group, with gradients.

Every rank can compute every rank's shares from the layouts alone (the lengths
are the same everywhere), so which element goes where is known locally and one
``all_to_all`` moves exactly the elements each rank needs: no size exchange, no
padding. The backward pass is the reverse ``all_to_all``. All the index
arithmetic is a reading of ``_plan``'s selections.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast, overload

import torch
import torch.distributed as dist
from torch import Tensor

from ._errors import LayoutError
from ._layout import Layout
from ._plan import resolve_length, response_base, selection
from ._types import Share

_I64 = torch.int64


class _Route(NamedTuple):
    """What this rank sends to and receives from every rank, for one list."""

    send_index: list[Tensor]  # per destination rank: rows of my flat shares, in its order
    recv_splits: list[int]  # per source rank: how many elements come from it
    # Per output element, in my output order: where the block of the rank it comes
    # from starts (counted in elements of one list), its place within that rank's
    # elements, and how many elements of one list that rank sends me.
    recv_block: Tensor
    recv_place: Tensor
    recv_run: Tensor
    dst_counts: list[int]  # per sample: elements of my output share
    src_total: int  # my flat input shares' length


def _ranks(layout: Layout, size: int) -> list[Layout]:
    # A "none" layout means the whole response on every rank.
    if layout.cp_mode == "none":
        return [layout] * size
    return [layout.for_rank(q) for q in range(size)]


def _element_ids(layout: Layout) -> Tensor:
    """For each response row of the rank, in extraction order, its index in all the
    responses back to back (the same numbering on every rank)."""
    sel = selection(layout, resolve_length(layout, what="the layout"), "response")
    return sel.sources(response_base(layout, concatenated=True))


@functools.lru_cache(maxsize=16)
def _route(src: Layout, dst: Layout, size: int) -> _Route:
    me = src.cp_rank
    total = sum(src.response_lengths)
    owner = torch.full((total,), -1, dtype=_I64)
    place = torch.full((total,), -1, dtype=_I64)
    src_total = 0
    for q, layout in enumerate(_ranks(src, size)):
        ids = _element_ids(layout)
        owner[ids] = q
        place[ids] = torch.arange(ids.numel(), dtype=_I64)
        if q == me:
            src_total = int(ids.numel())
    if total and bool((owner < 0).any()):  # pragma: no cover - docs/layouts.md's shares partition
        raise AssertionError("the source layout's shares do not cover every response element")
    dst_ids = [_element_ids(layout) for layout in _ranks(dst, size)]
    send_index = [place[ids[owner[ids] == me]] for ids in dst_ids]
    recv_owner = owner[dst_ids[me]]
    splits = torch.bincount(recv_owner, minlength=size)
    start = torch.cumsum(splits, 0) - splits
    # an element's place among those from the same rank, in my output order
    order = torch.sort(recv_owner, stable=True).indices
    grouped = torch.empty_like(order)
    grouped[order] = torch.arange(order.numel(), dtype=_I64)
    dst_counts = selection(dst, resolve_length(dst, what="the layout"), "response").counts
    return _Route(
        send_index,
        splits.tolist(),
        start[recv_owner],
        grouped - start[recv_owner],
        splits[recv_owner],
        list(dst_counts),
        src_total,
    )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dimension 0; backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any, send: Tensor, send_splits: list[int], recv_splits: list[int], group: Any
    ) -> Tensor:
        ctx.splits = (send_splits, recv_splits, group)
        out = send.new_empty((sum(recv_splits), *send.shape[1:]))
        dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        send_splits, recv_splits, group = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=group)
        return out, None, None, None


# torch leaves Function.apply untyped; typed once here, at the boundary.
_all_to_all = cast(Callable[[Tensor, list[int], list[int], Any], Tensor], _AllToAll.apply)


def _check(
    lists: Sequence[Sequence[Tensor]], src: Layout, dst: Layout, group: Any
) -> int:
    if not dist.is_initialized():
        raise RuntimeError("redistribute needs torch.distributed: call init_process_group first")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (src.total_lengths, src.response_lengths) != (dst.total_lengths, dst.response_lengths):
        raise LayoutError("src and dst must describe the same samples (total and response lengths)")
    if src.cp_size != size or src.cp_rank != rank:
        raise LayoutError(
            f"src is rank {src.cp_rank} of cp_size {src.cp_size} but this process is rank "
            f"{rank} of a group of {size}; pass the CP group (megatron-core: "
            "parallel_state.get_context_parallel_group()) as group="
        )
    if dst.cp_mode != "none" and (dst.cp_size != size or dst.cp_rank != rank):
        raise LayoutError(
            f"dst is rank {dst.cp_rank} of cp_size {dst.cp_size} but this process is rank "
            f"{rank} of {size}; a dst with CP must be this rank's layout, or use "
            "cp_mode='none' for whole responses on every rank"
        )
    counts = selection(src, resolve_length(src, what="the layout"), "response").counts
    first: Tensor | None = None
    for k, shares in enumerate(lists):
        given: object = shares  # checked at run time whatever the static type says
        if isinstance(given, Tensor) or not isinstance(given, Sequence):
            raise TypeError(f"list {k} must be a list of per-sample tensors")
        if len(shares) != src.num_samples:
            raise LayoutError(
                f"list {k} holds {len(shares)} shares but the layout has {src.num_samples} samples"
            )
        for i, (share, count) in enumerate(zip(shares, counts)):
            item: object = share
            if not isinstance(item, Tensor):
                raise TypeError(f"sample {i}: list {k}'s share is a {type(item).__name__}")
            if share.dim() == 0 or share.shape[0] != count:
                raise LayoutError(
                    f"sample {i}: list {k}'s share has {tuple(share.shape)} but rank {rank} "
                    f"holds {count} positions of it in the src layout"
                )
            if first is None:
                first = share
            elif share.shape[1:] != first.shape[1:] or share.dtype != first.dtype:
                raise LayoutError(
                    f"sample {i}: list {k}'s share is {share.dtype} {tuple(share.shape)} but "
                    f"others are {first.dtype} [*, {', '.join(map(str, first.shape[1:]))}] "
                    "(every share that travels in one call has one dtype and trailing shape)"
                )
    return size


def _redistribute(
    lists: Sequence[Sequence[Tensor]], src: Layout, dst: Layout, group: Any
) -> list[list[Tensor]]:
    size = _check(lists, src, dst, group)
    route = _route(src, dst, size)
    nlists = len(lists)
    flats = [torch.cat(list(shares)) for shares in lists]
    stacked = torch.cat(flats) if flats else torch.empty(0)
    device = stacked.device
    # send buffer: destination-major, then list, then the destination's order
    lists_base = torch.arange(nlists, dtype=_I64).unsqueeze(1) * route.src_total
    send_index = torch.cat([(lists_base + idx).reshape(-1) for idx in route.send_index])
    send = stacked.index_select(0, send_index.to(device))
    send_splits = [nlists * int(idx.numel()) for idx in route.send_index]
    recv_splits = [nlists * n for n in route.recv_splits]
    received = _all_to_all(send, send_splits, recv_splits, group)
    # the block from rank o starts at nlists * (its start in one list's units) and
    # holds nlists runs of what o sends of one list
    block = (nlists * route.recv_block + route.recv_place).to(device)
    run = route.recv_run.to(device)
    out: list[list[Tensor]] = []
    for k in range(nlists):
        gathered = received.index_select(0, block + k * run)
        out.append(list(torch.split(gathered, route.dst_counts)))
    return out


@overload
def redistribute(
    values: Sequence[Share], src: Layout, dst: Layout, *, group: Any = None
) -> list[Share]: ...
@overload
def redistribute(
    values: tuple[Sequence[Share], ...], src: Layout, dst: Layout, *, group: Any = None
) -> tuple[list[Share], ...]: ...
def redistribute(
    values: Sequence[Share] | tuple[Sequence[Share], ...],
    src: Layout,
    dst: Layout,
    *,
    group: Any = None,
) -> list[Share] | tuple[list[Share], ...]:
    """Move per-sample shares from ``src``'s layout to ``dst``'s, over the CP group.

    Args:
        values: this rank's shares in ``src`` (``[r_i, *rest]`` per sample, as
            ``extract_responses`` returns them), or a tuple of such lists that travel
            together (log-probs and entropy: one collective for all).
        src: this rank's layout of the shares.
        dst: this rank's target layout, for the same samples over the same group:
            e.g. allgather -> zigzag (what loss code written for ring attention
            expects), or any layout -> ``cp_mode="none"`` (whole responses on every
            rank). An allgather src or dst needs ``local_length``.
        group: the CP process group (``None``: the default group).

    Returns:
        The shares in ``dst``'s layout: a list, or a tuple of lists aligned with
        ``values``. Differentiable: gradients flow back to every rank's input shares.

    Collectives: exactly one ``all_to_all_single`` forward and one backward, whatever
    the number of samples and lists; every rank enters them, including a rank that
    holds nothing. It moves each element once, to each rank that needs it: ``1/c``
    of the responses per rank for allgather -> zigzag, the whole responses (1x, as an
    all-gather) for -> none. The zero-padded ``all_reduce`` of whole responses moves
    ``cp_size x`` as much data (and a ring all_reduce twice that).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        LayoutError: layouts for other samples, ranks or group size; a share of the
            wrong length, dtype or trailing shape.
    """
    if isinstance(values, tuple) and all(not isinstance(v, Tensor) for v in values):
        return tuple(_redistribute(values, src, dst, group))
    single = list(values)
    return _redistribute([single], src, dst, group)[0]  # type: ignore[list-item]


def gather_responses(values: Sequence[Share], layout: Layout, *, group: Any = None) -> list[Share]:
    """The whole response of every sample, on every rank of the CP group.

    ``redistribute(values, layout, Layout(total, response))``: one all-to-all that moves
    each rank's shares to every rank (1x the responses). Differentiable.
    """
    whole = Layout(layout.total_lengths, layout.response_lengths)
    return redistribute(values, layout, whole, group=group)
