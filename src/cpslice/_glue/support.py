"""Per-row token sets (top-p / top-k replay): the public ``Support``, built from a layout
or from a keep mask.

The record, its checks and its arithmetic are the vocabulary engine's
(``_vocab.token_sets``); this subclass, on the glue's side, adds its builders:
``from_responses``, which places the rollout's per-token sets on this rank's rows, and
``from_keep_mask``, which reads a TP rank's ``[T, V_local]`` boolean keep mask.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks as checks
from .._errors import LayoutError
from .._layout.layout import Layout
from .._layout.plan import Selection, exclusive_cumsum, resolve, response_base
from .._types import IdsArg
from .._vocab import token_sets as engine
from .._vocab.args import tp_world
from .._vocab.dtensor import is_dtensor, replicated_each
from .._vocab.token_sets import first_duplicate

_I64 = torch.int64


class Support(engine.Support):
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
            (the offsets are read on the host, once, here). Either may be a DTensor
            ``Replicate`` on every mesh dimension (its local tensor is used; DTensor
            logits take a plain support: the sets are over the rows, which no TP
            mesh dimension splits).

    Raises:
        TypeError: ``ids`` or ``offsets`` not a tensor, or not int64.
        LayoutError: not 1-D, ``offsets`` empty, not starting at 0, decreasing or not
            ending at ``len(ids)``, tensors on different devices; on the CPU (where it
            costs no device sync) a negative id or an id repeated within a row; a
            DTensor not ``Replicate`` on every mesh dimension. Ids beyond the
            vocabulary are refused by the log-prob functions (on the CPU).
    """

    __slots__ = ()

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
        id_list = _per_sample("ids", replicated_each("ids", ids), n)
        off_list = [x.to("cpu") for x in _per_sample("offsets", replicated_each("offsets", offsets), n)]
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
        glob = flat_off + torch.repeat_interleave(exclusive_cumsum(id_len), resp + 1, output_size=flat_off.numel())
        _check_ids(flat_ids.to("cpu"), glob, starts, ends, resp)
        read = resolve(layout, spans=("response",)).reads["response"]
        length, sel = read.mask.numel(), read.selection
        # offsets index of the set of position p of sample i: starts[i] + p - (P_i - 1)
        src = sel.sources(starts + response_base(layout))
        lo, hi = glob[src], glob[src + 1]
        rows = sel.rows
        if read.picks.k > 1:  # a shared prefix's prompt row: its branches' sets, one kept
            lo, hi, rows = _one_set_per_row(flat_ids, lo, hi, read.picks.slot, read.picks.element, sel, layout)
        order = torch.argsort(rows)
        rows, lo, count = rows[order], lo[order], (hi - lo)[order]
        per_row = torch.zeros(length, dtype=_I64).index_put_((rows,), count)
        local_off = torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(per_row, 0)])
        total = int(local_off[-1])
        take = torch.repeat_interleave(lo - exclusive_cumsum(count), count, output_size=total)
        take = take + torch.arange(total, dtype=_I64)
        # validated above, for every sample: no second pass over the ids
        out = cls.__new__(cls)
        out._init_checked(flat_ids.index_select(0, take.to(device)), local_off.to(device), local_off)
        return out

    @classmethod
    def from_keep_mask(cls, mask: Tensor, tp_group: dist.ProcessGroup | None = None) -> "Support":
        """This rank's ``Support`` from its ``[T, V_local]`` boolean keep mask, as slime holds
        a top-p / top-k mask: each TP rank the columns of its own vocabulary shard.

        Row ``t``'s set is the global ids of its True columns, ascending: column ``c`` of
        TP rank ``r`` is id ``r * V_local + c`` (megatron's contiguous vocabulary
        shards). Without ``tp_group`` the mask is the whole vocabulary (``V_local = V``)
        and no collective is entered. With ``tp_group``, every rank gets the same
        ``Support``, the sets of every shard's mask: each rank's ``[T]`` kept counts in
        one all-gather, then its kept ids alone in one ``all_to_all_single``, so that no
        ``[T, V]`` buffer exists anywhere (the mask's device: CUDA for NCCL); every rank of
        the group must call it, with masks of one shape. ``tp_group=None`` means no TP,
        as everywhere in cpslice (not the default group).

        A row that keeps nothing gets an empty set, which cpslice reads as unrestricted:
        the full softmax (slime keeps the target alone there, log-prob 0; see
        docs/recipes.md). The result is on the mask's device; the mask is not modified.

        Raises:
            TypeError: ``mask`` is not a ``torch.Tensor`` of dtype bool (or is a DTensor:
                pass its local shard and the TP group); ``tp_group`` is not a process
                group or None.
            LayoutError: ``mask`` is not 2-D ``[T, V_local]``; this process is not a
                member of ``tp_group``.
        """
        if is_dtensor(mask):
            raise TypeError(
                "mask is a DTensor; pass its local shard [T, V_local] (mask.to_local()) and its TP "
                "mesh dimension's group as tp_group="
            )
        x = checks.tensor("mask", mask, "a bool torch.Tensor [T, V_local] (the keep mask)")
        if x.dtype != torch.bool:
            raise TypeError(f"mask has dtype {x.dtype}; pass the bool keep mask [T, V_local] (True: kept)")
        if x.dim() != 2:
            raise LayoutError(
                f"mask has shape {tuple(x.shape)}; it must be 2-D [T, V_local], a row per token "
                "and a column per id of this rank's vocabulary shard"
            )
        if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or None, got {checks.kind(tp_group)}")
        group = tp_group if tp_world(tp_group) > 1 else None
        rank = 0 if group is None else dist.get_rank(group)
        ids, offsets, host = engine.keep_mask_sets(x, rank, group)
        out = cls.__new__(cls)
        out._init_checked(ids, offsets, host)
        return out


