"""``cpslice.response_vocab_distillation`` on one process: every rank's shares over random
layouts (CP none, zigzag and allgather, thd and bshd, padded samples, empty responses,
single tokens, samples shorter than ``2 * cp_size``, ranks holding nothing) against the
float64 definitions composed sample by sample, values and both logits' gradients;
invariant mode's bits across layouts, CP ranks and chunking; only the response rows
computed; a shared prefix's prompt row computed once; the refusals. TP 2 (with CP 2) on
gloo is tests/distributed/test_vocab_distillation_tp.py."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import cpslice
from cpslice import LayoutError, _probe, response_vocab_distillation, vocab_divergence
from tests.support.checked import refused

from ..support.divergence_cases import divergence64
from ..support.oracle import Config, local_length
from ..support.oracle import rows as oracle_rows
from ..support.oracle import shares as oracle_shares
from ..support.stars import Stars
from ..support.strategies import configs

V = 11
KINDS: list[tuple[str, float]] = [("forward", 0.5), ("reverse", 0.5), ("jsd", 0.4), ("jsd", 1.0)]


def _logits(total: tuple[int, ...], seed: int) -> tuple[list[Tensor], list[Tensor]]:
    """Each sample's whole ``[L_i, V]`` float64 logits, the student's and the teacher's."""
    gen = torch.Generator().manual_seed(seed)
    student = [torch.randn(n, V, generator=gen, dtype=torch.float64) * 2 for n in total]
    teacher = [torch.randn(n, V, generator=gen, dtype=torch.float64) * 2 for n in total]
    return student, teacher


