"""Samples that carry their own padding: ``padded_lengths``, ``align`` and
``Layout.from_cu_seqlens``; the resolved ``padded_lengths`` of every layout, what equality,
hashing, ``repr``, ``for_rank`` and ``with_local_length`` keep, and every refusal, with the
same message whether the debug mode (jaxtyping + beartype) is on or off."""

from pathlib import Path
from typing import Any

import pytest
import torch

from cpslice import Layout, LayoutError, extract_responses, pack, response_rows

from ..support.host_reads import DEVICES, read_once
from ..support.refusals import Table, refusal_test

ROOT = Path(__file__).resolve().parents[2]


def test_padded_lengths_are_resolved_for_every_layout() -> None:
    total, response = [10, 7, 1], [4, 3, 0]
    assert Layout(total, response).padded_lengths == (10, 7, 1)
    assert Layout(total, response, cp_mode="allgather", cp_size=3).padded_lengths == (10, 7, 1)
    assert Layout(total, response, cp_mode="zigzag", cp_size=2).padded_lengths == (12, 8, 4)
    bshd = Layout(total, response, qkv_format="bshd", max_seq_len=11)
    assert bshd.padded_lengths == (11, 11, 11)
    assert bshd.with_local_length(None).padded_lengths == (11, 11, 11)
    zig_bshd = Layout(total, response, qkv_format="bshd", max_seq_len=11, cp_mode="zigzag",
                      cp_size=2)
    assert zig_bshd.padded_lengths == (12, 12, 12)
    assert Layout(total, response, align=8).padded_lengths == (16, 8, 8)
    assert Layout(total, response, align=1).padded_lengths == (10, 7, 1)
    assert Layout(total, response, cp_mode="zigzag", cp_size=2, align=8).padded_lengths == (
        16, 8, 8)
    given = Layout(total, response, cp_mode="allgather", cp_size=2, padded_lengths=[10, 9, 5])
    assert given.padded_lengths == (10, 9, 5)
    assert Layout([], [], align=4).padded_lengths == ()


def test_equality_hash_repr_and_derived_layouts_keep_the_padding() -> None:
    aligned = Layout([10, 7], [4, 3], cp_mode="zigzag", cp_size=2, cp_rank=1, align=8)
    explicit = Layout([10, 7], [4, 3], cp_mode="zigzag", cp_size=2, cp_rank=1,
                      padded_lengths=(16, 8))
    default = Layout([10, 7], [4, 3], cp_mode="zigzag", cp_size=2, cp_rank=1)
    # equal: the same token at the same row; align=8 stands for W = 16, 8
    assert aligned == explicit and hash(aligned) == hash(explicit)
    assert aligned != default and hash(aligned) != hash(default)
    assert default == Layout([10, 7], [4, 3], cp_mode="zigzag", cp_size=2, cp_rank=1,
                             padded_lengths=[12, 8])
    assert repr(aligned).endswith("cp_rank=1, cp_size=2, align=8)")
    assert repr(explicit).endswith("cp_rank=1, cp_size=2, padded_lengths=[16, 8])")
    assert "align" not in repr(default) and "padded" not in repr(default)
    for derived in (aligned.for_rank(0), aligned.with_local_length(13),
                    aligned.with_local_length(13).with_local_length(None)):
        assert derived.padded_lengths == (16, 8) and derived.align == 8
    assert explicit.for_rank(0).padded_lengths == (16, 8)
    assert "padded_lengths=[16, 8]" in repr(explicit.for_rank(0))
    assert aligned.with_local_length(13).local_length == 13
    assert aligned.for_rank(0) != aligned
    # the padding changes what a rank holds: rank 1 holds sample 0's positions 4-11
    assert response_rows(aligned).counts == [4, 3]
    assert response_rows(default).counts == [4, 3]
    assert response_rows(aligned).rows.tolist() != response_rows(default).rows.tolist()


