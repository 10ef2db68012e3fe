"""The Layout: which samples a micro-batch holds and how one rank lays them out.

A Layout is a validated, immutable record. It holds no offset arithmetic of its
own: every offset is read from it by ``_plan`` (LAYOUTS.md, one place).
"""

from ._checks import integer, kind, lengths
from ._errors import LayoutError
from ._types import CpMode, FormatArg, IntArg, Lengths, ModeArg, QkvFormat

_FORMATS: tuple[QkvFormat, ...] = ("thd", "bshd")
_MODES: tuple[CpMode, ...] = ("none", "zigzag", "allgather")


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

    Integers may be ints, numpy integers or anything with ``__index__``; lengths
    any sequence of them (a list, a tuple, a ``range``).

    Raises:
        TypeError: a length, ``max_seq_len``, rank, size or ``local_length`` that is
            not an integer (a bool or a float included); lengths that are not a
            sequence; ``qkv_format`` or ``cp_mode`` not a str.
        LayoutError: on any value that breaks a rule of LAYOUTS.md; the message
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
        for name, given in (("qkv_format", qkv_format), ("cp_mode", cp_mode)):
            if not isinstance(given, str):
                raise TypeError(f"{name} must be a str, got {kind(given)} {given!r}")
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
        setattr_ = object.__setattr__
        setattr_(self, "total_lengths", total)
        setattr_(self, "response_lengths", response)
        setattr_(self, "qkv_format", fmt)
        setattr_(self, "max_seq_len", seq)
        setattr_(self, "cp_mode", mode)
        setattr_(self, "cp_rank", rank)
        setattr_(self, "cp_size", size)
        setattr_(self, "local_length", local)
        key = (total, response, fmt, seq, mode, rank, size, local)
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
    ) -> "Layout":
        """This rank's Layout, reading CP rank and size from megatron-core's parallel_state.

        The mode is ``"allgather"`` when ``allgather_cp``, else ``"zigzag"`` when the
        CP world size is above 1, else ``"none"``. Imports megatron-core (lazily).

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
        return (
            f"Layout(total_lengths={list(self.total_lengths)}, "
            f"response_lengths={list(self.response_lengths)}, qkv_format={self.qkv_format!r}"
            f"{extra}, cp_mode={self.cp_mode!r}, cp_rank={self.cp_rank}, "
            f"cp_size={self.cp_size}{local})"
        )
