"""The Triton backend natively on a CUDA device: the options of tests/vocabulary/test_triton.py at a
GPU's sizes (several blocks of the compiled kernels' width) against float64, with the
``auto`` selection taking Triton for CUDA tensors; and what only a GPU's arithmetic can
show, the invariant merge's correctly rounded division. Skipped, saying so, where no GPU
exists (``make test`` runs on CPUs) and under the interpreter: ``make gpu-check`` runs
this module natively on a GPU machine, with ``TRITON_INTERPRET=0``. The near-midpoint
quotients the division test divides are checked on the CPU too."""

import random
from typing import Any

import pytest
import torch
from torch import Tensor

from cpslice import _probe, log_probs_and_entropy, log_probs_at, topk_log_probs
from cpslice._vocab import spec as _spec
from cpslice._vocab.backends import selection as backend

from ..support.triton_cases import OPTIONS, launched, logits, on_cuda, reference

native = on_cuda("the Triton kernels ran under the interpreter only (tests/vocabulary/test_triton.py)")


@native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_cuda_against_float64(seen: _probe.Seen, dtype: torch.dtype, options: dict[str, Any]) -> None:
    t, v = 64, 40000
    opts = dict(options)
    if opts.get("temperature") == "per-row":
        opts["temperature"] = torch.linspace(0.5, 1.5, t, device="cuda")
    if "vocab_size" in opts:
        opts["vocab_size"] = v - 123
    with_entropy = opts.pop("with_entropy", True)
    use_h = with_entropy and opts.get("entropy_grad", True)
    x0 = logits(t, v, dtype, 3).cuda()
    targets = torch.randint(0, opts.get("vocab_size", v), (t,), device="cuda")
    x = x0.clone().requires_grad_()
    before = len(seen.events)
    with backend.using("auto"):
        lp, h = log_probs_and_entropy(x, targets, with_entropy=with_entropy, **opts)
        g_lp, g_h = torch.randn(t, device="cuda"), torch.randn(t, device="cuda")
        loss = (lp * g_lp).sum() + ((h * g_h).sum() if use_h and h is not None else 0.0)
        loss.backward()
    assert launched(seen, before) == {"default.stats", "default.grad"}
    ref_lp, ref_h, ref_grad = reference(x0, targets[:, None], opts.get("temperature", 1.0), opts.get("softcap"),
                                         opts.get("vocab_size"), g_lp[:, None], g_h if use_h else 0 * g_h)
    torch.testing.assert_close(lp.double(), ref_lp[:, 0], rtol=0, atol=2e-5)
    if with_entropy:
        assert h is not None
        torch.testing.assert_close(h.double(), ref_h, rtol=0, atol=2e-5)
    assert x.grad is not None
    rel = 2e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=rel, atol=rel * float(ref_grad.abs().max()))


@native
def test_cuda_log_probs_at_and_topk(seen: _probe.Seen) -> None:
    t, v = 32, 20000
    x0 = logits(t, v, torch.bfloat16, 4).cuda()
    ids = torch.randint(0, v, (t, 3), device="cuda")
    ids[:, 1] = ids[:, 0]
    x = x0.clone().requires_grad_()
    before = len(seen.events)
    with backend.using("auto"):  # whatever CPSLICE_BACKEND says: auto takes Triton for CUDA tensors
        lp = log_probs_at(x, ids, temperature=0.8)
        g = torch.randn(t, 3, device="cuda")
        (lp * g).sum().backward()  # type: ignore[no-untyped-call]
        top, top_ids = topk_log_probs(x0, 5)
    assert {"default.stats", "default.grad"} <= launched(seen, before)
    ref_lp, _, ref_grad = reference(x0, ids, 0.8, None, None, g, torch.zeros(t, device="cuda"))
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    assert x.grad is not None
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=2**-8, atol=2**-8 * float(ref_grad.abs().max()))
    want = torch.log_softmax(x0.double(), -1).topk(5, -1)
    torch.testing.assert_close(top.double(), want.values, rtol=0, atol=2e-5)


