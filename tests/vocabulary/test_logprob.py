"""log_probs_and_entropy and log_probs_and_entropy_from_hidden without TP, each test on both
drivers of tests/support/drivers.py (the logits path, and the hidden-state path on
``hidden @ weight.T``) where it says the same of both, each driver given its own input
(logits; a random LM head) and the hidden path also logits, through the identity head,
where that costs little: against the float64 reference, values and gradients (a random
upstream gradient on both outputs; the head's weight gradient too), chunking, dtypes,
peaked rows, temperatures, entropy_grad and every refusal. Only on the logits path: masked (-inf) logits and the
kernel past the CPU checks. Only on the hidden path: no tensor of ``[T, V]`` size
anywhere in forward or backward, response_log_probs_from_hidden, and a row sure of its
target getting exactly zero gradient."""

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from cpslice import (
    Layout,
    LayoutError,
    entropy_from_hidden,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    log_probs_at_from_hidden,
    pack,
    response_distillation_from_hidden,
    response_log_probs_from_hidden,
    response_topk_log_probs_from_hidden,
    shard_responses,
    topk_log_probs_from_hidden,
)
from cpslice._vocab.backends.chunks import default_chunk_rows
from cpslice._vocab.call import Options
from cpslice._vocab.head import log_probs
from cpslice._vocab.logits import LogitsHead

from ..support.checked import refused
from ..support.compare import check, check_logits
from ..support.drivers import BOTH, CROSSED, DRIVERS, HIDDEN, LOGITS, OWN, Driver
from ..support.lengths import edge_lengths
from ..support.reference import TEMPS, grad_close, head_reference, identity_grad_atol

EXAMPLES = {LOGITS: 40, HIDDEN: 15}  # hypothesis examples of each driver's property tests
FORMS = ("logits", "head")
Case = tuple[Tensor, Tensor | None, Tensor, float, int | None]


@st.composite
def cases(draw: st.DrawFn, form: str) -> Case:
    """Logits ``[T, V]`` at scales up to 100 (``form`` "logits"), or a random head (hidden
    ``[T, H]`` at scales up to 4, weight ``[V, H]``); targets, a temperature and a chunk."""
    t = draw(st.integers(0, 12))
    weight: Tensor | None
    if form == "logits":
        v = draw(st.integers(1, 40))
        scale = draw(st.sampled_from([0.1, 1.0, 10.0, 100.0]))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        x, weight = torch.randn(t, v, generator=gen) * scale, None
    else:
        h, v = draw(st.integers(1, 9)), draw(st.integers(1, 30))
        scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        x, weight = torch.randn(t, h, generator=gen) * scale, torch.randn(v, h, generator=gen)
    targets = torch.randint(0, v, (t,), generator=gen)
    chunk = draw(st.sampled_from([None, 1, 2, 5, 1000]))
    return x, weight, targets, draw(st.sampled_from(TEMPS)), chunk


def make(form: str, seed: int, t: int, v: int, h: int) -> tuple[Tensor, Tensor | None, Tensor, torch.Generator]:
    """Seeded inputs of ``t`` rows over ``v`` ids: logits ``[t, v]``, or a head (hidden
    ``[t, h]``, weight ``[v, h]``); their targets; the generator, to draw on from."""
    gen = torch.Generator().manual_seed(seed)
    if form == "logits":
        x, weight = torch.randn(t, v, generator=gen), None
    else:
        x, weight = torch.randn(t, h, generator=gen), torch.randn(v, h, generator=gen)
    return x, weight, torch.randint(0, v, (t,), generator=gen), gen


