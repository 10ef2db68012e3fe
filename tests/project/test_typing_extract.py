"""Static typing of the extraction contract, checked by mypy in `make typecheck`
(assert_type is a no-op at run time, so pytest merely runs it)."""

from typing import assert_type

import torch
from torch import Tensor

from cpslice import Layout, Strategy, extract_responses, extraction_strategy, shard_responses


def test_overloads_make_the_entropy_type_exact() -> None:
    layout = Layout([5, 3], [2, 1])
    values = torch.zeros(8)
    both = extract_responses(values, layout, torch.zeros(8))
    assert_type(both, tuple[list[Tensor], list[Tensor]])
    only = extract_responses(values, layout)
    assert_type(only, tuple[list[Tensor], None])
    maybe: Tensor | None = torch.zeros(8) if layout.num_samples else None
    assert_type(extract_responses(values, layout, maybe), tuple[list[Tensor], list[Tensor] | None])
    assert_type(shard_responses([torch.zeros(2), torch.zeros(1)], layout), list[Tensor])
    assert_type(extraction_strategy(layout), Strategy)
    assert only[1] is None
    assert len(both[1]) == 2
