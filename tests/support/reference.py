"""float64 single-process references for the tests, and the tolerances of float32 and
lower precisions against them: log-probs, entropy and gradients of one logits tensor
(``reference``), of an LM head ``hidden @ weight.T`` (``linear_reference``), of both
restricted to token sets (``support_reference``, ``linear_support_reference``), each
for either input of tests/support/drivers.py (``head_reference``, ``head_support_reference``);
and a random packed batch with its reference (``make_batch``)."""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cpslice import Layout, pack
from cpslice._types import CpMode, QkvFormat

from .lengths import edge_lengths
from .token_sets import Sets

EPS32 = 2.0**-24  # float32 unit roundoff
TEMPS = (0.5, 1.0, 1.7)  # the temperatures the tests sweep


def reference(
    logits: Tensor, targets: Tensor, temperature: float, g_lp: Tensor, g_h: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p, H, d(g_lp . log p + g_h . H)/d logits) in float64 from log_softmax.

    A -inf logit becomes one 1e4 below the row's smallest finite logit: the same
    distribution in float64 (exp underflows to 0), without autograd's 0 * inf."""
    x = logits.detach().double()
    finite = torch.where(torch.isfinite(x), x, math.inf).amin(1, keepdim=True)
    x = torch.where(x == -math.inf, finite - 1e4, x).requires_grad_(True)
    lp = torch.log_softmax(x / temperature, -1)
    logp = lp.gather(1, targets[:, None]).squeeze(1)
    entropy = -(lp.exp() * lp).sum(-1)
    torch.autograd.backward((logp * g_lp.double()).sum() + (entropy * g_h.double()).sum())
    assert x.grad is not None
    return logp.detach(), entropy.detach(), x.grad


def tolerance(logits: Tensor, temperature: float) -> float:
    """A few float32 roundings at the scale of the tempered logits (their spread sets
    the magnitude of log p and of every intermediate); measured worst ~3."""
    x = logits.detach().double()
    x = x[torch.isfinite(x)]
    spread = float(x.abs().max()) / temperature if x.numel() else 0.0
    return 8 * EPS32 * (spread + math.log(max(logits.shape[-1], 2)) + 1.0)


def grad_atol(ref_grad: Tensor, g_lp: Tensor, g_h: Tensor, temperature: float, rel: float) -> float:
    """``rel`` times the gradient's scale: its largest entry, or the upstream gradient
    over the temperature, whichever is larger. Where p is close to 1, ``onehot - p``
    cancels, and float32 leaves an absolute error of a few eps times that scale."""
    upstream = max([float(g.abs().max()) for g in (g_lp, g_h) if g.numel()], default=0.0)
    largest = float(ref_grad.abs().max()) if ref_grad.numel() else 0.0
    return rel * max(largest, upstream / temperature)


def softmax64(
    z: Tensor, temperature: float | Tensor = 1.0, softcap: float | None = None, vocab_size: int | None = None,
    sets: Sets | None = None,
) -> Tensor:
    """``log p`` in float64 over the last dimension of ``[..., V]`` logits ``z``
    (differentiable, as ``z`` is): ``log_softmax(c tanh(z / c) / tau)`` over the ids
    ``[0, vocab_size)`` (``temperature`` a number, or a tensor of ``z``'s leading shape
    or flattened), each flattened row ``t`` with a non-empty ``sets[t]`` restricted to
    it (-inf elsewhere)."""
    y = z.double()[..., : vocab_size or z.shape[-1]]
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    y = y / (temperature.double().reshape(y.shape[:-1])[..., None] if isinstance(temperature, Tensor)
             else temperature)
    keep = torch.ones(y.shape, dtype=torch.bool)
    for t, s in enumerate(sets or []):
        if s:
            row = keep.view(-1, y.shape[-1])[t]
            row[:] = False
            row[s] = True
    return torch.log_softmax(y.masked_fill(~keep, -math.inf), -1)


def entropy64(
    z: Tensor, temperature: float | Tensor = 1.0, softcap: float | None = None, vocab_size: int | None = None,
    sets: Sets | None = None,
) -> Tensor:
    """The float64 entropy of ``softmax64``'s distribution, ``[...]`` (differentiable: 0
    log 0, outside a set or at a -inf logit, is 0, with no NaN in the gradient)."""
    log_p = softmax64(z, temperature, softcap, vocab_size, sets)
    finite = log_p > -math.inf
    return -torch.where(finite, log_p.exp() * torch.where(finite, log_p, 0.0), 0.0).sum(-1)


