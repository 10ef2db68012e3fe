"""The methods the GPU command (``benchmarks/gpu_check.py``) times on the hidden-state path:
cpslice's, and its peers, each a ``Method`` that runs on ``(hidden [T, H], weight [V, H],
targets [T], mask)``.

Peers:

- **Liger's fused-linear cross-entropy** (``liger_kernel``'s Triton kernel,
  ``liger_fused_linear_cross_entropy``): log-prob only (the cross-entropy is its negative);
  where ``liger_kernel`` imports, on CUDA.
- **cut-cross-entropy** (``cut_cross_entropy.linear_cross_entropy``, its own Triton
  kernels, default gradient filtering): log-prob only; where it imports, on CUDA.
- **torch's materialized recipe**: ``logits = hidden @ weight.T`` (bfloat16), then
  ``log_softmax`` in float32, the target's log-prob and the entropy: holds ``[T, V]``
  float32 buffers (9.3 GiB each at the benchmark's size, several of them at once: fits
  an H100's and an H200's memory).
- **verl's chunked recipe** (``verl/utils/experimental/torch_functional.py``'s
  ``FusedLinearForPPO``, written out here, ``row_chunks``): 512-row chunks, each chunk's
  logits ``hidden[c] @ weight.T`` in the input dtype, made float32 for the softmax, the
  log-prob and entropy returned in the input dtype; backward recomputes each chunk's
  logits, forms its logit gradient in float32, rounds it to the input dtype and adds
  ``G @ weight`` into its rows of ``d hidden`` and ``G.T @ hidden[c]`` into ``d weight``,
  held in the input dtype across the chunks.

Liger and cut-cross-entropy return a summed cross-entropy, whose gradient is the
negative of the log-probs' (``Method.sign``); rows outside the mask take their
``ignore_index``. Their per-row values come from a second, ``reduction="none"`` call
that needs no gradient (the check step only).
"""

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

import cpslice

Out = tuple[Tensor | None, Tensor | None, Tensor | None]
"""What a method returns: the scalar backward runs from (None forward-only), the per-row
log-probs and the per-row entropy (None where it computes none)."""
Run = Callable[[Tensor, Tensor, Tensor, Tensor | None], Out]
"""A method's call on ``(hidden, weight, targets, mask)``: ``mask`` (``[T]`` of 0 and 1, or
None for every row) weighs each row's terms in the scalar."""
DEFAULT = "cpslice, log-prob + entropy"
"""The row of the goals' time and memory (the issue's "with entropy")."""
FORWARD = "cpslice, forward-only, log-prob + entropy"
INVARIANT = "cpslice invariant, log-prob + entropy"
CHUNK = 512
"""verl's rows per chunk (``FusedLinearForPPO(chunk_size=512)``)."""
IGNORE = -100
"""The target that Liger and cut-cross-entropy skip (their ``ignore_index``)."""


class Method(NamedTuple):
    """One method of the benchmark's table."""

    name: str
    run: Run
    entropy: bool
    """It computes the entropy (and its gradient)."""
    grad: bool = True
    """Forward and backward; False: forward only, under ``torch.no_grad()``."""
    sign: float = 1.0
    """The scalar's gradient is ``sign`` times that of ``sum(mask * (lp [+ H]))``."""
    needs_cuda: bool = False
    missing: str | None = None
    """Why it cannot run (a peer that does not import), None if it can."""
    cpslice: bool = False
    """One of cpslice's own (the goals' and the correctness checks')."""
    invariant: bool = False


def weighed(lp: Tensor, ent: Tensor | None, mask: Tensor | None) -> Tensor:
    """``sum(mask * (lp + H))`` (every row's weight 1 without ``mask``; no H without ``ent``)."""
    terms = lp.float() if ent is None else lp.float() + ent.float()
    return terms.sum() if mask is None else (terms * mask).sum()


def cpslice_method(name: str, entropy: bool, invariant: bool = False, grad: bool = True) -> Method:
    """``cpslice.log_probs_and_entropy_from_hidden`` (the backend ``auto`` picks)."""

    def run(x: Tensor, w: Tensor, targets: Tensor, mask: Tensor | None) -> Out:
        lp, ent = cpslice.log_probs_and_entropy_from_hidden(x, w, targets, with_entropy=entropy,
                                                            invariant=invariant)
        return (weighed(lp, ent, mask) if grad else None), lp, ent

    return Method(name, run, entropy, grad, cpslice=True, invariant=invariant)


