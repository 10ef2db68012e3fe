"""Distillation without TP: ``log_probs_at``, ``topk_log_probs`` and their hidden-state
forms against a float64 ``log_softmax`` (values and gradients, k from 1 to V, repeated
ids, temperatures, dtypes, the compiled kernels); ``topk_divergence`` against the
formulas written out over probabilities for every kind x tail (rows whose top-k hold
almost all the mass, k = V, zero-probability categories, sums that round above 1);
``response_distillation`` over random layouts against the reference composed per
sample, values and gradients, with CP invariance; every refusal. The TP cases run on
spawned gloo ranks (``tests/support/distill_cases.py``)."""

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import cpslice
from cpslice import (
    LayoutError,
    _probe,
    log_probs_at,
    log_probs_at_from_hidden,
    response_distillation,
    response_distillation_from_hidden,
    topk_divergence,
    topk_log_probs,
    topk_log_probs_from_hidden,
)
from cpslice._types import compute_dtype
from cpslice._vocab import topk
from cpslice._vocab.backends import selection as backend

from ..support import distill_reference as ref
from ..support._dist import run_distributed
from ..support.checked import refused
from ..support.oracle import Config, local_length
from ..support.oracle import rows as oracle_rows
from ..support.oracle import shares as oracle_shares
from ..support.strategies import configs

KINDS = ("forward", "reverse", "jsd")
TAILS = ("bin", "renormalize")
EPS32 = 2.0**-24


@st.composite
def at_cases(draw: st.DrawFn) -> dict[str, Any]:
    t = draw(st.integers(0, 9))
    v = draw(st.integers(1, 12))
    k = draw(st.integers(1, v + 2))  # k > V is fine for given ids (repeats)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    return {
        "logits": ref.peaked_logits(t, v, gen),
        "ids": ref.spread_ids(t, k, v, gen),
        "g": torch.randn(t, k, generator=gen, dtype=torch.float64),
        "temperature": draw(st.sampled_from([0.6, 1.0, 1.7])),
        "chunk": draw(st.sampled_from([1, 3, None])),
    }


def _check_at(case: dict[str, Any], dtype: torch.dtype, rel: float) -> None:
    x = case["logits"].detach().to(dtype).requires_grad_(True)
    lp = log_probs_at(x, case["ids"], temperature=case["temperature"], chunk_size=case["chunk"])
    assert lp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lp.shape == case["ids"].shape
    (lp * case["g"].to(lp.dtype)).sum().backward()
    x64 = x.detach().double().requires_grad_(True)
    want = ref.log_probs_at(x64, case["ids"], case["temperature"])
    (want * case["g"]).sum().backward()
    assert x64.grad is not None
    atol = rel * ref.entropy_free_tolerance(x64.detach(), case["temperature"]) / (8 * EPS32)
    torch.testing.assert_close(lp.double(), want.detach(), rtol=0, atol=atol)
    ref.grad_close(x.grad, x64.grad, rel * 4)


@settings(max_examples=30, deadline=None)
@given(at_cases())
def test_log_probs_at_matches_float64_log_softmax(case: dict[str, Any]) -> None:
    _check_at(case, torch.float64, 1e-12)
    _check_at(case, torch.float32, 8 * EPS32)
    _check_at(case, torch.bfloat16, 2.0**-6)


@pytest.fixture
def compiled() -> Iterator[None]:
    """The compiled chunk kernels on (aot_eager: the plumbing, without a C++ compile)."""
    with backend.using("compiled", compiler="aot_eager"):
        yield


def test_log_probs_at_through_the_compiled_kernels(compiled: None, seen: _probe.Seen) -> None:
    gen = torch.Generator().manual_seed(5)
    for k in (1, 4):
        case = {"logits": ref.peaked_logits(11, 16, gen), "ids": ref.spread_ids(11, k, 16, gen),
                "g": torch.randn(11, k, generator=gen, dtype=torch.float64), "temperature": 0.8,
                "chunk": 4}
        _check_at(case, torch.float32, 8 * EPS32)
    # 11 rows in compiled chunks of 4, forward and backward; nothing eager
    assert {(e.name, e.rows) for e in seen.of("launch")} == {("chunk_stats", 4), ("chunk_grad", 4)}


