"""What tests/vocabulary/test_triton.py (the interpreter) and tests/vocabulary/test_triton_cuda.py (a GPU)
share, and the hidden-state path's tests/vocabulary/test_hidden_triton.py and test_hidden_cuda.py:
the float64 references (of logits, of a head), the logits, the softmax options, and the
launches seen."""

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from cpslice._probe import Seen
from cpslice._vocab.backends.triton.interpreter import interpreted

from .reference import grad_close, value_atol


def on_cuda(cpu_proof: str) -> pytest.MarkDecorator:
    """Skip, saying why, unless the Triton kernels run natively on a CUDA device here: not
    without one (``cpu_proof``: where the CPU proves the same), and not under Triton's
    interpreter (``TRITON_INTERPRET=1``, which tests/conftest.py sets by default), which
    would run them a program at a time on the host, far too slowly at a GPU's sizes."""
    if not torch.cuda.is_available():
        return pytest.mark.skipif(True, reason=f"no CUDA device: {cpu_proof}")
    return pytest.mark.skipif(interpreted(), reason=(
        "TRITON_INTERPRET=1 (the suite's default) would run the Triton kernels in the interpreter: run the "
        "CUDA tests natively with `make gpu-check` (or TRITON_INTERPRET=0 pytest <this module>)"))


def launched(seen: Seen, since: int = 0) -> set[str]:
    """The Triton kernels launched among ``seen``'s events from the ``since``-th on (a
    fallback to another backend shows as none)."""
    return {e.name for e in seen.events[since:] if e.kind == "launch" and e.backend == "triton"}


def _terms(x64: Tensor, ids: Tensor, temperature: float | Tensor, softcap: float | None, vocab: int | None,
           g_lp: Tensor, g_h: Tensor) -> tuple[Tensor, Tensor]:
    """float64 (log p at ``ids``, H) of the float64 logits ``x64`` (in the graph), and the
    backward of ``g_lp . log p + g_h . H`` through them."""
    assert g_lp.shape == ids.shape
    y = x64[:, : vocab or x64.shape[1]]
    if softcap is not None:
        y = torch.tanh(y / softcap) * softcap
    tau = temperature.double()[:, None] if isinstance(temperature, Tensor) else temperature
    logp = torch.log_softmax(y / tau, -1)
    lp = logp.gather(1, ids)
    h = -(logp.exp() * logp).sum(1)
    ((lp * g_lp.double()).sum() + (h * g_h.double()).sum()).backward()  # type: ignore[no-untyped-call]
    return lp.detach(), h.detach()


def reference(x: Tensor, ids: Tensor, temperature: float | Tensor, softcap: float | None, vocab: int | None,
               g_lp: Tensor, g_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 (log p at ``ids`` ``[T, k]``, H, d(g_lp . log p + g_h . H)/dx), ``g_lp`` ``[T, k]``."""
    x64 = x.detach().double()
    # a -inf logit 1e4 below the row's smallest finite one: the same distribution, no 0 * inf
    finite = torch.where(torch.isfinite(x64), x64, math.inf).amin(1, keepdim=True)
    x64 = torch.where(x64 == -math.inf, finite - 1e4, x64).requires_grad_()
    lp, h = _terms(x64, ids, temperature, softcap, vocab, g_lp, g_h)
    assert x64.grad is not None
    return lp, h, x64.grad


def hidden_reference(hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float | Tensor,
                     softcap: float | None, vocab: int | None, g_lp: Tensor,
                     g_h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``reference`` of the logits ``hidden @ weight.T`` (rounded to a bfloat16 or float16
    head's dtype, as its GEMM rounds them; the gradient passes the rounding unchanged):
    (log p at ``ids``, H, d/d hidden, d/d weight)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.T
    if hidden.dtype in (torch.bfloat16, torch.float16):
        logits = logits + (logits.to(hidden.dtype).double() - logits).detach()
    lp, ent = _terms(logits, ids, temperature, softcap, vocab, g_lp, g_h)
    assert h.grad is not None and w.grad is not None
    return lp, ent, h.grad, w.grad


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


def head(t: int, h: int, v: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor]:
    """``[t, h]`` hidden states and a ``[v, h]`` LM head of ``dtype``, a peaked row among them."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(t, h, generator=gen), torch.randn(v, h, generator=gen) / 2
    hidden[1] *= 8.0
    return hidden.to(dtype), weight.to(dtype)


def options(opts: dict[str, Any], t: int, device: str = "cpu") -> dict[str, Any]:
    """``opts`` with a per-row temperature made a ``[t]`` tensor on ``device``."""
    out = dict(opts)
    if out.get("temperature") == "per-row":
        out["temperature"] = torch.linspace(0.6, 1.4, t, device=device)
    return out


# the float64 tolerances of a head (tests/support/compare.py's HEAD_REL): the values' relative
# roundings at the logits' scale, the gradients' relative error
TOLERANCE = {torch.float32: (2.0**-18, 1e-5), torch.bfloat16: (2.0**-7, 3e-2)}


def close(hidden: Tensor, weight: Tensor, temperature: Any, got: tuple[Tensor | None, ...],
          want: tuple[Tensor, ...]) -> None:
    """Values (log-probs, entropy: the first of ``got`` that are not gradients) and the
    gradients w.r.t. hidden and weight (the last two) against their float64 ``want``."""
    v_rel, g_rel = TOLERANCE[hidden.dtype]
    tau = float(temperature.min()) if isinstance(temperature, Tensor) else float(temperature)
    atol = value_atol(hidden, weight, tau, v_rel)
    for g, w in zip(got[:-2], want[:-2]):
        assert g is not None
        torch.testing.assert_close(g.double(), w, rtol=0.0, atol=atol)
    for g, w in zip(got[-2:], want[-2:]):
        assert g is not None and g.dtype == hidden.dtype
        grad_close(g, w, g_rel)


Settings = tuple[object, ...]


def gemm_settings() -> Settings:
    """The settings a GEMM's bits depend on, as one reads them."""
    cuda = torch.backends.cuda.matmul
    return (cuda.allow_tf32, cuda.allow_bf16_reduced_precision_reduction, cuda.allow_fp16_reduced_precision_reduction,
            cuda.allow_fp16_accumulation, torch.get_float32_matmul_precision(),
            torch.backends.mkldnn.matmul.fp32_precision)  # type: ignore[attr-defined]  # untyped in torch


EXACT: Settings = (False, False, False, False, "highest", "ieee")
