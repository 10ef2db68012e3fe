"""The distillation functions on tensor-parallel gloo ranks (run by tests/vocabulary/test_distill.py
through ``run_distributed``): every rank holds a shard of the same full logits (or LM-head
weight) and must get the same values as the float64 reference of the full vocabulary,
its shard's columns of the gradient, and enter exactly the documented collectives."""

from typing import Any

import torch

from cpslice import (
    Layout,
    _probe,
    log_probs_at,
    log_probs_at_from_hidden,
    pack,
    response_distillation,
    shard_responses,
    topk_log_probs,
    topk_log_probs_from_hidden,
)

from . import distill_reference as ref
from ._dist import tp_groups

V_LOCAL = 5
ROWS = 7


def _calls(seen: _probe.Seen) -> dict[str, int]:
    """The collectives ``seen`` so far, by name."""
    return {name: seen.count("collective", name=name) for name in ("all_gather", "all_reduce", "all_to_all_single")}


def _expect(seen: _probe.Seen, before: dict[str, int], gather: int, reduce: int) -> None:
    calls = _calls(seen)
    assert calls["all_gather"] - before["all_gather"] == gather, (calls, before)
    assert calls["all_reduce"] - before["all_reduce"] == reduce, (calls, before)
    assert calls["all_to_all_single"] == before["all_to_all_single"], (calls, before)


def _cases(group: Any, tp: int, rank: int, seen: _probe.Seen) -> int:
    vocab = tp * V_LOCAL
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    gen = torch.Generator().manual_seed(40 + tp)
    full = ref.peaked_logits(ROWS, vocab, gen)
    ids = ref.spread_ids(ROWS, 4, vocab, gen)
    g = torch.randn(ROWS, 4, generator=gen, dtype=torch.float64)
    done = 0

    # log_probs_at and topk_log_probs on the shards of the logits
    for name in ("at", "topk"):
        x = full[:, cols].float().requires_grad_(True)
        x64 = full.clone().requires_grad_(True)
        before = _calls(seen)
        if name == "at":
            got = log_probs_at(x, ids, temperature=0.9, tp_group=group, chunk_size=3)
            want = ref.log_probs_at(x64, ids, 0.9)
        else:
            got, top = topk_log_probs(x, 4, temperature=0.9, tp_group=group, chunk_size=3)
            want, want_ids = ref.teacher_top_k(x64, 4, 0.9)
            assert torch.equal(top, want_ids)
        _expect(seen, before, 1, 0)
        torch.autograd.backward([(got.double() * g).sum(), (want * g).sum()])
        _expect(seen, before, 1, 0)
        atol = ref.entropy_free_tolerance(full, 0.9)
        torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=atol)
        assert x64.grad is not None
        ref.grad_close(x.grad, x64.grad[:, cols], 32 * 2.0**-24)
        done += 1

    # the hidden-state forms: the full hidden gradient on every rank, the weight's shard
    h = torch.randn(ROWS, 3, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, 3, generator=gen, dtype=torch.float64)
    for name in ("at", "topk"):
        hid, shard = h.clone().requires_grad_(True), w[cols].clone().requires_grad_(True)
        h64, w64 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        before = _calls(seen)
        if name == "at":
            got = log_probs_at_from_hidden(hid, shard, ids, temperature=0.9, tp_group=group, chunk_size=2)
            want = ref.log_probs_at(h64 @ w64.T, ids, 0.9)
        else:
            got, top = topk_log_probs_from_hidden(hid, shard, 4, temperature=0.9, tp_group=group, chunk_size=2)
            want, want_ids = ref.teacher_top_k(h64 @ w64.T, 4, 0.9)
            assert torch.equal(top, want_ids)
        torch.autograd.backward([(got * g).sum(), (want * g).sum()])
        _expect(seen, before, 1, 1)
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
        assert w64.grad is not None and h64.grad is not None
        ref.grad_close(hid.grad, h64.grad, 1e-12)
        ref.grad_close(shard.grad, w64.grad[cols], 1e-12)
        done += 1

    # response_distillation in a CP layout where one of two CP ranks holds no response:
    # every TP rank of that CP rank still enters the all-gather
    total, response = [2, 1, 2], [1, 0, 1]
    samples = [ref.peaked_logits(n, vocab, gen) for n in total]
    teacher = [ref.teacher_top_k(ref.peaked_logits(r, vocab, gen), 3, 1.0) for r in response]
    lp, t_ids = [v for v, _ in teacher], [i for _, i in teacher]
    for cp_rank in (0, 1):
        layout = Layout(total, response, cp_mode="zigzag", cp_rank=cp_rank, cp_size=2)
        x = pack([s[:, cols] for s in samples], layout).float().requires_grad_(True)
        before = _calls(seen)
        div = response_distillation(x, lp, t_ids, layout, tp_group=group)
        torch.autograd.backward(sum((d.sum() for d in div), 0 * x.sum()))
        _expect(seen, before, 1, 0)
        whole = [
            ref.divergence(ref.log_probs_at(s[n - r - 1 : n - 1], i, 1.0), v, "forward", 0.5, "bin")
            for n, r, s, v, i in zip(total, response, samples, lp, t_ids)
        ]
        for a, b in zip(div, shard_responses(whole, layout)):
            torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5)
        holds = sum(d.numel() for d in div)
        assert holds == (0 if cp_rank == 1 else 2), holds
    return done + 1


def tp_worker(rank: int, world: int) -> list[tuple[int, int]]:
    with _probe.watch() as seen:
        return [(tp, _cases(group, tp, tp_rank, seen)) for group, tp, tp_rank in tp_groups(rank, world)]