@pytest.mark.parametrize("k", [1, 3, 12])
def test_topk_log_probs_is_torch_topk_of_the_log_softmax(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    full = ref.peaked_logits(9, 12, gen).requires_grad_(True)
    values, ids = topk_log_probs(full, k, temperature=0.7, chunk_size=2)
    want, want_ids = ref.teacher_top_k(full, k, 0.7)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
    torch.testing.assert_close(values, want, rtol=0, atol=1e-12)
    assert bool((values[:, :-1] >= values[:, 1:]).all()), "descending"
    g = torch.randn(9, k, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad((values * g).sum(), full)
    (expected,) = torch.autograd.grad((want * g).sum(), full)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_hidden_state_forms_equal_the_materialized_head() -> None:
    gen = torch.Generator().manual_seed(2)
    t, h, v = 13, 5, 11
    hidden = torch.randn(t, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = ref.spread_ids(t, 4, v, gen)
    g = torch.randn(t, 4, generator=gen, dtype=torch.float64)
    for chunk in (1, 3, None):
        lp = log_probs_at_from_hidden(hidden, weight, ids, temperature=0.8, chunk_size=chunk)
        want = ref.log_probs_at(hidden @ weight.T, ids, 0.8)
        torch.testing.assert_close(lp, want, rtol=0, atol=1e-12)
        got = torch.autograd.grad((lp * g).sum(), (hidden, weight))
        expected = torch.autograd.grad((want * g).sum(), (hidden, weight))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        values, top = topk_log_probs_from_hidden(hidden, weight, 4, temperature=0.8, chunk_size=chunk)
        want_v, want_ids = ref.teacher_top_k(hidden @ weight.T, 4, 0.8)
        assert torch.equal(top, want_ids)
        torch.testing.assert_close(values, want_v, rtol=0, atol=1e-12)
        got = torch.autograd.grad((values * g).sum(), (hidden, weight))
        expected = torch.autograd.grad((want_v * g).sum(), (hidden, weight))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _log_probs(t: int, v: int, gen: torch.Generator, peak: float = 0.0) -> Tensor:
    x = 2 * torch.randn(t, v, generator=gen, dtype=torch.float64)
    x[:, 0] += peak
    return torch.log_softmax(x, -1)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind", KINDS)
def test_divergence_matches_the_formulas_with_gradients(kind: str, tail: str) -> None:
    gen = torch.Generator().manual_seed(7)
    for k, peak in ((1, 0.0), (4, 0.0), (4, 25.0), (10, 0.0)):  # k = V: the tail is empty
        full_s, full_t = _log_probs(6, 10, gen, peak), _log_probs(6, 10, gen, peak)
        student = full_s[:, :k].clone().requires_grad_(True)
        teacher = full_t[:, :k].clone().requires_grad_(True)
        got = topk_divergence(student, teacher, kind=kind, beta=0.3, tail=tail)  # type: ignore[arg-type]
        want = ref.divergence(student, teacher, kind, 0.3, tail)
        # the tail's mass exactly: the other ids' probabilities (where 1 - sum loses digits)
        exact = ref.divergence(student, teacher, kind, 0.3, tail, full_s[:, k:], full_t[:, k:])
        ref.check_divergence(got, exact, atol=1e-12)
        g = torch.randn(6, generator=gen, dtype=torch.float64)
        grads = torch.autograd.grad((got * g).sum(), (student, teacher))
        # k = V: the tail is no mass at all (1 - sum(p) is rounding), so no gradient
        expected = torch.autograd.grad(((exact if k == 10 else want) * g).sum(), (student, teacher))
        # the reference's 1 - sum(p) of a tail of e^-25 keeps ~5 digits
        rtol = 1e-4 if peak else 1e-9
        for a, b in zip(grads, expected):
            assert bool(torch.isfinite(a).all())
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * 1e-3)


ENDS = ((0.0, "forward"), (1.0, "reverse"))


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize(("beta", "end"), ENDS)
def test_jsd_at_its_ends_is_forward_and_reverse(beta: float, end: str, tail: str) -> None:
    """``beta`` runs over [0, 1]: at 0 jsd is the forward KL, at 1 the reverse, as TRL's
    generalized JSD (the formula itself gives 0 there, one side being the mixture); the
    values and both gradients are the float64 reference's of that kind, and the same bits
    as the kind itself, whichever way ``beta`` is written. Rows with a category of
    probability 0 on the weighting side stay finite, with finite gradients."""
    gen = torch.Generator().manual_seed(5)
    for k, peak in ((1, 0.0), (4, 0.0), (4, 25.0), (10, 0.0)):
        full_s, full_t = _log_probs(6, 10, gen, peak), _log_probs(6, 10, gen, peak)
        student = full_s[:, :k].clone().requires_grad_(True)
        teacher = full_t[:, :k].clone().requires_grad_(True)
        got = topk_divergence(student, teacher, kind="jsd", beta=beta, tail=tail)  # type: ignore[arg-type]
        exact = ref.divergence(student, teacher, end, 0.5, tail, full_s[:, k:], full_t[:, k:])
        ref.check_divergence(got, exact, atol=1e-12)
        same = topk_divergence(student, teacher, kind=end, tail=tail)  # type: ignore[arg-type]
        assert torch.equal(got, same)
        for written in (int(beta), np.float32(beta)):
            assert torch.equal(topk_divergence(student, teacher, kind="jsd", beta=written, tail=tail), same)  # type: ignore[arg-type]
        g = torch.randn(6, generator=gen, dtype=torch.float64)
        grads = torch.autograd.grad((got * g).sum(), (student, teacher))
        want = ref.divergence(student, teacher, end, 0.5, tail)
        expected = torch.autograd.grad(((exact if k == 10 else want) * g).sum(), (student, teacher))
        rtol = 1e-4 if peak else 1e-9  # the reference's 1 - sum(p) of a tail of e^-25 keeps ~5 digits
        for a, b in zip(grads, expected):
            assert bool(torch.isfinite(a).all())
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * 1e-3)
    zero = torch.tensor([[0.0, -math.inf, -math.inf]])
    some = torch.log_softmax(torch.tensor([[1.0, 0.5, -1.0]]), -1)
    s_lp, t_lp = (some, zero) if end == "forward" else (zero, some)  # the zeros on the weighting side
    student, teacher = s_lp.clone().requires_grad_(True), t_lp.clone().requires_grad_(True)
    d = topk_divergence(student, teacher, kind="jsd", beta=beta, tail=tail)  # type: ignore[arg-type]
    torch.autograd.backward(d.sum())
    assert bool(torch.isfinite(d).all()) and all(bool(torch.isfinite(x.grad).all()) for x in (student, teacher)
                                                 if x.grad is not None)


@pytest.mark.parametrize(("beta", "end"), ENDS)
def test_response_distillation_takes_the_ends_of_beta(beta: float, end: str) -> None:
    """The per-sample forms at ``beta`` 0 and 1: the float64 reference of the forward and
    reverse KL composed per sample, values and the logits' gradient, on both heads."""
    gen = torch.Generator().manual_seed(9)
    layout = cpslice.Layout([8, 6, 1], [5, 3, 0])
    vocab = 7
    full = [ref.peaked_logits(n, vocab, gen, peak=3.0) for n in layout.total_lengths]
    top = [ref.teacher_top_k(ref.peaked_logits(r, vocab, gen, peak=3.0), 3, 1.0) for r in layout.response_lengths]
    lp, ids = [v for v, _ in top], [i for _, i in top]
    logits = torch.cat(full).requires_grad_(True)
    eye = torch.eye(vocab, dtype=torch.float64)
    for head in ("logits", "hidden"):
        x = logits if head == "logits" else logits.detach().clone().requires_grad_(True)
        call = (response_distillation(x, lp, ids, layout, kind="jsd", beta=beta, temperature=0.8) if head == "logits"
                else response_distillation_from_hidden(x, eye, lp, ids, layout, kind="jsd", beta=beta,
                                                       temperature=0.8))
        want_x = torch.cat(full).requires_grad_(True)
        want, start = [], 0
        for n, r, v, i in zip(layout.total_lengths, layout.response_lengths, lp, ids):
            want.append(ref.divergence(ref.log_probs_at(want_x[start + n - r - 1:start + n - 1], i, 0.8), v, end,
                                       0.5, "bin"))
            start += n
        for a, b in zip(call, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        w = torch.randn(sum(layout.response_lengths), generator=gen, dtype=torch.float64)
        (got,) = torch.autograd.grad((torch.cat(call) * w).sum(), x)
        (expected,) = torch.autograd.grad((torch.cat(want) * w).sum(), want_x)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_the_defaults_are_forward_bin_and_an_even_jsd() -> None:
    """The documented defaults, by value: ``kind="forward"``, ``tail="bin"``, and jsd's
    ``beta=0.5`` (the formula at 0.5, and not at another weight: these rows tell them
    apart), for ``topk_divergence`` and both per-sample forms."""
    gen = torch.Generator().manual_seed(11)
    student, teacher = _log_probs(5, 8, gen)[:, :3], _log_probs(5, 8, gen, 2.0)[:, :3]
    even = ref.divergence(student, teacher, "jsd", 0.5, "bin")
    ref.check_divergence(topk_divergence(student, teacher, kind="jsd"), even, atol=1e-12)
    assert not torch.allclose(ref.divergence(student, teacher, "jsd", 0.3, "bin"), even, atol=1e-3)
    ref.check_divergence(topk_divergence(student, teacher), ref.divergence(student, teacher, "forward", 0.5, "bin"),
                         atol=1e-12)
    layout = cpslice.Layout([8], [5])
    logits = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    lp, ids = [teacher], [torch.topk(teacher, 3).indices]
    eye = torch.eye(8, dtype=torch.float64)
    for kw in ({"kind": "jsd"}, {}):
        explicit = {"kind": "forward", "beta": 0.5, "tail": "bin", **kw}
        want = response_distillation(logits, lp, ids, layout, **explicit)  # type: ignore[arg-type]
        for got in (response_distillation(logits, lp, ids, layout, **kw),  # type: ignore[arg-type]
                    response_distillation_from_hidden(logits, eye, lp, ids, layout, **kw)):  # type: ignore[arg-type]
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
    other = response_distillation(logits, lp, ids, layout, kind="jsd", beta=0.3)
    assert not torch.allclose(other[0], response_distillation(logits, lp, ids, layout, kind="jsd")[0], atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_divergence_never_nan_at_zero_probability_and_rounding(kind: str) -> None:
    """A category of probability 0 (a -inf log-prob) adds 0 where it is the divergence's
    weighting side (the teacher's for forward, the student's for reverse, either for
    jsd); sums of exp that round above 1 floor the tail bin instead of a NaN log."""
    zero = torch.tensor([[0.0, -math.inf, -math.inf]])
    some = torch.log_softmax(torch.tensor([[1.0, 0.5, -1.0]]), -1)
    pairs = {"forward": [(some, zero)], "reverse": [(zero, some)], "jsd": [(some, zero), (zero, some)]}
    for s_lp, t_lp in pairs[kind] + [(zero, zero)]:
        for tail in TAILS:
            student, teacher = s_lp.clone().requires_grad_(True), t_lp.clone().requires_grad_(True)
            d = topk_divergence(student, teacher, kind=kind, tail=tail)  # type: ignore[arg-type]
            torch.autograd.backward(d.sum())
            assert bool(torch.isfinite(d).all()), (tail, d)
            for x in (student, teacher):
                assert x.grad is not None and not bool(x.grad.isnan().any()), (tail, x.grad)
    over = torch.log_softmax(torch.randn(64, 50), -1) + 2e-7  # sums of exp a bit above 1
    d = topk_divergence(over, over.flip(0), kind=kind)  # type: ignore[arg-type]
    assert bool(torch.isfinite(d).all()) and d.dtype == torch.float32
    same = topk_divergence(over, over, kind=kind)  # type: ignore[arg-type]
    torch.testing.assert_close(same, torch.zeros(64), rtol=0, atol=1e-5)


def _batch(cfg: Config, k: int, vocab: int, seed: int) -> dict[str, Any]:
    """Logits and teachers whose tails are not tiny (the reference's 1 - sum(p) keeps its
    digits; the tail's accuracy has tests of its own above)."""
    gen = torch.Generator().manual_seed(seed)
    full = [ref.peaked_logits(n, vocab, gen, peak=3.0) for n in cfg.total]
    teacher = [ref.teacher_top_k(ref.peaked_logits(r, vocab, gen, peak=3.0), k, 1.0) for r in cfg.response]
    weights = [torch.randn(r, generator=gen, dtype=torch.float64) for r in cfg.response]
    return {"full": full, "lp": [v for v, _ in teacher], "ids": [i for _, i in teacher], "w": weights}


def _reference(
    batch: dict[str, Any], cfg: Config, kind: str, tail: str, tau: float
) -> tuple[list[Tensor], list[Tensor]]:
    """Per sample, the divergence ``[R_i]`` and d(sum w * div)/d logits ``[L_i, V]``."""
    divs, grads = [], []
    for n, r, x, lp, ids, w in zip(cfg.total, cfg.response, batch["full"], batch["lp"], batch["ids"], batch["w"]):
        x = x.clone().requires_grad_(True)
        student = ref.log_probs_at(x[n - r - 1 : n - 1], ids, tau)
        div = ref.divergence(student, lp, kind, 0.4, tail)
        (grad,) = torch.autograd.grad((w * div).sum(), x)
        divs.append(div.detach())
        grads.append(grad)
    return divs, grads


def _rows(per_sample: list[Tensor], cfg: Config, rank: int, vocab: int) -> Tensor:
    """The oracle's local ``[T, V]`` tensor of the rank (zeros for a layout of no samples)."""
    if not per_sample:
        return torch.zeros(local_length(cfg), vocab, dtype=torch.float64)
    return oracle_rows(per_sample, cfg, rank)


@settings(max_examples=12, deadline=None)
@given(configs(max_cp=4), st.sampled_from(KINDS), st.sampled_from(TAILS), st.integers(1, 6))
def test_response_distillation_under_every_layout(cfg: Config, kind: str, tail: str, k: int) -> None:
    """Every rank's shares and gradient rows against the reference composed per sample
    (values read from the oracle's position-by-position layout); the shares of all ranks
    are the no-CP result; a rank that holds nothing returns empty shares in the graph."""
    vocab = 9
    batch = _batch(cfg, k, vocab, seed=len(cfg.total) + k)
    divs, grads = _reference(batch, cfg, kind, tail, 0.8)
    length = local_length(cfg)
    seen = [torch.zeros(r, dtype=torch.bool) for r in cfg.response]
    for rank in range(cfg.cp):
        layout = cfg.layout(rank).with_local_length(length)
        for path in ("logits", "hidden"):
            local = _rows(batch["full"], cfg, rank, vocab).requires_grad_(True)
            if path == "logits":
                got = response_distillation(local, batch["lp"], batch["ids"], layout, kind=kind,  # type: ignore[arg-type]
                                            beta=0.4, tail=tail, temperature=0.8, chunk_size=3)  # type: ignore[arg-type]
                leaf = local
            else:  # the identity head: logits = hidden @ I
                leaf = local
                got = response_distillation_from_hidden(
                    local, torch.eye(vocab, dtype=torch.float64), batch["lp"], batch["ids"], layout,
                    kind=kind, beta=0.4, tail=tail, temperature=0.8, chunk_size=3,  # type: ignore[arg-type]
                )
            want = oracle_shares(divs, cfg, rank)
            assert [x.shape for x in got] == [x.shape for x in want]
            for x, y in zip(got, want):
                assert x.grad_fn is not None, "every share, an empty one too, is in the graph"
                # float64, but the divergence of a row whose top-k holds nearly all the mass
                # cancels (log(1 - sum p)): a relative term as well (a share of 11.8 was
                # off by 1.03e-10 against the reference's formula)
                torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
            weights = oracle_shares(batch["w"], cfg, rank)
            loss = sum(((w * x).sum() for w, x in zip(weights, got)), 0 * leaf.sum())
            (grad,) = torch.autograd.grad(loss, leaf)
            torch.testing.assert_close(grad, _rows(grads, cfg, rank, vocab), rtol=0, atol=1e-10)
        for i, share in enumerate(oracle_shares([torch.arange(r) for r in cfg.response], cfg, rank)):
            assert not bool(seen[i][share].any()), "ranks' shares are disjoint"
            seen[i][share] = True
    assert all(bool(s.all()) for s in seen), "their union is every response token"


@settings(max_examples=10, deadline=None)
@given(configs(max_cp=4), st.integers(1, 4), st.booleans())
def test_the_teachers_per_sample_top_k_under_every_layout(cfg: Config, k: int, per_sample_tau: bool) -> None:
    """response_topk_log_probs (and its hidden-state twin): every rank's ``[r_i, k]``
    shares are the float64 top-k of each response token's log-softmax (values and ids),
    the gradient reaches the response rows only, an empty share is in the graph."""
    vocab = 9
    gen = torch.Generator().manual_seed(len(cfg.total) * 7 + k)
    full = [ref.peaked_logits(n, vocab, gen, peak=3.0) for n in cfg.total]
    taus = [0.5 + 0.25 * i for i in range(len(cfg.total))]
    temperature: Any = taus if per_sample_tau else 0.8
    want_v, want_g = [], []
    for n, r, x, tau in zip(cfg.total, cfg.response, full, taus):
        x64 = x.clone().requires_grad_(True)
        top = torch.topk(torch.log_softmax(x64 / (tau if per_sample_tau else 0.8), -1)[n - r - 1 : n - 1], k)
        want_v.append(top)
        (g,) = torch.autograd.grad(top.values.sum(), x64) if r else (torch.zeros_like(x),)
        want_g.append(g)
    length = local_length(cfg)
    for rank in range(cfg.cp):
        layout = cfg.layout(rank).with_local_length(length)
        for path in ("logits", "hidden"):
            local = _rows(full, cfg, rank, vocab).requires_grad_(True)
            if path == "logits":
                values, ids = cpslice.response_topk_log_probs(local, k, layout, temperature=temperature, chunk_size=3)
            else:
                values, ids = cpslice.response_topk_log_probs_from_hidden(
                    local, torch.eye(vocab, dtype=torch.float64), k, layout, temperature=temperature, chunk_size=3)
            want = oracle_shares([t.values for t in want_v], cfg, rank)
            want_ids = oracle_shares([t.indices for t in want_v], cfg, rank)
            assert [v.shape for v in values] == [w.shape for w in want] == [i.shape for i in ids]
            for v, w, i, wi in zip(values, want, ids, want_ids):
                assert v.grad_fn is not None and i.dtype == torch.int64
                torch.testing.assert_close(v, w, rtol=0, atol=1e-10)
                assert torch.equal(i, wi)
            (grad,) = torch.autograd.grad(sum((v.sum() for v in values), 0 * local.sum()), local)
            torch.testing.assert_close(grad, _rows(want_g, cfg, rank, vocab) * _held(cfg, rank, length), rtol=0,
                                       atol=1e-10)


def _held(cfg: Config, rank: int, length: int) -> Tensor:
    """``[T, 1]``: 1 at this rank's response rows (the gradient of the others is 0)."""
    rows = cpslice.response_rows(cfg.layout(rank).with_local_length(length)).rows
    out = torch.zeros(length, 1, dtype=torch.float64)
    out[rows] = 1.0
    return out


def test_the_teachers_top_k_refusals() -> None:
    # no rows at all (a rank that holds nothing): [0, k], not a reshape error
    nothing = (topk_log_probs(torch.zeros(0, 5), 2),
               topk_log_probs_from_hidden(torch.zeros(0, 3), torch.zeros(5, 3), 2))
    for got in nothing:
        assert [x.shape for x in got] == [(0, 2), (0, 2)]
    layout = cpslice.Layout([5, 4], [2, 1])
    with refused(LayoutError, r"k=7 is larger than the vocabulary: 6 ids"):
        cpslice.response_topk_log_probs(torch.zeros(9, 6), 7, layout)
    with refused(LayoutError, r"logits has length 8 but the layout|the layout needs at least 9"):
        cpslice.response_topk_log_probs(torch.zeros(8, 6), 2, layout)
    with refused(LayoutError, r"k=0 is not allowed"):
        cpslice.response_topk_log_probs_from_hidden(torch.zeros(9, 3), torch.zeros(6, 3), 0, layout)


def test_only_the_response_rows_are_computed() -> None:
    """The dense kernels are given the response rows alone, as an index (no copy of the
    logits selects them): a long prompt is never read."""
    layout = cpslice.Layout([40, 6], [3, 2])
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(46, 8, generator=gen, requires_grad=True)
    lp, ids = topk_log_probs(torch.randn(5, 8, generator=gen), 2)
    with _probe.watch() as seen:
        div = response_distillation(logits, [lp[:3], lp[3:]], [ids[:3], ids[3:]], layout, chunk_size=2)
        torch.autograd.backward(sum((d.sum() for d in div), 0 * logits.sum()))
    asked = [list(range(e.rows)) if e.index is None else e.index.tolist() for e in seen.of("call")]
    assert asked == [[36, 37, 38, 43, 44]] * 2, asked  # forward and backward: the response rows
    assert logits.grad is not None and float(logits.grad[:36].abs().sum()) == 0.0


GOOD = torch.zeros(3, 4)
IDS = torch.tensor([[0, 1], [2, 3], [1, 1]])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: log_probs_at(GOOD, IDS.int()), TypeError, r"ids has dtype torch.int32; pass int64"),
        (lambda: log_probs_at(GOOD, [[0]]), TypeError, r"ids must be a torch.Tensor \[T, k\]"),  # type: ignore[arg-type]
        (lambda: log_probs_at(GOOD, IDS[:, 0]), LayoutError, r"ids has shape \(3,\) .* must be \[T, k\]"),
        (lambda: log_probs_at(GOOD, IDS[:2]), LayoutError, r"ids has shape \(2, 2\) but logits has 3 rows"),
        (lambda: log_probs_at(GOOD, IDS[:, :0]), LayoutError, r"k >= 1 token ids per row"),
        (lambda: log_probs_at(GOOD, IDS + 3), LayoutError,
         r"ids\[0, 1\] = 4 is outside the vocabulary \[0, 4\) \(5 such ids\)"),
        (lambda: log_probs_at(GOOD.long(), IDS), TypeError, "logits has dtype torch.int64"),
        (lambda: topk_log_probs(GOOD, 5), LayoutError, r"k=5 is larger than the vocabulary: 4 ids"),
        (lambda: topk_log_probs(GOOD, 0), LayoutError, r"k=0 is not allowed: it must be >= 1"),
        (lambda: topk_log_probs(GOOD, 1.5), TypeError, r"k 1.5 is a float, not an int"),  # type: ignore[arg-type]
        (lambda: log_probs_at_from_hidden(GOOD, GOOD, IDS.double()), TypeError, "ids has dtype torch.float64"),
        (lambda: topk_log_probs_from_hidden(GOOD, GOOD, 9), LayoutError, "k=9 is larger than the vocabulary"),
        (lambda: topk_divergence(GOOD, GOOD[:, :3]), LayoutError,
         r"student has shape \(3, 4\) but teacher has \(3, 3\)"),
        (lambda: topk_divergence(GOOD, GOOD, kind="kl"), LayoutError, r"kind='kl' is not one of 'forward'"),  # type: ignore[arg-type]
        (lambda: topk_divergence(GOOD, GOOD, tail="drop"), LayoutError, r"tail='drop' is not one of 'bin'"),  # type: ignore[arg-type]
        (lambda: topk_divergence(GOOD, GOOD, kind="jsd", beta=1.5), LayoutError,
         r"beta=1.5 is not allowed: the mixture weight of jsd must be in \[0, 1\] \(0 is kind='forward', "
         r"1 is kind='reverse', as TRL's generalized JSD\)"),
        (lambda: topk_divergence(GOOD, GOOD, kind="jsd", beta=-0.25), LayoutError, r"beta=-0.25 is not allowed"),
        (lambda: topk_divergence(GOOD, GOOD, kind="jsd", beta=math.nan), LayoutError, r"beta=nan is not allowed"),
        (lambda: topk_divergence(GOOD, GOOD, beta="half"), TypeError, "beta must be a real number"),  # type: ignore[arg-type]
        (lambda: topk_divergence(GOOD, IDS), TypeError, "teacher has dtype torch.int64"),
        (lambda: topk_divergence(torch.tensor(1.0), torch.tensor(1.0)), LayoutError, r"it must be \[\.\.\., k\]"),
    ],
)
def test_refusals(call: Any, error: type[Exception], match: str) -> None:
    with refused(error, match):
        call()


