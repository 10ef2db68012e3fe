"""Static typing of ``entropy``, ``entropy_from_hidden`` and the ``[..., V]`` forms of the
logits functions, checked by mypy in `make typecheck` (assert_type is a no-op at run
time, so pytest merely runs it)."""

from typing import assert_type

import torch
from torch import Tensor

from cpslice import Support, entropy, entropy_from_hidden, log_probs_and_entropy, log_probs_at, topk_log_probs


def test_the_entropy_is_one_tensor() -> None:
    logits = torch.zeros(2, 3, 5)
    support = Support(torch.tensor([1, 2]), torch.tensor([0, 0, 2, 2, 2, 2, 2]))
    assert_type(entropy(logits), Tensor)
    every = entropy(
        logits, temperature=torch.ones(2, 3), tp_group=None, chunk_size=2, support=support, entropy_over="support",
        softcap=30.0, vocab_size=5, invariant=True,
    )
    assert_type(every, Tensor)
    assert every.shape == (2, 3)
    from_hidden = entropy_from_hidden(torch.zeros(6, 4), torch.zeros(5, 4), temperature=0.7, support=support)
    assert_type(from_hidden, Tensor)
    assert from_hidden.shape == (6,)
    if not logits.is_cuda:  # static checks only: each call raises at run time
        return
    entropy(logits, with_entropy=True)  # type: ignore[call-arg]
    entropy(logits, entropy_grad=False)  # type: ignore[call-arg]
    entropy(logits, torch.zeros(2, 3, dtype=torch.int64))  # type: ignore[call-arg]
    entropy(logits, entropy_over="all")  # type: ignore[arg-type]


def test_the_leading_shape_keeps_the_types() -> None:
    logits = torch.zeros(2, 3, 5)
    targets = torch.zeros(2, 3, dtype=torch.int64)
    assert_type(log_probs_and_entropy(logits, targets), tuple[Tensor, None])
    on = log_probs_and_entropy(logits, targets, with_entropy=True, temperature=torch.ones(2, 3))
    assert_type(on, tuple[Tensor, Tensor])
    assert_type(log_probs_at(logits, torch.zeros(2, 3, 4, dtype=torch.int64)), Tensor)
    best = topk_log_probs(logits, 2)
    assert_type(best, tuple[Tensor, Tensor])
    assert on[1].shape == (2, 3) and best[1].shape == (2, 3, 2)