@pytest.mark.parametrize(
    "bounds",
    [[0, 16, 24], (0, 16, 24), torch.tensor([0, 16, 24], dtype=torch.int32),
     torch.tensor([0, 16, 24])],
)
def test_from_cu_seqlens(bounds: Any) -> None:
    layout = Layout.from_cu_seqlens(bounds, [10, 7], [4, 3], cp_mode="zigzag", cp_rank=1,
                                    cp_size=2, local_length=12)
    assert layout == Layout([10, 7], [4, 3], cp_mode="zigzag", cp_rank=1, cp_size=2,
                            local_length=12, align=8)
    assert layout.padded_lengths == (16, 8) and layout.qkv_format == "thd"


@pytest.mark.parametrize("device", DEVICES)
def test_from_cu_seqlens_reads_a_device_tensor_once(device: str) -> None:
    """One host read of the boundaries (tests/support/host_reads.py counts them on any device;
    on CUDA, the synchronizations it reports too)."""
    layout = read_once(lambda bounds: Layout.from_cu_seqlens(bounds, [3, 9], [1, 2], cp_mode="allgather",
                                                             cp_size=2),
                       torch.tensor([0, 4, 4 + 16], device=device))
    assert layout == Layout([3, 9], [1, 2], cp_mode="allgather", cp_size=2, padded_lengths=[4, 16])


def test_the_docs_verl_example() -> None:
    # docs/layouts.md: tp = 2, cp = 2, align = 8, L = 10, 7, R = 4, 3
    rank0 = Layout([10, 7], [4, 3], cp_mode="zigzag", cp_size=2, cp_rank=0, align=8)
    tokens = [torch.arange(100, 110), torch.arange(200, 207)]
    assert pack(tokens, rank0, fill=-1).tolist() == [
        100, 101, 102, 103, -1, -1, -1, -1, 200, 201, 206, -1]
    assert pack(tokens, rank0.for_rank(1), fill=-1).tolist() == [
        104, 105, 106, 107, 108, 109, -1, -1, 202, 203, 204, 205]
    values = torch.arange(12.0)
    assert [s.tolist() for s in extract_responses(values, rank0)[0]] == [[], []]
    assert [s.tolist() for s in extract_responses(values, rank0.for_rank(1))[0]] == [
        [1.0, 2.0, 3.0, 4.0], [9.0, 10.0, 11.0]]


def test_a_padded_layout_reads_its_offsets_from_the_widths() -> None:
    # with the default packing a longer local tensor is refused unless the layout
    # declares its tail padding; with padded samples the same tensor means other
    # offsets: sample 1 starts at W_0 = 12
    values = torch.arange(19.0)
    with pytest.raises(LayoutError, match=r"values has length 19 but the layout needs exactly 17 rows"):
        extract_responses(values, Layout([10, 7], [4, 3]))
    default, _ = extract_responses(values, Layout([10, 7], [4, 3], local_length=19))
    padded, _ = extract_responses(values, Layout([10, 7], [4, 3], padded_lengths=[12, 7]))
    assert default[1].tolist() == [13.0, 14.0, 15.0]
    assert padded[1].tolist() == [15.0, 16.0, 17.0]
    with pytest.raises(LayoutError, match=r"values has length 18, which is too short: the "
                       r"layout needs at least 19 positions"):
        extract_responses(torch.zeros(18), Layout([10, 7], [4, 3], padded_lengths=[12, 7]))
    allgather = Layout([10, 7], [4, 3], cp_mode="allgather", cp_size=2, align=8)
    with pytest.raises(LayoutError, match=r"cp_size \* T = 2 \* 11 = 22 < sum\(padded_lengths\) "
                       r"= 24"):
        extract_responses(torch.zeros(11), allgather)


