"""``cpslice plan`` of a shared-prefix layout: its stars (a group's prompt once, then
each sample's response), what each rank holds of them, and each sample's rows.

Every offset is read from ``_layout.plan`` (runs, segments and selections) or from a
``Layout`` of the stars themselves; none is computed here.
"""

import itertools

import torch
from torch import Tensor

from .._layout.checks import star_lengths
from .._layout.layout import Layout
from .._layout.plan import runs, segments, selection_at


def _range(lo: int, hi: int) -> str:
    return f"[{lo}, {hi})"


def groups(layout: Layout) -> list[range]:
    """The samples of each shared-prefix group (each sample its own without one)."""
    sizes = layout.shared_prefix or (1,) * layout.num_samples
    starts = [0, *itertools.accumulate(sizes)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def star_layout(first: Layout, order: Tensor | None, length: int) -> Layout | None:
    """A shared-prefix layout's stars laid out as samples of their own (what each rank
    holds of each star, its padding included); None without a shared prefix."""
    if first.shared_prefix is None:
        return None
    stars = star_lengths(first.shared_prefix, first.total_lengths, first.response_lengths)
    empty = [0] * len(stars)
    if first.cp_mode == "order":
        assert order is not None
        placed = Layout.from_order(order, stars, empty, cp_rank=0, cp_size=first.cp_size,
                                   padded_lengths=first.padded_lengths)
        return placed.with_local_length(length)
    return Layout(stars, empty, cp_mode=first.cp_mode, cp_size=first.cp_size,
                  local_length=length, padded_lengths=first.padded_lengths)


def star_line(first: Layout, j: int, group: range, padded: bool) -> str:
    """Star ``j``: its samples, its length and where each sample's response sits in it."""
    stars = star_lengths(first.shared_prefix, first.total_lengths, first.response_lengths)
    response = first.response_lengths
    # each sample's response at star positions [lo, lo + R_i): ``_layout.plan``'s second segment
    lo: list[int] = segments(first).lo[1::2].tolist()
    p = first.prompt_lengths[group[0]]
    width = f", padded to W* {first.padded_lengths[j]}" if padded else ""
    parts = ", ".join(
        f"sample {i}'s {_range(lo[i], lo[i] + response[i]) if response[i] else 'none'}" for i in group
    )
    sums = " + ".join(str(response[i]) for i in group)
    return (
        f"star {j}: samples {group[0]}-{group[-1]}, L* {stars[j]} = prompt {p} + responses "
        f"{sums}{width}; star positions: prompt {_range(0, p)} once, then {parts}"
    ) if len(group) > 1 else (
        f"star {j}: sample {group[0]} alone, L* {stars[j]}{width}; star positions: prompt "
        f"{_range(0, p)}, then {parts}"
    )


def strips(layout: Layout, length: int, depth: int, rows: str) -> list[str]:
    """Per sample of a shared-prefix layout, its own rows of the picture ``rows``: ``p``/``r``
    (upper case: its share), ``-`` another sample's row, ``.`` padding."""
    out = [[g if g == "." else "-" for g in rows] for _ in layout.total_lengths]
    rs = runs(layout, length)
    prompt = layout.prompt_lengths
    for i, local, start, size in zip(*(t.tolist() for t in (rs.sample, rs.local, rs.start, rs.length))):
        for k in range(size):
            out[i][local + k] = "p" if start + k < prompt[i] else "r"
    share = selection_at(layout, length, "response", depth)
    for i, rows_of in enumerate(torch.split(share.rows, share.counts)):
        for row in rows_of.tolist():
            out[i][row] = out[i][row].upper()
    return ["".join(strip) for strip in out]
