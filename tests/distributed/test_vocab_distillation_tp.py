"""``cpslice.response_vocab_distillation`` on real gloo groups: a world of 4 ranks as CP 2 x
TP 2 (TP groups ``[0, 1]`` and ``[2, 3]``, CP rank ``rank // 2``), each rank holding its
CP rank's zigzag rows and its TP rank's vocabulary shard of both models' logits. Every
kind's shares equal the float64 full-vocabulary reference composed per sample, each
rank's gradients (student and teacher) the reference's columns of its shard at its rows;
the CP ranks' shares together are every response token; ``"forward"`` and ``"reverse"``
enter exactly one all-gather of ``[5, T]`` in the TP group, ``"jsd"`` two, backward none,
a CP rank holding no response included; invariant mode gives the bits of one process
without CP or TP."""

import math
from typing import Any

import torch
from torch import Tensor

from cpslice import Layout, _probe, pack, response_vocab_distillation, shard_responses

from ..support._dist import run_distributed, tp_groups
from ..support.divergence_cases import KINDS, divergence64, value_atol

V_LOCAL = 128  # invariant mode's tile: a TP shard holds whole tiles
TOTAL, RESPONSE = [10, 3, 13], [4, 0, 6]
EMPTY = [8, 1], [1, 0]
"""A batch whose one response token sits on CP rank 0: rank 1 holds none (of ``TOTAL``'s,
rank 0 holds none)."""


def _samples(total: list[int], seed: int) -> tuple[list[Tensor], list[Tensor]]:
    """Each sample's whole ``[L_i, 2 V_LOCAL]`` float64 logits, student's and teacher's, -inf
    on either side in a response row of sample 2 (within one shard each)."""
    gen = torch.Generator().manual_seed(seed)
    student = [torch.randn(n, 2 * V_LOCAL, generator=gen, dtype=torch.float64) * 3 for n in total]
    teacher = [torch.randn(n, 2 * V_LOCAL, generator=gen, dtype=torch.float64) * 3 for n in total]
    if len(total) > 2:
        student[2][9, 200] = -math.inf  # reverse: the student's mass is elsewhere; forward: +inf
        teacher[2][10, 5] = -math.inf
    return student, teacher


