"""Left-padded bshd rows: ``row_offsets`` and ``Layout.from_attention_mask``; what
equality, hashing, ``repr`` and the derived layouts keep; the worked example of
docs/layouts.md through pack, shifted_targets and extraction; every refusal."""


import numpy as np
import pytest
import torch

from cpslice import Layout, extract_responses, pack, shifted_targets

from ..support.host_reads import DEVICES, read_once
from ..support.refusals import Table, refusal_test

# docs/layouts.md: S = 12, prompts of 6 and 2 tokens left-padded to 6 (o = 0, 4),
# responses of 4 and 5, zigzag over c = 2 ranks (chunks of 3 columns)
TOTAL, RESPONSE, OFFSETS, S = [10, 7], [4, 5], [0, 4], 12
MASK = [[1] * 10 + [0] * 2, [0] * 4 + [1] * 7 + [0]]


def _rows(rank: int) -> Layout:
    return Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=S, row_offsets=OFFSETS,
                  cp_mode="zigzag", cp_size=2, cp_rank=rank)


def test_the_docs_left_padded_example() -> None:
    tokens = [torch.arange(100, 110), torch.arange(200, 207)]
    assert pack(tokens, _rows(0), fill=-1).tolist() == [
        100, 101, 102, 109, -1, -1, -1, -1, -1, 205, 206, -1]
    assert pack(tokens, _rows(1), fill=-1).tolist() == [
        103, 104, 105, 106, 107, 108, -1, 200, 201, 202, 203, 204]
    # the next token of the same sample; every padding row and each last token: fill
    assert shifted_targets(tokens, _rows(1), fill=-1).tolist() == [
        104, 105, 106, 107, 108, 109, -1, 201, 202, 203, 204, 205]
    values = torch.arange(12.0)
    assert [s.tolist() for s in extract_responses(values, _rows(0))[0]] == [[], [9.0]]
    assert [s.tolist() for s in extract_responses(values, _rows(1))[0]] == [
        [2.0, 3.0, 4.0, 5.0], [8.0, 9.0, 10.0, 11.0]]
    none = Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=S, row_offsets=OFFSETS)
    assert pack(tokens, none, fill=-1).tolist() == (
        [*range(100, 110), -1, -1] + [-1] * 4 + [*range(200, 207), -1])
    assert [s.tolist() for s in extract_responses(torch.arange(24.0), none)[0]] == [
        [5.0, 6.0, 7.0, 8.0], [17.0, 18.0, 19.0, 20.0, 21.0]]


def test_zeros_are_no_offsets_and_offsets_are_kept() -> None:
    plain = Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=S)
    zeros = Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=S, row_offsets=[0, 0])
    assert zeros == plain and hash(zeros) == hash(plain) and repr(zeros) == repr(plain)
    assert "row_offsets" not in repr(plain) and plain.row_offsets == (0, 0)
    assert Layout(TOTAL, RESPONSE).row_offsets == (0, 0)
    rows = _rows(1)
    assert rows != _rows(1).for_rank(0) and rows != Layout(
        TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=S, row_offsets=[0, 5],
        cp_mode="zigzag", cp_size=2, cp_rank=1)
    assert rows != Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=S, cp_mode="zigzag",
                          cp_size=2, cp_rank=1)
    assert repr(rows).endswith("cp_rank=1, cp_size=2, row_offsets=[0, 4])")
    for derived in (rows.for_rank(0), rows.with_local_length(13).with_local_length(None)):
        assert derived.row_offsets == (0, 4)
    assert rows.for_rank(0).for_rank(1) == rows
    assert rows.row_offsets == (0, 4) and rows.padded_lengths == (12, 12)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.uint8])
