"""Static typing of the support arguments, checked by mypy in `make typecheck`
(assert_type is a no-op at run time, so pytest merely runs it)."""

from typing import assert_type

import torch
from torch import Tensor

from cpslice import Layout, Support, log_probs_and_entropy, response_log_probs


def test_support_keeps_the_overloads_exact() -> None:
    layout = Layout([4], [2])
    support = Support.from_responses([[1, 2]], [[0, 1, 2]], layout)
    assert_type(support, Support)
    assert_type(Support.from_keep_mask(torch.ones(4, 5, dtype=torch.bool)), Support)
    logits = torch.zeros(support.num_rows, 5)
    targets = torch.tensor([0, 1, 4, 0])
    plain = log_probs_and_entropy(logits, targets, support=support)
    assert_type(plain, tuple[Tensor, None])
    on = log_probs_and_entropy(logits, targets, with_entropy=True, support=support, entropy_over="support")
    assert_type(on, tuple[Tensor, Tensor])
    shares = response_log_probs(logits, [torch.arange(4)], layout, with_entropy=True, support=support)
    assert_type(shares, tuple[list[Tensor], list[Tensor]])
    assert on[1].shape == (4,) and shares[0][0].shape == (2,)