def _reference(student: list[Tensor], teacher: list[Tensor], total: list[int], response: list[int], kind: str,
               beta: float, tau: float) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per sample the float64 divergence of its response rows and the gradients of its sum
    (the rows of infinite divergence weighted 0) w.r.t. both whole ``[L_i, V]`` logits."""
    divs, s_grads, t_grads = [], [], []
    for n, r, s, t in zip(total, response, student, teacher):
        rows = slice(n - r - 1, n - 1)
        div = divergence64(s[rows], t[rows], kind, beta, temperature=tau)
        s_, t_ = (x.clone().requires_grad_(True) for x in (s, t))
        finite = torch.isfinite(div)
        low = [torch.where(x.isinf(), torch.full_like(x, -1e4), x) for x in (s_, t_)]  # no autograd 0 * inf
        again = divergence64(low[0][rows], low[1][rows], kind, beta, temperature=tau)
        gs, gt = torch.autograd.grad((again * finite).sum(), (s_, t_))
        divs.append(div)
        s_grads.append(gs)
        t_grads.append(gt)
    return divs, s_grads, t_grads


def _collectives(seen: _probe.Seen, since: int) -> list[tuple[str, int]]:
    return [(e.name, e.elements) for e in seen.of("collective")[since:]]


def _cases(group: Any, cp_rank: int, tp_rank: int, seen: _probe.Seen) -> int:
    cols = slice(tp_rank * V_LOCAL, (tp_rank + 1) * V_LOCAL)
    done = 0
    for (kind, beta), (total, response) in zip(KINDS, [(TOTAL, RESPONSE)] * 4 + [EMPTY]):
        student, teacher = _samples(total, 50 + done)
        layout = Layout(total, response, cp_mode="zigzag", cp_rank=cp_rank, cp_size=2)
        s = pack([x[:, cols] for x in student], layout).float().requires_grad_(True)
        t = pack([x[:, cols] for x in teacher], layout).float().requires_grad_(True)
        n0 = len(seen.of("collective"))
        got = response_vocab_distillation(s, t, layout, kind=kind, beta=beta, temperature=0.8, tp_group=group,
                                          chunk_size=2)
        rows = s.shape[0]
        jsd = kind == "jsd" and 0 < beta < 1
        want_calls = [("all_gather", 4 * rows), ("all_gather", 2 * rows)] if jsd else [("all_gather", 5 * rows)]
        assert _collectives(seen, n0) == want_calls, (kind, beta, _collectives(seen, n0))
        divs, s_grads, t_grads = _reference(student, teacher, total, response, kind, beta, 0.8)
        want = shard_responses(divs, layout)
        finite = [torch.isfinite(w) for w in want]
        torch.autograd.backward(sum(((x * f).sum() for x, f in zip(got, finite)), (s.sum() + t.sum()) * 0))
        assert len(seen.of("collective")) == n0 + len(want_calls), "backward enters none"
        for x, y in zip(got, want):
            assert x.grad_fn is not None and torch.equal(torch.isfinite(x), torch.isfinite(y)), (kind, x, y)
            atol = value_atol(torch.cat(student), torch.cat(teacher), 0.8)
            torch.testing.assert_close(x.double()[torch.isfinite(y)], y[torch.isfinite(y)], rtol=0, atol=atol)
        for grad, ref in ((s.grad, s_grads), (t.grad, t_grads)):
            assert grad is not None and not grad.isnan().any()
            expected = pack([g[:, cols] for g in ref], layout)
            torch.testing.assert_close(grad.double(), expected, rtol=0, atol=3e-5)
        assert [x.numel() for x in got] == [y.numel() for y in want]  # TOTAL: CP rank 0 holds none
        done += 1
    return done


def _invariant(group: Any, cp_rank: int, tp_rank: int) -> int:
    """Invariant mode: each share and this shard's gradient rows are the bits of one
    process holding the whole batch, no CP and no TP (bfloat16, a cap, a padded vocabulary)."""
    cols = slice(tp_rank * V_LOCAL, (tp_rank + 1) * V_LOCAL)
    student, teacher = ([x.to(torch.bfloat16) for x in side] for side in _samples(TOTAL, 60))
    opts: dict[str, Any] = {"kind": "jsd", "beta": 0.3, "softcap": 20.0, "vocab_size": 250, "invariant": True}
    layout = Layout(TOTAL, RESPONSE, cp_mode="zigzag", cp_rank=cp_rank, cp_size=2)
    s = pack([x[:, cols] for x in student], layout).requires_grad_(True)
    t = pack([x[:, cols] for x in teacher], layout).requires_grad_(True)
    got = response_vocab_distillation(s, t, layout, tp_group=group, **opts)
    torch.autograd.backward(sum((x.sum() for x in got), (s.sum() + t.sum()) * 0))
    whole = Layout(TOTAL, RESPONSE)
    one_s = pack(student, whole).requires_grad_(True)
    one_t = pack(teacher, whole).requires_grad_(True)
    one = response_vocab_distillation(one_s, one_t, whole, chunk_size=1, **opts)
    torch.autograd.backward(sum((x.sum() for x in one), (one_s.sum() + one_t.sum()) * 0))
    for x, y in zip(got, shard_responses([y.detach() for y in one], layout)):
        assert torch.equal(x.detach(), y)
    assert s.grad is not None and t.grad is not None and one_s.grad is not None and one_t.grad is not None
    for mine, whole_grad in ((s.grad, one_s.grad), (t.grad, one_t.grad)):  # each sample's rows, laid out here
        assert torch.equal(mine, pack([g[:, cols] for g in torch.split(whole_grad, TOTAL)], layout))
    return 1


def _worker(rank: int, world: int) -> int:
    group = tp_groups(rank, world)[1][0]  # the TP pair of this rank
    with _probe.watch() as seen:
        return _cases(group, rank // 2, rank % 2, seen) + _invariant(group, rank // 2, rank % 2)


def test_cp_2_by_tp_2_on_gloo() -> None:
    assert run_distributed(_worker, 4, timeout=240) == [len(KINDS) + 1] * 4
