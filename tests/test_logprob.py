"""log_probs_and_entropy without TP, against a float64 log_softmax reference: values and
gradients (a random upstream gradient on both outputs), chunking, dtypes, peaked and
masked rows, temperatures, and every refusal."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from cpslice import LayoutError, log_probs_and_entropy
from cpslice._vocab.engine import Options
from cpslice._vocab.kernels import default_chunk_rows
from cpslice._vocab.logits import apply
from tests.checked import refused

from .compare import check_logits
from .reference import TEMPS, reference

PROPS = settings(max_examples=40, deadline=None)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Tensor, Tensor, float, int | None]:
    t = draw(st.integers(0, 12))
    v = draw(st.integers(1, 40))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0, 100.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=gen) * scale
    targets = torch.randint(0, v, (t,), generator=gen)
    chunk = draw(st.sampled_from([None, 1, 2, 5, 1000]))
    return logits, targets, draw(st.sampled_from(TEMPS)), chunk


@PROPS
@given(cases())
def test_float32_matches_float64_reference(case: tuple[Tensor, Tensor, float, int | None]) -> None:
    logits, targets, temperature, chunk = case
    check_logits(logits, targets, temperature, chunk)


@PROPS
@given(cases())
def test_bfloat16_matches_float64_of_its_values(
    case: tuple[Tensor, Tensor, float, int | None],
) -> None:
    logits, targets, temperature, chunk = case
    # Values are computed in float32 from the exact bf16 values; only the gradient,
    # which comes back in bfloat16, is rounded to bf16.
    check_logits(logits.bfloat16(), targets, temperature, chunk, grad_rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_float_dtypes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 9, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, 9, (6,), generator=gen)
    check_logits(logits, targets, 1.7, 4, grad_rtol=2e-3 if dtype == torch.float16 else 1e-5)


def test_float64_gradcheck() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 7, generator=gen, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, 7, (5,), generator=gen)

    def both(x: Tensor) -> tuple[Tensor, Tensor]:
        return log_probs_and_entropy(x, targets, with_entropy=True, temperature=0.8, chunk_size=2)

    assert torch.autograd.gradcheck(both, (logits,))


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("chunk", [1, 3, None])
def test_peaked_rows(temperature: float, chunk: int | None) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=gen)
    logits[0, 7] += 1e4  # target at the peak: log p = 0 to rounding
    logits[1, 3] += 1e4  # target elsewhere: log p = -1e4 / temperature
    logits[2] -= 1e4  # a whole row shifted far down
    logits[3, :] = 1e4  # a uniform row at a large offset
    logits[4, 10:12] = 100.0  # two equal peaks sharing the mass
    targets = torch.tensor([7, 0, 1, 2, 10, 49])
    check_logits(logits, targets, temperature, chunk)
    logp, entropy = log_probs_and_entropy(
        logits, targets, with_entropy=True, temperature=temperature
    )
    assert abs(float(logp[0])) < 1e-6 and abs(float(entropy[0])) < 1e-6
    assert float(entropy[3]) == pytest.approx(math.log(50), rel=1e-6)
    assert float(entropy[4]) == pytest.approx(math.log(2), abs=1e-5)


@pytest.mark.parametrize("temperature", TEMPS)
def test_masked_logits(temperature: float) -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 12, generator=gen)
    logits[:, 9:] = -math.inf  # vocabulary padding
    logits[2, :8] = -math.inf  # all but one token masked: p = 1 on it
    targets = torch.tensor([0, 3, 8, 5, 1])
    for chunk in (1, None):
        check_logits(logits, targets, temperature, chunk)
    logp, entropy = log_probs_and_entropy(logits, targets, with_entropy=True)
    assert float(logp[2]) == 0.0 and float(entropy[2]) == 0.0
    # A masked target has log p = -inf; a row of nothing but -inf is NaN.
    logp, _ = log_probs_and_entropy(logits, torch.tensor([9, 3, 8, 5, 1]))
    assert float(logp[0]) == -math.inf
    logits[1] = -math.inf
    logp, entropy = log_probs_and_entropy(logits, targets, with_entropy=True)
    assert math.isnan(float(logp[1])) and math.isnan(float(entropy[1]))
    assert torch.isfinite(logp[[0, 2, 3, 4]]).all()


def test_chunk_sizes_agree() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(37, 29, generator=gen).requires_grad_(True)
    targets = torch.randint(0, 29, (37,), generator=gen)
    got = []
    for chunk in (1, 4, 36, 37, 100, None):
        logp, entropy = log_probs_and_entropy(
            logits, targets, with_entropy=True, temperature=1.7, chunk_size=chunk
        )
        (grad,) = torch.autograd.grad((logp.sum() + 2 * entropy.sum()), logits)
        got.append((logp, entropy, grad))
    for other in got[1:]:
        for a, b in zip(got[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_zero_rows(with_entropy: bool) -> None:
    logits = torch.zeros(0, 8, requires_grad=True)
    logp, entropy = log_probs_and_entropy(
        logits, torch.zeros(0, dtype=torch.int64), with_entropy=with_entropy, chunk_size=3
    )
    assert logp.shape == (0,) and logp.dtype == torch.float32
    assert (entropy is None) == (not with_entropy)
    loss = logp.sum() if entropy is None else logp.sum() + entropy.sum()
    torch.autograd.backward(loss)
    assert logits.grad is not None and logits.grad.shape == (0, 8)


def test_without_entropy_returns_none_and_log_prob_gradient() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(7, 11, generator=gen).requires_grad_(True)
    targets = torch.randint(0, 11, (7,), generator=gen)
    g = torch.randn(7, generator=gen)
    logp, entropy = log_probs_and_entropy(logits, targets, temperature=0.5, chunk_size=2)
    assert entropy is None
    torch.autograd.backward((logp * g).sum())
    ref_lp, _, ref_grad = reference(logits, targets, 0.5, g, torch.zeros(7))
    torch.testing.assert_close(logp.double(), ref_lp, rtol=1e-6, atol=1e-5)
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_entropy_without_grad_is_a_detached_metric() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(7, 11, generator=gen).requires_grad_(True)
    targets = torch.randint(0, 11, (7,), generator=gen)
    g = torch.randn(7, generator=gen)
    logp, entropy = log_probs_and_entropy(
        logits, targets, with_entropy=True, entropy_grad=False, temperature=1.7
    )
    assert not entropy.requires_grad and entropy.grad_fn is None
    assert logp.requires_grad
    torch.autograd.backward((logp * g).sum())
    _, ref_h, ref_grad = reference(logits, targets, 1.7, g, torch.zeros(7))
    torch.testing.assert_close(entropy.double(), ref_h, rtol=1e-5, atol=1e-6)
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["log_probs", "entropy"])
def test_gradient_through_one_output_only(which: str) -> None:
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(6, 13, generator=gen).requires_grad_(True)
    targets = torch.randint(0, 13, (6,), generator=gen)
    g = torch.randn(6, generator=gen)
    logp, entropy = log_probs_and_entropy(logits, targets, with_entropy=True, chunk_size=4)
    zero = torch.zeros(6)
    if which == "log_probs":
        torch.autograd.backward((logp * g).sum())
        *_, ref_grad = reference(logits, targets, 1.0, g, zero)
    else:
        torch.autograd.backward((entropy * g).sum())
        *_, ref_grad = reference(logits, targets, 1.0, zero, g)
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_no_grad_and_inputs_without_grad() -> None:
    logits = torch.randn(4, 6)
    targets = torch.tensor([0, 5, 2, 2])
    logp, entropy = log_probs_and_entropy(logits, targets, with_entropy=True)
    assert not logp.requires_grad and not entropy.requires_grad
    with torch.no_grad():
        again, _ = log_probs_and_entropy(logits.requires_grad_(True), targets)
    assert not again.requires_grad
    torch.testing.assert_close(again, logp)


def test_caller_logits_never_modified_non_contiguous() -> None:
    base = torch.randn(9, 6)
    logits = base.t()  # [6, 9], non-contiguous
    targets = torch.tensor([0, 8, 1, 2, 3, 4])
    check_logits(logits, targets, 0.5, 2)
    check_logits(logits.bfloat16(), targets, 1.0, None, grad_rtol=1e-2)
    before = base.clone()
    x = logits.requires_grad_(True)
    logp, entropy = log_probs_and_entropy(x, targets, with_entropy=True, temperature=0.5)
    torch.autograd.backward(logp.sum() + entropy.sum())
    assert torch.equal(base, before) and base._version == 0


def test_out_of_range_target_off_the_cpu_check_is_nan() -> None:
    # The eager check runs only for CPU targets; past it (as on a GPU) the row is NaN.
    logits = torch.randn(3, 5)
    logp, entropy = apply(logits, torch.tensor([0, 5, -1]), Options(True, True, 1.0, None, 2, None, False))
    assert not math.isnan(float(logp[0]))
    assert math.isnan(float(logp[1])) and math.isnan(float(logp[2]))
    assert entropy is not None and torch.isfinite(entropy).all()


def test_default_chunk_rows() -> None:
    assert default_chunk_rows(32768) == 32  # 2 x 32 rows x 128 KiB = 8 MiB
    assert default_chunk_rows(32768, torch.bfloat16, "cuda") == 256
    assert default_chunk_rows(32768, torch.float64) == 16
    assert default_chunk_rows(10**9) == 1


GOOD = torch.zeros(3, 5)
TARGETS = torch.tensor([0, 1, 4])


@pytest.mark.parametrize(
    ("logits", "targets", "kwargs", "error", "match"),
    [
        ([[0.0]], TARGETS, {}, TypeError, "logits must be a torch.Tensor"),
        (torch.zeros(3, 5, dtype=torch.int64), TARGETS, {}, TypeError, "floating-point"),
        (GOOD, [0, 1, 4], {}, TypeError, "targets must be a torch.Tensor"),
        (GOOD, TARGETS.int(), {}, TypeError, r"int32; pass int64 token ids \(targets.long\(\)\)"),
        (GOOD, TARGETS.float(), {}, TypeError, "pass int64"),
        (torch.zeros(15), TARGETS, {}, LayoutError, r"shape \(15,\); it must be 2-D"),
        (torch.zeros(3, 5, 1), TARGETS, {}, LayoutError, "must be 2-D"),
        (torch.zeros(3, 0), TARGETS, {}, LayoutError, "0 vocabulary columns"),
        (GOOD, TARGETS[:2], {}, LayoutError, r"shape \(2,\) but logits has 3 rows"),
        (GOOD, TARGETS[:, None], {}, LayoutError, r"must be \[T\] = \[3\]"),
        (GOOD, TARGETS, {"temperature": 0.0}, LayoutError, "temperature=0.0 .* > 0"),
        (GOOD, TARGETS, {"temperature": -1.0}, LayoutError, "temperature=-1.0"),
        (GOOD, TARGETS, {"temperature": math.nan}, LayoutError, "finite"),
        (GOOD, TARGETS, {"temperature": math.inf}, LayoutError, "finite"),
        (GOOD, TARGETS, {"temperature": "1"}, TypeError, "temperature must be a real number, got a str"),
        (GOOD, TARGETS, {"temperature": True}, TypeError, "temperature must be a real number, got a bool"),
        (GOOD, TARGETS, {"chunk_size": 0}, LayoutError, "chunk_size=0 .* >= 1"),
        (GOOD, TARGETS, {"chunk_size": -3}, LayoutError, "chunk_size=-3"),
        (GOOD, TARGETS, {"chunk_size": 2.0}, TypeError, "chunk_size 2.0 is a float, not an int"),
        (GOOD, torch.tensor([0, 5, 1]), {}, LayoutError, r"targets\[1\] = 5 is outside .*\[0, 5\)"),
        (GOOD, torch.tensor([0, 1, -2]), {}, LayoutError, r"targets\[2\] = -2 .*e\.g\. 0"),
    ],
)
def test_refusals(
    logits: object, targets: object, kwargs: dict[str, object], error: type, match: str
) -> None:
    with refused(error, match):
        log_probs_and_entropy(logits, targets, **kwargs)  # type: ignore[call-overload]


def test_integer_temperature_is_accepted() -> None:
    logp, _ = log_probs_and_entropy(GOOD, TARGETS, temperature=2)
    torch.testing.assert_close(logp, torch.full((3,), -math.log(5)))
