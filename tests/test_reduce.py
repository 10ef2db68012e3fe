"""The reducers need no communication, so their CP property is checked in one process:
the parts of every rank add up to the no-CP value, for values and gradients."""

import pytest
import torch
from hypothesis import given, settings

from cpslice import Layout, LayoutError, extract_responses, sum_of_sample_means, sum_of_tokens
from tests.checked import CHECKED, refused

from .oracle import Config, local_length, local_values
from .strategies import configs


@settings(max_examples=80, deadline=None)
@given(configs())
def test_parts_sum_to_the_no_cp_value(cfg: Config) -> None:
    gen = torch.Generator().manual_seed(len(cfg.total))
    masks = [torch.rand(r, generator=gen) > 0.4 for r in cfg.response]
    weights = [torch.randn(r, generator=gen, dtype=torch.float64) for r in cfg.response]
    ref_means = sum(
        ((w[m].sum() / m.sum()) if m.any() else torch.zeros((), dtype=torch.float64))
        for w, m in zip(weights, masks)
    )
    ref_tokens = sum((w[m].sum() for w, m in zip(weights, masks)), torch.zeros((), dtype=torch.float64))
    means = torch.zeros((), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    for rank in range(cfg.cp):
        layout = cfg.layout(rank).with_local_length(local_length(cfg))
        # put weights where the layout puts each response position, then extract
        ids = local_values(cfg, rank)
        lookup = {(i * 1000 + (t - r - 1) + k): float(weights[i][k])
                  for i, (t, r) in enumerate(zip(cfg.total, cfg.response)) for k in range(r)}
        values = torch.tensor([lookup.get(int(v), 0.0) for v in ids.tolist()],
                              dtype=torch.float64, requires_grad=True)
        shares, _ = extract_responses(values, layout)
        part_means = sum_of_sample_means(shares, masks, layout)
        part_tokens = sum_of_tokens(shares, masks, layout)
        if cfg.total:
            assert part_means.requires_grad, "a part is in the graph even when its shares are empty"
        means = means + part_means.detach()
        tokens = tokens + part_tokens.detach()
    assert torch.allclose(means, torch.as_tensor(ref_means, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(tokens, ref_tokens, atol=1e-12)


def test_fully_masked_samples_count_zero_and_masked_infinities_do_not_poison() -> None:
    layout = Layout([4, 3], [2, 2])
    values = [torch.tensor([float("-inf"), 2.0], requires_grad=True),
              torch.tensor([float("nan"), 1.0], requires_grad=True)]
    masks = [torch.tensor([False, True]), torch.tensor([False, False])]
    mean = sum_of_sample_means(values, masks, layout)
    assert mean.item() == 2.0
    assert sum_of_tokens(values, masks, layout).item() == 2.0
    torch.autograd.backward(mean)
    assert values[0].grad is not None and values[0].grad.tolist() == [0.0, 1.0]
    assert values[1].grad is not None and values[1].grad.tolist() == [0.0, 0.0]


def test_reducer_errors() -> None:
    layout = Layout([4, 3], [2, 2], cp_mode="zigzag", cp_size=2)
    with refused(LayoutError, r"sample 0: values\[0\] has 2 positions but this rank's share is 0"):
        sum_of_sample_means([torch.zeros(2), torch.zeros(1)], [torch.ones(2), torch.ones(2)], layout)
    with refused(LayoutError, r"values has 1 samples but the layout has 2"):
        sum_of_tokens([torch.zeros(1)], [torch.ones(2), torch.ones(2)], layout)
    with refused(LayoutError, r"sample 1: loss_masks\[1\] has 3 positions but response_length is 2"):
        sum_of_tokens([torch.zeros(0), torch.zeros(1)], [torch.ones(2), torch.ones(3)], layout)


def test_a_2d_share_is_refused_as_values() -> None:
    layout = Layout([3], [2])
    with refused(LayoutError, r"sample 0: values\[0\] has shape \(2, 1\); it must be 1-D"):
        sum_of_tokens([torch.zeros(2, 1)], [torch.ones(2)], layout)
    with refused(LayoutError, r"sample 0: loss_masks\[0\] has shape \(2, 1\); it must be 1-D"):
        sum_of_tokens([torch.zeros(2)], [torch.ones(2, 1)], layout)
    if CHECKED:
        # the checker names the argument that is wrong, not the one after it
        from jaxtyping import TypeCheckError

        with pytest.raises(TypeCheckError) as info:
            sum_of_sample_means([torch.zeros(2, 1)], [torch.ones(2)], layout)
        assert "typechecking parameter 'values'" in str(info.value), str(info.value)[:2000]
