"""The reducers need no communication, so their CP property is checked in one process:
the parts of every rank add up to the no-CP value, for values and gradients; for
``sample_means`` / ``sample_max`` / ``sample_min``, the per-rank parts their one
all_reduce combines (tests/distributed/test_sample_means.py runs the collectives on gloo)."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from cpslice import (
    Layout,
    LayoutError,
    extract_responses,
    sample_max,
    sample_means,
    sample_min,
    shard_responses,
    sum_of_sample_means,
    sum_of_tokens,
)
from cpslice._layout.reduce import _EXTREMES, _divide, _local_extreme, _sums

from ..support.checked import refused
from ..support.oracle import Config, local_length, local_values, shares
from ..support.sample_stats import masked_extreme, masked_means
from ..support.strategies import configs


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
    # checked or not, the argument that is wrong is the one named, not the one after it
    with pytest.raises((LayoutError, TypeError)) as info:
        sum_of_sample_means([torch.zeros(2, 1)], [torch.ones(2)], layout)
    assert "values" in str(info.value) and "loss_masks" not in str(info.value), str(info.value)
    # the refusal says where [r_i, m] goes: sample_means takes it, one mean per column
    with refused(LayoutError, r"reduce one value per token to a loss part; sample_means, "
                 r"sample_max and sample_min take \[r_i, m\]"):
        sum_of_tokens([torch.zeros(2, 3)], [torch.ones(2)], layout)
    assert sample_means([torch.ones(2, 1)], [torch.ones(2)], layout).shape == (1, 1)
    # any trailing shape: [r_i, *m] gives [n, *m]
    assert sample_means([torch.ones(2, 2, 3)], [torch.ones(2)], layout).tolist() == [[[1.0] * 3] * 2]
    assert sample_max([torch.ones(2, 2, 3)], [torch.ones(2)], layout).shape == (1, 2, 3)


# ---------------------------------------------------------------- mask dtypes, denominators


def _masks(kind: int, response: tuple[int, ...], gen: torch.Generator) -> list[torch.Tensor]:
    if kind == 0:
        return [torch.rand(r, generator=gen) > 0.4 for r in response]
    if kind == 1:  # int weights 0, 1, 2
        return [torch.randint(0, 3, (r,), generator=gen) for r in response]
    # fractional float weights (0.0 among them)
    return [torch.rand(r, generator=gen).round(decimals=1) for r in response]


@settings(max_examples=30, deadline=None)
@given(configs(), st.integers(0, 2), st.sampled_from(["whole", "list", "tensor"]))
def test_parts_and_gradients_sum_to_the_no_cp_ones_for_every_mask_and_denominator(
    cfg: Config, kind: int, denominators: str
) -> None:
    gen = torch.Generator().manual_seed(sum(cfg.total) + kind)
    masks = _masks(kind, cfg.response, gen)
    weights = [torch.randn(r, generator=gen, dtype=torch.float64) for r in cfg.response]
    whole = [float(m.double().sum()) for m in masks]
    d: list[float] = [float(r % 3) for r in cfg.response] if denominators != "whole" else whole
    given_d: list[float] | torch.Tensor | None = {
        "whole": None, "list": d, "tensor": torch.tensor(d, dtype=torch.float64)}[denominators]
    # float64 no-CP: sum_i sum_k w m / d_i, and its gradient m / d_i (0 where d_i is 0)
    ref = sum((float((w * m.double()).sum()) / di for w, m, di in zip(weights, masks, d) if di),
              0.0)
    ref_grad = [m.double() / di if di else torch.zeros(len(m), dtype=torch.float64)
                for m, di in zip(masks, d)]
    total = 0.0
    grad = [torch.zeros(r, dtype=torch.float64) for r in cfg.response]
    for rank in range(cfg.cp):
        layout = cfg.layout(rank).with_local_length(local_length(cfg))
        ids = local_values(cfg, rank)
        lookup = {(i * 1000 + (t - r - 1) + k): (i, k)
                  for i, (t, r) in enumerate(zip(cfg.total, cfg.response)) for k in range(r)}
        where = [lookup.get(int(v)) for v in ids.tolist()]
        values = torch.tensor([float(weights[w[0]][w[1]]) if w else 0.0 for w in where],
                              dtype=torch.float64, requires_grad=True)
        shares, _ = extract_responses(values, layout)
        part = sum_of_sample_means(shares, masks, layout, denominators=given_d)
        total += float(part.detach())
        if part.requires_grad:
            (g,) = torch.autograd.grad(part, values)
            for row, w in enumerate(where):
                if w is not None:
                    grad[w[0]][w[1]] += g[row]
    assert abs(total - ref) <= 1e-12 * max(1.0, abs(ref))
    for got, want in zip(grad, ref_grad):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    if cfg.cp == 1:  # no CP: sample_means needs no process group, and no collective
        means = sample_means(shares, masks, cfg.layout(0).with_local_length(local_length(cfg)),
                             denominators=given_d)
        want = torch.tensor([float((w * m.double()).sum()) / di if di else 0.0
                             for w, m, di in zip(weights, masks, d)], dtype=torch.float64)
        assert torch.allclose(means.double(), want, rtol=1e-12, atol=1e-12)
        assert means.dtype == torch.float64 or not cfg.total  # no samples: no dtype to keep


M = 3  # statistics per token in the [r_i, m] tests


def _whole_columns(cfg: Config, masks: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    """Per sample ``[R_i, M]`` float64 leaves; masked positions hold -inf, +inf or NaN."""
    out = []
    for r, m in zip(cfg.response, masks):
        v = torch.randn(r, M, generator=gen, dtype=torch.float64)
        junk = torch.tensor([float("-inf"), float("nan"), float("inf")], dtype=torch.float64)
        junk = junk.repeat(r * M)[: r * M].view(r, M)
        out.append(torch.where((m == 0)[:, None], junk, v).requires_grad_())
    return out


def _part(what: str, values: list[Tensor], masks: list[Tensor], layout: Layout) -> Tensor:
    """One rank's part of ``what``: its extremes, NaN where it holds an unmasked NaN."""
    extremes, nan = _local_extreme(_EXTREMES[what], values, masks, layout)
    return torch.where(nan, math.nan, extremes)


