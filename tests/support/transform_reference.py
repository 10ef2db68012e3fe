"""Float64 references of what models do to their logits, written out from the formulas:
``softcap * tanh(x / softcap)``, the padded vocabulary's ids ``>= vocab_size`` removed
from the softmax, and one temperature per row; and random inputs that exercise them."""

import math

import torch
from torch import Tensor


def distribution(
    logits: Tensor, tau: float | Tensor, softcap: float | None, vocab_size: int | None
) -> Tensor:
    """``[T, V]`` float64 log-probs of the softmax the options define (-inf at padded
    ids), differentiable w.r.t. ``logits``."""
    x = logits.double()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    if isinstance(tau, Tensor):
        x = x / tau.double()[:, None]
    else:
        x = x / tau
    if vocab_size is not None:
        keep = torch.arange(x.shape[1]) < vocab_size
        x = torch.where(keep, x, -math.inf)
    return torch.log_softmax(x, -1)


def entropy(log_p: Tensor) -> Tensor:
    """``-sum p log p``, 0 at ids of probability 0 (no ``0 * -inf``, in the gradient too)."""
    counts = log_p > -math.inf
    safe = torch.where(counts, log_p, 0.0)
    return -torch.where(counts, safe.exp() * safe, 0.0).sum(-1)


def inputs(t: int, v: int, seed: int, vocab_size: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Logits of a large spread (the cap bites), targets inside the distribution, and
    per-row temperatures."""
    gen = torch.Generator().manual_seed(seed)
    logits = 20 * torch.randn(t, v, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab_size or v, (t,), generator=gen)
    taus = 0.5 + torch.rand(t, generator=gen, dtype=torch.float64) * 1.5
    return logits, targets, taus
