"""One call of a single-process driver (tests/support/drivers.py) against its float64 reference
(tests/support/reference.py): values, the gradients of its inputs and the caller's tensors
untouched (``check``); ``check_logits`` and ``check_linear`` are its logits-path and
LM-head-path forms."""

import torch
from torch import Tensor

from .drivers import HIDDEN, LOGITS, Driver
from .reference import EPS32, grad_atol, grad_close, head_reference, identity_grad_atol, tolerance, value_atol

LOGITS_GRAD_REL = {torch.float32: 16 * EPS32, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-5}
"""Given logits: the gradient's relative tolerance by dtype (the values are computed in
float32 or float64 from the exact inputs: ``tolerance`` for every dtype)."""
HEAD_REL = {
    torch.float32: (64 * EPS32, 1e-5), torch.bfloat16: (2.0**-7, 3e-2),
    torch.float16: (2.0**-9, 1e-2), torch.float64: (1e-12, 1e-10),
}
"""Given a head: (values, gradients) relative tolerances by dtype; a bfloat16 or float16
head rounds its logits to that dtype (and so does the reference)."""


def check(
    driver: Driver,
    x: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    weight: Tensor | None = None,
    *,
    value_rel: float | None = None,
    grad_rel: float | None = None,
) -> None:
    """``driver`` on logits ``x`` (``weight`` None) or the head ``x @ weight.T`` (the
    hidden path) against
    ``head_reference``: values, the gradients of x and of the weight the driver
    multiplies by (the identity's too), their dtypes, and x and weight untouched.
    Tolerances by the input's form and dtype (``LOGITS_GRAD_REL``, ``HEAD_REL``) unless
    given."""
    gen = torch.Generator().manual_seed(1)
    t = x.shape[0]
    g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    inputs = (x, weight) if weight is not None else (x,)
    before = [(a.detach().clone(), a._version) for a in inputs]
    h = x.detach().requires_grad_(True)
    head = driver.head(x, weight)
    w = None if head is None else head.detach().requires_grad_(True)
    logp, entropy = driver.both(h, targets, w, temperature=temperature, chunk_size=chunk_size)
    out = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert logp.dtype == entropy.dtype == out and logp.shape == entropy.shape == (t,)
    torch.autograd.backward((logp * g_lp.to(out)).sum() + (entropy * g_h.to(out)).sum())
    ref_lp, ref_h, ref_dx, ref_dw = head_reference(x, weight, targets, temperature, g_lp, g_h)
    assert h.grad is not None and h.grad.dtype == x.dtype
    assert w is None or w.grad is not None and w.grad.dtype == x.dtype
    if weight is None:
        rel = LOGITS_GRAD_REL[x.dtype] if grad_rel is None else grad_rel
        atol = tolerance(x, temperature)
        dx_atol = grad_atol(ref_dx, g_lp, g_h, temperature, rel)
        torch.testing.assert_close(h.grad.double(), ref_dx, rtol=rel, atol=dx_atol)
        if w is not None:  # the identity head
            assert w.grad is not None
            dw_atol = identity_grad_atol(x, dx_atol, rel, ref_dw)
            torch.testing.assert_close(w.grad.double(), ref_dw, rtol=rel, atol=dw_atol)
    else:
        v_rel, g_rel = HEAD_REL[x.dtype]
        atol = value_atol(x, weight, temperature, v_rel if value_rel is None else value_rel)
        assert w is not None
        grad_close(h.grad, ref_dx, g_rel if grad_rel is None else grad_rel)
        grad_close(w.grad, ref_dw, g_rel if grad_rel is None else grad_rel)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=0.0, atol=atol)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=0.0, atol=atol)
    for a, (copy, version) in zip(inputs, before):
        assert torch.equal(a, copy) and a._version == version


def check_logits(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    grad_rtol: float = 16 * EPS32,
) -> None:
    """``check`` of the logits path given logits."""
    check(LOGITS, logits, targets, temperature, chunk_size, grad_rel=grad_rtol)


def check_linear(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    value_rel: float = 64 * EPS32,
    grad_rel: float = 1e-5,
) -> None:
    """``check`` of the hidden-state path given a head."""
    check(HIDDEN, hidden, targets, temperature, chunk_size, weight, value_rel=value_rel, grad_rel=grad_rel)
