"""Static typing of log_probs_and_entropy_from_hidden's and response_log_probs_from_hidden's
overloads, checked by mypy in `make typecheck` (assert_type is a no-op at run time)."""

from typing import assert_type

import torch
from torch import Tensor

from cpslice import Layout, log_probs_and_entropy_from_hidden, response_log_probs_from_hidden


def test_overloads_make_the_entropy_type_exact() -> None:
    hidden, weight = torch.zeros(3, 4), torch.zeros(5, 4)
    targets = torch.tensor([0, 1, 4])
    plain = log_probs_and_entropy_from_hidden(hidden, weight, targets)
    assert_type(plain, tuple[Tensor, None])
    on = log_probs_and_entropy_from_hidden(hidden, weight, targets, with_entropy=True, entropy_grad=False)
    assert_type(on, tuple[Tensor, Tensor])
    flag = hidden.shape[0] > 1
    maybe = log_probs_and_entropy_from_hidden(hidden, weight, targets, with_entropy=flag, chunk_size=2)
    assert_type(maybe, tuple[Tensor, Tensor | None])
    assert on[1].shape == (3,) and maybe[1] is not None

    layout = Layout([3], [1])
    tokens = [torch.tensor([0, 1, 2])]
    shares = response_log_probs_from_hidden(hidden, weight, tokens, layout)
    assert_type(shares, tuple[list[Tensor], None])
    both = response_log_probs_from_hidden(hidden, weight, tokens, layout, with_entropy=True)
    assert_type(both, tuple[list[Tensor], list[Tensor]])
    assert [x.shape for x in both[1]] == [(1,)]


def test_every_shared_keyword_at_once() -> None:
    hidden, weight = torch.zeros(3, 4), torch.zeros(5, 4)
    targets = torch.tensor([0, 1, 4])
    every = log_probs_and_entropy_from_hidden(
        hidden, weight, targets, with_entropy=True, entropy_grad=False, temperature=0.7, tp_group=None,
        chunk_size=2, support=None, entropy_over="support", softcap=30.0, vocab_size=5, sequence_parallel=False,
    )
    assert_type(every, tuple[Tensor, Tensor])
    assert every[1].shape == (3,)
    shares = response_log_probs_from_hidden(hidden, weight, [targets], Layout([3], [1]), with_entropy=True,
                                            sequence_parallel=False)
    assert_type(shares, tuple[list[Tensor], list[Tensor]])
    if not hidden.is_cuda:  # static checks only: the call raises at run time
        return
    log_probs_and_entropy_from_hidden(hidden, weight, targets, with_entopy=True)  # type: ignore[call-overload]
    log_probs_and_entropy_from_hidden(hidden, weight, targets, sequence_parallel=1)  # type: ignore[call-overload]