def near_midpoints(count: int, seed: int) -> tuple[Tensor, Tensor]:
    """``count`` float32 pairs ``(n, tau)``, ``n < 0``, ``tau`` in ``[1, 2)``, whose exact
    quotient ``n / tau`` (in ``[-8, -1/4)``) lies within ``2^-24`` of a float32 ulp of a
    midpoint between two float32 values: its correct rounding turns on the quotient's
    25th bit and beyond, which no division short of a correctly rounded one gets right
    every time. Made by number theory, not search: for an odd significand ``T`` of
    ``tau``, an odd ``M`` in ``[2^24, 2^25)`` (a midpoint's significand) with ``M T = N
    2^24 +- 1`` (``M = +-T^-1 mod 2^24``), so that ``N / T = M / 2^24 -+ 1 / (2^24 T)``;
    kept where ``N < 2^24`` fits a float32 significand."""
    gen = random.Random(seed)
    ns: list[float] = []
    taus: list[float] = []
    while len(ns) < count:
        t = gen.randrange(2**23, 2**24) | 1
        sign = gen.choice((1, -1))
        m = (sign * pow(t, -1, 2**24)) % 2**24 + 2**24
        n = (m * t - sign) // 2**24  # m t = n 2^24 + sign
        if n >= 2**24:
            continue
        ns.append(-n * 2.0 ** -gen.randrange(21, 26))
        taus.append(t * 2.0**-23)
    return torch.tensor(ns), torch.tensor(taus)


def merge_at_near_midpoints(device: str) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The Triton merge on ``device`` and the eager spec (``spec.merge_tiles``, on the CPU)
    of rows of two tiles whose ``delta = (m_j - M) / tau`` is ``near_midpoints``' quotient:
    tile 0 the max (``m = 0``, ``s = 0``), tile 1 ``m = n``, ``s = 1``, ``a = 0``, so that the
    row's ``S`` is ``exp(delta)`` and its ``A`` is ``exp(delta) * delta``: the division's
    bits, seen."""
    from cpslice._vocab.backends.triton import invariant as tri

    n, tau = near_midpoints(64, 11)
    m = torch.stack([torch.zeros_like(n), n], 1)
    s = torch.stack([torch.zeros_like(n), torch.ones_like(n)], 1)
    a = torch.zeros_like(m)
    want = _spec.merge_tiles(m.t(), s.t(), a.t(), tau)
    got = tri.merge(m.to(device), s.to(device), a.to(device), tau.to(device))
    return tuple(g.cpu() for g in got if g is not None), tuple(w for w in want if w is not None)


def test_near_midpoints_are_rounding_sensitive() -> None:
    """What the CUDA test below divides: quotients a hair from a midpoint (float64 sees it)."""
    n, tau = near_midpoints(64, 11)
    q = n.double() / tau.double()
    ulp = (q.float().abs().nextafter(torch.tensor(float("inf"))) - q.float().abs()).double()
    nearest = q.float().double()
    off = ((q - nearest).abs() / ulp - 0.5).abs()  # from the midpoint, in ulps
    assert bool((off < 2**-23).all()) and bool((q < -0.25).all()) and bool((q >= -8).all())


@native
def test_cuda_invariant_merge_divides_correctly_rounded() -> None:
    """The merge's ``delta`` by ``tl.math.div_rn``, not ``/``: on a GPU ``/`` is the
    approximate ``div.full.f32``, which rounds some quotients a hair from a midpoint the
    other way, and the bits of ``S`` and ``A`` with them. CUDA-only: Triton's interpreter
    divides in numpy, exactly rounded either way, so no CPU test can see it."""
    from cpslice._vocab.backends.triton import invariant as tri

    if type(tri.invariant_merge).__name__ == "InterpretedFunction":
        pytest.skip("the Triton kernels were imported under TRITON_INTERPRET=1 (the interpreter divides "
                    "exactly): run TRITON_INTERPRET=0 pytest tests/vocabulary/test_triton_cuda.py")
    got, want = merge_at_near_midpoints("cuda")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32)), (g, w)
