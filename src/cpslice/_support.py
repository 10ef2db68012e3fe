"""Per-row token sets (top-p / top-k replay): the ``Support`` record, built from a layout.

A ``Support`` is the layout side of the sets: which ids each local row keeps, in CSR
form, checked once and read by the vocabulary functions' token-set driver
(``_vocab.sparse``), which does their arithmetic.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import _checks as checks
from ._errors import LayoutError
from ._layout import Layout
from ._plan import exclusive_cumsum, resolve_length, response_base, selection
from ._types import IdsArg, TensorArg

_I64 = torch.int64


def _first_duplicate(ids: Tensor, row: Tensor) -> int | None:
    """Index (into ``ids``) of an id that repeats within its row, else None. CPU only."""
    if ids.numel() < 2:
        return None
    # sort by (row, id): ids are >= 0 here; either copy of a repeat names it (a
    # stable sort, several times slower on the CPU, is not needed)
    key, order = torch.sort(row * (int(ids.max()) + 1) + ids)
    same = (key[1:] == key[:-1]).nonzero()
    return int(order[int(same[0, 0])]) if same.numel() else None


class Support:
    """Per-row token sets over the ``T`` rows of one local tensor, in CSR form.

    Row ``t``'s set is ``ids[offsets[t]:offsets[t + 1]]``, global token ids (a TP rank
    uses those its vocabulary shard owns). An empty set means the row is unrestricted.
    Pass the same ``Support`` on every rank of a TP group. A frozen record: build a new
    one to change it (it holds ``ids`` and ``offsets`` by reference: do not modify them
    in place afterwards).

    Args:
        ids: ``[K]`` int64 token ids, rows back to back; no id repeated within a row.
        offsets: ``[T + 1]`` int64, ``offsets[0] == 0``, non-decreasing,
            ``offsets[T] == K``. On the same device as ``ids``; CPU tensors are best
            (the offsets are read on the host, once, here).

    Raises:
        TypeError: ``ids`` or ``offsets`` not a tensor, or not int64.
        LayoutError: not 1-D, ``offsets`` empty, not starting at 0, decreasing or not
            ending at ``len(ids)``, tensors on different devices; on the CPU (where it
            costs no device sync) a negative id or an id repeated within a row. Ids
            beyond the vocabulary are refused by the log-prob functions (on the CPU).
    """

    __slots__ = ("ids", "offsets", "_host_offsets")

    ids: Tensor
    offsets: Tensor
    _host_offsets: Tensor

    def __init__(self, ids: TensorArg, offsets: TensorArg) -> None:
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
        if int(host[-1]) != ids.numel():
            raise LayoutError(
                f"Support offsets ends at {int(host[-1])} but ids has {ids.numel()} "
                "elements; offsets[T] must equal len(ids)"
            )
        if ids.device.type == "cpu" and ids.numel():
            row = torch.repeat_interleave(
                torch.arange(host.numel() - 1), host.diff(), output_size=ids.numel()
            )
            neg = (ids < 0).nonzero()
            if neg.numel():
                k = int(neg[0, 0])
                raise LayoutError(
                    f"Support row {int(row[k])}: id {int(ids[k])} < 0 (token ids are >= 0)"
                )
            k_dup = _first_duplicate(ids, row)
            if k_dup is not None:
                raise LayoutError(
                    f"Support row {int(row[k_dup])}: id {int(ids[k_dup])} appears twice in "
                    "the row's set (each kept token once)"
                )
        setattr_ = object.__setattr__
        setattr_(self, "ids", ids)
        setattr_(self, "offsets", offsets)
        setattr_(self, "_host_offsets", host)

    @property
    def num_rows(self) -> int:
        """``T``, the rows the sets are over."""
        return int(self._host_offsets.numel()) - 1

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Support is immutable; build a new one ({name})")

    def __repr__(self) -> str:
        return f"Support(rows={self.num_rows}, ids={self.ids.numel()}, device={self.ids.device})"

    @classmethod
    def from_responses(cls, ids: IdsArg, offsets: IdsArg, layout: Layout) -> "Support":
        """This rank's ``Support`` from the rollout's per-sample, per-response-token sets.

        ``ids[i]`` holds the kept ids of sample ``i``'s response tokens back to back;
        ``offsets[i]`` is ``[R_i + 1]``: response token ``r`` keeps
        ``ids[i][offsets[i][r]:offsets[i][r + 1]]``. Each is a 1-D integer tensor or a
        list of ints. The row whose logit predicts response token ``r`` (position
        ``P_i - 1 + r``) gets that token's set; every other local row (prompt, padding,
        other ranks' shares) an empty one. ``T`` is the layout's ``local_length``, else
        the least length it needs (for allgather, set ``local_length``). The result is
        on the device of ``ids`` (CPU for lists). No communication.

        Raises:
            TypeError: ``ids``/``offsets`` not lists or tuples of 1-D integer tensors
                or int lists.
            LayoutError: not one entry per sample; ``offsets[i]`` not ``[R_i + 1]``, not
                starting at 0, decreasing or not ending at ``len(ids[i])``; a negative
                id or one repeated within a token's set (named by sample and token);
                an allgather layout without ``local_length``.
        """
        n = layout.num_samples
        id_list = _per_sample("ids", ids, n)
        off_list = [x.to("cpu") for x in _per_sample("offsets", offsets, n)]
        device = id_list[0].device if id_list else torch.device("cpu")
        resp = torch.tensor(layout.response_lengths, dtype=_I64)
        for i, (x, o) in enumerate(zip(id_list, off_list)):
            r = layout.response_lengths[i]
            if o.numel() != r + 1:
                raise LayoutError(
                    f"sample {i}: offsets[{i}] has {o.numel()} entries but the response has "
                    f"{r} tokens; it must be [R_i + 1] = [{r + 1}]"
                )
            if x.device != device:
                raise LayoutError(f"sample {i}: ids[{i}] is on {x.device}, ids[0] on {device}")
        id_len = torch.tensor([x.numel() for x in id_list], dtype=_I64)
        flat_off = torch.cat(off_list) if off_list else torch.zeros(0, dtype=_I64)
        starts = exclusive_cumsum(resp + 1)
        ends = starts + resp
        _check_offsets(flat_off, starts, ends, id_len, resp)
        flat_ids = torch.cat(id_list) if id_list else torch.zeros(0, dtype=_I64)
        # global[j]: where flat_off[j]'s set starts in flat_ids
        glob = flat_off + torch.repeat_interleave(exclusive_cumsum(id_len), resp + 1)
        _check_ids(flat_ids.to("cpu"), glob, starts, ends, resp)
        length = resolve_length(layout)
        sel = selection(layout, length, "response")
        # offsets index of the set of position p of sample i: starts[i] + p - (P_i - 1)
        src = sel.sources(starts + response_base(layout))
        lo, hi = glob[src], glob[src + 1]
        order = torch.argsort(sel.rows)
        rows, lo, count = sel.rows[order], lo[order], (hi - lo)[order]
        per_row = torch.zeros(length, dtype=_I64).index_put_((rows,), count)
        local_off = torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(per_row, 0)])
        total = int(local_off[-1])
        take = torch.repeat_interleave(lo - exclusive_cumsum(count), count, output_size=total)
        take = take + torch.arange(total, dtype=_I64)
        out = cls.__new__(cls)
        setattr_ = object.__setattr__
        # validated above, for every sample: no second pass over the ids
        setattr_(out, "ids", flat_ids.index_select(0, take.to(device)))
        setattr_(out, "offsets", local_off.to(device))
        setattr_(out, "_host_offsets", local_off)
        return out


def _per_sample(name: str, values: object, n: int) -> list[Tensor]:
    if isinstance(values, (Tensor, str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name} must be a list or tuple with one entry per sample (a 1-D integer "
            f"tensor or a list of ints), got {checks.kind(values)}"
        )
    if len(values) != n:
        raise LayoutError(f"{name} has {len(values)} entries but the layout has {n} samples")
    out = []
    for i, x in enumerate(values):
        if isinstance(x, Tensor):
            if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
                raise TypeError(f"sample {i}: {name}[{i}] has dtype {x.dtype}; pass integer ids")
            if x.dim() != 1:
                raise LayoutError(f"sample {i}: {name}[{i}] has shape {tuple(x.shape)}; it must be 1-D")
            out.append(x.to(_I64))
        elif isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
            # ints, numpy integers: what checks.integer accepts everywhere else
            ids = [checks.integer(f"sample {i}: {name}[{i}][{j}]", v) for j, v in enumerate(x)]
            out.append(torch.tensor(ids, dtype=_I64))
        else:
            raise TypeError(
                f"sample {i}: {name}[{i}] is {checks.kind(x)}; pass a 1-D integer "
                "tensor or a list of ints"
            )
    return out


def _sample_of(index: int, starts: Tensor) -> int:
    return int(torch.searchsorted(starts, torch.tensor(index), right=True)) - 1


def _check_offsets(flat: Tensor, starts: Tensor, ends: Tensor, id_len: Tensor, resp: Tensor) -> None:
    bad = (flat[starts] != 0).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise LayoutError(f"sample {i}: offsets[{i}][0] = {int(flat[starts[i]])}; offsets start at 0")
    step = flat.diff() < 0
    if step.numel():
        step[ends[:-1]] = False  # between samples
    drop = step.nonzero()
    if drop.numel():
        j = int(drop[0, 0])
        i = _sample_of(j, starts)
        r = j - int(starts[i])
        raise LayoutError(
            f"sample {i}: offsets[{i}] decreases at token {r}: {int(flat[j])} > {int(flat[j + 1])} "
            "(token r keeps ids[offsets[r]:offsets[r + 1]]; offsets must be non-decreasing)"
        )
    bad = (flat[ends] != id_len).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise LayoutError(
            f"sample {i}: offsets[{i}] ends at {int(flat[ends[i]])} but ids[{i}] has "
            f"{int(id_len[i])} ids; offsets[i][R_i] must equal len(ids[i])"
        )


def _check_ids(flat_ids: Tensor, glob: Tensor, starts: Tensor, ends: Tensor, resp: Tensor) -> None:
    """Ids >= 0 and none repeated within a token's set, named by sample and token."""
    if flat_ids.numel() == 0:
        return
    # the set index (into the concatenated responses) of every id
    counts = glob.diff()
    counts[ends[:-1]] = 0  # between samples
    token = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=flat_ids.numel())

    def where(k: int) -> str:
        j = int(token[k])
        i = _sample_of(j, starts)
        return f"sample {i}, response token {j - int(starts[i])}"

    neg = (flat_ids < 0).nonzero()
    if neg.numel():
        k = int(neg[0, 0])
        raise LayoutError(f"{where(k)}: id {int(flat_ids[k])} < 0 (token ids are >= 0)")
    k_dup = _first_duplicate(flat_ids, token)
    if k_dup is not None:
        raise LayoutError(
            f"{where(k_dup)}: id {int(flat_ids[k_dup])} appears twice in the token's set "
            "(each kept token once)"
        )


