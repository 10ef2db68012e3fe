"""The Layout: which samples a micro-batch holds and how one rank lays them out.

A Layout is a validated, immutable record. It holds no offset arithmetic of its
own: its pieces (where each rank's rows sit) are placed by ``pieces.py``, and every
offset is read from them by ``plan.py`` (docs/layouts.md). Its other constructors are
the module functions ``_from_*`` here, bound to it as class methods.
"""

from collections.abc import Sequence
from typing import cast

from torch import Tensor

from .._types import (
    Boundaries,
    CpMode,
    FormatArg,
    IntArg,
    LayoutMode,
    Lengths,
    ModeArg,
    QkvFormat,
    TensorArg,
)
from .checks import (
    check_cp,
    check_format,
    check_local_length,
    check_padding,
    check_parallel_state_mode,
    check_samples,
    check_shared_prefix,
    cu_seqlens_widths,
    star_lengths,
)
from .masks import mask_rows
from .pieces import Closed, Order, order_of, read, twin
from .widths import resolve_padded_lengths, resolve_row_offsets


def _from_parallel_state(
    cls: "type[Layout]",
    total_lengths: Lengths,
    response_lengths: Lengths,
    *,
    qkv_format: FormatArg = "thd",
    max_seq_len: IntArg | None = None,
    cp_mode: ModeArg | None = None,
    local_length: IntArg | None = None,
    padded_lengths: Lengths | None = None,
    align: IntArg | None = None,
    row_offsets: Lengths | None = None,
    shared_prefix: Lengths | None = None,
) -> "Layout":
    """This rank's Layout, reading CP rank and size from megatron-core's parallel_state.

    ``cp_mode`` None reads the mode too: ``"zigzag"`` at a CP world size above 1, else
    ``"none"``. ``"allgather"`` is all-gather CP at that rank and size; ``"zigzag"`` and
    ``"none"`` are checked against the size. Imports megatron-core (lazily). The other
    arguments are ``Layout``'s (e.g. verl's ``align=tp * cp * 2`` under CP, ``tp`` without).

    Raises:
        ImportError: megatron-core is not installed (``pip install 'cpslice[megatron]'``).
        RuntimeError: megatron-core's model parallel state is not initialized.
        LayoutError: ``cp_mode="zigzag"`` at CP world size 1, or ``"none"`` above 1
            (the message says what to pass); anything ``Layout`` refuses.
    """
    from .megatron import cp_rank_and_size

    rank, size = cp_rank_and_size()
    return cls(
        total_lengths, response_lengths, qkv_format=qkv_format, max_seq_len=max_seq_len,
        cp_mode=check_parallel_state_mode(cp_mode, size), cp_rank=rank, cp_size=size,
        local_length=local_length, padded_lengths=padded_lengths, align=align, row_offsets=row_offsets,
        shared_prefix=shared_prefix,
    )


def _from_cu_seqlens(
    cls: "type[Layout]",
    cu_seqlens_padded: Boundaries,
    total_lengths: Lengths,
    response_lengths: Lengths,
    *,
    cp_mode: ModeArg = "none",
    cp_rank: IntArg = 0,
    cp_size: IntArg = 1,
    local_length: IntArg | None = None,
    shared_prefix: Lengths | None = None,
) -> "Layout":
    """The thd Layout of samples padded to the boundaries a framework already holds.

    Args:
        cu_seqlens_padded: ``[n + 1]`` ints, ``0 = b_0 <= b_1 <= ... <= b_n``: the
            global padded boundaries before any CP split, exactly what megatron-core's
            ``PackedSeqParams.cu_seqlens_q_padded`` holds. A list/tuple of ints or an
            integer tensor on any device (read with one host copy). Sample ``i``
            occupies ``W_i = b_{i+1} - b_i`` positions. With ``shared_prefix``, the
            ``[m + 1]`` boundaries of the ``m`` groups' stars (Megatron's packed stars).
        total_lengths, response_lengths, cp_mode, cp_rank, cp_size, local_length,
        shared_prefix: as ``Layout``.

    Returns:
        ``Layout(total_lengths, response_lengths, padded_lengths=W, ...)``.

    Raises:
        TypeError: ``cu_seqlens_padded`` is neither a list of ints nor an integer tensor.
        LayoutError: it is not 1-D, has not ``n + 1`` entries, does not start at 0,
            decreases, or gives a sample fewer positions than its tokens; anything
            ``Layout`` refuses.
    """
    total, response = check_samples(total_lengths, response_lengths)
    groups = check_shared_prefix(shared_prefix, total, response, "thd")
    widths = cu_seqlens_widths(cu_seqlens_padded, star_lengths(groups, total, response), groups is not None)
    return cls(total, response, cp_mode=cp_mode, cp_rank=cp_rank, cp_size=cp_size,
               local_length=local_length, padded_lengths=widths, shared_prefix=groups)