# Every refusal: (code building the layout, the message). Run in this (checked) session,
# and again unchecked by tests/layout/test_errors.py::test_error_tests_pass_unchecked: the same
# exception type and message with and without run-time checking.
REFUSALS: Table = [
    ("Layout([3, 4], [1, 1], padded_lengths=[4, 4], align=2)",
     "padded_lengths and align=2 are both given; pass one"),
    ("Layout([3, 4], [1, 1], padded_lengths=[4, 3])",
     "sample 1: padded_length 3 < total_length 4 (a padded sample holds its tokens, then padding)"),
    ("Layout([3, 4], [1, 1], padded_lengths=[4, 6], cp_mode='zigzag', cp_size=2)",
     "sample 1: padded_length 6 is not a multiple of 2 * cp_size = 4 (zigzag cuts each padded "
     "sample into 2 * cp_size = 4 equal chunks)"),
    ("Layout([3, 4], [1, 1], align=6, cp_mode='zigzag', cp_size=2)",
     "align 6 is not a multiple of 2 * cp_size = 4"),
    ("Layout([3, 4], [1, 1], align=0)", "align 0 < 1"),
    ("Layout([3, 4], [1, 1], align=-4, cp_mode='allgather', cp_size=2)", "align -4 < 1"),
    ("Layout([3, 4], [1, 1], padded_lengths=[4])",
     "padded_lengths has 1 samples but total_lengths has 2"),
    ("Layout([3, 4], [1, 1], qkv_format='bshd', max_seq_len=4, align=2)",
     "align is given with qkv_format 'bshd', whose rows are already padded to max_seq_len"),
    ("Layout([3, 4], [1, 1], qkv_format='bshd', max_seq_len=4, padded_lengths=[4, 4])",
     "padded_lengths is given with qkv_format 'bshd'"),
    ("Layout.from_cu_seqlens([1, 4, 8], [3, 4], [1, 1])",
     "cu_seqlens_padded starts at 1, not 0"),
    ("Layout.from_cu_seqlens([0, 4, 3], [3, 1], [1, 0])",
     "sample 1: cu_seqlens_padded decreases, 4 then 3"),
    ("Layout.from_cu_seqlens([0, 4], [3, 4], [1, 1])",
     "cu_seqlens_padded has 2 entries but there are 2 samples (it holds the n + 1 = 3"),
    ("Layout.from_cu_seqlens(torch.tensor([0, 4, 8, 9]), [3, 4], [1, 1])",
     "cu_seqlens_padded has 4 entries but there are 2 samples"),
    ("Layout.from_cu_seqlens([0, 4, 7], [3, 4], [1, 1])",
     "sample 1: cu_seqlens_padded[2] - cu_seqlens_padded[1] = 7 - 4 = 3 < total_length 4"),
    ("Layout.from_cu_seqlens(torch.tensor([[0, 4, 8]]), [3, 4], [1, 1])",
     "cu_seqlens_padded must be 1-D [n + 1]"),
    ("Layout.from_cu_seqlens([0, 4, 10], [3, 4], [1, 1], cp_mode='zigzag', cp_size=2)",
     "sample 1: padded_length 6 is not a multiple of 2 * cp_size = 4"),
    ("Layout.from_cu_seqlens([0, 4, 8], [3, 4], [1, 2, 1])",
     "total_lengths has 2 samples but response_lengths has 3"),
]
TYPE_REFUSALS: Table = [
    ("Layout([3, 4], [1, 1], padded_lengths=[4, 4.0])",
     "sample 1: padded_length 4.0 is a float, not an int"),
    ("Layout([3, 4], [1, 1], align=2.0)", "align 2.0 is a float, not an int"),
    ("Layout.from_cu_seqlens([0, 4, 8.0], [3, 4], [1, 1])",
     "cu_seqlens_padded[2] 8.0 is a float, not an int"),
    ("Layout.from_cu_seqlens(torch.tensor([0.0, 4.0, 8.0]), [3, 4], [1, 1])",
     "cu_seqlens_padded must hold integers, got a tensor of dtype torch.float32"),
    ("Layout.from_cu_seqlens('0,4,8', [3, 4], [1, 1])",
     "cu_seqlens_padded must be a list of ints or an integer tensor, got a str"),
]


test_refusals = refusal_test(REFUSALS, TYPE_REFUSALS)