def host_offsets(support: Support) -> Tensor:
    """The CPU copy of ``support.offsets`` its constructor read (no further device sync)."""
    return support._host_offsets


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
    if ids.device.type == "cpu" and ids.numel():
        bad = (ids >= vocab_total).nonzero()
        if bad.numel():
            k = int(bad[0, 0])
            row = int(torch.searchsorted(host_offsets(support), torch.tensor(k), right=True)) - 1
            raise LayoutError(
                f"support row {row}: id {int(ids[k])} is outside the vocabulary "
                f"[0, {vocab_total}) ({bad.numel()} such ids)"
            )
    return support


def take_rows(support: Support, rows: Tensor) -> Support:
    """The sets of the given rows (CPU int64 indices into ``support``'s rows, in any
    order), as a ``Support`` over ``len(rows)`` rows: for a function that computes only
    some rows (the response rows of ``response_log_probs_from_hidden``)."""
    host = host_offsets(support)
    counts = host.diff()[rows]
    offsets = torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(counts, 0)])
    k = int(offsets[-1])
    within = torch.arange(k) - torch.repeat_interleave(offsets[:-1], counts, output_size=k)
    index = torch.repeat_interleave(host[:-1][rows], counts, output_size=k) + within
    device = support.ids.device
    return Support(support.ids[index.to(device)], offsets.to(device))


if TYPE_CHECKING:
    SupportArg = Support | None
else:  # as every argument alias of ``_types``: the function's own check names the error
    SupportArg = object
