"""Float64 references for distillation, written out from the formulas (no cpslice code):
log-probs at ids and the teacher's top-k from a full ``log_softmax``, and the top-k
divergence from probabilities (``1 - sum`` for the tail bin, ``p log(p / q)``)."""

import math
from typing import Any

import torch
from torch import Tensor

FLOOR = torch.finfo(torch.float64).eps  # the tail bin's mass is floored here (as cpslice)


def log_probs_at(logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
    return torch.log_softmax(logits.double() / temperature, -1).gather(1, ids)


def categories(log_probs: Tensor, tail: str, rest: Tensor | None = None, floor: float = FLOOR) -> Tensor:
    """Probabilities of the categories of ``[..., k]`` log-probs; the tail bin's mass is
    ``1 - sum(p)``, or the sum of ``rest``'s probabilities (the other ids') where given,
    at least ``floor`` (the compute dtype's epsilon)."""
    p = torch.exp(log_probs)
    if tail == "renormalize":
        return p / p.sum(-1, keepdim=True)
    mass = 1.0 - p.sum(-1, keepdim=True) if rest is None else torch.exp(rest).sum(-1, keepdim=True)
    return torch.cat([p, torch.clamp(mass, min=floor)], -1)


def kl(p: Tensor, q: Tensor) -> Tensor:
    safe_p = torch.where(p > 0, p, 1.0)
    safe_q = torch.where(p > 0, q, 1.0)
    return torch.where(p > 0, p * torch.log(safe_p / safe_q), 0.0).sum(-1)


def divergence(
    student: Tensor, teacher: Tensor, kind: str, beta: float, tail: str,
    student_rest: Tensor | None = None, teacher_rest: Tensor | None = None, floor: float = FLOOR,
) -> Tensor:
    q = categories(student, tail, student_rest, floor)
    p = categories(teacher, tail, teacher_rest, floor)
    if kind == "forward":
        return kl(p, q)
    if kind == "reverse":
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


def peaked_logits(t: int, v: int, gen: torch.Generator, scale: float = 3.0, peak: float = 30.0) -> Tensor:
    """Random logits, a few rows sure of one id (the top-k then hold almost all the mass)."""
    x = scale * torch.randn(t, v, generator=gen, dtype=torch.float64)
    for row in range(0, t, 4):
        x[row, row % v] += peak
    return x


def teacher_top_k(logits: Tensor, k: int, temperature: float) -> tuple[Tensor, Tensor]:
    return torch.topk(torch.log_softmax(logits.double() / temperature, -1), k)


def check_divergence(got: Tensor, want: Tensor, atol: float = 1e-9) -> None:
    assert bool(torch.isfinite(got).all()), got
    torch.testing.assert_close(got.double(), want, rtol=1e-7, atol=atol)


def spread_ids(t: int, k: int, vocab: int, gen: torch.Generator) -> Tensor:
    """``[t, k]`` ids over every shard, some repeated within a row."""
    ids = torch.randint(0, vocab, (t, k), generator=gen)
    if k > 1 and t:
        ids[:, -1] = ids[:, 0]  # a repeat in every row
    return ids


def grad_close(got: Any, want: Tensor, rel: float) -> None:
    assert got is not None
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    torch.testing.assert_close(got.double(), want, rtol=0.0, atol=rel * scale)


def entropy_free_tolerance(logits: Tensor, temperature: float) -> float:
    """A few float32 roundings at the scale of the tempered logits."""
    x = logits[torch.isfinite(logits)]
    spread = float(x.abs().max()) / temperature if x.numel() else 0.0
    return 8 * 2.0**-24 * (spread + math.log(max(logits.shape[-1], 2)) + 1.0)