BEYOND = 2**24 + 1  # the first vocabulary whose ids float32 does not hold exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top_k_refuses_ids_float32_would_round(dtype: torch.dtype) -> None:
    """Top-k's candidate ids travel as float32 (the compute dtype of every dtype but
    float64): a vocabulary of more than 2^24 ids is refused, on both drivers. The
    tensors are stride-0 views: nothing of 2^24 columns is allocated."""
    match = rf"a vocabulary of {BEYOND} ids is beyond what top-k's float32 all-gather carries exactly"
    with refused(LayoutError, match):
        topk_log_probs(torch.zeros((), dtype=dtype).expand(2, BEYOND), 1)
    with refused(LayoutError, match):
        topk_log_probs_from_hidden(torch.zeros(2, 1, dtype=dtype), torch.zeros((), dtype=dtype).expand(BEYOND, 1), 1)
    topk.check_k(1, 2**24, compute_dtype(dtype))  # the last vocabulary that fits


def test_top_k_takes_the_ids_that_fit() -> None:
    """The limit counts the distribution's ids (``vocab_size``), and float64 has none."""
    for dtype, vocab in ((torch.float32, 2**24), (torch.float64, None)):
        values, ids = topk_log_probs(torch.zeros((), dtype=dtype).expand(1, BEYOND), 1, vocab_size=vocab)
        assert math.isclose(float(values), -math.log(vocab or BEYOND), rel_tol=1e-6) and int(ids) == 0


