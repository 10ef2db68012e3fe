"""One call of a single-process path against its float64 reference (tests/reference.py):
values, gradients and the caller's tensors untouched, for the logits path
(``check_logits``) and the LM-head path (``check_linear``)."""

import torch
from torch import Tensor

from cpslice import log_probs_and_entropy, log_probs_and_entropy_from_hidden

from .reference import EPS32, grad_atol, grad_close, linear_reference, reference, tolerance, value_atol


def check_logits(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    grad_rtol: float = 16 * EPS32,
) -> None:
    """Values and gradient of cpslice against the reference, and the caller's logits untouched."""
    torch.manual_seed(1)
    t = logits.shape[0]
    g_lp, g_h = torch.randn(t), torch.randn(t)
    before, version = logits.detach().clone(), logits._version
    x = logits.detach().requires_grad_(True)
    logp, entropy = log_probs_and_entropy(
        x, targets, with_entropy=True, temperature=temperature, chunk_size=chunk_size
    )
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    assert logp.dtype == entropy.dtype == out_dtype
    assert logp.shape == entropy.shape == (t,)
    torch.autograd.backward((logp * g_lp.to(out_dtype)).sum() + (entropy * g_h.to(out_dtype)).sum())
    ref_lp, ref_h, ref_grad = reference(logits, targets, temperature, g_lp, g_h)
    atol = tolerance(logits, temperature)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=0.0, atol=atol)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=0.0, atol=atol)
    assert x.grad is not None and x.grad.dtype == logits.dtype
    atol = grad_atol(ref_grad, g_lp, g_h, temperature, grad_rtol)
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=grad_rtol, atol=atol)
    assert torch.equal(logits, before) and logits._version == version


def check_linear(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    value_rel: float = 64 * EPS32,
    grad_rel: float = 1e-5,
) -> None:
    """Values and both gradients against the reference; the caller's tensors untouched."""
    gen = torch.Generator().manual_seed(1)
    t = hidden.shape[0]
    g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    before = (hidden.detach().clone(), weight.detach().clone())
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    logp, entropy = log_probs_and_entropy_from_hidden(
        h, w, targets, with_entropy=True, temperature=temperature, chunk_size=chunk_size
    )
    out = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    assert logp.dtype == entropy.dtype == out and logp.shape == entropy.shape == (t,)
    torch.autograd.backward((logp * g_lp.to(out)).sum() + (entropy * g_h.to(out)).sum())
    ref_lp, ref_h, ref_dh, ref_dw = linear_reference(hidden, weight, targets, temperature, g_lp, g_h)
    atol = value_atol(hidden, weight, temperature, value_rel)
    torch.testing.assert_close(logp.double(), ref_lp, rtol=0.0, atol=atol)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=0.0, atol=atol)
    assert h.grad is not None and w.grad is not None
    assert h.grad.dtype == w.grad.dtype == hidden.dtype
    grad_close(h.grad, ref_dh, grad_rel)
    grad_close(w.grad, ref_dw, grad_rel)
    assert torch.equal(hidden, before[0]) and torch.equal(weight, before[1])