def _reference(student: list[Tensor], teacher: list[Tensor], cfg: Config, kind: str, beta: float,
               tau: list[float], weights: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per sample the divergence ``[R_i]`` of the rows predicting its response tokens
    (``[L_i - R_i - 1, L_i - 1)``), and d(sum w * div) w.r.t. both ``[L_i, V]`` logits."""
    divs, s_grads, t_grads = [], [], []
    for n, r, s, t, w, temp in zip(cfg.total, cfg.response, student, teacher, weights, tau):
        s, t = s.clone().requires_grad_(True), t.clone().requires_grad_(True)
        div = divergence64(s[n - r - 1 : n - 1], t[n - r - 1 : n - 1], kind, beta, temperature=temp)
        gs, gt = torch.autograd.grad((w * div).sum(), (s, t))
        divs.append(div.detach())
        s_grads.append(gs)
        t_grads.append(gt)
    return divs, s_grads, t_grads


def _local(per_sample: list[Tensor], cfg: Config, rank: int) -> Tensor:
    """The oracle's local ``[T, V]`` tensor of the rank (zeros for a layout of no samples)."""
    if not per_sample:
        return torch.zeros(local_length(cfg), V, dtype=torch.float64)
    return oracle_rows(per_sample, cfg, rank)


@settings(max_examples=14, deadline=None)
@given(configs(max_cp=4), st.sampled_from(KINDS), st.booleans(), st.sampled_from([None, 1, 3]), st.integers(0, 2**16))
def test_every_rank_of_random_layouts_against_float64(cfg: Config, kind_beta: tuple[str, float], per_sample: bool,
                                                      chunk: int | None, seed: int) -> None:
    """Every rank's shares are the float64 divergence of the rows predicting its response
    tokens, its gradients (the student's and the teacher's) the reference's at its rows
    and 0 elsewhere; every share, an empty one too, is in the graph; the ranks' shares are
    disjoint and cover every response token; the caller's tensors are left unchanged."""
    kind, beta = kind_beta
    student, teacher = _logits(cfg.total, seed)
    tau = [0.6 + 0.3 * i for i in range(len(cfg.total))] if per_sample else [0.8] * len(cfg.total)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [torch.randn(r, generator=gen, dtype=torch.float64) for r in cfg.response]
    divs, s_grads, t_grads = _reference(student, teacher, cfg, kind, beta, tau, weights)
    covered = [torch.zeros(r, dtype=torch.bool) for r in cfg.response]
    for rank in range(cfg.cp):
        layout = cfg.layout(rank).with_local_length(local_length(cfg))
        s = _local(student, cfg, rank).requires_grad_(True)
        t = _local(teacher, cfg, rank).requires_grad_(True)
        before = (s.detach().clone(), t.detach().clone())
        got = response_vocab_distillation(s, t, layout, kind=kind, beta=beta,  # type: ignore[arg-type]
                                          temperature=tau if per_sample else 0.8, chunk_size=chunk)
        assert torch.equal(s, before[0]) and torch.equal(t, before[1])
        want = oracle_shares(divs, cfg, rank)
        assert len(got) == len(cfg.total) and [x.shape for x in got] == [x.shape for x in want]
        for x, y in zip(got, want):
            assert x.grad_fn is not None, "every share, an empty one too, is in the graph"
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
        loss = sum(((w * x).sum() for w, x in zip(oracle_shares(weights, cfg, rank), got)), (s.sum() + t.sum()) * 0)
        gs, gt = torch.autograd.grad(loss, (s, t))
        torch.testing.assert_close(gs, _local(s_grads, cfg, rank), rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(gt, _local(t_grads, cfg, rank), rtol=1e-9, atol=1e-10)
        for i, share in enumerate(oracle_shares([torch.arange(r) for r in cfg.response], cfg, rank)):
            assert not bool(covered[i][share].any()), "the ranks' shares are disjoint"
            covered[i][share] = True
    assert all(bool(c.all()) for c in covered), "their union is every response token"


@pytest.mark.parametrize(("kind", "beta"), KINDS[:3])
def test_invariant_bits_whatever_the_layout(kind: str, beta: float) -> None:
    """``invariant=True``: each response token's divergence and its rows' gradients are the
    same bits without CP, on either zigzag CP rank (chunks of 1 row), and from
    ``vocab_divergence`` of that token's row alone; bfloat16 logits, a cap, a padded
    vocabulary and a temperature per sample."""
    total, response = (9, 5, 12), (4, 0, 6)
    gen = torch.Generator().manual_seed(3)
    student = [(torch.randn(n, 300, generator=gen) * 3).bfloat16() for n in total]
    teacher = [(torch.randn(n, 300, generator=gen) * 3).bfloat16() for n in total]
    opts: dict[str, Any] = {"kind": kind, "beta": beta, "softcap": 20.0, "vocab_size": 290, "invariant": True,
                            "temperature": [0.7, 1.0, 1.3]}
    per_token: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}
    layouts = [cpslice.Layout(total, response)] + [
        cpslice.Layout(total, response, cp_mode="zigzag", cp_rank=r, cp_size=2) for r in (0, 1)]
    for n_layout, layout in enumerate(layouts):
        s = cpslice.pack(student, layout).requires_grad_(True)
        t = cpslice.pack(teacher, layout).requires_grad_(True)
        got = response_vocab_distillation(s, t, layout, chunk_size=1 if n_layout else None, **opts)
        torch.autograd.backward(sum((x.sum() for x in got), s.sum() * 0))
        assert s.grad is not None and t.grad is not None
        rows = cpslice.response_rows(layout).rows
        positions = cpslice.position_ids(layout)
        k = 0
        for i, share in enumerate(got):
            for value in share:
                row = int(rows[k])
                key = (i, int(positions[row]))
                mine = (value.detach(), s.grad[row], t.grad[row])
                if key in per_token:
                    assert all(torch.equal(a, b) for a, b in zip(mine, per_token[key])), key
                per_token[key] = mine
                k += 1
    assert len(per_token) == sum(response)
    for (i, p), (value, grad_s, grad_t) in list(per_token.items())[::3]:
        s = student[i][p : p + 1].clone().requires_grad_(True)
        t = teacher[i][p : p + 1].clone().requires_grad_(True)
        one = vocab_divergence(s, t, kind=kind, beta=beta, softcap=20.0, vocab_size=290, invariant=True,  # type: ignore[arg-type]
                               temperature=opts["temperature"][i])
        one.sum().backward()  # type: ignore[no-untyped-call]
        assert torch.equal(one[0], value) and s.grad is not None and t.grad is not None
        assert torch.equal(s.grad[0], grad_s) and torch.equal(t.grad[0], grad_t)


@pytest.mark.parametrize("kind", ["forward", "jsd"])
def test_only_the_response_rows_are_computed(kind: str, seen: _probe.Seen) -> None:
    """Each pass's kernels are given the response rows alone, as an index (no copy of
    either side selects them): a long prompt is never read, its gradient rows are 0."""
    layout = cpslice.Layout([40, 6], [3, 2])
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(46, 8, generator=gen, requires_grad=True)
    t = torch.randn(46, 8, generator=gen, requires_grad=True)
    div = response_vocab_distillation(s, t, layout, kind=kind, chunk_size=2)  # type: ignore[arg-type]
    torch.autograd.backward(sum((d.sum() for d in div), s.sum() * 0))
    asked = [e.index.tolist() if e.index is not None else None for e in seen.of("call")]
    passes = 3 if kind == "jsd" else 2
    assert asked == [[36, 37, 38, 43, 44]] * passes, asked  # stats (mix), grad: the response rows
    for grad in (s.grad, t.grad):
        assert grad is not None and not grad[:36].any() and not grad[39:43].any() and not grad[45:].any()


def test_a_shared_prompt_row_is_computed_once_for_its_branches() -> None:
    """A star (docs/layouts.md's: a prompt of 3, branches of 2, 4 and 3 tokens): the
    prompt's last row predicts each branch's first token, its divergence each branch's
    and its gradient the sum of theirs; the rows computed are the distinct ones."""
    layout = Stars((3,), (3,), (2, 4, 3)).layout(0)
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(12, V, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randn(12, V, generator=gen, dtype=torch.float64)
    with _probe.watch() as seen:
        got = response_vocab_distillation(s, t, layout, kind="reverse", temperature=0.9)
    assert [e.index.tolist() for e in seen.of("call") if e.index is not None] == [[2, 3, 5, 6, 7, 9, 10]]
    rows = [2, 3, 2, 5, 6, 7, 2, 9, 10]  # response_rows(layout): row 2 three times
    want = divergence64(s.detach(), t, "reverse", 0.5, temperature=0.9)
    torch.testing.assert_close(torch.cat(got), want[rows], rtol=1e-12, atol=1e-12)
    w = torch.randn(9, generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad((torch.cat(got) * w).sum(), s)
    x = s.detach().clone().requires_grad_(True)
    (want_grad,) = torch.autograd.grad((divergence64(x, t, "reverse", 0.5, temperature=0.9)[rows] * w).sum(), x)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_a_rank_holding_no_response_gets_empty_shares_in_the_graph() -> None:
    """Zigzag CP 2 where rank 1 holds only prompt rows: aligned empty shares, views in
    the graph, zero gradients; a layout of no samples likewise."""
    layout = cpslice.Layout([8, 1], [1, 0], cp_mode="zigzag", cp_rank=1, cp_size=2)  # row 6: rank 0's
    t_local = cpslice.pack([torch.zeros(8), torch.zeros(1)], layout).shape[0]
    s = torch.randn(t_local, V, requires_grad=True)
    got = response_vocab_distillation(s, torch.randn(t_local, V), layout, kind="jsd")
    assert [x.shape[0] for x in got] == [0, 0] and all(x.grad_fn is not None for x in got)
    torch.autograd.backward(sum((x.sum() for x in got), s.sum() * 0))
    assert s.grad is not None and not s.grad.any()
    assert response_vocab_distillation(torch.zeros(0, V), torch.zeros(0, V), cpslice.Layout([], [])) == []


def _call(**change: Any) -> None:
    layout = cpslice.Layout([5, 4], [2, 1])
    call: dict[str, Any] = {"logits": torch.zeros(9, 6), "teacher_logits": torch.zeros(9, 6), "layout": layout}
    call.update(change)
    response_vocab_distillation(call.pop("logits"), call.pop("teacher_logits"), call.pop("layout"), **call)


REFUSALS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"logits": [[0.0]]}, TypeError, r"logits must be a torch.Tensor \[T, V_local\]"),
    ({"teacher_logits": "t"}, TypeError, r"teacher_logits must be a torch.Tensor \[T, V_local\]"),
    ({"teacher_logits": torch.zeros(9, 6, dtype=torch.int64)}, TypeError, "teacher_logits has dtype torch.int64"),
    ({"logits": torch.zeros(3, 3, 6)}, LayoutError, r"logits has shape \(3, 3, 6\); it must be 2-D .*logits.reshape"),
    ({"teacher_logits": torch.zeros(9, 5)}, LayoutError,
     r"logits has shape \(9, 6\) but teacher_logits has \(9, 5\): both are"),
    ({"teacher_logits": torch.zeros(9, 6, device="meta")}, LayoutError, "teacher_logits is on meta but logits on cpu"),
    ({"logits": torch.zeros(8, 6), "teacher_logits": torch.zeros(8, 6)}, LayoutError,
     "logits has length 8, which is too short"),
    ({"kind": "kl"}, LayoutError, "kind='kl' is not one of 'forward'"),
    ({"kind": "jsd", "beta": 1.5}, LayoutError,
     r"beta=1.5 is not allowed: the mixture weight of jsd must be in \[0, 1\]"),
    ({"temperature": [1.0]}, LayoutError, "temperature"),
    ({"vocab_size": 7}, LayoutError, "vocab_size=7 is not allowed"),
    ({"chunk_size": 0}, LayoutError, "chunk_size=0"),
]


