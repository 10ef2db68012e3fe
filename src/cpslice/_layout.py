"""The Layout: which samples a micro-batch holds and how one rank lays them out.

A Layout is a validated, immutable record. It holds no offset arithmetic of its
own: every offset is read from it by ``_plan`` (docs/layouts.md, one place).
"""

from collections.abc import Sequence

import torch

from ._checks import integer, kind, lengths, per_sample_lengths
from ._errors import LayoutError
from ._masks import mask_rows
from ._types import (
    Boundaries,
    CpMode,
    FormatArg,
    IntArg,
    Lengths,
    ModeArg,
    QkvFormat,
    TensorArg,
)
from ._widths import resolve_padded_lengths, resolve_row_offsets

_FORMATS: tuple[QkvFormat, ...] = ("thd", "bshd")
_MODES: tuple[CpMode, ...] = ("none", "zigzag", "allgather")


def _boundaries(values: object) -> tuple[int, ...]:
    """``cu_seqlens_padded`` as host ints: a list/tuple of ints, or a 1-D integer tensor
    on any device (read with one host copy)."""
    name = "cu_seqlens_padded"
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of dtype {values.dtype}")
        if values.dim() != 1:
            raise LayoutError(
                f"{name} must be 1-D [n + 1] (the padded sample boundaries), got shape "
                f"{tuple(values.shape)}"
            )
        host: list[int] = values.tolist()  # the one host copy
        return tuple(host)
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list of ints or an integer tensor, got {kind(values)}")
    return tuple(integer(f"{name}[{i}]", v) for i, v in enumerate(values))


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
            attention; thd or bshd) or ``"allgather"`` (contiguous split of the
            packed stream; thd only; also Ulysses-style contiguous sharding).
        cp_rank, cp_size: this rank and the context-parallel world size.
        local_length: the length ``T`` of this rank's local tensor. For allgather
            it defines the pieces ``[r*T, (r+1)*T)``; a function that receives the
            local tensor infers it when it is None. When set, a local tensor of
            another length is an error, and so is a ``local_length`` shorter than
            the layout needs (reported by the first function that reads the layout:
            a Layout is a record and computes no offsets itself).
        padded_lengths: thd only, keyword-only: ``W_i >= L_i`` positions per sample,
            its ``L_i`` tokens then ``W_i - L_i`` padding on the right (verl,
            Megatron-Bridge, NeMo: ``PackedSeqParams.cu_seqlens_q_padded``; see
            ``from_cu_seqlens``). No CP: sample ``i`` starts at ``W_0 + ... + W_{i-1}``;
            zigzag: ``W_i`` must be a multiple of ``2 * cp_size`` and is cut into
            ``2 * cp_size`` chunks; allgather: the stream of padded samples is cut into
            ``cp_size`` pieces of ``T``. None: each sample's default extent.
        align: thd only, keyword-only: shorthand for ``W_i = ceil(L_i / align) * align``
            (``align >= 1``; under zigzag a multiple of ``2 * cp_size``). Give
            ``padded_lengths`` or ``align``, not both.
        row_offsets: bshd only, keyword-only: ``o_i``, the column of row ``i`` where
            sample ``i`` starts: it occupies columns ``[o_i, o_i + L_i)`` of its row
            (``o_i >= 0``, ``o_i + L_i <= max_seq_len``), the columns before and after
            it padding (a Hugging Face batch: the prompt left-padded, the response
            right after it; see ``from_attention_mask``). Under zigzag the padded row
            is cut into ``2 * cp_size`` chunks as without offsets, the offsets counting
            within the row. None: every sample at column 0.

    The resolved ``W_i`` of every layout is ``padded_lengths`` (the attribute): the
    given ones; without them ``L_i`` (cp none and allgather, thd), the least multiple
    of ``2 * cp_size`` that is ``>= L_i`` (zigzag, thd), or the padded row width
    (bshd); ``row_offsets`` (the attribute) holds every layout's ``o_i``, zeros unless
    given. Padding positions hold no token: never extracted, filled by ``pack``
    and ``shifted_targets``. Two layouts are equal when they place every token of
    every sample at the same local row: the same lengths, format, mode, rank, size,
    local length, resolved ``padded_lengths`` and ``row_offsets`` (``align=8`` equals
    the ``padded_lengths`` it stands for, ``row_offsets`` of zeros equals none given).
    docs/layouts.md gives every rule.

    Integers may be ints, numpy integers or anything with ``__index__``; lengths
    any sequence of them (a list, a tuple, a ``range``).

    Raises:
        TypeError: a length, offset, ``max_seq_len``, rank, size, ``local_length`` or
            ``align`` that is not an integer (a bool or a float included); lengths or
            offsets that are not a sequence; ``qkv_format`` or ``cp_mode`` not a str.
        LayoutError: on any value that breaks a rule of docs/layouts.md; the message
            names the sample, the values and the rule.
    """

    __slots__ = (
        "total_lengths",
        "response_lengths",
        "qkv_format",
        "max_seq_len",
        "cp_mode",
        "cp_rank",
        "cp_size",
        "local_length",
        "padded_lengths",
        "align",
        "row_offsets",
        "_given_padding",
        "_key",
        "_hash",
    )

    total_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    qkv_format: QkvFormat
    max_seq_len: int | None
    cp_mode: CpMode
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
    _given_padding: tuple[int, ...] | None
    _key: tuple[object, ...]
    _hash: int

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
    ) -> None:
        total = lengths("total_lengths", total_lengths)
        response = lengths("response_lengths", response_lengths)
        if len(total) != len(response):
            raise LayoutError(
                f"total_lengths has {len(total)} samples but response_lengths has "
                f"{len(response)} (one entry per sample in each)"
            )
        for i, (t, r) in enumerate(zip(total, response)):
            if t < 1:
                raise LayoutError(f"sample {i}: total_length {t} < 1 (a sample holds a token)")
            if r < 0:
                raise LayoutError(f"sample {i}: response_length {r} < 0")
            if r > t - 1:
                raise LayoutError(
                    f"sample {i}: response_length {r} > total_length - 1 = {t - 1} "
                    "(a response needs at least one prompt token before it)"
                )
        for name, given_str in (("qkv_format", qkv_format), ("cp_mode", cp_mode)):
            if not isinstance(given_str, str):
                raise TypeError(f"{name} must be a str, got {kind(given_str)} {given_str!r}")
        if qkv_format not in _FORMATS:
            raise LayoutError(f"qkv_format {qkv_format!r} is not one of {_FORMATS}")
        if cp_mode not in _MODES:
            raise LayoutError(f"cp_mode {cp_mode!r} is not one of {_MODES}")
        fmt: QkvFormat = qkv_format
        mode: CpMode = cp_mode
        seq: int | None = None
        if fmt == "bshd":
            if max_seq_len is None:
                raise LayoutError(
                    "qkv_format 'bshd' needs max_seq_len, the padded row length S "
                    "(or pass qkv_format='thd' for packed samples)"
                )
            seq = integer("max_seq_len", max_seq_len)
            if seq < 1:
                raise LayoutError(f"max_seq_len {seq} < 1")
            for i, t in enumerate(total):
                if t > seq:
                    raise LayoutError(
                        f"sample {i}: total_length {t} > max_seq_len {seq} "
                        "(a bshd row holds at most max_seq_len tokens)"
                    )
        elif max_seq_len is not None:
            raise LayoutError(
                f"max_seq_len={max_seq_len!r} is given with qkv_format 'thd', where it means "
                "nothing; pass qkv_format='bshd' for padded rows, or drop max_seq_len"
            )
        size = integer("cp_size", cp_size)
        rank = integer("cp_rank", cp_rank)
        if size < 1:
            raise LayoutError(f"cp_size {size} < 1")
        if not 0 <= rank < size:
            raise LayoutError(f"cp_rank {rank} is outside [0, cp_size={size})")
        if mode == "none" and size > 1:
            raise LayoutError(
                f"cp_mode 'none' with cp_size {size}: pass cp_mode='zigzag' or "
                "'allgather' for context parallelism, or cp_size=1"
            )
        if mode == "allgather" and fmt == "bshd":
            raise LayoutError(
                "cp_mode 'allgather' splits the packed stream, so it needs qkv_format "
                "'thd'; pass cp_mode='zigzag' for bshd rows"
            )
        local: int | None = None
        if local_length is not None:
            local = integer("local_length", local_length)
            if local < 0:
                raise LayoutError(f"local_length {local} < 0")
        given, align_ = _padding(total, fmt, mode, size, padded_lengths, align)
        padded = resolve_padded_lengths(total, fmt, seq, mode, size, given, align_)
        offsets = resolve_row_offsets(total, fmt, seq, row_offsets)
        setattr_ = object.__setattr__
        setattr_(self, "total_lengths", total)
        setattr_(self, "response_lengths", response)
        setattr_(self, "qkv_format", fmt)
        setattr_(self, "max_seq_len", seq)
        setattr_(self, "cp_mode", mode)
        setattr_(self, "cp_rank", rank)
        setattr_(self, "cp_size", size)
        setattr_(self, "local_length", local)
        setattr_(self, "padded_lengths", padded)
        setattr_(self, "align", align_)
        setattr_(self, "row_offsets", offsets)
        setattr_(self, "_given_padding", given)
        key: tuple[object, ...] = (total, response, fmt, seq, mode, rank, size, local, padded)
        if any(offsets):  # offsets of zeros place every token as none: the same key
            key += (offsets,)
        setattr_(self, "_key", key)
        setattr_(self, "_hash", hash(key))

    @classmethod
    def from_parallel_state(
        cls,
        total_lengths: Lengths,
        response_lengths: Lengths,
        *,
        qkv_format: FormatArg = "thd",
        max_seq_len: IntArg | None = None,
        allgather_cp: bool = False,
        local_length: IntArg | None = None,
        padded_lengths: Lengths | None = None,
        align: IntArg | None = None,
        row_offsets: Lengths | None = None,
    ) -> "Layout":
        """This rank's Layout, reading CP rank and size from megatron-core's parallel_state.

        The mode is ``"allgather"`` when ``allgather_cp``, else ``"zigzag"`` when the
        CP world size is above 1, else ``"none"``. Imports megatron-core (lazily).
        ``padded_lengths``, ``align`` and ``row_offsets`` are ``Layout``'s (e.g. verl's
        ``align=tp * cp * 2`` under CP, ``tp`` without).

        Raises:
            ImportError: megatron-core is not installed (``pip install 'cpslice[megatron]'``).
            RuntimeError: megatron-core's model parallel state is not initialized.
            LayoutError: as ``Layout(...)``.
        """
        from ._megatron import cp_rank_and_size

        rank, size = cp_rank_and_size()
        mode: CpMode = "allgather" if allgather_cp else ("zigzag" if size > 1 else "none")
        return cls(
            total_lengths,
            response_lengths,
            qkv_format=qkv_format,
            max_seq_len=max_seq_len,
            cp_mode=mode,
            cp_rank=rank,
            cp_size=size,
            local_length=local_length,
            padded_lengths=padded_lengths,
            align=align,
            row_offsets=row_offsets,
        )

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens_padded: Boundaries,
        total_lengths: Lengths,
        response_lengths: Lengths,
        *,
        cp_mode: ModeArg = "none",
        cp_rank: IntArg = 0,
        cp_size: IntArg = 1,
        local_length: IntArg | None = None,
    ) -> "Layout":
        """The thd Layout of samples padded to the boundaries a framework already holds.

        Args:
            cu_seqlens_padded: ``[n + 1]`` ints, ``0 = b_0 <= b_1 <= ... <= b_n``: the
                global padded boundaries before any CP split, exactly what megatron-core's
                ``PackedSeqParams.cu_seqlens_q_padded`` holds. A list/tuple of ints or an
                integer tensor on any device (read with one host copy). Sample ``i``
                occupies ``W_i = b_{i+1} - b_i`` positions.
            total_lengths, response_lengths, cp_mode, cp_rank, cp_size, local_length:
                as ``Layout``.

        Returns:
            ``Layout(total_lengths, response_lengths, padded_lengths=W, ...)``.

        Raises:
            TypeError: ``cu_seqlens_padded`` is neither a list of ints nor an integer tensor.
            LayoutError: it is not 1-D, has not ``n + 1`` entries, does not start at 0,
                decreases, or gives a sample fewer positions than its tokens; anything
                ``Layout`` refuses.
        """
        total = lengths("total_lengths", total_lengths)
        bounds = _boundaries(cu_seqlens_padded)
        n = len(total)
        if len(bounds) != n + 1:
            raise LayoutError(
                f"cu_seqlens_padded has {len(bounds)} entries but there are {n} samples "
                f"(it holds the n + 1 = {n + 1} padded boundaries, starting at 0)"
            )
        if bounds[0] != 0:
            raise LayoutError(
                f"cu_seqlens_padded starts at {bounds[0]}, not 0 (the global boundaries of "
                "the whole micro-batch, before any CP split)"
            )
        widths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        for i, (w, t) in enumerate(zip(widths, total)):
            if w < 0:
                raise LayoutError(
                    f"sample {i}: cu_seqlens_padded decreases, {bounds[i]} then {bounds[i + 1]} "
                    "(boundaries are non-decreasing)"
                )
            if w < t:
                raise LayoutError(
                    f"sample {i}: cu_seqlens_padded[{i + 1}] - cu_seqlens_padded[{i}] = "
                    f"{bounds[i + 1]} - {bounds[i]} = {w} < total_length {t} (a padded "
                    "sample holds its tokens, then padding)"
                )
        return cls(
            total,
            response_lengths,
            cp_mode=cp_mode,
            cp_rank=cp_rank,
            cp_size=cp_size,
            local_length=local_length,
            padded_lengths=widths,
        )

    @classmethod
    def from_attention_mask(
        cls,
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
        return cls(
            total,
            response_lengths,
            qkv_format="bshd",
            max_seq_len=seq,
            cp_mode=cp_mode,
            cp_rank=cp_rank,
            cp_size=cp_size,
            local_length=local_length,
            row_offsets=offsets,
        )

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
        return Layout(
            self.total_lengths,
            self.response_lengths,
            qkv_format=self.qkv_format,
            max_seq_len=self.max_seq_len,
            cp_mode=self.cp_mode,
            cp_rank=cp_rank,
            cp_size=self.cp_size,
            local_length=local_length,
            padded_lengths=self._given_padding,
            align=self.align,
            row_offsets=self.row_offsets if self.qkv_format == "bshd" else None,
        )

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Layout is immutable; use for_rank() or build a new one ({name})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        extra = f", max_seq_len={self.max_seq_len}" if self.max_seq_len is not None else ""
        local = f", local_length={self.local_length}" if self.local_length is not None else ""
        if self._given_padding is not None:
            local += f", padded_lengths={list(self._given_padding)}"
        if self.align is not None:
            local += f", align={self.align}"
        if any(self.row_offsets):
            local += f", row_offsets={list(self.row_offsets)}"
        return (
            f"Layout(total_lengths={list(self.total_lengths)}, "
            f"response_lengths={list(self.response_lengths)}, qkv_format={self.qkv_format!r}"
            f"{extra}, cp_mode={self.cp_mode!r}, cp_rank={self.cp_rank}, "
            f"cp_size={self.cp_size}{local})"
        )


def _padding(
    total: tuple[int, ...],
    fmt: QkvFormat,
    mode: CpMode,
    size: int,
    padded_lengths: object,
    align: object,
) -> tuple[tuple[int, ...] | None, int | None]:
    """The validated ``padded_lengths`` and ``align`` arguments (at most one of them)."""
    if padded_lengths is None and align is None:
        return None, None
    what = "padded_lengths" if padded_lengths is not None else "align"
    if fmt == "bshd":
        raise LayoutError(
            f"{what} is given with qkv_format 'bshd', whose rows are already padded to "
            "max_seq_len; pass qkv_format='thd' for packed padded samples, or drop it"
        )
    if padded_lengths is not None and align is not None:
        raise LayoutError(
            f"padded_lengths and align={align!r} are both given; pass one: align a stands "
            "for padded_lengths W_i = ceil(L_i / a) * a"
        )
    two_c = 2 * size
    zigzag = (
        f" (zigzag cuts each padded sample into 2 * cp_size = {two_c} equal chunks)"
    )
    if align is not None:
        a = integer("align", align)
        if a < 1:
            raise LayoutError(f"align {a} < 1 (samples are padded to a multiple of align)")
        if mode == "zigzag" and a % two_c:
            raise LayoutError(f"align {a} is not a multiple of 2 * cp_size = {two_c}{zigzag}")
        return None, a
    given = per_sample_lengths("padded_lengths", padded_lengths, total)
    for i, (w, t) in enumerate(zip(given, total)):
        if w < t:
            raise LayoutError(
                f"sample {i}: padded_length {w} < total_length {t} (a padded sample holds "
                "its tokens, then padding)"
            )
        if mode == "zigzag" and w % two_c:
            raise LayoutError(
                f"sample {i}: padded_length {w} is not a multiple of 2 * cp_size = "
                f"{two_c}{zigzag}"
            )
    return given, None
