"""Static typing of log_probs_and_entropy's overloads, checked by mypy in `make typecheck`
(assert_type is a no-op at run time, so pytest merely runs it)."""

from typing import assert_type

import torch
from torch import Tensor

from cpslice import log_probs_and_entropy


def test_overloads_make_the_entropy_type_exact() -> None:
    logits = torch.zeros(3, 5)
    targets = torch.tensor([0, 1, 4])
    plain = log_probs_and_entropy(logits, targets)
    assert_type(plain, tuple[Tensor, None])
    off = log_probs_and_entropy(logits, targets, with_entropy=False, temperature=0.7)
    assert_type(off, tuple[Tensor, None])
    on = log_probs_and_entropy(logits, targets, with_entropy=True, entropy_grad=False)
    assert_type(on, tuple[Tensor, Tensor])
    flag = logits.shape[0] > 1
    maybe = log_probs_and_entropy(logits, targets, with_entropy=flag, chunk_size=2)
    assert_type(maybe, tuple[Tensor, Tensor | None])
    assert on[1].shape == (3,)
    assert maybe[1] is not None