def leaves(driver: Driver, x: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Fresh leaves that require grad: x, and the weight ``driver`` multiplies it by."""
    head = driver.head(x, weight)
    return x.clone().requires_grad_(True), None if head is None else head.clone().requires_grad_(True)


def grads_close(x: Tensor, weight: Tensor | None, leaf: tuple[Tensor | None, Tensor | None],
                want: tuple[Tensor, Tensor], rel: float = 1e-5) -> None:
    """The gradients of a driver's leaves (x's, the weight's; None: not a leaf) against
    the reference's: of logits to ``rel`` relative and ``rel / 10`` absolute (the
    identity head's weight gradient, ``dlogits.T @ x``, to that carried through x); of
    a head ``grad_close``."""
    (h, w), (dx, dw) = leaf, want
    if weight is None:
        if h is not None:
            assert h.grad is not None
            torch.testing.assert_close(h.grad.double(), dx, rtol=rel, atol=rel / 10)
        if w is not None:
            assert w.grad is not None
            torch.testing.assert_close(w.grad.double(), dw, rtol=rel,
                                       atol=identity_grad_atol(x, rel / 10, rel, dw))
    else:
        if h is not None:
            grad_close(h.grad, dx, rel)
        if w is not None:
            grad_close(w.grad, dw, rel)


def for_examples(driver: Driver, form: str, test: Callable[[Case], None]) -> None:
    """``test`` on ``EXAMPLES[driver]`` hypothesis examples of ``cases(form)``."""
    settings(max_examples=EXAMPLES[driver], deadline=None)(given(cases(form))(test))()


@OWN
def test_float32_matches_float64_reference(driver: Driver, form: str) -> None:
    def test(case: Case) -> None:
        x, weight, targets, temperature, chunk = case
        check(driver, x, targets, temperature, chunk, weight)

    for_examples(driver, form, test)


@OWN
def test_bfloat16_matches_float64_of_its_values(driver: Driver, form: str) -> None:
    # Given logits, the values are computed in float32 from the exact bf16 values; only
    # the gradient, which comes back in bfloat16, is rounded to bf16. A head's logits
    # are bf16 (the reference rounds them too), its statistics float32, its gradients bf16.
    def test(case: Case) -> None:
        x, weight, targets, temperature, chunk = case
        check(driver, x.bfloat16(), targets, temperature, chunk, None if weight is None else weight.bfloat16())

    for_examples(driver, form, test)


@CROSSED
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_float_dtypes(driver: Driver, form: str, dtype: torch.dtype) -> None:
    if form == "logits":
        x, weight, targets, _ = make(form, 3, 6, 9, 0)
        check(driver, (x * 3).to(dtype), targets, 1.7, 4)
    else:
        x, weight, targets, _ = make(form, 3, 7, 9, 5)
        assert weight is not None
        check(driver, x.to(dtype), targets, 1.7, 3, weight.to(dtype))


@OWN
def test_float64_gradcheck(driver: Driver, form: str) -> None:
    x, weight, targets, _ = make(form, 4, 5, 7, 4)
    inputs = [a.double().requires_grad_(True) for a in (x, weight) if a is not None]

    def both(*args: Tensor) -> tuple[Tensor, Tensor]:
        return driver.both(args[0], targets, args[1] if len(args) > 1 else None, temperature=0.8,
                           chunk_size=2)

    assert torch.autograd.gradcheck(both, tuple(inputs))


# the hidden path at one chunk size (two chunks of rows): its small chunks are slow
PEAKED = [(LOGITS, temperature, chunk) for chunk in (1, 3, None) for temperature in TEMPS]
PEAKED += [(HIDDEN, temperature, 3) for temperature in TEMPS]


@pytest.mark.parametrize(("driver", "temperature", "chunk"), PEAKED, ids=str)
def test_peaked_rows(driver: Driver, temperature: float, chunk: int | None) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=gen)
    logits[0, 7] += 1e4  # target at the peak: log p = 0 to rounding
    logits[1, 3] += 1e4  # target elsewhere: log p = -1e4 / temperature
    logits[2] -= 1e4  # a whole row shifted far down
    logits[3, :] = 1e4  # a uniform row at a large offset
    logits[4, 10:12] = 100.0  # two equal peaks sharing the mass
    targets = torch.tensor([7, 0, 1, 2, 10, 49])
    check(driver, logits, targets, temperature, chunk)
    logp, entropy = driver.both(logits, targets, temperature=temperature)
    assert abs(float(logp[0])) < 1e-6 and abs(float(entropy[0])) < 1e-6
    assert float(entropy[3]) == pytest.approx(math.log(50), rel=1e-6)
    assert float(entropy[4]) == pytest.approx(math.log(2), abs=1e-5)


def test_peaked_rows_and_large_logits_of_a_head() -> None:
    hidden, weight, targets, _ = make("head", 5, 6, 40, 8)
    assert weight is not None
    hidden[0] *= 300.0  # logits in the thousands: a one-hot distribution
    targets[0] = int((hidden[0] @ weight.T).argmax())
    for temperature in TEMPS:
        check(HIDDEN, hidden, targets, temperature, 4, weight)
    logp, entropy = HIDDEN.both(hidden, targets, weight)
    assert abs(float(logp[0])) < 1e-6 and abs(float(entropy[0])) < 1e-6


@pytest.mark.parametrize("temperature", TEMPS)
def test_masked_logits(temperature: float) -> None:
    # the logits path only: a head's logits are finite (and -inf * 0 is NaN)
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


@OWN
def test_chunk_sizes_agree(driver: Driver, form: str) -> None:
    x, weight, targets, _ = make(form, 7, 37, 29, 6)
    h, w = leaves(driver, x, weight)
    inputs = (h,) if w is None else (h, w)
    got = []
    for chunk in (1, 4, 36, 37, 100, None):
        logp, entropy = driver.both(h, targets, w, temperature=1.7, chunk_size=chunk)
        grads = torch.autograd.grad(logp.sum() + 2 * entropy.sum(), inputs)
        got.append((logp, entropy, *grads))
    # given logits: log p, entropy and their gradient to 1e-6 (the identity head's weight
    # gradient, a sum over 37 rows, to 1e-5); given a head, everything to 1e-5
    tol = [1e-6, 1e-6, 1e-6, 1e-5] if form == "logits" else [1e-5] * 4
    for other in got[1:]:
        for a, b, t in zip(got[0], other, tol):
            torch.testing.assert_close(a, b, rtol=t, atol=t)


@CROSSED
@pytest.mark.parametrize("with_entropy", [False, True])
def test_zero_rows(driver: Driver, form: str, with_entropy: bool) -> None:
    x = torch.zeros(0, 8 if form == "logits" else 4)
    h, w = leaves(driver, x, None if form == "logits" else torch.randn(8, 4))
    logp, entropy = driver(h, torch.zeros(0, dtype=torch.int64), w, with_entropy=with_entropy,
                           chunk_size=3)
    assert logp.shape == (0,) and logp.dtype == torch.float32
    assert (entropy is None) == (not with_entropy)
    torch.autograd.backward(logp.sum() if entropy is None else logp.sum() + entropy.sum())
    assert h.grad is not None and h.grad.shape == x.shape
    assert w is None or w.grad is not None and torch.equal(w.grad, torch.zeros(w.shape))


# (form, seed, temperature, chunk, with_entropy, entropy_grad): given logits to the
# logits path and the hidden path, a head to the hidden path
DETACHED = [
    ("logits", 8, 0.5, 2, False, True),
    ("logits", 9, 1.7, None, True, False),
    ("head", 8, 0.5, 2, False, False),
    ("head", 8, 0.5, 2, True, False),
]
DETACHED_CASES = [(d, *case) for case in DETACHED for d in DRIVERS if (d, case[0]) != (LOGITS, "head")]


@pytest.mark.parametrize(("driver", "form", "seed", "temperature", "chunk", "with_entropy", "entropy_grad"),
                         DETACHED_CASES, ids=str)
def test_without_entropy_and_entropy_as_a_detached_metric(
    driver: Driver, form: str, seed: int, temperature: float, chunk: int | None, with_entropy: bool,
    entropy_grad: bool,
) -> None:
    """Without entropy it is None; with ``entropy_grad=False`` a value outside the
    graph; either way log p and its gradient are the reference's."""
    x, weight, targets, gen = make(form, seed, 7, 11, 5)
    g = torch.randn(7, generator=gen)
    ref_lp, ref_h, *ref_grads = head_reference(x, weight, targets, temperature, g, torch.zeros(7))
    h, w = leaves(driver, x, weight)
    logp, entropy = driver(h, targets, w, with_entropy=with_entropy, entropy_grad=entropy_grad,
                           temperature=temperature, chunk_size=chunk)
    if with_entropy:
        assert entropy is not None and not entropy.requires_grad and entropy.grad_fn is None
        torch.testing.assert_close(entropy.double(), ref_h, rtol=1e-5, atol=1e-6)
    else:
        assert entropy is None
    assert logp.requires_grad
    torch.testing.assert_close(logp.double(), ref_lp, rtol=1e-6, atol=1e-5)
    torch.autograd.backward((logp * g).sum())
    grads_close(x, weight, (h, w), (ref_grads[0], ref_grads[1]))


GRADIENT_CASES = [
    (driver, form, which)
    for driver, form in ((LOGITS, "logits"), (HIDDEN, "head"), (HIDDEN, "logits"))
    for which in ("log_probs", "entropy", "hidden only", "weight only")
    if which in ("log_probs", "entropy") or driver is HIDDEN  # a weight to leave out
]


@pytest.mark.parametrize(("driver", "form", "which"), GRADIENT_CASES, ids=str)
def test_gradient_through_one_output_or_one_input(driver: Driver, form: str, which: str) -> None:
    """The gradient through log p alone or the entropy alone; of x alone ("hidden
    only") or the weight alone, where the driver multiplies by one."""
    x, weight, targets, gen = make(form, 10, 6, 13, 5)
    g, zero = torch.randn(6, generator=gen), torch.zeros(6)
    h, w = leaves(driver, x, weight)
    h.requires_grad_(which != "weight only")
    if w is not None:
        w.requires_grad_(which != "hidden only")
    logp, entropy = driver.both(h, targets, w, chunk_size=4)
    if which == "entropy":
        torch.autograd.backward((entropy * g).sum())
        *_, ref_dx, ref_dw = head_reference(x, weight, targets, 1.0, zero, g)
    else:
        torch.autograd.backward((logp * g).sum())
        *_, ref_dx, ref_dw = head_reference(x, weight, targets, 1.0, g, zero)
    if which == "weight only":
        assert h.grad is None
    if which == "hidden only":
        assert w is not None and w.grad is None
    grads_close(x, weight, (h if h.requires_grad else None, w if w is not None and w.requires_grad else None),
                (ref_dx, ref_dw))


@BOTH
def test_no_grad_and_inputs_without_grad(driver: Driver) -> None:
    logits = torch.randn(4, 6)
    targets = torch.tensor([0, 5, 2, 2])
    logp, entropy = driver.both(logits, targets)
    assert not logp.requires_grad and not entropy.requires_grad
    with torch.no_grad():
        again, _ = driver(logits.requires_grad_(True), targets)
    assert not again.requires_grad
    torch.testing.assert_close(again, logp)


@BOTH
def test_caller_logits_never_modified_non_contiguous(driver: Driver) -> None:
    base = torch.randn(9, 6)
    logits = base.t()  # [6, 9], non-contiguous (to the hidden path: the hidden states)
    targets = torch.tensor([0, 8, 1, 2, 3, 4])
    check(driver, logits, targets, 0.5, 2)
    check(driver, logits.bfloat16(), targets, 1.0, None)
    before = base.clone()
    x = logits.requires_grad_(True)
    logp, entropy = driver.both(x, targets, temperature=0.5)
    torch.autograd.backward(logp.sum() + entropy.sum())
    assert torch.equal(base, before) and base._version == 0


def test_out_of_range_target_off_the_cpu_check_is_nan() -> None:
    # The eager check runs only for CPU targets; past it (as on a GPU) the row is NaN.
    logits = torch.randn(3, 5)
    options = Options(True, True, 1.0, None, 2, None, False)
    logp, entropy = log_probs(LogitsHead(logits), torch.tensor([0, 5, -1]), options)
    assert not math.isnan(float(logp[0]))
    assert math.isnan(float(logp[1])) and math.isnan(float(logp[2]))
    assert entropy is not None and torch.isfinite(entropy).all()


def test_default_chunk_rows() -> None:
    assert default_chunk_rows(32768) == 32  # 2 x 32 rows x 128 KiB = 8 MiB
    assert default_chunk_rows(32768, torch.bfloat16, "cuda") == 256
    assert default_chunk_rows(32768, torch.float64) == 16
    assert default_chunk_rows(10**9) == 1


def test_default_linear_chunk_rows() -> None:
    from cpslice._vocab.blocks import default_hidden_chunk_rows

    assert default_hidden_chunk_rows(32768) == 256  # 256 rows x 128 KiB = 32 MiB
    assert default_hidden_chunk_rows(10**9) == 1


GOOD = torch.zeros(3, 5)
TARGETS = torch.tensor([0, 1, 4])
GOOD_H, GOOD_W = torch.zeros(3, 4), torch.zeros(5, 4)

# Refused the same way on both paths, logits GOOD (through the identity head on the
# hidden path): (targets, kwargs, error, match), "{x}" standing for the path's first input.
EITHER: list[tuple[object, dict[str, object], type, str]] = [
    ([0, 1, 4], {}, TypeError, "targets must be a torch.Tensor"),
    (TARGETS.int(), {}, TypeError, r"int32; pass int64 token ids \(targets.long\(\)\)"),
    (TARGETS.float(), {}, TypeError, "pass int64"),
    (TARGETS[:2], {}, LayoutError, r"shape \(2,\) but {x} has 3 rows"),
    (TARGETS[:, None], {}, LayoutError, r"must be \[T\] = \[3\]"),
    (TARGETS, {"temperature": 0.0}, LayoutError, "temperature=0.0 .* > 0"),
    (TARGETS, {"temperature": -1.0}, LayoutError, "temperature=-1.0"),
    (TARGETS, {"temperature": math.nan}, LayoutError, "finite"),
    (TARGETS, {"temperature": math.inf}, LayoutError, "finite"),
    (TARGETS, {"temperature": "1"}, TypeError, "temperature must be a real number, got a str"),
    (TARGETS, {"temperature": True}, TypeError, "temperature must be a real number, got a bool"),
    (TARGETS, {"chunk_size": 0}, LayoutError, "chunk_size=0 .* >= 1"),
    (TARGETS, {"chunk_size": -3}, LayoutError, "chunk_size=-3"),
    (TARGETS, {"chunk_size": 2.0}, TypeError, "chunk_size 2.0 is a float, not an int"),
    (torch.tensor([0, 5, 1]), {}, LayoutError, r"targets\[1\] = 5 is outside .*\[0, 5\)"),
    (torch.tensor([0, 1, -2]), {}, LayoutError, r"targets\[2\] = -2 .*e\.g\. 0"),
]
# The first inputs themselves: (x, weight, error, match), weight None on the logits path.
LOGITS_INPUTS: list[tuple[object, object, type, str]] = [
    ([[0.0]], None, TypeError, "logits must be a torch.Tensor"),
    (torch.zeros(3, 5, dtype=torch.int64), None, TypeError, "floating-point"),
    (torch.zeros(15), None, LayoutError, r"shape \(15,\); it must be 2-D \[T, V_local\] or more, \[\.\.\., V_local\]"),
    # [..., V] logits: their leading shape is the targets'
    (torch.zeros(3, 5, 1), None, LayoutError,
     r"targets has shape \(3,\) but logits has shape \(3, 5, 1\); targets must be \[\.\.\.\] = \[3, 5\]"),
    (torch.zeros(3, 0), None, LayoutError, "0 vocabulary columns"),
]
HIDDEN_INPUTS: list[tuple[object, object, type, str]] = [
    ([[0.0]], GOOD_W, TypeError, r"hidden must be a torch.Tensor \[T, H\]"),
    (GOOD_H, "w", TypeError, r"weight must be a torch.Tensor \[V_local, H\]"),
    (GOOD_H.long(), GOOD_W, TypeError, "hidden has dtype torch.int64"),
    (GOOD_H, GOOD_W.int(), TypeError, "weight has dtype torch.int32"),
    (GOOD_H, GOOD_W.double(), TypeError, "hidden has dtype torch.float32 but weight torch.float64"),
    (torch.zeros(12), GOOD_W, LayoutError, r"hidden has shape \(12,\); it must be 2-D"),
    (GOOD_H, torch.zeros(5, 4, 1), LayoutError, "weight has shape .* must be 2-D"),
    (GOOD_H, torch.zeros(0, 4), LayoutError, "0 vocabulary rows"),
    (GOOD_H, torch.zeros(5, 3), LayoutError, "hidden sizes 4 and 3 must agree"),
]
REFUSALS = [
    *[(d, GOOD, None, targets, kwargs, error, match.replace("{x}", d.name))
      for d in DRIVERS for targets, kwargs, error, match in EITHER],
    *[(LOGITS, x, weight, TARGETS, {}, error, match) for x, weight, error, match in LOGITS_INPUTS],
    *[(HIDDEN, x, weight, TARGETS, {}, error, match) for x, weight, error, match in HIDDEN_INPUTS],
]


@pytest.mark.parametrize(("driver", "x", "weight", "targets", "kwargs", "error", "match"), REFUSALS)
def test_refusals(
    driver: Driver, x: object, weight: object, targets: object, kwargs: dict[str, object], error: type,
    match: str,
) -> None:
    with refused(error, match):
        driver(x, targets, weight, **kwargs)  # type: ignore[arg-type]


@BOTH
def test_integer_temperature_is_accepted(driver: Driver) -> None:
    logp, _ = driver(GOOD, TARGETS, temperature=2)
    torch.testing.assert_close(logp, torch.full((3,), -math.log(5)))


# --- the hidden-state path only


class _Sizes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the storage size (in elements) of every tensor an operator returns: a
    view or an expanded tensor counts what it really holds."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, Tensor):
                self.sizes.append((str(func), x.untyped_storage().nbytes() // x.element_size()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_never_a_tensor_of_logits_size(dtype: torch.dtype) -> None:
    t, h, v, chunk = 96, 8, 40, 8
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(t, h, generator=gen).to(dtype).requires_grad_(True)
    weight = torch.randn(v, h, generator=gen).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (t,), generator=gen)
    with _Sizes() as sizes:
        logp, entropy = log_probs_and_entropy_from_hidden(
            hidden, weight, targets, with_entropy=True, temperature=0.9, chunk_size=chunk
        )
        torch.autograd.backward(logp.sum() + entropy.sum())
    biggest = max(n for _, n in sizes.sizes)
    # the inputs' gradients ([T, H], [V, H]) and [chunk, V] blocks; never T x V
    assert biggest <= max(t * h, v * h, chunk * v) < t * v, sorted(sizes.sizes, key=lambda s: -s[1])[:3]
    assert hidden.grad is not None and weight.grad is not None


# --- response_log_probs_from_hidden ---------------------------------------------------


@pytest.mark.parametrize("kind", ["none-thd", "none-bshd", "zigzag", "allgather"])
def test_response_shares_and_gradients_match_the_reference(kind: str) -> None:
    """Each CP rank's shares equal the float64 reference at its positions; its hidden
    gradient the reference at its rows (zero elsewhere); the weight gradients of the
    ranks sum to the reference's."""
    cp = 1 if kind.startswith("none") else 3
    total, response = edge_lengths(9, cp, 0)
    gen = torch.Generator().manual_seed(12)
    h_size, vocab, temperature = 6, 23, 0.8
    tokens = [torch.randint(0, vocab, (t,), generator=gen) for t in total]
    hiddens = [torch.randn(t, h_size, generator=gen) for t in total]
    weight = torch.randn(vocab, h_size, generator=gen)
    w_lp = [torch.randn(r, generator=gen, dtype=torch.float64) for r in response]
    w_ent = [torch.randn(r, generator=gen, dtype=torch.float64) for r in response]
    ref_lp, ref_ent, ref_dh = [], [], []
    wd = weight.double().requires_grad_(True)
    for t, r, tok, hs, a, b in zip(total, response, tokens, hiddens, w_lp, w_ent):
        x = hs.double().requires_grad_(True)
        span = torch.log_softmax((x @ wd.T) / temperature, -1)[t - r - 1 : t - 1]
        lp_ref = span.gather(1, tok[t - r :, None])[:, 0]
        ent_ref = -(span.exp() * span).sum(-1)
        torch.autograd.backward((a * lp_ref).sum() + (b * ent_ref).sum())
        ref_lp.append(lp_ref.detach())
        ref_ent.append(ent_ref.detach())
        assert x.grad is not None
        ref_dh.append(x.grad)
    mode = "none" if cp == 1 else kind
    fmt = "bshd" if kind == "none-bshd" else "thd"
    seq = max(total) + 1 if fmt == "bshd" else None
    dw = torch.zeros(vocab, h_size, dtype=torch.float64)
    for rank in range(cp):
        layout = Layout(total, response, qkv_format=fmt, max_seq_len=seq,  # type: ignore[arg-type]
                        cp_mode=mode, cp_rank=rank, cp_size=cp)  # type: ignore[arg-type]
        if mode == "allgather":
            layout = layout.with_local_length(-(-sum(total) // cp))
        hidden = pack(hiddens, layout).requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        lp, ent = response_log_probs_from_hidden(
            hidden, w, tokens, layout, with_entropy=True, temperature=temperature, chunk_size=4
        )
        for got, want in ((lp, shard_responses(ref_lp, layout)), (ent, shard_responses(ref_ent, layout))):
            assert [x.shape for x in got] == [x.shape for x in want]
            for x, y in zip(got, want):
                torch.testing.assert_close(x.double(), y, rtol=0, atol=1e-5)
                assert x.grad_fn is not None  # empty shares too: in the graph
        loss = sum(((a.float() * x).sum() + (b.float() * y).sum()
                    for a, x, b, y in zip(shard_responses(w_lp, layout), lp,
                                          shard_responses(w_ent, layout), ent)), torch.zeros(()))
        torch.autograd.backward(loss)
        assert hidden.grad is not None and w.grad is not None
        grad_close(hidden.grad, pack(ref_dh, layout).double(), 1e-5)
        dw += w.grad.double()
    assert wd.grad is not None
    grad_close(dw, wd.grad, 1e-5)


def test_response_from_hidden_refuses_and_keeps_the_entropy_none() -> None:
    layout = Layout([5, 4], [2, 1])
    tokens = [torch.zeros(5, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)]
    lp, ent = response_log_probs_from_hidden(torch.randn(9, 3), torch.randn(7, 3), tokens, layout)
    assert ent is None
    assert [x.shape[0] for x in lp] == [2, 1]
    with refused(LayoutError, r"hidden has shape \(9,\); it must be 2-D \[T, H\]"):
        response_log_probs_from_hidden(torch.randn(9), torch.randn(7, 3), tokens, layout)
    with pytest.raises(LayoutError, match="hidden"):
        response_log_probs_from_hidden(torch.randn(8, 3), torch.randn(7, 3), tokens, layout)


@pytest.mark.parametrize("chunk", [1, 3, None])
def test_a_row_sure_of_its_target_gets_exactly_zero_gradient(chunk: int | None) -> None:
    """With one vocabulary entry every log-prob and entropy is 0 and so is every
    gradient: exactly, only if backward recomputes bit for bit the logits forward took
    the max and the sum of (a matmul of another shape rounds differently)."""
    gen = torch.Generator().manual_seed(4)
    hidden = (torch.randn(40, 5, generator=gen) * 4).requires_grad_(True)
    weight = torch.randn(1, 5, generator=gen).requires_grad_(True)
    logp, entropy = log_probs_and_entropy_from_hidden(
        hidden, weight, torch.zeros(40, dtype=torch.int64), with_entropy=True, temperature=0.5,
        chunk_size=chunk,
    )
    torch.autograd.backward((logp * torch.randn(40, generator=gen)).sum() + entropy.sum())
    assert not logp.any() and not entropy.any()
    assert hidden.grad is not None and weight.grad is not None
    assert not hidden.grad.any() and not weight.grad.any()


# --- sequence parallelism: its checks without a process group (on gloo: tests/support/sequence_cases.py)

_ONE = Layout([3], [1])
_TOKENS = [TARGETS]
SEQUENCE_CALLS: dict[str, Callable[..., object]] = {
    "log_probs_and_entropy_from_hidden": lambda **kw: log_probs_and_entropy_from_hidden(GOOD_H, GOOD_W, TARGETS, **kw),
    "log_probs_at_from_hidden": lambda **kw: log_probs_at_from_hidden(GOOD_H, GOOD_W, TARGETS[:, None], **kw),
    "topk_log_probs_from_hidden": lambda **kw: topk_log_probs_from_hidden(GOOD_H, GOOD_W, 2, **kw),
    "entropy_from_hidden": lambda **kw: entropy_from_hidden(GOOD_H, GOOD_W, **kw),
    "response_log_probs_from_hidden": lambda **kw: response_log_probs_from_hidden(GOOD_H, GOOD_W, _TOKENS, _ONE, **kw),
    "response_distillation_from_hidden": lambda **kw: response_distillation_from_hidden(
        GOOD_H, GOOD_W, [torch.zeros(1, 2)], [torch.zeros(1, 2, dtype=torch.int64)], _ONE, **kw),
    "response_topk_log_probs_from_hidden": lambda **kw: response_topk_log_probs_from_hidden(
        GOOD_H, GOOD_W, 2, _ONE, **kw),
}


@pytest.mark.parametrize("name", SEQUENCE_CALLS)
def test_sequence_parallel_is_a_bool_and_needs_a_tp_group(name: str) -> None:
    call = SEQUENCE_CALLS[name]
    call(sequence_parallel=False)
    with refused(TypeError, r"sequence_parallel=1 is an int; pass True or False"):
        call(sequence_parallel=1)
    with refused(LayoutError, r"sequence_parallel=True needs tp_group: hidden is then this TP rank's \[T / tp, H\] "
                 r"shard of the sequence, gathered over the TP group; pass tp_group \(or the weight as a DTensor"):
        call(sequence_parallel=True)