def _from_attention_mask(
    cls: "type[Layout]",
    attention_mask: TensorArg,
    response_lengths: Lengths,
    *,
    cp_mode: ModeArg = "none",
    cp_rank: IntArg = 0,
    cp_size: IntArg = 1,
    local_length: IntArg | None = None,
) -> "Layout":
    """The bshd Layout of a Hugging Face batch: rows of ``S`` columns, each holding
    one sample's tokens where its attention mask is 1.

    Args:
        attention_mask: ``[B, S]``, bool or integer (0 and 1), on any device (read
            with one host copy): row ``i`` holds sample ``i`` at the columns where
            it is 1, which must be contiguous (a left-padded prompt, then the
            response, then padding: TRL, OpenRLHF, verl without remove-padding).
        response_lengths: ``R_i``, the response tokens at the end of each row's ones.
        cp_mode, cp_rank, cp_size, local_length: as ``Layout``.

    Returns:
        ``Layout(L, response_lengths, qkv_format="bshd", max_seq_len=S,
        row_offsets=o, ...)``, ``L_i`` the ones of row ``i`` and ``o_i`` its first one.

    Raises:
        TypeError: ``attention_mask`` is not a bool or integer tensor.
        LayoutError: it is not 2-D, holds a value other than 0 and 1, or a row has
            no 1 or a 0 between its ones (the message names the row); anything
            ``Layout`` refuses.
    """
    total, offsets, seq = mask_rows(attention_mask)
    return cls(total, response_lengths, qkv_format="bshd", max_seq_len=seq, cp_mode=cp_mode,
               cp_rank=cp_rank, cp_size=cp_size, local_length=local_length, row_offsets=offsets)


def _from_order(
    cls: "type[Layout]",
    order: TensorArg | Sequence[IntArg] | Sequence[Sequence[IntArg]],
    total_lengths: Lengths,
    response_lengths: Lengths,
    *,
    cp_rank: IntArg,
    cp_size: IntArg,
    qkv_format: FormatArg = "thd",
    max_seq_len: IntArg | None = None,
    padded_lengths: Lengths | None = None,
    align: IntArg | None = None,
    row_offsets: Lengths | None = None,
    shared_prefix: Lengths | None = None,
) -> "Layout":
    """The Layout of a load balancer's token order (torch's context parallelism):
    rank ``r`` holds rows ``order[r*T:(r+1)*T]`` of the packed stream of padded samples,
    ``T = N / cp_size`` (thd: ``order`` ``[N]`` or ``[1, N]``, a permutation of
    ``range(N)``, ``N = sum(W_i)``), or, row after row, the columns
    ``order[b, r*S/c:(r+1)*S/c]`` (bshd: ``[S]`` or ``[1, S]`` for every row, as torch
    applies its head-tail balancer's, or ``[B, S]``; each row a permutation of
    ``range(S)``). An integer tensor (one host copy) or nested ints.
    Padding positions stay padding; the index is taken as given, whatever its balance.
    The other arguments are ``Layout``'s (with ``shared_prefix``, the stream is the
    groups' padded stars back to back). Where a closed form places every position
    alike (``Layout.order`` gives its index), that layout is returned; else one of
    ``cp_mode`` ``"order"``, whose local length is at least ``T``.

    Raises:
        TypeError: ``order`` is not integers (a float or bool tensor).
        LayoutError: a repeated, missing or out-of-range position (the message names
            the first bad entry), a length ``cp_size`` does not divide, a bshd row that
            is not a permutation, anything ``Layout`` refuses.
    """
    base = cls(total_lengths, response_lengths, qkv_format=qkv_format, max_seq_len=max_seq_len,
               padded_lengths=padded_lengths, align=align, row_offsets=row_offsets,
               shared_prefix=shared_prefix)
    rank, size = check_cp(cp_rank, cp_size, base.qkv_format, "order")
    _, placement = read(order, base.qkv_format, base.padded_lengths, base.max_seq_len, size)
    mode = twin(placement, base.qkv_format, base.padded_lengths, size)
    if mode is None:
        return base._placed(rank, size, None, placement)
    thd = base.qkv_format == "thd"
    return cls(base.total_lengths, base.response_lengths, qkv_format=base.qkv_format,
               max_seq_len=base.max_seq_len, cp_mode=mode, cp_rank=rank, cp_size=size,
               local_length=placement.length if mode == "allgather" else None,
               padded_lengths=base.padded_lengths if thd else None,
               row_offsets=None if thd else base.row_offsets, shared_prefix=base.shared_prefix)


