"""``W_i``, the positions each sample occupies: the one number per sample a Layout
resolves when it is built (to validate it and to compare layouts by what they place
where). Every offset is derived from these widths by ``_plan`` (docs/layouts.md).
"""

from ._types import CpMode, QkvFormat


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