# --- the LM head: hidden @ weight.T


def linear_reference(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, g_lp: Tensor, g_h: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log p, H, d/d hidden, d/d weight) of ``g_lp . log p + g_h . H`` in float64.

    For bfloat16/float16 inputs the logits are rounded to that dtype, as the head's own
    matmul rounds them (the gradient passes the rounding unchanged, as it does there)."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    logits = h @ w.T
    if hidden.dtype in (torch.bfloat16, torch.float16):
        logits = logits + (logits.to(hidden.dtype).double() - logits).detach()
    lp = torch.log_softmax(logits / temperature, -1)
    logp = lp.gather(1, targets[:, None]).squeeze(1)
    entropy = -(lp.exp() * lp).sum(-1)
    torch.autograd.backward((logp * g_lp.double()).sum() + (entropy * g_h.double()).sum())
    assert h.grad is not None and w.grad is not None
    return logp.detach(), entropy.detach(), h.grad, w.grad


def value_atol(hidden: Tensor, weight: Tensor, temperature: float, rel: float) -> float:
    """``rel`` roundings at the scale of the tempered logits: a logit is a sum of H
    products, each at most max|h| * max|w|."""
    h, w = hidden.detach().double(), weight.detach().double()
    scale = float(h.abs().max()) * float(w.abs().max()) * h.shape[1] if h.numel() else 0.0
    return rel * (scale / temperature + math.log(max(weight.shape[0], 2)) + 1.0)


def grad_close(got: Tensor | None, want: Tensor, rel: float) -> None:
    """``got`` equals ``want`` to ``rel``, relative and of the larger of 1 and ``want``'s
    largest entry."""
    assert got is not None and got.shape == want.shape
    atol = rel * max(float(want.abs().max()) if want.numel() else 0.0, 1.0)
    torch.testing.assert_close(got.double(), want, rtol=rel, atol=atol)


def head_reference(
    x: Tensor, weight: Tensor | None, targets: Tensor, temperature: float, g_lp: Tensor, g_h: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log p, H, d/dx, d/d weight) in float64 for a driver's input (tests/support/drivers.py):
    ``linear_reference`` of a head; of logits (``weight`` None) ``reference``, whose
    logits gradient is x's, and the identity head's weight gradient ``dlogits.T @ x``."""
    if weight is not None:
        return linear_reference(x, weight, targets, temperature, g_lp, g_h)
    logp, entropy, grad = reference(x, targets, temperature, g_lp, g_h)
    return logp, entropy, grad, grad.T @ x.detach().double()


def identity_grad_atol(x: Tensor, grad_atol: float, rel: float, ref_dw: Tensor) -> float:
    """The identity head's weight gradient ``dlogits.T @ x`` to: each logits gradient
    entry's ``grad_atol`` carried through a column of ``x``, plus ``rel`` of its scale."""
    carried = float(x.detach().double().abs().sum(0).max()) if x.numel() else 0.0
    return grad_atol * carried + rel * (float(ref_dw.abs().max()) if ref_dw.numel() else 0.0)


# --- token sets (supports)


def support_reference(
    logits: Tensor, targets: Tensor, sets: Sets, temperature: float, over: str,
    g_lp: Tensor, g_h: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p, H, gradient) in float64: log_softmax of the logits masked (-inf) outside
    each non-empty set plus the target; H over the whole vocabulary or the same set.
    A -inf logit becomes one 1e4 below the row's smallest finite logit (as in
    ``reference``): the same distribution, without autograd's 0 * inf."""
    x = logits.detach().double()
    finite = torch.where(torch.isfinite(x), x, math.inf).amin(1, keepdim=True)
    x = torch.where(x == -math.inf, finite - 1e4, x).requires_grad_(True)
    keep = torch.ones(x.shape, dtype=torch.bool)
    for t, s in enumerate(sets):
        if s:
            keep[t] = False
            keep[t, s + [int(targets[t])]] = True
    z = x / temperature
    restricted = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)
    full = torch.log_softmax(z, -1)
    logp = restricted.gather(1, targets[:, None]).squeeze(1)
    # 0 * log 0 outside the set is 0: where() keeps the -inf out of the gradient
    inside = torch.where(keep, restricted.exp() * torch.where(keep, restricted, 0.0), 0.0)
    h = -(full.exp() * full).sum(-1) if over == "full" else -inside.sum(-1)
    torch.autograd.backward((logp * g_lp.double()).sum() + (h * g_h.double()).sum())
    assert x.grad is not None
    return logp.detach(), h.detach(), x.grad


