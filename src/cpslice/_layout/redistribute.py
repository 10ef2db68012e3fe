"""Moving response shares between layouts over the CP group, with gradients.

Every rank can compute every rank's shares from the layouts alone (the lengths
are the same everywhere), so which element goes where is known locally and one
``all_to_all`` moves exactly the elements each rank needs: no size exchange, no
padding. The backward pass is the reverse ``all_to_all``. All the index
arithmetic is a reading of ``plan.py``'s selections.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast, overload

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks as checks
from .. import _probe
from .._cache import cached
from .._errors import LayoutError
from .._types import IntArg, Share
from .layout import Layout
from .plan import resolve, response_base, select, selection_at

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


def _element_ids(layout: Layout, length: int, rank: int, depth: int) -> Tensor:
    """For each response row of CP rank ``rank`` (any rank: a "none" layout holds the
    whole response on every rank) at ``depth``, in extraction order, the index of the
    token it predicts in all the responses back to back (one numbering on every rank)."""
    # `select`, not the cached `selection`: the other ranks' selections would push this
    # step's own entries out of that small cache.
    sel = select(layout, length, "response", None if layout.cp_mode == "none" else rank, depth)
    return sel.sources(response_base(layout, concatenated=True, depth=depth))


# One step redistributes between a few pairs of layouts.
@cached(maxsize=8)
def _route(src: Layout, src_length: int, dst: Layout, dst_length: int, size: int, depth: int) -> _Route:
    whole = src.cp_mode == "none"  # every rank holds every response whole: dst has the CP
    me = dst.cp_rank if whole else src.cp_rank
    total = sum(src.response_lengths)
    owner = torch.full((total,), -1, dtype=_I64)
    place = torch.full((total,), -1, dtype=_I64)
    src_total = 0
    dst_ids = [_element_ids(dst, dst_length, q, depth) for q in range(size)]
    for q in range(size):
        ids = _element_ids(src, src_length, q, depth)
        place[ids] = torch.arange(ids.numel(), dtype=_I64)
        # a whole src: each rank sends itself its own share, so that nothing crosses
        # ranks and each rank's gradient reaches its own copy (as shard_responses)
        owner[dst_ids[q] if whole else ids] = q
        if q == me:
            src_total = int(ids.numel())
    # at depth d both layouts hold the same elements: those with a predicting position
    if any(bool((owner[ids] < 0).any()) for ids in dst_ids):  # pragma: no cover - docs/layouts.md's shares partition
        raise AssertionError("the source layout's shares do not cover every response element")
    send_index = [place[ids[owner[ids] == me]] for ids in dst_ids]
    recv_owner = owner[dst_ids[me]]
    splits = torch.bincount(recv_owner, minlength=size)
    start = torch.cumsum(splits, 0) - splits
    # an element's place among those from the same rank, in my output order
    order = torch.sort(recv_owner, stable=True).indices
    grouped = torch.empty_like(order)
    grouped[order] = torch.arange(order.numel(), dtype=_I64)
    dst_counts = selection_at(dst, dst_length, "response", depth).counts
    if _probe.active is not None:
        _probe.active.host_read("tolist")
    return _Route(
        send_index,
        splits.tolist(),
        start[recv_owner],
        grouped - start[recv_owner],
        splits[recv_owner],
        list(dst_counts),
        src_total,
    )


class _DeviceRoute(NamedTuple):
    """A route's indices for ``nlists`` lists on one device, built once per step's layouts."""

    send_index: Tensor  # rows of the stacked flat shares, destination-major, then list
    send_splits: list[int]
    recv_splits: list[int]
    block: Tensor  # per output element of list 0: its place in the received buffer
    run: Tensor  # per output element: the stride to the same element of the next list
    dst_counts: list[int]


@cached(maxsize=8)
def _device_route(
    src: Layout, src_length: int, dst: Layout, dst_length: int, size: int, nlists: int,
    device: torch.device, depth: int,
) -> _DeviceRoute:
    route = _route(src, src_length, dst, dst_length, size, depth)
    # send buffer: destination-major, then list, then the destination's order
    lists_base = torch.arange(nlists, dtype=_I64).unsqueeze(1) * route.src_total
    send_index = torch.cat([(lists_base + idx).reshape(-1) for idx in route.send_index])
    # the block from rank o starts at nlists * (its start in one list's units) and
    # holds nlists runs of what o sends of one list
    return _DeviceRoute(
        send_index.to(device),
        [nlists * int(idx.numel()) for idx in route.send_index],
        [nlists * n for n in route.recv_splits],
        (nlists * route.recv_block + route.recv_place).to(device),
        route.recv_run.to(device),
        route.dst_counts,
    )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dimension 0; backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx: Any, send: Tensor, send_splits: list[int], recv_splits: list[int], group: Any
    ) -> Tensor:
        ctx.splits = (send_splits, recv_splits, group)
        out = send.new_empty((sum(recv_splits), *send.shape[1:]))
        if _probe.active is not None:
            _probe.active.collective("all_to_all_single", send.numel())
        dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        send_splits, recv_splits, group = ctx.splits
        out = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        if _probe.active is not None:
            _probe.active.collective("all_to_all_single", grad.numel())
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=group)
        return out, None, None, None


# torch leaves Function.apply untyped; typed once here, at the boundary.
_all_to_all = cast(Callable[[Tensor, list[int], list[int], Any], Tensor], _AllToAll.apply)


def _check(
    lists: Sequence[object], src: Layout, dst: Layout, name: str, depth: int
) -> tuple[int, list[list[Tensor]]]:
    """``src``'s local length (its one resolution) and every list's shares, checked
    against ``src``'s counts on this rank, before any collective: one dtype and trailing
    shape for all (they travel in one buffer)."""
    if src.response_lengths != dst.response_lengths:
        raise LayoutError(
            f"src has response_lengths {list(src.response_lengths)} but dst has "
            f"{list(dst.response_lengths)} (src and dst must describe the same samples)"
        )
    if src.total_lengths != dst.total_lengths:
        raise LayoutError(
            f"src has total_lengths {list(src.total_lengths)} but dst has "
            f"{list(dst.total_lengths)} (src and dst must describe the same samples)"
        )
    at = resolve(src, what="the layout", spans=("response",), depth=depth)
    counts = at.reads["response"].selection.counts
    out: list[list[Tensor]] = []
    first: Tensor | None = None
    for k, given in enumerate(lists):
        label = name if len(lists) == 1 else f"{name}[{k}]"
        shares = checks.per_sample(label, given, counts, f"rank {src.cp_rank}'s share in src")
        for i, x in enumerate(shares):
            first = x if first is None else first
            if x.shape[1:] != first.shape[1:] or x.dtype != first.dtype:
                raise LayoutError(
                    f"sample {i}: {label}[{i}] is {x.dtype} {tuple(x.shape)} but another "
                    f"share is {first.dtype} {tuple(first.shape)} (every share that travels "
                    "in one call has one dtype and trailing shape)"
                )
        out.append(shares)
    return at.length, out


def _check_group(what: str, src: Layout, dst: Layout, cp_group: Any) -> int:
    """The CP group's size, read from the layout that has CP: ``src``, or ``dst`` when
    ``src`` holds whole responses (``cp_mode="none"``); the other one must agree."""
    if src.cp_mode == "none":
        return checks.cp_group(what, "dst", dst.cp_rank, dst.cp_size, cp_group)
    size = checks.cp_group(what, "src", src.cp_rank, src.cp_size, cp_group)
    rank = src.cp_rank
    if dst.cp_mode != "none" and (dst.cp_size != size or dst.cp_rank != rank):
        raise LayoutError(
            f"dst is rank {dst.cp_rank} of cp_size {dst.cp_size} but this process is rank "
            f"{rank} of {size}; a dst with CP must be this rank's layout, or use "
            "cp_mode='none' for whole responses on every rank"
        )
    return size


def _redistribute(
    lists: Sequence[object], src: Layout, dst: Layout, cp_group: Any, name: str, what: str,
    depth: object,
) -> list[list[Tensor]]:
    d = checks.depth(depth)
    # One rank holds every share whole, in every layout: nothing to move, no group.
    local = src.cp_size == 1 and dst.cp_size == 1
    size = 1 if local else _check_group(what, src, dst, cp_group)
    src_length, shares = _check(lists, src, dst, name, d)
    if local:
        return [list(s) for s in shares]
    nlists = len(shares)
    stacked = torch.cat([x for s in shares for x in s])
    dst_length = resolve(dst, what="the layout").length
    route = _device_route(src, src_length, dst, dst_length, size, nlists, stacked.device, d)
    send = stacked.index_select(0, route.send_index)
    received = _all_to_all(send, route.send_splits, route.recv_splits, cp_group)
    return [
        list(torch.split(received.index_select(0, route.block + k * route.run), route.dst_counts))
        for k in range(nlists)
    ]


@overload
def redistribute(
    values: Sequence[Share], src: Layout, dst: Layout, *, cp_group: Any = None, depth: IntArg = 0
) -> list[Share]: ...
@overload
def redistribute(
    values: tuple[Sequence[Share], ...], src: Layout, dst: Layout, *, cp_group: Any = None,
    depth: IntArg = 0,
) -> tuple[list[Share], ...]: ...
def redistribute(
    values: Sequence[Share] | tuple[Sequence[Share], ...],
    src: Layout,
    dst: Layout,
    *,
    cp_group: Any = None,
    depth: IntArg = 0,
) -> list[Share] | tuple[list[Share], ...]:
    """Move per-sample shares from ``src``'s layout to ``dst``'s, over the CP group.

    Args:
        values: this rank's shares in ``src`` (``[r_i, *rest]`` per sample, as
            ``extract_responses`` returns them), or a tuple of such lists that travel
            together (log-probs and entropy: one collective for all).
        src: this rank's layout of the shares; ``cp_mode="none"``: the whole
            responses, the same on every rank (then each rank keeps its own share of
            its copy, as ``shard_responses``: nothing crosses ranks, and each rank's
            gradient reaches its own copy).
        dst: this rank's target layout, for the same samples over the same group:
            e.g. allgather -> zigzag (what loss code written for ring attention
            expects), or any layout -> ``cp_mode="none"`` (whole responses on every
            rank). An allgather src or dst needs ``local_length``.
        cp_group: the CP process group (megatron-core:
            ``parallel_state.get_context_parallel_group()``; ``dist.group.WORLD`` when
            every process is one CP group). ``None`` (the default) means no group, as
            ``tp_group=None`` means no TP: only cp_size 1 (src and dst) may omit it;
            its size and this process's rank in it are read from the layout with CP
            (src, or dst when src has none).
        depth: the shares' target depth ``d >= 0`` (``extract_responses(...,
            depth=d)``: a multi-token prediction head's), the same in both layouts.

    Returns:
        The shares in ``dst``'s layout: a list, or a tuple of lists aligned with
        ``values``. Differentiable: gradients flow back to every rank's input shares.

    Collectives: exactly one ``all_to_all_single`` forward and one backward, whatever
    the number of samples and lists; every rank enters them, including a rank that
    holds nothing. It moves each element once, to each rank that needs it: ``1/c``
    of the responses per rank for allgather -> zigzag, the whole responses (1x, as an
    all-gather) for -> none. The zero-padded ``all_reduce`` of whole responses moves
    ``cp_size x`` as much data (and a ring all_reduce twice that).

    At cp_size 1 (src and dst both on one rank) every share already is the whole
    response: nothing moves, no collective is entered and no process group is needed
    (``cp_group`` is then unused).

    Raises:
        TypeError: ``values`` is not a list (or tuple of lists) of per-sample tensors;
            ``depth`` is not an int.
        RuntimeError: cp_size > 1 and torch.distributed is not initialized.
        LayoutError: CP with no ``cp_group``; layouts for other samples (total or
            response lengths), ranks or group size; a share of the wrong length (at
            ``depth``), dtype or trailing shape; a negative depth. Raised before any
            collective.
    """
    if isinstance(values, tuple) and values and all(not isinstance(v, Tensor) for v in values):
        return tuple(_redistribute(values, src, dst, cp_group, "values", "redistribute", depth))
    return _redistribute([values], src, dst, cp_group, "values", "redistribute", depth)[0]


def gather_responses(
    values: Sequence[Share], layout: Layout, *, cp_group: Any = None, depth: IntArg = 0
) -> list[Share]:
    """The whole response of every sample, on every rank of the CP group.

    ``redistribute(values, layout, Layout(total, response), depth=depth)``: one
    all-to-all that moves each rank's shares to every rank (1x the responses); at depth
    ``d`` a sample's whole share is that of the tokens predicted at that depth (all but
    the first ``d + 1 - P_i`` where its prompt is shorter). Differentiable.
    ``cp_group``, collectives and errors as ``redistribute``.
    """
    whole = _whole(layout)
    return _redistribute([values], layout, whole, cp_group, "values", "gather_responses", depth)[0]


@cached(maxsize=8)
def _whole(layout: Layout) -> Layout:
    """The layout without CP of the same samples (built once per layout)."""
    return Layout(layout.total_lengths, layout.response_lengths)
