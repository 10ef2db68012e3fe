"""The Triton kernels' inline soft cap and temperature are the reference's
(``cpslice._vocab.softmax`` and ``cpslice._vocab.spec``), through Triton's interpreter
(``TRITON_INTERPRET=1``, set for the session by conftest.py).

A Triton kernel cannot call a Python function, so it spells the cap and the temperature
out; these tests pin each spelling to the one reference: invariant mode's kernels bit for
bit (``torch.equal``, and a zero's sign) against ``spec.softcap``, ``spec.softcap_slope``,
``spec.exp``, ``spec.tree`` and ``softmax.reciprocals``; the default kernels against
``softmax.exp_capped``, ``exp_complement``, ``from_complement`` and ``complement_slope``
within float32 rounding (numpy's ``exp`` is not torch's). The inputs exercise the cap
where ``tanh`` saturates (logits far beyond a small cap, both signs), where it is near
linear, and per-row temperatures on both sides of 1."""

import math
from typing import no_type_check

import pytest
import torch
from torch import Tensor

from cpslice._vocab import spec
from cpslice._vocab.softmax import (
    complement_slope,
    exp_capped,
    exp_complement,
    exp_constants,
    from_complement,
    reciprocal,
    reciprocals,
)

triton = pytest.importorskip("triton")  # in the dev install (requirements-dev.txt)
tl = pytest.importorskip("triton.language")

from cpslice._vocab.backends.triton import default as _default  # noqa: E402  (after the skip)
from cpslice._vocab.backends.triton import invariant as _tri  # noqa: E402

# numpy warns of the -inf - -inf of a masked slot and of exp's overflow past a small cap
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

T, V = 5, 600  # 5 tiles, the last one partial; 3 of the default kernels' 256-column blocks
CAPS = (0.5, 3.0, 30.0)


def _logits() -> Tensor:
    """``[T, V]`` float32 logits: far past a small cap's saturation (both signs), near 0
    (the cap near linear, ``tanh``'s cancellation), ordinary, a masked token."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, V, generator=gen) * 4
    x[0] *= 300  # |x| up to ~1e3: tanh(x / cap) rounds to +-1
    x[1] = torch.linspace(-60.0, 60.0, V)
    x[2] *= 1e-3
    x[3, 7] = -math.inf
    x[4, :300] = x[4, :300].abs() + 50.0
    return x


def _taus() -> Tensor:
    """Per-row temperatures on both sides of 1."""
    return torch.tensor([0.35, 1.0, 1.7, 0.8, 2.5])


def _same(a: Tensor, b: Tensor) -> bool:
    """``torch.equal``, and the same sign bits: bit for bit where no NaN is."""
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@triton.jit
@no_type_check
def _softcap_kernel(x_ptr, y_ptr, t_ptr, n, cap, BLOCK: tl.constexpr):
    """``_tri._softcap`` of ``n`` float32 values: ``y`` and ``t`` stored."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    y, t = _tri._softcap(tl.load(x_ptr + cols, mask=inside, other=0.0), cap, _tri._exp)
    tl.store(y_ptr + cols, y, mask=inside)
    tl.store(t_ptr + cols, t, mask=inside)