def linear_support_reference(
    hidden: Tensor, weight: Tensor, targets: Tensor, sets: Sets, temperature: float, over: str,
    g_lp: Tensor, g_h: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``support_reference`` on the float64 logits (rounded to the inputs' dtype, as
    the head's matmul rounds them); its logit gradient carried to hidden and weight."""
    h, w = hidden.double(), weight.double()
    logits = h @ w.T
    if hidden.dtype != torch.float64:
        logits = logits.to(hidden.dtype).double()
    logp, ent, grad = support_reference(logits, targets, sets, temperature, over, g_lp, g_h)
    return logp, ent, grad @ w, grad.T @ h


def head_support_reference(
    x: Tensor, weight: Tensor | None, targets: Tensor, sets: Sets, temperature: float, over: str,
    g_lp: Tensor, g_h: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``head_reference`` restricted to the sets: ``linear_support_reference`` of a head;
    of logits ``support_reference`` and the identity head's ``dlogits.T @ x``."""
    if weight is not None:
        return linear_support_reference(x, weight, targets, sets, temperature, over, g_lp, g_h)
    logp, entropy, grad = support_reference(x, targets, sets, temperature, over, g_lp, g_h)
    return logp, entropy, grad, grad.T @ x.detach().double()


# --- a packed batch


@dataclass
class Batch:
    total: list[int]
    response: list[int]
    vocab: int
    temperature: float
    tokens: list[Tensor]  # [L_i] int64
    logits: list[Tensor]  # [L_i, V] float32 (what every rank packs)
    w_lp: list[Tensor]  # [R_i] loss weights of log-probs
    w_ent: list[Tensor]  # [R_i] loss weights of entropy
    masks: list[Tensor]  # [R_i] bool loss masks
    ref_lp: list[Tensor]  # [R_i] float64
    ref_ent: list[Tensor]  # [R_i] float64
    ref_grad: list[Tensor]  # [L_i, V] float64: d(sum w_lp*lp + w_ent*ent) / d logits


def make_batch(seed: int, n: int, cp: int, vocab: int, temperature: float = 0.8) -> Batch:
    """``n`` samples of ``edge_lengths`` at ``cp``: random tokens, logits, loss weights
    and masks, and their float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    total, response = edge_lengths(n, cp, seed)
    tokens = [torch.randint(0, vocab, (t,), generator=gen) for t in total]
    logits = [3 * torch.randn(t, vocab, generator=gen) for t in total]
    w_lp = [torch.randn(r, generator=gen, dtype=torch.float64) for r in response]
    w_ent = [torch.randn(r, generator=gen, dtype=torch.float64) for r in response]
    masks = [torch.rand(r, generator=gen) > 0.3 for r in response]
    ref_lp, ref_ent, ref_grad = [], [], []
    for t, r, tok, lg, a, b in zip(total, response, tokens, logits, w_lp, w_ent):
        x = lg.double().requires_grad_()
        logp = torch.log_softmax(x / temperature, -1)
        span = slice(t - r - 1, t - 1)
        lp = logp[span].gather(1, tok[t - r :, None])[:, 0]
        ent = -(logp[span].exp() * logp[span]).sum(-1)
        (grad,) = torch.autograd.grad((a * lp).sum() + (b * ent).sum(), x)
        ref_lp.append(lp.detach())
        ref_ent.append(ent.detach())
        ref_grad.append(grad)
    return Batch(total, response, vocab, temperature, tokens, logits, w_lp, w_ent, masks,
                 ref_lp, ref_ent, ref_grad)


def layout_for(batch: Batch, kind: str, cp_rank: int, cp_size: int) -> Layout:
    """kind: none-thd, none-bshd, zigzag-thd, zigzag-bshd, allgather."""
    mode: CpMode = "none" if kind.startswith("none") else (
        "allgather" if kind == "allgather" else "zigzag"
    )
    fmt: QkvFormat = "bshd" if kind.endswith("bshd") else "thd"
    seq = max(batch.total, default=1) + 1 if fmt == "bshd" else None
    layout = Layout(batch.total, batch.response, qkv_format=fmt, max_seq_len=seq,
                    cp_mode=mode, cp_rank=cp_rank, cp_size=cp_size)
    # fix T, so that every rank (and shard_responses) agrees on allgather's pieces
    return layout.with_local_length(pack([torch.zeros(t) for t in batch.total], layout).shape[0])