def _one_set_per_row(
    flat_ids: Tensor, lo: Tensor, hi: Tensor, slot: Tensor, element: Tensor, sel: Selection, layout: Layout
) -> tuple[Tensor, Tensor, Tensor]:
    """The sets ``flat_ids[lo:hi]`` of the elements that are first on their row (``slot`` 0),
    after checking that every other element's set (a shared prompt row's other branches)
    is the same ids: the row's distribution is one, so its rollout kept one set."""
    first = torch.full((int(element.max()) + 1,), -1, dtype=_I64).index_copy_(
        0, element[slot == 0], (slot == 0).nonzero()[:, 0]
    )
    sample = torch.repeat_interleave(torch.arange(layout.num_samples, dtype=_I64),
                                     torch.tensor(sel.counts, dtype=_I64), output_size=int(slot.numel()))
    for e in (slot > 0).nonzero()[:, 0].tolist():
        f = int(first[element[e]])
        mine, theirs = flat_ids[int(lo[e]):int(hi[e])], flat_ids[int(lo[f]):int(hi[f])]
        if not torch.equal(mine.sort().values, theirs.sort().values):
            i, j = int(sample[e]), int(sample[f])
            token = int(sel.positions[e]) + 1 - layout.prompt_lengths[i]
            raise LayoutError(
                f"sample {i}, response token {token}: its set differs from sample {j}'s on the "
                f"same shared prompt row ({mine.numel()} ids against {theirs.numel()}); the "
                "branches of a shared_prefix group predict their first tokens from one row, "
                "whose rollout set is one: give every branch the same set there"
            )
    keep = slot == 0
    return lo[keep], hi[keep], sel.rows[keep]


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
    k_dup = first_duplicate(flat_ids, token)
    if k_dup is not None:
        raise LayoutError(
            f"{where(k_dup)}: id {int(flat_ids[k_dup])} appears twice in the token's set "
            "(each kept token once)"
        )


def take_rows(support: engine.Support, rows: Tensor) -> Support:
    """The sets of the given rows (CPU int64 indices into ``support``'s rows, in any
    order), as a ``Support`` over ``len(rows)`` rows (``_vocab.token_sets.select_rows``)."""
    return Support(*engine.select_rows(support, rows))


if TYPE_CHECKING:
    SupportArg = Support | None
else:  # as every argument alias of ``_types``: the function's own check names the error
    SupportArg = object