def test_from_attention_mask(dtype: torch.dtype) -> None:
    mask = torch.tensor(MASK, dtype=dtype)
    before = mask.clone()
    layout = Layout.from_attention_mask(mask, RESPONSE, cp_mode="zigzag", cp_size=np.int64(2),
                                        cp_rank=1, local_length=12)
    assert layout == _rows(1).with_local_length(12)
    assert (layout.max_seq_len, layout.qkv_format) == (S, "bshd")
    assert torch.equal(mask, before)
    # a row's last column and a whole row; no CP by default
    full = Layout.from_attention_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), [1, 3])
    assert full == Layout([2, 4], [1, 3], qkv_format="bshd", max_seq_len=4, row_offsets=[2, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_from_attention_mask_reads_a_device_tensor_once(device: str) -> None:
    """One host read of the statistics computed from the mask on its device (counted on
    any device by tests/support/host_reads.py; on CUDA, the synchronizations it reports too)."""
    layout = read_once(lambda mask: Layout.from_attention_mask(mask, RESPONSE), torch.tensor(MASK, device=device))
    assert layout == Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=S, row_offsets=OFFSETS)


# Every refusal: (code, message).
REFUSALS: Table = [
    ("Layout([3, 4], [1, 1], qkv_format='bshd', max_seq_len=6, row_offsets=[3, 3])",
     "sample 1: row_offset 3 + total_length 4 = 7 > max_seq_len 6 (sample i's tokens are "
     "columns [o_i, o_i + L_i) of its row, which ends at max_seq_len)"),
    ("Layout([3, 4], [1, 1], qkv_format='bshd', max_seq_len=6, row_offsets=[-1, 0])",
     "sample 0: row_offset -1 < 0 (sample i occupies columns [o_i, o_i + L_i) of its row)"),
    ("Layout([3, 4], [1, 1], qkv_format='bshd', max_seq_len=6, row_offsets=[0])",
     "row_offsets has 1 samples but total_lengths has 2 (one entry per sample in each)"),
    ("Layout([3, 4], [1, 1], row_offsets=[0, 0])",
     "row_offsets is given with qkv_format 'thd', whose samples start where the previous one "
     "ends; pass qkv_format='bshd' for left-padded rows, or drop it"),
    ("Layout.from_attention_mask(torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1]]), [1, 1, 1])",
     "attention_mask row 2 (sample 2) has a hole: its ones span columns [0, 3) but 1 of those "
     "are 0"),
    ("Layout.from_attention_mask(torch.tensor([[1, 1, 0], [0, 0, 0]]), [1, 0])",
     "attention_mask row 1 (sample 1) has no 1: a row holds at least one token"),
    ("Layout.from_attention_mask(torch.zeros(2, 0, dtype=torch.bool), [0, 0])",
     "attention_mask row 0 (sample 0) has no 1"),
    ("Layout.from_attention_mask(torch.tensor([[1, 2, 0]]), [1])",
     "attention_mask row 0 (sample 0) holds 1 values other than 0 and 1 (the first: 2 at column 1"),
    # negative values are no tokens and no padding either, in every integer dtype, at a
    # row's edge or between its ones
    *[(f"Layout.from_attention_mask(torch.tensor({m}, dtype=torch.{dtype}), [1, 1])",
       f"attention_mask row 1 (sample 1) holds {k} values other than 0 and 1 (the first: {v} at column {c}")
      for dtype in ("int8", "int16", "int32", "int64")
      for m, k, v, c in (("[[1, 1, 0], [0, 1, -1]]", 1, -1, 2), ("[[1, 1, 1], [-1, 1, 1]]", 1, -1, 0),
                         ("[[0, 1, 1], [1, -2, 1]]", 1, -2, 1), ("[[1, 1, 0], [-1, -1, -1]]", 3, -1, 0),
                         ("[[1, 1, 0], [0, 0, -1]]", 1, -1, 2))],
    ("Layout.from_attention_mask(torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.uint8) * 255, [1, 1])",
     "attention_mask row 0 (sample 0) holds 2 values other than 0 and 1 (the first: 255 at column 0"),
    ("Layout.from_attention_mask(torch.zeros(0, 0, dtype=torch.int64), [])", "max_seq_len 0 < 1"),
    ("Layout.from_attention_mask(torch.ones(2, 3, 1, dtype=torch.bool), [1, 1])",
     "attention_mask must be 2-D [B, S] (one row per sample), got shape (2, 3, 1)"),
    ("Layout.from_attention_mask(torch.tensor([[1, 1, 0]]), [2])",
     "sample 0: response_length 2 > total_length - 1 = 1"),
    ("Layout.from_attention_mask(torch.tensor([[1, 1, 0]]), [1, 0])",
     "total_lengths has 1 samples but response_lengths has 2"),
]
TYPE_REFUSALS: Table = [
    ("Layout([3, 4], [1, 1], qkv_format='bshd', max_seq_len=6, row_offsets=[0, 1.0])",
     "sample 1: row_offset 1.0 is a float, not an int"),
    ("Layout([3, 4], [1, 1], qkv_format='bshd', max_seq_len=6, row_offsets=torch.tensor([0, 1]))",
     "row_offsets must be a sequence of ints, got a Tensor (call .tolist() on it first)"),
    ("Layout([3, 4], [1, 1], qkv_format='bshd', max_seq_len=6, row_offsets=[True, 0])",
     "sample 0: row_offset True is a bool, not an int"),
    ("Layout.from_attention_mask(torch.ones(2, 3), [1, 1])",
     "attention_mask must hold bools or integers (0 and 1), got a tensor of dtype torch.float32"),
    ("Layout.from_attention_mask([[1, 1, 0]], [1])",
     "attention_mask must be a bool or integer torch.Tensor [B, S], got a list"),
]


test_refusals = refusal_test(REFUSALS, TYPE_REFUSALS)
