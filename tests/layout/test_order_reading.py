"""The reading of a token order (``cpslice._layout.pieces``), at the seams of its fast paths.

``Layout.from_order`` reads an order in one pass of steps of ``_pieces._CHUNK`` rows
(its runs of consecutive positions), checks it is a permutation by whether those runs
tile the stream (the first bad entry found only when they do not), and finds the closed
form that places it alike from pieces, never from an index: the identity for none and
allgather, zigzag by its count of pieces, a few probed rows, then every piece. Here:
orders longer than a step, with their breaks and bad entries on a step's seam; every
closed form's own index (each must come back as that closed form) and orders a row
away from one (each must not).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpslice import Layout, LayoutError
from cpslice._layout.pieces import _CHUNK

# torch's _PerDocumentHeadTailLoadBalancer for two documents of 8 at cp 2
PER_DOCUMENT = [0, 1, 6, 7, 2, 3, 4, 5, 8, 9, 14, 15, 10, 11, 12, 13]


def test_a_long_order_is_read_across_the_steps() -> None:
    # blocks of _CHUNK - 1 positions, reversed: every break sits near a step's seam
    n, block = 4 * _CHUNK, _CHUNK - 1
    starts = list(range(0, n, block))[::-1]
    order = torch.cat([torch.arange(s, min(s + block, n)) for s in starts])
    widths = [n // 2 - 5, n // 2 + 5]
    layout = Layout.from_order(order, widths, [5, 7], cp_rank=1, cp_size=4)
    assert layout.cp_mode == "order"
    assert torch.equal(layout.order(), order)
    placed = layout._order
    assert placed is not None
    # a run a block, cut where a rank starts and where sample 1 starts
    assert placed.pieces == len(starts) + 3 + 1


@pytest.mark.parametrize("at", [0, 1, _CHUNK - 1, _CHUNK, _CHUNK + 1, 2 * _CHUNK + 5])
def test_a_bad_entry_on_a_step_s_seam_is_named(at: int) -> None:
    n = 3 * _CHUNK
    order = torch.arange(n)
    order[at] = n  # out of range
    with pytest.raises(LayoutError, match=rf"^order\[{at}\] = {n} is outside \[0, {n}\) "):
        Layout.from_order(order, [n], [1], cp_rank=0, cp_size=2)
    order[at] = (at + 7) % n  # a repeat: the later of the two is named
    first, second = sorted((at, (at + 7) % n))
    with pytest.raises(LayoutError, match=rf"^order\[{second}\] = {order[second]} repeats order\[{first}\] "):
        Layout.from_order(order, [n], [1], cp_rank=0, cp_size=2)


Closed = tuple[list[int], list[int], dict[str, object]]


@st.composite
def closed_layouts(draw: st.DrawFn) -> Closed:
    """A closed-form layout's samples and arguments, its ranks tiling the stream (so that
    it has an order); built in the test (a Layout built in a strategy would run debug
    mode's checks there, which draw from ``random``)."""
    cp = draw(st.integers(1, 4))
    mode = "none" if cp == 1 else draw(st.sampled_from(["zigzag", "allgather"]))
    fmt = "thd" if mode == "allgather" else draw(st.sampled_from(["thd", "bshd"]))
    n = draw(st.integers(1, 5))
    total = [draw(st.integers(1, 12)) for _ in range(n)]
    response = [draw(st.integers(0, t - 1)) for t in total]
    if fmt == "bshd":
        seq = max(total) + draw(st.integers(0, 3))
        if mode == "zigzag":  # a row zigzag would round up has no order of max_seq_len columns
            seq = -(-seq // (2 * cp)) * 2 * cp
        return total, response, {"qkv_format": "bshd", "max_seq_len": seq, "cp_mode": mode, "cp_size": cp}
    padded = [t + draw(st.integers(0, 3)) for t in total]
    if mode == "zigzag":
        padded = [-(-w // (2 * cp)) * 2 * cp for w in padded]
    padded[-1] += -sum(padded) % cp
    local = sum(padded) // cp if mode == "allgather" else None
    return total, response, {"cp_mode": mode, "cp_size": cp, "padded_lengths": padded, "local_length": local}


@settings(max_examples=30, deadline=None)
@given(closed_layouts(), st.data())
def test_a_closed_form_s_index_is_that_closed_form_and_a_swap_is_not(
    case: Closed, data: st.DataObject
) -> None:
    total, response, kwargs = case
    closed = Layout(total, response, **kwargs)  # type: ignore[arg-type]  # the strategy's kwargs, Layout's own
    index = closed.order()
    fmt = closed.qkv_format

    def read(order: torch.Tensor, rank: int) -> Layout:
        return Layout.from_order(order, total, response, cp_rank=rank, cp_size=closed.cp_size,
                                 qkv_format=fmt, max_seq_len=closed.max_seq_len,
                                 padded_lengths=closed.padded_lengths if fmt == "thd" else None)

    for rank in range(closed.cp_size):
        again = read(index, rank)
        assert again.cp_mode == closed.cp_mode
        assert again == closed.for_rank(rank).with_local_length(again.local_length)
    flat = index.reshape(-1, index.shape[-1])
    j, k = (data.draw(st.integers(0, flat.shape[1] - 1)) for _ in "jk")
    if j == k:
        return
    swapped = flat.clone()
    swapped[:, [j, k]] = swapped[:, [k, j]]
    moved = read(swapped.view_as(index), 0)
    # a closed form read back places every position as the order does
    assert torch.equal(moved.order().reshape(swapped.shape), swapped)
    if moved.cp_mode != "order":
        return
    for mode in ("zigzag", "allgather", "none"):
        try:
            other = Layout(total, response, qkv_format=fmt, max_seq_len=closed.max_seq_len,
                           cp_mode=mode, cp_size=closed.cp_size,
                           padded_lengths=closed.padded_lengths if fmt == "thd" else None,
                           local_length=sum(closed.padded_lengths) // closed.cp_size
                           if mode == "allgather" else None)
            theirs = other.order()
        except LayoutError:  # no such closed form for these samples
            continue
        assert not torch.equal(theirs, swapped.view_as(index)), mode


def test_torch_per_document_head_tail_is_no_closed_form() -> None:
    layout = Layout.from_order(PER_DOCUMENT, [8, 8], [4, 3], cp_rank=0, cp_size=2)
    assert layout.cp_mode == "order"
    placed = layout._order
    assert placed is not None
    # rank 0: document 0's chunks [0, 2) [6, 8) [2, 6) as three runs; rank 1 document 1's
    assert placed.pieces == 6
    assert [p.tolist() for p in placed.of_rank(0)] == [[0, 0, 0], [0, 4, 2], [0, 2, 6], [2, 4, 2]]