@settings(max_examples=30, deadline=None)
@given(configs(), st.integers(0, 2))
def test_columns_and_extremes_of_every_rank_combine_to_the_whole_response_ones(
    cfg: Config, kind: int
) -> None:
    """sample_means' [n, m] sums (and gradients) and sample_max / sample_min's parts, per
    rank, summed / maxed over the ranks: the float64 whole-response statistics."""
    if not cfg.total:
        return
    gen = torch.Generator().manual_seed(sum(cfg.total) + kind)
    masks = _masks(kind, cfg.response, gen)
    whole = _whole_columns(cfg, masks, gen)
    weight = torch.randn(len(cfg.total), M, generator=gen, dtype=torch.float64)
    sums = torch.zeros(len(cfg.total), M, dtype=torch.float64)
    largest = torch.full_like(sums, -math.inf)
    least = torch.full_like(sums, math.inf)
    for rank in range(cfg.cp):
        layout = cfg.layout(rank).with_local_length(local_length(cfg))
        mine = shares(whole, cfg, rank)
        part = _sums(mine, masks, layout, columns=True)
        assert part.local.shape == (len(cfg.total), M)
        sums = sums + part.local
        largest = torch.maximum(largest, _part("sample_max", mine, masks, layout))
        least = torch.minimum(least, _part("sample_min", mine, masks, layout))
    means = _divide(sums, part.whole)
    grads = torch.autograd.grad((means * weight).sum(), whole, allow_unused=True,
                                materialize_grads=True)
    want = masked_means(whole, masks)
    want_grads = torch.autograd.grad((want * weight).sum(), whole, allow_unused=True,
                                     materialize_grads=True)
    assert torch.allclose(means.detach(), want.detach(), rtol=1e-12, atol=1e-12)
    for got_grad, want_grad in zip(grads, want_grads):
        assert torch.allclose(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(largest, masked_extreme(whole, masks, largest=True))
    assert torch.equal(least, masked_extreme(whole, masks, largest=False))
    if cfg.cp == 1:  # no CP: the public functions themselves, with no process group
        layout = cfg.layout(0).with_local_length(local_length(cfg))
        mine = shares(whole, cfg, 0)
        assert torch.equal(sample_means(mine, masks, layout), means)
        assert torch.equal(sample_max(mine, masks, layout), largest)
        assert torch.equal(sample_min(mine, masks, layout), least)


def test_extremes_keep_the_dtype_count_nonzero_masks_and_carry_no_gradient() -> None:
    layout = Layout([4, 3, 3, 2], [3, 2, 2, 0])
    values = [torch.tensor([0.5, float("nan"), -2.0], dtype=torch.bfloat16, requires_grad=True),
              torch.tensor([float("inf"), 3.0], dtype=torch.bfloat16),
              torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
              torch.zeros(0, dtype=torch.bfloat16)]
    # a fractional mask keeps its token unscaled; an int 2 keeps it too; 0 drops it
    masks = [torch.tensor([0.25, 0.0, 2.0]), torch.tensor([0, 2]), torch.zeros(2, dtype=torch.bool),
             torch.zeros(0)]
    for fn, want in ((sample_max, [0.5, 3.0, -math.inf, -math.inf]),
                     (sample_min, [-2.0, 3.0, math.inf, math.inf])):
        got = fn(values, masks, layout)
        assert got.dtype == torch.bfloat16 and not got.requires_grad
        assert got.tolist() == want, fn.__name__
    columns = [torch.stack([v, -v], 1) for v in values]
    got = sample_max(columns, masks, layout)
    assert got.shape == (4, 2) and got[:, 1].tolist() == [2.0, -3.0, -math.inf, -math.inf]
    assert sample_min([], [], Layout([], [])).shape == (0,)


def test_an_unmasked_nan_makes_its_sample_nan_and_only_it() -> None:
    """NaN propagates to its sample's (and statistic's) result, as ``torch.max`` does; a
    masked NaN is never seen; the other samples and statistics keep their values."""
    layout = Layout([4, 3, 3], [3, 2, 2])
    values = [torch.tensor([[0.5, 1.0], [math.nan, 2.0], [-2.0, 4.0]]),
              torch.tensor([[3.0, math.nan], [1.0, 5.0]]),
              torch.tensor([[math.nan, math.nan], [2.0, 6.0]])]
    masks = [torch.ones(3), torch.ones(2), torch.tensor([0, 1])]
    for fn, want in ((sample_max, [[math.nan, 4.0], [3.0, math.nan], [2.0, 6.0]]),
                     (sample_min, [[math.nan, 1.0], [1.0, math.nan], [2.0, 6.0]])):
        got = fn(values, masks, layout)
        assert torch.equal(got.isnan(), torch.tensor(want).isnan()), (fn.__name__, got)
        assert torch.equal(got.nan_to_num(7.0), torch.tensor(want).nan_to_num(7.0)), (fn.__name__, got)
        first = fn([v[:, 0] for v in values], masks, layout)
        assert torch.equal(first.nan_to_num(7.0), torch.tensor(want)[:, 0].nan_to_num(7.0))


def test_extremes_without_cp_need_no_process_group_and_with_cp_say_so() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    values, masks = [torch.tensor([1.0, 3.0])], [torch.ones(2)]
    cp = Layout([8], [2], cp_mode="zigzag", cp_size=2, cp_rank=1)
    for fn, want in ((sample_max, [3.0]), (sample_min, [1.0])):
        assert fn(values, masks, Layout([3], [2], cp_mode="allgather", cp_size=1, local_length=3)).tolist() == want
        with pytest.raises(RuntimeError, match=rf"{fn.__name__} at cp_size 2 needs torch.distributed"):
            fn(shard_responses(values, cp), masks, cp)


def test_fractional_masks_divide_by_their_actual_sum() -> None:
    # a mask summing to 0.5 divides by 0.5 (clamp_min(sum, 1) would divide by 1)
    layout = Layout([3, 4], [2, 3])
    values = [torch.tensor([2.0, 4.0]), torch.tensor([1.0, 3.0, 5.0])]
    masks = [torch.tensor([0.25, 0.25]), torch.tensor([0.0, 0.5, 0.0])]
    assert sum_of_sample_means(values, masks, layout).item() == 3.0 + 3.0
    assert sample_means(values, masks, layout).tolist() == [3.0, 3.0]
    assert sum_of_tokens(values, masks, layout).item() == 1.5 + 1.5
    ints = [torch.tensor([1, 2]), torch.tensor([0, 3, 1])]  # int weights
    doubles = [v.double() for v in values]
    assert sample_means(doubles, ints, layout).tolist() == [10 / 3, 14 / 4]


def test_denominators_replace_the_mask_sums_and_zero_gives_zero() -> None:
    layout = Layout([3, 4, 2], [2, 3, 1])
    values = [torch.tensor([2.0, 4.0], requires_grad=True), torch.tensor([1.0, 3.0, 5.0]),
              torch.tensor([7.0])]
    masks = [torch.ones(2, dtype=torch.bool), torch.tensor([True, False, True]),
             torch.zeros(1, dtype=torch.bool)]
    for d in ([4.0, 0, 2.0], torch.tensor([4.0, 0.0, 2.0])):
        assert sample_means(values, masks, layout, denominators=d).tolist() == [1.5, 0.0, 0.0]
        part = sum_of_sample_means(values, masks, layout, denominators=d)
        assert part.item() == 1.5
        (g,) = torch.autograd.grad(part, values[0])
        assert g.tolist() == [0.25, 0.25]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_values_accumulate_in_float32(dtype: torch.dtype) -> None:
    # 1000 tokens near 1.4: a sum in bfloat16 stalls at 1024, a mean at 4.0 was seen
    gen = torch.Generator().manual_seed(0)
    layout = Layout([1001, 5], [1000, 4])
    values = [(1.4 + 0.05 * torch.randn(r, generator=gen)).to(dtype) for r in (1000, 4)]
    masks = [torch.rand(r, generator=gen) > 0.1 for r in (1000, 4)]
    exact = [v.double()[m].sum() for v, m in zip(values, masks)]
    means = [float(s) / float(m.sum()) for s, m in zip(exact, masks)]
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    tokens = sum_of_tokens(values, masks, layout)
    assert tokens.dtype == dtype
    assert abs(float(tokens) - float(sum(exact))) <= ulp * float(sum(exact))
    total = sum_of_sample_means(values, masks, layout)
    assert abs(float(total) - sum(means)) <= ulp * sum(means)
    got = sample_means(values, masks, layout)
    assert got.dtype == dtype
    assert torch.allclose(got.double(), torch.tensor(means, dtype=torch.float64), rtol=ulp, atol=0)


def test_sample_means_without_cp_needs_no_process_group_and_with_cp_says_so() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    values, masks = [torch.tensor([1.0, 3.0])], [torch.ones(2)]
    for layout in (Layout([3], [2]), Layout([3], [2], cp_mode="allgather", cp_size=1, local_length=3)):
        assert sample_means(values, masks, layout).tolist() == [2.0]
    cp = Layout([8], [2], cp_mode="zigzag", cp_size=2, cp_rank=1)
    with pytest.raises(RuntimeError, match=r"cp_size 2 needs torch.distributed"):
        sample_means(shard_responses(values, cp), masks, cp)


@pytest.mark.parametrize("fn", [sample_means, sample_max, sample_min], ids=lambda f: f.__name__)
def test_a_layout_of_no_samples_under_cp_is_refused_without_a_group_too(fn: Any) -> None:
    """No samples means no collective, on every rank alike, but not that no group is
    needed: the check comes first (with torch.distributed up, tests/distributed/test_cp_invariance.py's
    ``_from_whole`` checks the no-group LayoutError on gloo)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    assert fn([], [], Layout([], [])).shape == (0,)
    empty = Layout([], [], cp_mode="zigzag", cp_size=2, cp_rank=1)
    with pytest.raises(RuntimeError, match=rf"{fn.__name__} at cp_size 2 needs torch.distributed"):
        fn([], [], empty)


def test_index_tensors_are_built_once_per_layout_and_device() -> None:
    from cpslice._cache import cache_info
    from cpslice._layout.reduce import _index

    layout = Layout([5, 4, 3], [3, 2, 1], cp_mode="zigzag", cp_size=2, cp_rank=1)
    shares, _ = extract_responses(torch.randn(8), layout)
    masks = [torch.ones(r) for r in layout.response_lengths]
    sum_of_tokens(shares, masks, layout)
    before = cache_info(_index)
    sum_of_sample_means(shares, masks, layout)
    sum_of_tokens(shares, masks, layout)
    after = cache_info(_index)
    assert after.misses == before.misses and after.hits == before.hits + 2


# ---------------------------------------------------------------- errors (checked in both modes)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        # a share that is not a tensor: TypeError naming the argument and the sample
        (lambda L: sum_of_sample_means([[1.0, 2.0]], [torch.ones(2)], L),  # type: ignore[list-item]
         TypeError,
         r"sample 0: values\[0\] must be a tensor .*, got a list"),
        (lambda L: sample_means(torch.zeros(2), [torch.ones(2)], L),  # type: ignore[arg-type]
         TypeError,
         r"values must be a list of per-sample tensors, got a Tensor"),
        (lambda L: sum_of_tokens([torch.zeros(2, dtype=torch.int64)], [torch.ones(2)], L),
         TypeError, r"sample 0: values\[0\] has dtype torch.int64; it must be floating point"),
        # a share of the right length but not 1-D: the 1-D check alone catches it
        (lambda L: sum_of_sample_means([torch.zeros(2, 1)], [torch.ones(2)], L), LayoutError,
         r"sample 0: values\[0\] has shape \(2, 1\); it must be 1-D \[this rank's share\] = \[2\]"),
        (lambda L: sum_of_tokens([torch.zeros(2)], [torch.ones(2, 1)], L), LayoutError,
         r"sample 0: loss_masks\[0\] has shape \(2, 1\); it must be 1-D \[response_length\]"),
        (lambda L: sample_means([torch.zeros(2)], [torch.ones(2)], L, denominators=[1.0, 2.0]),
         LayoutError, r"denominators holds 2 values but the layout has 1 samples"),
        (lambda L: sum_of_sample_means([torch.zeros(2)], [torch.ones(2)], L,
                                       denominators=torch.ones(2)),
         LayoutError, r"denominators has shape \(2,\) but the layout has 1 samples"),
        (lambda L: sample_means([torch.zeros(2)], [torch.ones(2)], L, denominators=[-2.0]),
         LayoutError, r"sample 0: denominators\[0\] is -2.0; a denominator is .* >= 0"),
        (lambda L: sum_of_sample_means([torch.zeros(2)], [torch.ones(2)], L,
                                       denominators=torch.tensor([-0.5])),
         LayoutError, r"sample 0: denominators\[0\] is -0.5"),
        (lambda L: sample_means([torch.zeros(2)], [torch.ones(2)], L,
                                denominators=[float("nan")]),
         LayoutError, r"sample 0: denominators\[0\] is nan"),
        # a tensor's NaN too (a CPU tensor is checked; NaN < 0 is False, so it needs isnan)
        (lambda L: sample_means([torch.zeros(2)], [torch.ones(2)], L,
                                denominators=torch.tensor([float("nan")])),
         LayoutError, r"sample 0: denominators\[0\] is nan; a denominator is .* >= 0"),
        (lambda L: sum_of_sample_means([torch.zeros(2)], [torch.ones(2)], L,
                                       denominators=torch.tensor([float("nan")], dtype=torch.float64)),
         LayoutError, r"sample 0: denominators\[0\] is nan"),
        (lambda L: sample_means([torch.zeros(2)], [torch.ones(2)], L, denominators=["2"]),  # type: ignore[list-item]
         TypeError, r"sample 0: denominators\[0\] must be a real number, got a str '2'"),
        (lambda L: sample_means([torch.zeros(2)], [torch.ones(2)], L, denominators=3.0),  # type: ignore[arg-type]
         TypeError, r"denominators must be a \[n\] tensor or a list of floats, got float"),
    ],
)
def test_error_reducer_arguments(call: Any, error: type[Exception], match: str) -> None:
    with refused(error, match):
        call(Layout([3], [2]))


@pytest.mark.parametrize("fn", [sample_means, sample_max, sample_min], ids=lambda f: f.__name__)
def test_shares_of_one_call_have_one_trailing_shape(fn: Any) -> None:
    layout = Layout([3, 4, 2], [2, 3, 1])
    with refused(LayoutError, r"sample 1: values\[1\] has shape \(3, 2\) but values\[0\] has "
                 r"\(2, 3\) \(the shares of one call have one trailing shape"):
        fn([torch.zeros(2, 3), torch.zeros(3, 2), torch.zeros(1, 3)], [torch.ones(r) for r in (2, 3, 1)],
           layout)
    with refused(LayoutError, r"sample 2: values\[2\] has shape \(0,\) but values\[0\] has \(2, 3\)"):
        fn([torch.zeros(2, 3), torch.zeros(3, 3), torch.zeros(0)], [torch.ones(r) for r in (2, 3, 0)],
           Layout([3, 4, 2], [2, 3, 0]))
    with refused(LayoutError, r"sample 1: values\[1\] has 2 positions but this rank's share is 3"):
        fn([torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(1, 3)], [torch.ones(r) for r in (2, 3, 1)],
           layout)
    with refused(TypeError, r"sample 0: values\[0\] has dtype torch.int64; it must be floating point"):
        fn([torch.zeros(2, 3, dtype=torch.int64)], [torch.ones(2)], Layout([3], [2]))
