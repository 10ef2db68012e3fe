"""A random batch and its float64 single-process reference: per-sample logits over the
whole vocabulary, log-probs, entropy, and the gradient of a weighted loss."""

from dataclasses import dataclass

import torch
from torch import Tensor

from cpslice import Layout, pack
from cpslice._types import CpMode, QkvFormat
from cpslice._verify.batches import edge_lengths


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
