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


def test_the_shared_keywords_keep_their_types() -> None:
    """The overloads take the shared keywords as ``Unpack`` of one TypedDict
    (``_types.LogProbKeywords``): every keyword at once keeps the form exact, a dict of
    that type forwards them (as the glue may), and a misspelled keyword or a value of the
    wrong type is a type error (mypy --strict warns on an unused ignore)."""
    from cpslice._vocab.args import Keywords

    logits = torch.zeros(3, 5)
    targets = torch.tensor([0, 1, 4])
    every = log_probs_and_entropy(
        logits, targets, with_entropy=True, entropy_grad=False, temperature=torch.ones(3), tp_group=None,
        chunk_size=2, support=None, entropy_over="support", softcap=30.0, vocab_size=5,
    )
    assert_type(every, tuple[Tensor, Tensor])
    forwarded: Keywords = {"temperature": 0.5, "chunk_size": 2, "vocab_size": 5}
    assert_type(log_probs_and_entropy(logits, targets, **forwarded), tuple[Tensor, None])
    assert_type(log_probs_and_entropy(logits, targets, with_entropy=True, **forwarded), tuple[Tensor, Tensor])
    if not logits.is_cuda:  # static checks only: each call raises at run time
        return
    log_probs_and_entropy(logits, targets, temprature=0.5)  # type: ignore[call-overload]
    log_probs_and_entropy(logits, targets, entropy_over="all")  # type: ignore[call-overload]
    log_probs_and_entropy(logits, targets, chunk_size="2")  # type: ignore[call-overload]
