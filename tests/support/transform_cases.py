"""Soft-capping, a padded vocabulary and per-row temperatures on tensor-parallel gloo
ranks (run by tests/vocabulary/test_transforms.py through ``run_distributed``). With ``V_local`` 5:
at TP 4 the vocabulary of 20 rows holds 13 ids (shard 2 holds 3 of them, shard 3 only
padded rows); at TP 2, 10 rows hold 6 ids (shard 1 holds one). Every rank gets the
float64 reference's values and its shard's columns (rows) of the gradient, zero at
the padded ids."""

from typing import Any

import torch

from cpslice import log_probs_and_entropy, log_probs_and_entropy_from_hidden, topk_log_probs

from . import transform_reference as ref
from ._dist import tp_groups

V_LOCAL = 5
ROWS = 6


def _cases(group: Any, tp: int, rank: int) -> int:
    total = tp * V_LOCAL
    vocab = 13 if tp == 4 else 6
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    logits, targets, taus = ref.inputs(ROWS, total, 70 + tp, vocab)
    opts: dict[str, Any] = {"temperature": taus, "softcap": 6.0, "vocab_size": vocab, "tp_group": group}
    full = ref.distribution(logits.clone(), taus, 6.0, vocab)
    done = 0
    for path, dtype in (("logits", torch.float32), ("logits", torch.bfloat16),
                        ("hidden", torch.float64), ("hidden", torch.bfloat16)):
        low = dtype == torch.bfloat16
        base = logits.to(dtype).double() if low else logits  # what a bfloat16 rank holds
        x64 = base.clone().requires_grad_(True)
        want = ref.distribution(x64, taus, 6.0, vocab)
        want_lp, want_h = want.gather(1, targets[:, None])[:, 0], ref.entropy(want)
        (want_g,) = torch.autograd.grad(want_lp.sum() + want_h.sum(), x64)
        if path == "logits":
            x = base[:, cols].to(dtype).requires_grad_(True)
            lp, h = log_probs_and_entropy(x, targets, with_entropy=True, chunk_size=2, **opts)
            (g,) = torch.autograd.grad(lp.sum() + h.sum(), x)
            got_g, expect = g, want_g[:, cols]
        else:  # hidden = the logits, weight = this shard's rows of the identity
            hidden = base.to(dtype).requires_grad_(True)
            weight = torch.eye(total, dtype=dtype)[cols].clone().requires_grad_(True)
            lp, h = log_probs_and_entropy_from_hidden(hidden, weight, targets, with_entropy=True, chunk_size=2, **opts)
            g_h, g_w = torch.autograd.grad(lp.sum() + h.sum(), (hidden, weight))
            # the full hidden gradient
            torch.testing.assert_close(g_h.double(), want_g, rtol=0, atol=2.0**-6 if low else 1e-10)
            got_g, expect = g_w, (want_g.T @ base)[cols]  # d weight = G.T @ hidden
        atol = 1e-10 if lp.dtype == torch.float64 else 2e-4
        torch.testing.assert_close(lp.double(), want_lp.detach(), rtol=0, atol=atol)
        torch.testing.assert_close(h.double(), want_h.detach(), rtol=0, atol=atol)
        # a bfloat16 gradient is rounded once (2^-9 of its size; d weight sums T rows)
        scale = float(expect.abs().max()) * 2.0**-6 if low else atol * 10
        torch.testing.assert_close(got_g.double(), expect, rtol=0, atol=scale)
        padded = range(max(0, vocab - rank * V_LOCAL), V_LOCAL)
        assert all(bool((got_g[:, j] == 0).all()) if path == "logits" else bool((got_g[j] == 0).all())
                   for j in padded), "the padded ids get zero gradient"
        done += 1
    values, ids = topk_log_probs(logits[:, cols].float(), 4, chunk_size=2, **opts)
    want_v, want_ids = torch.topk(full, 4)
    assert torch.equal(ids, want_ids) and bool((ids < vocab).all())
    torch.testing.assert_close(values.double(), want_v.detach(), rtol=0, atol=2e-4)
    return done + 2


def tp_worker(rank: int, world: int) -> list[tuple[int, int]]:
    return [(tp, _cases(group, tp, tp_rank)) for group, tp, tp_rank in tp_groups(rank, world)]