@pytest.mark.parametrize(("change", "error", "match"), REFUSALS, ids=lambda c: str(c)[:40])
def test_refusals_name_the_argument(change: dict[str, Any], error: type[Exception], match: str) -> None:
    with refused(error, match):
        _call(**change)


def test_a_masked_logit_on_either_side_adds_nothing() -> None:
    """A -inf logit (a probability of 0) on either side, in a response row: the per-sample
    shares equal ``vocab_divergence`` of the rows (+inf where the forward KL's teacher has
    mass the student excludes), no NaN in the gradients of a loss that masks that token."""
    layout = cpslice.Layout([4, 3], [2, 2])
    gen = torch.Generator().manual_seed(9)
    s, t = torch.randn(7, V, generator=gen), torch.randn(7, V, generator=gen)
    s[1, 3] = -math.inf  # row 1 predicts sample 0's first response token
    t[5, 4] = -math.inf
    s_ = s.clone().requires_grad_(True)
    got = response_vocab_distillation(s_, t, layout)
    want = vocab_divergence(s, t)
    assert torch.equal(torch.cat(got), want[[1, 2, 4, 5]]) and got[0][0] == math.inf
    torch.autograd.backward(got[0][1:].sum() + got[1].sum())
    assert s_.grad is not None and not s_.grad.isnan().any() and not s_.grad[1].any()