class Layout:
    """Where every token of every sample sits in one rank's local tensor.

    Args:
        total_lengths: ``L_i``, prompt + response tokens of each sample.
        response_lengths: ``R_i``, response tokens of each sample
            (``0 <= R_i <= L_i - 1``: a response needs one prompt token before it).
        qkv_format: ``"thd"`` (samples packed back to back) or ``"bshd"``
            (rows of ``max_seq_len``, flattened to dimension 0).
        max_seq_len: the bshd row length ``S``; required for bshd, refused for thd.
        cp_mode: ``"none"`` (cp_size 1), ``"zigzag"`` (load-balanced ring
            attention, cp_size 2 or more; thd or bshd) or ``"allgather"`` (contiguous
            split of the packed stream; thd only; also Ulysses-style contiguous sharding).
        cp_rank, cp_size: this rank and the context-parallel world size.
        local_length: ``T``, the length of this rank's local tensor (allgather's pieces
            ``[r*T, (r+1)*T)``), checked where the layout is read; None: the length of
            the local tensor a function receives.
        padded_lengths: thd only, keyword-only: ``W_i >= L_i`` positions per sample, its
            tokens then padding (under zigzag a multiple of ``2 * cp_size``; see
            ``from_cu_seqlens``). None: each sample's default extent.
        align: thd only, keyword-only: shorthand for ``W_i = ceil(L_i / align) * align``
            (``align >= 1``; under zigzag a multiple of ``2 * cp_size``). Give
            ``padded_lengths`` or ``align``, not both.
        row_offsets: bshd only, keyword-only: ``o_i``, the column of row ``i`` where
            sample ``i`` starts (``o_i >= 0``, ``o_i + L_i <= max_seq_len``: a left-padded
            Hugging Face row; see ``from_attention_mask``). None: every sample at column 0.
        shared_prefix: thd only, keyword-only: group sizes ``[G_0, G_1, ...]`` summing to
            ``n``; the ``G_j`` consecutive samples of group ``j`` have equal prompt lengths
            and share their prompt, packed as one *star*: the prompt once, then the
            responses back to back. The star is what padding (``padded_lengths`` then
            has one entry per group), ``align``, zigzag chunks and allgather pieces apply
            to; per-sample inputs and outputs stay ``n`` aligned entries. None (or groups
            all of 1): no sharing.

    The attributes ``padded_lengths`` and ``row_offsets`` hold every layout's resolved ``W_i``
    (one per group's star with ``shared_prefix``) and ``o_i``. Two layouts are equal when they
    place every token of every sample at the same local row: the same lengths, format, mode,
    rank, size, local length, resolved ``padded_lengths``, ``row_offsets`` and groups
    (``align=8`` equals the ``padded_lengths`` it stands for, ``row_offsets`` of zeros equals
    none given, groups all of 1 no ``shared_prefix``). Integers may be ints, numpy integers or
    anything with ``__index__``; lengths any sequence of them (a list, a tuple, a ``range``).
    docs/layouts.md gives every rule.

    Raises:
        TypeError: a length, offset, ``max_seq_len``, rank, size, ``local_length`` or
            ``align`` that is not an integer (a bool or a float included); lengths or
            offsets that are not a sequence; ``qkv_format`` or ``cp_mode`` not a str.
        LayoutError: on any value that breaks a rule of docs/layouts.md; the message
            names the sample, the values and the rule.
    """

    __slots__ = ("total_lengths", "response_lengths", "qkv_format", "max_seq_len", "cp_mode",
                 "cp_rank", "cp_size", "local_length", "padded_lengths", "align", "row_offsets",
                 "shared_prefix", "_given_padding", "_key", "_hash", "_order")  # the order in which __init__ sets them

    total_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    qkv_format: QkvFormat
    max_seq_len: int | None
    cp_mode: LayoutMode
    cp_rank: int
    cp_size: int
    local_length: int | None
    padded_lengths: tuple[int, ...]
    """``W_i``, the positions sample ``i`` occupies, its padding included (resolved
    for every layout; for bshd, the padded row width)."""
    align: int | None
    row_offsets: tuple[int, ...]
    """``o_i``, the padding positions before sample ``i``'s first token in its extent
    (bshd: its first column; zeros unless given, and for every thd layout)."""
    shared_prefix: tuple[int, ...] | None
    """The group sizes ``G_j`` of a shared-prefix layout (None: every sample its own)."""
    _given_padding: tuple[int, ...] | None
    _key: tuple[object, ...]
    _hash: int
    _order: Order | None
    """An order layout's placement (``cp_mode`` ``"order"``), else None."""

    def __init__(
        self,
        total_lengths: Lengths,
        response_lengths: Lengths,
        *,
        qkv_format: FormatArg = "thd",
        max_seq_len: IntArg | None = None,
        cp_mode: ModeArg = "none",
        cp_rank: IntArg = 0,
        cp_size: IntArg = 1,
        local_length: IntArg | None = None,
        padded_lengths: Lengths | None = None,
        align: IntArg | None = None,
        row_offsets: Lengths | None = None,
        shared_prefix: Lengths | None = None,
    ) -> None:
        total, response = check_samples(total_lengths, response_lengths)
        fmt, mode, seq = check_format(qkv_format, cp_mode, max_seq_len, total)
        rank, size = check_cp(cp_rank, cp_size, fmt, mode)
        local = check_local_length(local_length)
        groups = check_shared_prefix(shared_prefix, total, response, fmt)
        stars = star_lengths(groups, total, response)  # the extents' tokens
        given, align_ = check_padding(stars, fmt, mode, size, padded_lengths, align, groups is not None)
        padded = resolve_padded_lengths(stars, fmt, seq, mode, size, given, align_)
        offsets = resolve_row_offsets(total, fmt, seq, row_offsets)
        key: tuple[object, ...] = (total, response, fmt, seq, mode, rank, size, local, padded)
        if any(offsets):  # offsets of zeros place every token as none: the same key
            key += (offsets,)
        if groups is not None:
            key += (groups,)
        values = (total, response, fmt, seq, mode, rank, size, local, padded, align_, offsets,
                  groups, given, key, hash(key), None)  # in the order of __slots__
        for name, value in zip(self.__slots__, values, strict=True):
            object.__setattr__(self, name, value)

    from_parallel_state = classmethod(_from_parallel_state)
    from_cu_seqlens = classmethod(_from_cu_seqlens)
    from_attention_mask = classmethod(_from_attention_mask)
    from_order = classmethod(_from_order)  # the constructors' bodies and docs: above

    def order(self) -> Tensor:
        """The rearrange index that places every position as this layout does (CPU int64:
        thd ``[N]``, bshd ``[B, S]``), for ``from_order`` and for a model's inputs.

        Raises:
            LayoutError: the ranks' local tensors do not cover the stream (allgather
                without ``local_length = N / cp_size``).
        """
        placed = self._placement()
        # an order's own length; a closed form's local_length, else its least
        length = self.local_length if self._order is None and self.local_length else placed.least_length
        pieces = [placed.of_rank(r, length) for r in range(self.cp_size)]
        return order_of(self.qkv_format, self.padded_lengths, self.max_seq_len, pieces, length)

    @property
    def num_samples(self) -> int:
        """The number of samples ``n``."""
        return len(self.total_lengths)

    @property
    def prompt_lengths(self) -> tuple[int, ...]:
        """``P_i = L_i - R_i`` of each sample."""
        return tuple(t - r for t, r in zip(self.total_lengths, self.response_lengths))

    def for_rank(self, cp_rank: IntArg) -> "Layout":
        """The same samples and mode as seen by another rank of the CP group."""
        return self._replace(cp_rank, self.local_length)

    def with_local_length(self, local_length: IntArg | None) -> "Layout":
        """This layout with ``local_length`` set (or cleared, with None)."""
        return self._replace(self.cp_rank, local_length)

    def _replace(self, cp_rank: IntArg, local_length: IntArg | None) -> "Layout":
        if self._order is not None:
            return self._placed(check_cp(cp_rank, self.cp_size, self.qkv_format, "order")[0],
                                self.cp_size, check_local_length(local_length), self._order)
        return Layout(
            self.total_lengths, self.response_lengths, qkv_format=self.qkv_format,
            max_seq_len=self.max_seq_len, cp_mode=self._closed_mode(), cp_rank=cp_rank,
            cp_size=self.cp_size, local_length=local_length, padded_lengths=self._given_padding,
            align=self.align, row_offsets=self.row_offsets if self.qkv_format == "bshd" else None,
            shared_prefix=self.shared_prefix,
        )

    def _placed(self, rank: int, size: int, local: int | None, placement: Order) -> "Layout":
        """This layout's samples at ``placement``: ``cp_mode`` ``"order"``."""
        new = object.__new__(Layout)
        head = (self.total_lengths, self.response_lengths, self.qkv_format, self.max_seq_len, "order")
        offsets = (self.row_offsets,) if any(self.row_offsets) else ()
        groups = () if self.shared_prefix is None else (self.shared_prefix,)
        key = (*head, rank, size, local, self.padded_lengths, *offsets, *groups, placement)
        values = (*head, rank, size, local, self.padded_lengths, self.align, self.row_offsets,
                  self.shared_prefix, self._given_padding, key, hash(key), placement)
        for name, value in zip(self.__slots__, values, strict=True):
            object.__setattr__(new, name, value)
        return new

    def _placement(self) -> Order | Closed:
        """Where this layout's rows sit: its order's reading, or its closed form's
        arithmetic (``least_length`` and ``of_rank`` of either)."""
        if self._order is not None:
            return self._order
        return Closed(self._closed_mode(), self.padded_lengths, self.cp_size)

    def _closed_mode(self) -> CpMode:
        """The ``cp_mode`` of a closed-form layout (one not built from an order)."""
        assert self._order is None, "an order layout has no closed form"
        return cast(CpMode, self.cp_mode)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Layout is immutable; use for_rank() or build a new one ({name})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        given = self._given_padding  # the arguments as given: None and no offsets left out
        fields = {
            "total_lengths": list(self.total_lengths), "response_lengths": list(self.response_lengths),
            "qkv_format": self.qkv_format, "max_seq_len": self.max_seq_len, "cp_mode": self.cp_mode,
            "cp_rank": self.cp_rank, "cp_size": self.cp_size, "local_length": self.local_length,
            "padded_lengths": None if given is None else list(given), "align": self.align,
            "row_offsets": list(self.row_offsets) if any(self.row_offsets) else None,
            "shared_prefix": None if self.shared_prefix is None else list(self.shared_prefix),
        }
        return f"Layout({', '.join(f'{k}={v!r}' for k, v in fields.items() if v is not None)})"