@pytest.mark.parametrize("cap", CAPS)
def test_the_invariant_kernels_cap_is_the_specs_bit_for_bit(cap: float) -> None:
    x = _logits()[:, :256].reshape(-1).contiguous()
    y, t = torch.empty_like(x), torch.empty_like(x)
    _softcap_kernel[(-(-x.numel() // 256),)](x, y, t, x.numel(), cap, BLOCK=256, enable_fp_fusion=False)
    want_y, want_t = spec.softcap(x, cap)
    assert _same(y, want_y) and _same(t, want_t)
    assert bool((want_t.abs() == 1).any()) and bool((want_t.abs() < 0.5).any())  # saturated and not


def _spec_tiles(x: Tensor, r: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-tile ``(m, s, a)`` ``[T, n]`` of ``x`` from the spec's functions (steps 1 to 3)."""
    n = spec.TILE * -(-x.shape[1] // spec.TILE)
    y = torch.cat([spec.softcap(x, cap)[0], x.new_full((x.shape[0], n - x.shape[1]), -math.inf)], 1)
    y = y.view(x.shape[0], -1, spec.TILE)
    m = spec.tile_max(y)
    shift = torch.where(m == -math.inf, 0.0, m)
    d = ((y - shift[..., None]) * r[:, None, None]).clamp(min=spec.FLOOR)
    e = spec.exp(d)
    a = spec.tree(d * e)
    return m, spec.tree(e), a


@pytest.mark.parametrize("cap", CAPS)
def test_the_invariant_kernels_temperature_and_cap_are_the_specs_bit_for_bit(cap: float) -> None:
    x, tau = _logits(), _taus()
    r = reciprocals(tau, T, torch.float32, x.device)
    n = -(-V // spec.TILE)
    got = [torch.full((n, T), math.nan).t() for _ in range(3)]  # [T, n] views, as the kernels take them
    _tri.tile_stats(x, None, r, cap, V, got[0], got[1], got[2])
    for g, w in zip(got, _spec_tiles(x, r, cap)):
        assert _same(g, w)
    # the gradient: p * (a log p + b) times the cap's derivative, at every column
    big, log_s = x.amax(1).clamp(max=cap), torch.rand(T, generator=torch.Generator().manual_seed(2)) * 3
    coef_a, coef_b = torch.linspace(-1.0, 1.0, T), torch.linspace(0.5, -0.5, T)
    out = torch.empty_like(x)
    _tri.grad(x, None, r, big, log_s, coef_a, coef_b, cap, out)
    y, t = spec.softcap(x, cap)
    d = ((y - big[:, None]) * r[:, None] - log_s[:, None]).clamp(min=spec.FLOOR)
    want = spec.exp(d) * (coef_a[:, None] * d + coef_b[:, None]) * spec.softcap_slope(t)
    assert _same(out, want)


def _default_stats(x: Tensor, tau: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, S, A)`` of the default mode from the reference's one-``exp`` cap and the
    kernels' multiplication by ``1 / tau``."""
    c, two = (torch.tensor(v) for v in exp_constants(cap))
    y = exp_capped(x, c, two)
    m = y.amax(1)
    r = reciprocal(tau, torch.float32)
    assert isinstance(r, Tensor)
    d = ((y - m[:, None]) * r[:, None]).clamp(min=spec.FLOOR)
    p = torch.exp(d)
    return m, p.sum(1), (p * d).sum(1)


@pytest.mark.parametrize("cap", CAPS)
def test_the_default_kernels_temperature_and_cap_are_the_references(cap: float) -> None:
    x, tau = _logits(), _taus()
    got = [torch.empty(T) for _ in range(3)]
    _default.stats(x, tau, cap, *got)
    want = _default_stats(x, tau, cap)
    # a capped logit is within cap * eps of another exp's (the cancellation in cap - 2 cap /
    # (e + 1)); the sums add V of them in another order
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=cap * 2**-22)
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=V * cap * 2**-23)
    big, total, _ = want
    log_s = torch.log(total)
    coef_a, coef_b = torch.linspace(-1.0, 1.0, T), torch.linspace(0.5, -0.5, T)
    out = torch.empty_like(x)
    _default.grad(x, tau, cap, big, log_s, coef_a, coef_b, out)
    c, two = (torch.tensor(v) for v in exp_constants(cap))
    s = exp_complement(x, two)
    r = reciprocal(tau, torch.float32)
    assert isinstance(r, Tensor)
    d = ((from_complement(s, c) - big[:, None]) * r[:, None] - log_s[:, None]).clamp(min=spec.FLOOR)
    want_grad = torch.exp(d) * (coef_a[:, None] * d + coef_b[:, None]) * complement_slope(s)
    torch.testing.assert_close(out, want_grad, rtol=2e-5, atol=1e-7)
    assert bool((complement_slope(s) == 0).any()) and bool((complement_slope(s) > 0.5).any())
