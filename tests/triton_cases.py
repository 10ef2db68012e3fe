"""What tests/vocabulary/test_triton.py (the interpreter) and tests/vocabulary/test_triton_cuda.py (a GPU)
share: the float64 reference, the logits, the softmax options, and the launches seen."""

import math
from typing import Any

import torch
from torch import Tensor

from cpslice._probe import Seen


def launched(seen: Seen, since: int = 0) -> set[str]:
    """The Triton kernels launched among ``seen``'s events from the ``since``-th on (a
    fallback to another backend shows as none)."""
    return {e.name for e in seen.events[since:] if e.kind == "launch" and e.backend == "triton"}


def reference(x: Tensor, ids: Tensor, temperature: float | Tensor, softcap: float | None, vocab: int | None,
               g_lp: Tensor, g_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 (log p at ``ids`` ``[T, k]``, H, d(g_lp . log p + g_h . H)/dx), ``g_lp`` ``[T, k]``."""
    assert g_lp.shape == ids.shape
    x64 = x.detach().double()
    # a -inf logit 1e4 below the row's smallest finite one: the same distribution, no 0 * inf
    finite = torch.where(torch.isfinite(x64), x64, math.inf).amin(1, keepdim=True)
    x64 = torch.where(x64 == -math.inf, finite - 1e4, x64).requires_grad_()
    y = x64[:, : vocab or x.shape[1]]
    if softcap is not None:
        y = torch.tanh(y / softcap) * softcap
    tau = temperature.double()[:, None] if isinstance(temperature, Tensor) else temperature
    logp = torch.log_softmax(y / tau, -1)
    lp = logp.gather(1, ids)
    h = -(logp.exp() * logp).sum(1)
    ((lp * g_lp.double()).sum() + (h * g_h.double()).sum()).backward()  # type: ignore[no-untyped-call]
    assert x64.grad is not None
    return lp.detach(), h.detach(), x64.grad


def logits(t: int, v: int, dtype: torch.dtype, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, v, generator=gen) * 4
    x[1, :300] = -math.inf  # a whole block of masked tokens
    x[2, v - 1] += 30.0  # a peaked row
    return x.to(dtype)


OPTIONS: list[dict[str, Any]] = [
    {},
    {"temperature": 0.7},
    {"temperature": "per-row"},
    {"softcap": 20.0},
    {"softcap": 20.0, "temperature": 1.3, "vocab_size": 650},
    {"vocab_size": 600},
    {"with_entropy": False},
    {"entropy_grad": False},
]
