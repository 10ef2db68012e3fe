"""What the tests of ``vocab_divergence`` share (tests/vocabulary/test_divergence.py, the
interpreter's and the compiled kernels' tests, tests/distributed/test_divergence_tp.py):
the float64 reference written out from the definitions (no cpslice code), logits with
every edge of zero probabilities, and the tolerances."""

import math
from typing import Any

import torch
from torch import Tensor

from cpslice._types import Divergence

from .reference import EPS32

KINDS: list[tuple[Divergence, float]] = [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.3), ("jsd", 0.0), ("jsd", 1.0)]
"""Each kind, ``"jsd"`` inside ``(0, 1)`` and at both ends of ``beta``."""


def _kl(a: Tensor, b: Tensor) -> Tensor:
    """``sum e^a (a - b)`` of log-probs; a category of probability 0 adds 0."""
    p = a.exp()
    return torch.where(p > 0, p * (a - b), 0.0).sum(-1)


def divergence64(student: Tensor, teacher: Tensor, kind: str, beta: float, temperature: float | Tensor = 1.0,
                 softcap: float | None = None, vocab_size: int | None = None) -> Tensor:
    """The divergence of ``[..., V]`` logits in float64 from its definition: ``p``, ``q`` the
    softmax of the capped logits over ``[0, vocab_size)`` divided by the temperature (a
    number or one per row of the leading shape), then ``KL(q || p)``, ``KL(p || q)`` or
    ``beta KL(q || m) + (1 - beta) KL(p || m)`` (``beta`` 0 and 1: forward and reverse).
    Differentiable where the inputs are."""
    s = student.double()[..., : vocab_size or student.shape[-1]]
    t = teacher.double()[..., : vocab_size or teacher.shape[-1]]
    if softcap is not None:
        s, t = softcap * torch.tanh(s / softcap), softcap * torch.tanh(t / softcap)
    tau = temperature.double().reshape(s.shape[:-1])[..., None] if isinstance(temperature, Tensor) else temperature
    p, q = torch.log_softmax(s / tau, -1), torch.log_softmax(t / tau, -1)
    if kind == "forward" or (kind == "jsd" and beta == 0.0):
        return _kl(q, p)
    if kind == "reverse" or (kind == "jsd" and beta == 1.0):
        return _kl(p, q)
    m = torch.logaddexp(q + math.log(beta), p + math.log1p(-beta))
    return beta * _kl(q, m) + (1 - beta) * _kl(p, m)


def reference(student: Tensor, teacher: Tensor, kind: str, beta: float, g: Tensor,
              **options: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(value, d/d student, d/d teacher, finite)`` in float64 of ``sum g * divergence``:
    the value from the logits as they are (``+inf`` rows included), the gradients with
    every ``-inf`` logit 1e4 below its row's smallest finite one (the same distribution
    in float64, without autograd's ``0 * inf``), compared on the rows whose value is
    finite (``finite``)."""
    value = divergence64(student, teacher, kind, beta, **options)
    finite = torch.isfinite(value)

    def finite_logits(x: Tensor) -> Tensor:
        x = x.detach().double()
        low = torch.where(torch.isfinite(x), x, math.inf).amin(-1, keepdim=True)
        return torch.where(x == -math.inf, low - 1e4, x).requires_grad_()

    s, t = finite_logits(student), finite_logits(teacher)
    torch.autograd.backward((divergence64(s, t, kind, beta, **options) * g.double() * finite).sum())
    assert s.grad is not None and t.grad is not None
    return value, s.grad, t.grad, finite


def logits(t: int, v: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> tuple[Tensor, Tensor]:
    """A student's and a teacher's ``[t, v]`` logits (``t >= 5``) with every edge of zero
    probability: row 0 plain, row 1 the student -inf at an id the teacher holds (forward
    KL +inf), row 2 the teacher -inf at an id the student holds (reverse KL +inf), row 3
    all -inf but one on the teacher's side, row 4 a peaked student, both -inf at one id, row
0 a peaked teacher (each peak late in the row: a running max that changes)."""
    gen = torch.Generator().manual_seed(seed)
    s, t_ = torch.randn(t, v, generator=gen) * scale, torch.randn(t, v, generator=gen) * scale
    s[1, 3] = -math.inf
    t_[2, 5] = -math.inf
    t_[3] = -math.inf
    t_[3, v // 2] = 1.0
    s[4, v - 20] += 30.0
    t_[0, v - 30] += 25.0
    s[4, 0] = t_[4, 0] = -math.inf
    return s.to(dtype), t_.to(dtype)


def value_atol(student: Tensor, teacher: Tensor, temperature: float | Tensor) -> float:
    """A few float32 roundings at the scale of the tempered logits (the closed forms add
    and cancel terms of that size)."""
    x = torch.cat([student.detach().double().flatten(), teacher.detach().double().flatten()])
    x = x[torch.isfinite(x)]
    tau = float(temperature.min()) if isinstance(temperature, Tensor) else temperature
    spread = float(x.abs().max()) / tau if x.numel() else 0.0
    return 16 * EPS32 * (spread + math.log(max(student.shape[-1], 2)) + 1.0)


GRAD_REL = {torch.float32: 2e-5, torch.bfloat16: 2.0**-7, torch.float64: 1e-12}
"""A gradient's tolerance relative to its largest entry (bfloat16: its own rounding)."""


def check(value: Tensor, grads: tuple[Tensor | None, Tensor | None], want: tuple[Tensor, Tensor, Tensor, Tensor],
          dtype: torch.dtype, atol: float, upstream: float = 1.0) -> None:
    """The values (``+inf`` exactly where the reference's, no NaN) and both gradients (no NaN;
    on the finite rows, within ``GRAD_REL`` of their scale: the largest entry, or the
    ``upstream`` gradient over the temperature, whichever is larger) against
    ``reference``'s."""
    ref, ref_s, ref_t, finite = want
    assert not value.isnan().any() and torch.equal(torch.isfinite(value), finite)
    torch.testing.assert_close(value.double()[finite], ref[finite], rtol=0, atol=atol)
    for got, w in zip(grads, (ref_s, ref_t)):
        assert got is not None and got.dtype == dtype and not got.isnan().any()
        rel = GRAD_REL[dtype]
        scale = max(float(w[finite].abs().max()) if finite.any() else 0.0, upstream)
        torch.testing.assert_close(got.double()[finite], w[finite], rtol=rel, atol=rel * scale)
