"""``cpslice verify``'s support check: the same batch, each response token restricted to
a random top-p / top-k set (``Support.from_responses``), against float64.

The reference masks each sample's whole logits to the token's set plus its target and
takes ``log_softmax``; the entropy is that of the restricted distribution
(``entropy_over="support"``). Log-probs, entropy and the logits' gradient are compared
in the rank's own layout (no redistribution): the expected shares and gradient rows
are read from ``_verify_oracle``'s position-by-position reading of the layout, as in
the main check, never from the code under check.
"""

import random
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from . import _verify_oracle as oracle
from ._layout import Layout
from ._pack import pack
from ._response import response_log_probs
from ._support import Support

if TYPE_CHECKING:
    from ._verify import Batch, Case, Config, Errors

MAX_SET = 4
"""Each response token keeps 0 to ``MAX_SET`` random ids (0: unrestricted)."""


def response_sets(batch: "Batch", vocab: int, seed: int) -> list[list[list[int]]]:
    """Per sample, per response token, the kept ids: some empty, some a single id,
    some holding the target, some not."""
    rng = random.Random(seed)
    return [
        [rng.sample(range(vocab), rng.randint(0, min(MAX_SET, vocab))) for _ in range(r)]
        for r in batch.response
    ]


def reference(
    batch: "Batch", sets: list[list[list[int]]], temperature: float
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per sample, float64: restricted log-probs and entropy ``[R_i]``, and the gradient
    ``[L_i, V]`` of ``sum w_lp * lp + w_ent * ent``."""
    ref_lp, ref_ent, ref_grad = [], [], []
    for i, (t, r) in enumerate(zip(batch.total, batch.response)):
        x = batch.logits[i].double().requires_grad_()
        z = (x / temperature)[t - r - 1 : t - 1]
        targets = batch.tokens[i][t - r :]
        keep = torch.ones(z.shape, dtype=torch.bool)
        for k, kept in enumerate(sets[i]):
            if kept:
                keep[k] = False
                keep[k, kept + [int(targets[k])]] = True
        logq = torch.log_softmax(z.masked_fill(~keep, -torch.inf), -1)
        lp = logq.gather(1, targets[:, None])[:, 0]
        ent = -torch.where(keep, logq.exp() * torch.where(keep, logq, 0.0), 0.0).sum(-1)
        loss = (batch.w_lp[i].double() * lp).sum() + (batch.w_ent[i].double() * ent).sum()
        (grad,) = torch.autograd.grad(loss, x)
        ref_lp.append(lp.detach())
        ref_ent.append(ent.detach())
        ref_grad.append(grad)
    return ref_lp, ref_ent, ref_grad


def check_support_batch(
    case: "Case", batch: "Batch", config: "Config", tp_rank: int, tp_group: dist.ProcessGroup
) -> "Errors":
    """This rank's errors for the batch under per-token sets, in the case's layout.

    Collectives: the TP all-gather of ``response_log_probs``; every rank enters it.
    """
    from ._verify import CHUNK_ROWS, TEMPERATURE, VOCAB_PER_RANK, Errors, _max_error, _weighted

    seq = max(batch.total) + 1 if case.fmt == "bshd" else None
    layout = Layout.from_parallel_state(
        batch.total, batch.response, qkv_format=case.fmt, max_seq_len=seq,
        allgather_cp=case.mode == "allgather", align=case.align,
    )
    length = oracle.least_length(
        batch.total, case.mode, case.fmt, seq, layout.cp_size, case.align
    ) + 1
    layout = layout.with_local_length(length)
    view = oracle.RankView(batch.total, batch.response, case.mode, case.fmt, seq,
                           layout.cp_rank, layout.cp_size, length, case.align)
    vocab = VOCAB_PER_RANK * config.tp_size
    sets = response_sets(batch, vocab, config.seed + 101)
    ref_lp, ref_ent, ref_grad = reference(batch, sets, TEMPERATURE)
    ids = [[j for kept in sample for j in kept] for sample in sets]
    offsets = [[0] for _ in sets]
    for off, sample in zip(offsets, sets):
        for kept in sample:
            off.append(off[-1] + len(kept))
    support = Support.from_responses(ids, offsets, layout)
    shard = slice(tp_rank * VOCAB_PER_RANK, (tp_rank + 1) * VOCAB_PER_RANK)
    logits = pack([x[:, shard] for x in batch.logits], layout).requires_grad_()
    lp, ent = response_log_probs(
        logits, batch.tokens, layout, with_entropy=True, temperature=TEMPERATURE,
        tp_group=tp_group, chunk_size=CHUNK_ROWS, support=support, entropy_over="support",
    )
    anchor = logits.sum() * 0  # a rank holding no response still runs backward
    loss = _weighted(oracle.shares(batch.w_lp, view), lp, anchor) + _weighted(
        oracle.shares(batch.w_ent, view), ent, anchor
    )
    (grad,) = torch.autograd.grad(loss, logits)
    want = oracle.rows([g[:, shard] for g in ref_grad], view)
    return Errors(
        _max_error(lp, oracle.shares(ref_lp, view)),
        _max_error(ent, oracle.shares(ref_ent, view)),
        _max_error([grad], [want]),
    )
