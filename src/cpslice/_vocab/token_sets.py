"""Per-row token sets (top-p / top-k replay): the engine's ``Support`` record, its checks
and its row arithmetic.

A ``Support`` holds which ids each row of one local tensor keeps, in CSR form, checked
once when built; ``set_elements`` does the arithmetic of the sets' elements. The
public ``cpslice.Support`` (``_glue.support``) is a subclass that adds what needs a
``Layout`` (``from_responses``); the engine takes any ``Support``.
"""

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _probe
from .._errors import LayoutError
from .._types import TensorArg
from .dtensor import replicated
from .stats import all_gather_rows

_I64 = torch.int64


def first_duplicate(ids: Tensor, row: Tensor) -> int | None:
    """Index (into ``ids``) of an id that repeats within its row, else None. CPU only."""
    if ids.numel() < 2:
        return None
    # sort by (row, id): ids are >= 0 here; either copy of a repeat names it (a
    # stable sort, several times slower on the CPU, is not needed)
    key, order = torch.sort(row * (int(ids.max()) + 1) + ids)
    same = (key[1:] == key[:-1]).nonzero()
    return int(order[int(same[0, 0])]) if same.numel() else None


class Support:
    """Per-row token sets over the ``T`` rows of one local tensor, in CSR form: row
    ``t``'s set is ``ids[offsets[t]:offsets[t + 1]]`` (the public class, ``cpslice.Support``,
    documents it). Frozen; ``offsets`` is read on the host once, here."""

    __slots__ = ("ids", "offsets", "_host_offsets")

    ids: Tensor
    offsets: Tensor
    _host_offsets: Tensor

    def __init__(self, ids: TensorArg, offsets: TensorArg) -> None:
        # the same sets on every rank: a replicated DTensor's local tensor is the whole
        ids, offsets = replicated("Support ids", ids), replicated("Support offsets", offsets)
        for name, x in (("ids", ids), ("offsets", offsets)):
            if not isinstance(x, Tensor):
                raise TypeError(f"Support {name} must be an int64 torch.Tensor, got {type(x).__name__}")
            if x.dtype != _I64:
                raise TypeError(f"Support {name} has dtype {x.dtype}; pass int64 ({name}.long())")
            if x.dim() != 1:
                raise LayoutError(f"Support {name} has shape {tuple(x.shape)}; it must be 1-D")
        if ids.device != offsets.device:
            raise LayoutError(
                f"Support ids is on {ids.device} but offsets on {offsets.device}; put them "
                "on the same device"
            )
        if offsets.numel() == 0:
            raise LayoutError("Support offsets is empty; it must be [T + 1], starting at 0")
        host = offsets.to("cpu")  # one small copy; a device sync only for device offsets
        _check_offsets(host, ids.numel())
        if ids.device.type == "cpu" and ids.numel():
            _check_ids(ids, host)
        setattr_ = object.__setattr__
        setattr_(self, "ids", ids)
        setattr_(self, "offsets", offsets)
        setattr_(self, "_host_offsets", host)

    def _init_checked(self, ids: Tensor, offsets: Tensor, host_offsets: Tensor) -> None:
        """Set the fields of a new (``__new__``) ``Support`` to sets its builder has
        checked already (as the constructor would), ``host_offsets`` the CPU copy of
        ``offsets``: no second pass."""
        setattr_ = object.__setattr__
        setattr_(self, "ids", ids)
        setattr_(self, "offsets", offsets)
        setattr_(self, "_host_offsets", host_offsets)

    @property
    def num_rows(self) -> int:
        """``T``, the rows the sets are over."""
        return int(self._host_offsets.numel()) - 1

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Support is immutable; build a new one ({name})")

    def __repr__(self) -> str:
        return f"Support(rows={self.num_rows}, ids={self.ids.numel()}, device={self.ids.device})"


def _check_offsets(host: Tensor, elements: int) -> None:
    """CSR offsets: from 0, non-decreasing, to ``elements``."""
    if int(host[0]) != 0:
        raise LayoutError(f"Support offsets[0] = {int(host[0])}; CSR offsets start at 0")
    drop = (host[1:] < host[:-1]).nonzero()
    if drop.numel():
        t = int(drop[0, 0])
        raise LayoutError(
            f"Support offsets decrease at row {t}: offsets[{t}] = {int(host[t])} > "
            f"offsets[{t + 1}] = {int(host[t + 1])} (row {t}'s set is "
            "ids[offsets[t]:offsets[t + 1]]; offsets must be non-decreasing)"
        )
    if int(host[-1]) != elements:
        raise LayoutError(
            f"Support offsets ends at {int(host[-1])} but ids has {elements} "
            "elements; offsets[T] must equal len(ids)"
        )


