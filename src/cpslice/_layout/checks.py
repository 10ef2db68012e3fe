"""The checks of a Layout's arguments, one function per group of them, each returning its
arguments validated: host ints, the format and mode literals, the given extents.

``Layout`` calls them in the order it raises its errors (a sample's lengths first, then
the format and mode, the CP rank and size, ``local_length``, the padding); the extents
and row offsets are resolved in ``widths.py``, an attention mask is read in ``masks.py``.
Every message names the sample, the values and the rule of docs/layouts.md.
"""

from collections.abc import Sequence
from typing import cast

import torch

from .._checks import integer, kind, lengths, per_sample_lengths
from .._errors import LayoutError
from .._types import CpMode, FormatArg, LayoutMode, ModeArg, QkvFormat

_FORMATS: tuple[QkvFormat, ...] = ("thd", "bshd")
_MODES: tuple[CpMode, ...] = ("none", "zigzag", "allgather")


def check_samples(
    total_lengths: object, response_lengths: object
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``L`` and ``R`` as ints: one of each per sample, ``L_i >= 1``, ``0 <= R_i <= L_i - 1``."""
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
    return total, response


def check_format(
    qkv_format: FormatArg, cp_mode: ModeArg, max_seq_len: object, total: tuple[int, ...]
) -> tuple[QkvFormat, CpMode, int | None]:
    """The format, the mode and (bshd) the row length ``S``, which every sample fits."""
    fmt, mode = _format_and_mode(qkv_format, cp_mode)
    return fmt, mode, _row_length(fmt, max_seq_len, total)


def _format_and_mode(qkv_format: FormatArg, cp_mode: ModeArg) -> tuple[QkvFormat, CpMode]:
    """Both names strs, then each one this ``Layout`` is built with (``"order"`` has its
    own constructor)."""
    for name, given_str in (("qkv_format", qkv_format), ("cp_mode", cp_mode)):
        if not isinstance(given_str, str):
            raise TypeError(f"{name} must be a str, got {kind(given_str)} {given_str!r}")
    if qkv_format not in _FORMATS:
        raise LayoutError(f"qkv_format {qkv_format!r} is not one of {_FORMATS}")
    if cast(str, cp_mode) == "order":
        raise LayoutError("cp_mode 'order' needs the order itself: build the layout with Layout.from_order")
    if cp_mode not in _MODES:
        raise LayoutError(f"cp_mode {cp_mode!r} is not one of {_MODES}")
    return qkv_format, cp_mode


def _row_length(fmt: QkvFormat, max_seq_len: object, total: tuple[int, ...]) -> int | None:
    """bshd's row length ``S >= 1``, which every sample fits; thd takes none."""
    if fmt == "thd":
        if max_seq_len is not None:
            raise LayoutError(
                f"max_seq_len={max_seq_len!r} is given with qkv_format 'thd', where it means "
                "nothing; pass qkv_format='bshd' for padded rows, or drop max_seq_len"
            )
        return None
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
    return seq


def check_cp(cp_rank: object, cp_size: object, fmt: QkvFormat, mode: LayoutMode) -> tuple[int, int]:
    """The CP rank and size: ``0 <= cp_rank < cp_size``, a size the mode and format allow
    (``"order"``: any size, the order's to check). The one statement of each mode's size
    rule: ``none`` is cp_size 1, ``zigzag`` cp_size 2 or more."""
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
    if mode == "zigzag" and size == 1:
        raise LayoutError(
            "cp_mode 'zigzag' with cp_size 1: zigzag needs cp_size 2 or more (it deals each "
            "sample's 2 * cp_size chunks out to the CP ranks in pairs); pass cp_mode='none' "
            "for one rank"
        )
    if mode == "allgather" and fmt == "bshd":
        raise LayoutError(
            "cp_mode 'allgather' splits the packed stream, so it needs qkv_format "
            "'thd'; pass cp_mode='zigzag' for bshd rows"
        )
    return rank, size


def check_local_length(local_length: object) -> int | None:
    """``T`` as an int ``>= 0``, or None (the layout's functions read it from the tensor)."""
    if local_length is None:
        return None
    local = integer("local_length", local_length)
    if local < 0:
        raise LayoutError(f"local_length {local} < 0")
    return local


def check_padding(
    total: tuple[int, ...],
    fmt: QkvFormat,
    mode: CpMode,
    size: int,
    padded_lengths: object,
    align: object,
    grouped: bool = False,
) -> tuple[tuple[int, ...] | None, int | None]:
    """The validated ``padded_lengths`` and ``align`` arguments (at most one of them);
    ``total`` the extents' token counts: the samples', or with ``grouped`` the stars' of a
    ``shared_prefix`` layout (one padded length per group)."""
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
    if align is not None:
        return None, _check_align(align, mode, size)
    return _check_widths(padded_lengths, total, mode, size, grouped), None


def _zigzag_multiple(size: int) -> str:
    """Why zigzag at ``size`` needs a multiple of ``2 * size``, for messages."""
    return f" (zigzag cuts each padded sample into 2 * cp_size = {2 * size} equal chunks)"


def _check_align(align: object, mode: CpMode, size: int) -> int:
    """``align``: an int >= 1, under zigzag a multiple of ``2 * cp_size``."""
    a = integer("align", align)
    if a < 1:
        raise LayoutError(f"align {a} < 1 (samples are padded to a multiple of align)")
    if mode == "zigzag" and a % (2 * size):
        raise LayoutError(f"align {a} is not a multiple of 2 * cp_size = {2 * size}{_zigzag_multiple(size)}")
    return a


def _check_widths(
    padded_lengths: object, total: tuple[int, ...], mode: CpMode, size: int, grouped: bool
) -> tuple[int, ...]:
    """``padded_lengths``: one per extent (sample, or with ``grouped`` star), each at least
    its tokens, under zigzag a multiple of ``2 * cp_size``."""
    if grouped:
        given = lengths("padded_lengths", padded_lengths, "group")
        if len(given) != len(total):
            raise LayoutError(
                f"padded_lengths has {len(given)} entries but shared_prefix has {len(total)} "
                "groups (a shared_prefix layout pads each group's star: one entry per group)"
            )
    else:
        given = per_sample_lengths("padded_lengths", padded_lengths, total)
    unit, tokens = ("group", "star length") if grouped else ("sample", "total_length")
    for i, (w, t) in enumerate(zip(given, total)):
        if w < t:
            raise LayoutError(
                f"{unit} {i}: padded_length {w} < {tokens} {t} (a padded {unit} holds "
                "its tokens, then padding)"
            )
        if mode == "zigzag" and w % (2 * size):
            raise LayoutError(
                f"{unit} {i}: padded_length {w} is not a multiple of 2 * cp_size = "
                f"{2 * size}{_zigzag_multiple(size)}"
            )
    return given


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


def cu_seqlens_widths(
    cu_seqlens_padded: object, total: tuple[int, ...], grouped: bool = False
) -> tuple[int, ...]:
    """``W_i = b_{i+1} - b_i`` of the global padded boundaries ``b``
    (``Layout.from_cu_seqlens``): ``n + 1`` of them, from 0, non-decreasing, ``W_i >= L_i``;
    ``total`` the extents' token counts (with ``grouped``, the ``m`` stars')."""
    bounds = _boundaries(cu_seqlens_padded)
    n = len(total)
    unit, units, tokens = ("group", "shared_prefix groups", "star length") if grouped else (
        "sample", "samples", "total_length"
    )
    if len(bounds) != n + 1:
        raise LayoutError(
            f"cu_seqlens_padded has {len(bounds)} entries but there are {n} {units} "
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
                f"{unit} {i}: cu_seqlens_padded decreases, {bounds[i]} then {bounds[i + 1]} "
                "(boundaries are non-decreasing)"
            )
        if w < t:
            raise LayoutError(
                f"{unit} {i}: cu_seqlens_padded[{i + 1}] - cu_seqlens_padded[{i}] = "
                f"{bounds[i + 1]} - {bounds[i]} = {w} < {tokens} {t} (a padded "
                f"{unit} holds its tokens, then padding)"
            )
    return widths


def check_parallel_state_mode(cp_mode: ModeArg | None, size: int) -> ModeArg:
    """``Layout.from_parallel_state``'s mode at megatron-core's CP world size ``size``:
    None reads it (``"zigzag"`` above 1, else ``"none"``); ``"zigzag"`` and ``"none"``
    refused at a size ``check_cp``'s rule refuses them, in megatron-core's terms;
    anything else is ``Layout``'s to check."""
    if cp_mode is None:
        return "zigzag" if size > 1 else "none"
    if cp_mode == "zigzag" and size == 1:
        raise LayoutError(
            "cp_mode 'zigzag' but megatron-core's context-parallel world size is 1: pass "
            "cp_mode='none' (or None, which reads it from parallel_state) to run without "
            "context parallelism"
        )
    if cp_mode == "none" and size > 1:
        raise LayoutError(
            f"cp_mode 'none' but megatron-core's context-parallel world size is {size}: pass "
            "cp_mode='zigzag' or 'allgather' (or None, which reads 'zigzag' from "
            "parallel_state), or build Layout(...) without CP for a batch every CP rank "
            "holds whole"
        )
    return cp_mode


def check_shared_prefix(
    groups: object, total: tuple[int, ...], response: tuple[int, ...], fmt: QkvFormat
) -> tuple[int, ...] | None:
    """The group sizes of ``shared_prefix`` (None: no sharing, as are groups all of 1):
    each ``G_j >= 1``, summing to ``n``; the samples of a group have equal prompt lengths
    ``P_j``; thd only (a bshd row holds one sample)."""
    if groups is None:
        return None
    sizes = lengths("shared_prefix", groups, "group", "a group size counts samples")
    n = len(total)
    for j, g in enumerate(sizes):
        if g < 1:
            raise LayoutError(f"group {j}: shared_prefix size {g} < 1 (a group holds a sample)")
    if sum(sizes) != n:
        raise LayoutError(
            f"shared_prefix sums to {sum(sizes)} but there are {n} samples (the group sizes "
            "G_0 + G_1 + ... count every sample once, groups of consecutive samples)"
        )
    if all(g == 1 for g in sizes):
        return None
    if fmt == "bshd":
        raise LayoutError(
            "shared_prefix is given with qkv_format 'bshd', whose rows hold one sample each; "
            "pass qkv_format='thd' to pack each group's prompt once with its responses"
        )
    first = 0
    for j, g in enumerate(sizes):
        prompt = total[first] - response[first]
        for i in range(first + 1, first + g):
            if total[i] - response[i] != prompt:
                raise LayoutError(
                    f"group {j}: sample {i} has prompt length {total[i] - response[i]} "
                    f"(total_length {total[i]} - response_length {response[i]}) but sample "
                    f"{first}, the group's first, has {prompt} (the samples of a shared_prefix "
                    "group share one prompt)"
                )
        first += g
    return sizes


def star_lengths(
    sizes: tuple[int, ...] | None, total: tuple[int, ...], response: tuple[int, ...]
) -> tuple[int, ...]:
    """``L*_j = P_j + sum R_i`` of each group's star (the samples' lengths without sharing)."""
    if sizes is None:
        return total
    out: list[int] = []
    first = 0
    for g in sizes:
        out.append(total[first] - response[first] + sum(response[first:first + g]))
        first += g
    return tuple(out)
