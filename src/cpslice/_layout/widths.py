"""``W_i``, the positions each sample occupies, and ``o_i``, where its tokens start among
them: the numbers per sample a Layout resolves when it is built (to validate it and to
compare layouts by what they place where). Every offset is derived from these by
``pieces.py`` and ``plan.py`` (docs/layouts.md).
"""

from .._checks import per_sample_lengths
from .._errors import LayoutError
from .._types import CpMode, QkvFormat


def resolve_padded_lengths(
    total: tuple[int, ...],
    fmt: QkvFormat,
    max_seq_len: int | None,
    mode: CpMode,
    cp_size: int,
    padded: tuple[int, ...] | None,
    align: int | None,
) -> tuple[int, ...]:
    """``W_i``, the positions sample ``i`` occupies (``Layout.padded_lengths``).

    The given ``padded`` ones; with ``align``, ``ceil(L_i / align) * align``; else the
    default extent: a bshd row (``S``, rounded up to a multiple of ``2c`` under
    zigzag), the least multiple of ``2c`` that is ``>= L_i`` (zigzag thd), or ``L_i``.
    The arguments are already validated by ``Layout``.
    """
    if padded is not None:
        return padded
    if fmt == "bshd":
        assert max_seq_len is not None
        step = 2 * cp_size if mode == "zigzag" else 1
        return (-(-max_seq_len // step) * step,) * len(total)
    step = align if align is not None else (2 * cp_size if mode == "zigzag" else 1)
    if step == 1:
        return total
    return tuple(-(-t // step) * step for t in total)


def resolve_row_offsets(
    total: tuple[int, ...],
    fmt: QkvFormat,
    max_seq_len: int | None,
    offsets: object,
) -> tuple[int, ...]:
    """``o_i``, the padding positions before sample ``i``'s first token in its extent
    (``Layout.row_offsets``): the given ``row_offsets`` of a bshd layout, else zeros.

    A bshd sample occupies columns ``[o_i, o_i + L_i)`` of its row of ``S`` columns
    (a Hugging Face batch's left-padded prompt, then the response), so ``o_i >= 0``
    and ``o_i + L_i <= S``.

    Raises:
        TypeError: ``offsets`` is not a sequence of integers.
        LayoutError: given with thd; not one per sample; a sample that does not fit.
    """
    if offsets is None:
        return (0,) * len(total)
    if fmt != "bshd":
        raise LayoutError(
            "row_offsets is given with qkv_format 'thd', whose samples start where the "
            "previous one ends; pass qkv_format='bshd' for left-padded rows, or drop it"
        )
    assert max_seq_len is not None
    given = per_sample_lengths("row_offsets", offsets, total)
    for i, (o, t) in enumerate(zip(given, total)):
        if o < 0:
            raise LayoutError(
                f"sample {i}: row_offset {o} < 0 (sample i occupies columns "
                "[o_i, o_i + L_i) of its row)"
            )
        if o + t > max_seq_len:
            raise LayoutError(
                f"sample {i}: row_offset {o} + total_length {t} = {o + t} > max_seq_len "
                f"{max_seq_len} (sample i's tokens are columns [o_i, o_i + L_i) of its row, "
                "which ends at max_seq_len)"
            )
    return given