def materialized(x: Tensor, w: Tensor, targets: Tensor, mask: Tensor | None) -> Out:
    """torch's recipe: the whole ``[T, V]`` logits, ``log_softmax`` in float32."""
    logp = torch.log_softmax((x @ w.t()).float(), -1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return (weighed(lp, ent, mask) if torch.is_grad_enabled() else None), lp, ent


def _chunk_terms(h: Tensor, w: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk's float32 logits, softmax, log-softmax and entropy (verl's forward step)."""
    logits = (h @ w.t()).float()
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    ent = torch.logsumexp(logits, -1) - (p * logits).sum(-1)
    return logits, p, logp, ent


class _RowChunks(torch.autograd.Function):
    """verl's chunked recipe as an autograd function: forward chunk by chunk, saving only
    the inputs; backward recomputes each chunk (``row_chunks``)."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        lp, ent = h.new_empty(h.shape[0]), h.new_empty(h.shape[0])
        for s in range(0, h.shape[0], CHUNK):
            _, _, logp, e = _chunk_terms(h[s : s + CHUNK], w, ids[s : s + CHUNK])
            lp[s : s + CHUNK] = logp.gather(1, ids[s : s + CHUNK, None])[:, 0]
            ent[s : s + CHUNK] = e
        ctx.save_for_backward(h, w, ids)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor, Tensor, None]:
        h, w, ids = ctx.saved_tensors
        dh, dw = torch.zeros_like(h), torch.zeros_like(w)
        for s in range(0, h.shape[0], CHUNK):
            hc, c = h[s : s + CHUNK], ids[s : s + CHUNK]
            _, p, logp, e = _chunk_terms(hc, w, c)
            g = torch.zeros_like(p)
            if g_lp is not None:
                g = g_lp[s : s + CHUNK, None].float() * (torch.zeros_like(p).scatter_(1, c[:, None], 1.0) - p)
            if g_ent is not None:
                g = g - g_ent[s : s + CHUNK, None].float() * p * (logp + e[:, None])
            gd = g.to(h.dtype)
            dh[s : s + CHUNK] = gd @ w
            dw += gd.t() @ hc
        return dh, dw, None


def row_chunks(x: Tensor, w: Tensor, targets: Tensor, mask: Tensor | None) -> Out:
    """verl's chunked recipe (``_RowChunks``): log-prob and entropy in the input dtype."""
    lp, ent = _RowChunks.apply(x, w, targets)  # type: ignore[no-untyped-call]
    return (weighed(lp, ent, mask) if torch.is_grad_enabled() else None), lp, ent


def _import(module: str, name: str) -> tuple[Callable[..., Tensor] | None, str | None]:
    """``module.name``, or None and why it cannot be had."""
    try:
        found: Callable[..., Tensor] = getattr(importlib.import_module(module), name)
    except Exception as error:  # an import may fail in any way (a Triton it does not know)
        first = str(error).splitlines()[0] if str(error) else ""
        return None, f"{module} does not import ({type(error).__name__}: {first[:100]})"
    return found, None


def cross_entropy_peer(name: str, module: str, function: str) -> Method:
    """A peer that returns the summed cross-entropy of ``(hidden, weight, targets)`` with
    ``reduction=`` and ``ignore_index=`` keywords (Liger's, cut-cross-entropy's)."""
    fn, missing = _import(module, function)

    def run(x: Tensor, w: Tensor, targets: Tensor, mask: Tensor | None) -> Out:
        assert fn is not None
        kept = targets if mask is None else torch.where(mask > 0, targets, IGNORE)
        loss = fn(x, w, kept, reduction="sum", ignore_index=IGNORE)
        if mask is None:
            return loss, None, None
        with torch.no_grad():  # the check step's per-row values
            lp = -fn(x.detach(), w.detach(), targets, reduction="none", ignore_index=IGNORE).float()
        return loss, lp, None

    return Method(name, run, False, sign=-1.0, needs_cuda=True, missing=missing)


def methods() -> list[Method]:
    """Every method of the table, in its order: cpslice's first (the goals'), then the peers."""
    return [
        cpslice_method(DEFAULT, True),
        cpslice_method("cpslice, log-prob only", False),
        cpslice_method(FORWARD, True, grad=False),
        cpslice_method(INVARIANT, True, invariant=True),
        cpslice_method("cpslice invariant, forward-only", True, invariant=True, grad=False),
        Method("torch materialized, log-prob + entropy", materialized, True),
        Method("torch materialized, forward-only", materialized, True, grad=False),
        Method("verl chunked, log-prob + entropy", row_chunks, True),
        Method("verl chunked, forward-only", row_chunks, True, grad=False),
        cross_entropy_peer("Liger fused-linear CE, log-prob only", "liger_kernel.transformers.functional",
                           "liger_fused_linear_cross_entropy"),
        cross_entropy_peer("cut-cross-entropy, log-prob only", "cut_cross_entropy", "linear_cross_entropy"),
    ]