def test_response_refusals_name_the_sample() -> None:
    layout = cpslice.Layout([5, 4], [2, 1])
    logits = torch.zeros(9, 6)
    lp = [torch.zeros(2, 3), torch.zeros(1, 3)]
    ids = [torch.zeros(2, 3, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int64)]
    cases: list[tuple[Any, type[Exception], str]] = [
        ((lp, ids[:1]), LayoutError, "teacher_ids has 1 samples but the layout has 2"),
        ((lp, [ids[0], ids[1][:, :2]]), LayoutError, "sample 1: teacher_ids.1. has k = 2 ids per token"),
        (([lp[0], lp[1][:0]], ids), LayoutError, "sample 1: teacher_log_probs.1. has 0 positions"),
        ((lp, [ids[0], ids[1].int()]), TypeError, "sample 1: teacher_ids.1. has dtype torch.int32"),
        ((lp, [ids[0], ids[1] + 6]), LayoutError, r"sample 1: teacher_ids\[1\]\[0, 0\] = 6 is outside"),
        (([lp[0], lp[1].long()], ids), TypeError, "sample 1: teacher_log_probs.1. has dtype torch.int64"),
        (([lp[0], lp[1][:, 0]], ids), LayoutError, r"sample 1: teacher_log_probs\[1\] has shape \(1,\)"),
    ]
    for (t_lp, t_ids), error, match in cases:
        with refused(error, match):
            response_distillation(logits, t_lp, t_ids, layout)
        with refused(error, match):
            response_distillation_from_hidden(logits, torch.zeros(6, 6), t_lp, t_ids, layout)
    with refused(LayoutError, "kind='kl'"):
        response_distillation(logits, lp, ids, layout, kind="kl")  # type: ignore[arg-type]
    with refused(LayoutError, "logits has length 8 but"):
        response_distillation(logits[:8], lp, ids, layout.with_local_length(9))


def test_tensor_parallel_distillation() -> None:
    """TP 4 and TP 2 on gloo: log_probs_at and topk_log_probs equal on every rank, each
    shard's gradient the reference's columns (hidden's the full one), one all-gather
    forward and none backward (one all-reduce for hidden), a CP rank with no response
    entering it too."""
    from ..support.distill_cases import tp_worker

    for done in run_distributed(tp_worker, 4, timeout=240):
        assert done == [(4, 5), (2, 5)]