def _check_ids(ids: Tensor, host: Tensor) -> None:
    """CPU ids: none negative, none repeated within its row."""
    row = torch.repeat_interleave(torch.arange(host.numel() - 1), host.diff(), output_size=ids.numel())
    neg = (ids < 0).nonzero()
    if neg.numel():
        k = int(neg[0, 0])
        raise LayoutError(f"Support row {int(row[k])}: id {int(ids[k])} < 0 (token ids are >= 0)")
    k_dup = first_duplicate(ids, row)
    if k_dup is not None:
        raise LayoutError(
            f"Support row {int(row[k_dup])}: id {int(ids[k_dup])} appears twice in "
            "the row's set (each kept token once)"
        )


def keep_mask_sets(mask: Tensor, rank: int, group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor, Tensor]:
    """The CSR sets of a checked ``[T, V_local]`` bool keep mask, vocabulary shard ``rank``
    (global id ``rank * V_local + column``): ``(ids, offsets, host offsets)``, each row's
    ids ascending, on the mask's device. With ``group`` (of that shard's TP group), every
    shard's: each rank's ``[T]`` counts in one all-gather, then its kept ids alone in one
    ``all_to_all_single`` (each rank sends its ids to every rank); no ``[T, V]`` anywhere."""
    rows, columns = mask.nonzero(as_tuple=True)  # row-major: in each row, columns ascending
    ids = columns + rank * mask.shape[1]
    counts = torch.bincount(rows, minlength=mask.shape[0])
    if group is None:
        host = torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(counts.to("cpu"), 0)])
        return ids, host.to(mask.device), host
    every = all_gather_rows(counts[None], group)[:, 0].to("cpu")  # [W, T]
    totals = every.sum(1)
    received = ids.new_empty(int(totals.sum()))
    world = every.shape[0]
    if _probe.active is not None:
        _probe.active.collective("all_to_all_single", world * ids.numel())
    dist.all_to_all_single(received, ids.repeat(world), totals.tolist(), [ids.numel()] * world, group=group)
    # rank q's ids of row t start at its block's start plus its earlier rows' counts; the
    # sets are row-major, and in a row the shards in rank order: ascending global ids
    start = (torch.cumsum(totals, 0) - totals)[:, None] + torch.cumsum(every, 1) - every
    start, length = start.t().reshape(-1), every.t().reshape(-1)
    k = int(received.numel())
    take = torch.repeat_interleave(start - (torch.cumsum(length, 0) - length), length, output_size=k)
    host = torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(every.sum(0), 0)])
    return received[(take + torch.arange(k)).to(mask.device)], host.to(mask.device), host


def host_offsets(support: Support) -> Tensor:
    """The CPU copy of ``support.offsets`` its constructor read (no further device sync)."""
    return support._host_offsets


def on_host(ids: Tensor) -> bool:
    """Whether ``ids`` are checked against the vocabulary on the host: on the CPU, where it
    costs no device sync (``_probe``'s step ``host_checks``)."""
    return ids.device.type == "cpu"


def check_support(support: object, rows: int, vocab_total: int, what: str = "logits") -> Support:
    """The support given to a log-prob function, checked against the ``[T]`` rows of
    ``what`` and the vocabulary (ids on the CPU only, where it costs no device sync)."""
    if not isinstance(support, Support):
        raise TypeError(
            f"support must be a cpslice.Support or None, got {type(support).__name__} "
            "(build one with Support(ids, offsets) or Support.from_responses)"
        )
    if support.num_rows != rows:
        raise LayoutError(
            f"support has {support.num_rows} rows but {what} has {rows}; the sets are per "
            "row of the local tensor (offsets must be [T + 1]; Support.from_responses "
            "gives the layout's local_length rows, else the least it needs: build the "
            "Layout with local_length=T)"
        )
    ids = support.ids
    checked = _probe.step("host_checks", on_host)
    if checked(ids) and ids.numel():
        bad = (ids >= vocab_total).nonzero()
        if bad.numel():
            k = int(bad[0, 0])
            row = int(torch.searchsorted(host_offsets(support), torch.tensor(k), right=True)) - 1
            raise LayoutError(
                f"support row {row}: id {int(ids[k])} is outside the vocabulary "
                f"[0, {vocab_total}) ({bad.numel()} such ids)"
            )
    return support


def select_rows(support: Support, rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(ids, offsets)``, the CSR sets of the given rows (CPU int64 indices into
    ``support``'s rows, in any order): for a function that computes only some rows (the
    response rows of ``response_log_probs_from_hidden``)."""
    host = host_offsets(support)
    counts = host.diff()[rows]
    offsets = torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(counts, 0)])
    k = int(offsets[-1])
    within = torch.arange(k) - torch.repeat_interleave(offsets[:-1], counts, output_size=k)
    index = torch.repeat_interleave(host[:-1][rows], counts, output_size=k) + within
    device = support.ids.device
    return support.ids[index.to(device)], offsets.to(device)


if TYPE_CHECKING:
    SupportArg = Support | None
else:  # as every argument alias of ``_types``: the function's own check names the error
    SupportArg = object
