"""Static typing of the end-to-end and CP functions (checked by mypy)."""

from typing import assert_type

import torch
from torch import Tensor

import cpslice
from cpslice import Layout


def test_response_log_probs_overloads() -> None:
    layout = Layout([5, 3], [2, 1])
    tokens = [torch.randint(0, 9, (5,)), torch.randint(0, 9, (3,))]
    logits = torch.randn(8, 9)
    both = cpslice.response_log_probs(logits, tokens, layout, with_entropy=True)
    assert_type(both, tuple[list[Tensor], list[Tensor]])
    plain = cpslice.response_log_probs(logits, tokens, layout)
    assert_type(plain, tuple[list[Tensor], None])
    flag = bool(len(tokens))
    either = cpslice.response_log_probs(logits, tokens, layout, with_entropy=flag)
    assert_type(either, tuple[list[Tensor], list[Tensor] | None])
    assert plain[1] is None
    assert len(both[1]) == 2
    assert_type(cpslice.response_rows(layout), cpslice.ResponseRows)
    assert_type(cpslice.pack(tokens, layout), Tensor)
    assert_type(cpslice.shifted_targets(tokens, layout), Tensor)


def test_redistribute_and_reducer_types() -> None:
    layout = Layout([5, 3], [2, 1])
    shares = [torch.zeros(2), torch.zeros(1)]
    masks = [torch.ones(2), torch.ones(1)]
    assert_type(cpslice.sum_of_sample_means(shares, masks, layout), Tensor)
    assert_type(cpslice.sum_of_tokens(shares, masks, layout), Tensor)
    assert_type(cpslice.sample_means(shares, masks, layout, denominators=[2.0, 1.0]), Tensor)
    assert_type(cpslice.sample_max(shares, masks, layout), Tensor)
    assert_type(cpslice.sample_min([s[:, None] for s in shares], masks, layout, cp_group=None), Tensor)
    assert_type(
        cpslice.sum_of_sample_means(shares, masks, layout, denominators=torch.ones(2)), Tensor
    )
    if torch.distributed.is_initialized():  # static checks only; run time has no group
        assert_type(cpslice.redistribute(shares, layout, layout), list[Tensor])
        assert_type(
            cpslice.redistribute((shares, shares), layout, layout), tuple[list[Tensor], ...]
        )
        assert_type(cpslice.gather_responses(shares, layout), list[Tensor])
