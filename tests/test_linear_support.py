"""Supports (top-p / top-k sets) on the hidden-state path: ``log_probs_and_entropy_from_hidden``
and ``response_log_probs_from_hidden`` with ``support=`` against the float64 masked
reference on ``hidden @ weight.T`` (values, and the gradients of hidden and weight),
over the random sets of tests/supports.py; rows with a set compute no logits row
where they need none; the response path subsets a whole-tensor support to its rows.
The TP cases: tests/tp_cases.py, run by test_logprob_tp.py."""

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from cpslice import (
    Layout,
    LayoutError,
    Support,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    response_log_probs,
    response_log_probs_from_hidden,
)
from tests.checked import refused

from .oracle import Config, local_length
from .reference import grad_close, linear_support_reference, value_atol
from .strategies import configs
from .supports import H, csr, head, response_sets, support_cases


def check(
    case: dict[str, Any], dtype: torch.dtype, value_rel: float, grad_rel: float,
    spy: TorchDispatchMode | None = None,
) -> None:
    t, v = case["logits"].shape
    targets: Tensor = case["targets"]
    hidden, weight = head(t, v, seed=t * 31 + v, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    x, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    use_h = case["with_entropy"] and case["entropy_grad"]
    with spy or contextlib.nullcontext():
        lp, ent = log_probs_and_entropy_from_hidden(
            x, w, targets, with_entropy=case["with_entropy"], entropy_grad=case["entropy_grad"],
            temperature=case["temperature"], chunk_size=case["chunk"], support=csr(case["sets"]),
            entropy_over=case["over"],
        )
        loss = (lp * g_lp).sum() + ((ent * g_h).sum() if ent is not None and use_h else 0.0)
        torch.autograd.backward(loss)
    g_h = g_h if use_h else torch.zeros(t)
    ref_lp, ref_h, ref_dh, ref_dw = linear_support_reference(
        hidden, weight, targets, case["sets"], case["temperature"], case["over"], g_lp, g_h
    )
    atol = value_atol(hidden, weight, case["temperature"], value_rel)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0.0, atol=atol)
    if case["with_entropy"]:
        assert ent is not None
        torch.testing.assert_close(ent.double(), ref_h, rtol=0.0, atol=atol)
    else:
        assert ent is None
    assert x.grad is not None and w.grad is not None and w.grad.dtype == dtype
    grad_close(x.grad, ref_dh, grad_rel)
    grad_close(w.grad, ref_dw, grad_rel)


@settings(max_examples=20, deadline=None)
@given(support_cases())
def test_float64_and_float32_match_the_masked_reference(case: dict[str, Any]) -> None:
    check(case, torch.float64, 1e-12, 1e-9)
    check(case, torch.float32, 2.0**-18, 1e-5)


@settings(max_examples=6, deadline=None)
@given(support_cases())
def test_bfloat16_matches_the_masked_reference_of_its_logits(case: dict[str, Any]) -> None:
    check(case, torch.bfloat16, 2.0**-7, 3e-2)


class _Spy(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The output shapes of every matmul run under it, and the sizes of the float32
    tensors any operator returns."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.shapes: list[tuple[int, ...]] = []
        self.float32: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.shapes.append(tuple(out.shape))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, Tensor) and x.dtype == torch.float32:
                self.float32.append(x.untyped_storage().nbytes() // 4)
        return out


@pytest.mark.parametrize("over", ["full", "support"])
def test_bfloat16_equals_the_materialized_path_to_float32_rounding(over: str) -> None:
    """A set element's logit is rounded to bfloat16 as the head's matmul rounds its
    logits, so the hidden path equals ``log_probs_and_entropy(hidden @ weight.T, ...)``
    on the materialized bfloat16 logits to float32 rounding. The inputs are multiples of
    1/8 and H = 4: every product sum is exact in float32 whatever the order, so both
    paths round the same exact logit to bfloat16 (which keeps 8 of its ~14 bits); an
    element logit left unrounded differs by up to half a bfloat16 ulp (~0.1 here)."""
    t, v = 64, 40
    gen = torch.Generator().manual_seed(21)
    hidden = (torch.randint(-64, 65, (t, 4), generator=gen) / 8).bfloat16()
    weight = (torch.randint(-64, 65, (v, 4), generator=gen) / 8).bfloat16()
    targets = torch.randint(0, v, (t,), generator=gen)
    sets = [torch.randperm(v, generator=gen)[: 1 + row % 6].tolist() if row % 3 else [] for row in range(t)]
    kw: dict[str, Any] = {"with_entropy": True, "temperature": 1.3, "support": csr(sets), "entropy_over": over}
    lp, ent = log_probs_and_entropy_from_hidden(hidden, weight, targets, chunk_size=16, **kw)
    want_lp, want_ent = log_probs_and_entropy(hidden @ weight.T, targets, **kw)
    scale = float((hidden.float() @ weight.float().T).abs().max()) / 1.3
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=16 * 2.0**-24 * scale)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=16 * 2.0**-24 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_with_a_set_compute_no_logits_row_and_the_weight_gradient_is_rounded_once(
    dtype: torch.dtype,
) -> None:
    """Every row has a set: without entropy (or with entropy over the sets) no matmul
    produces vocabulary-wide logits, forward or backward; with the full entropy every
    row's logits are computed. A popular id in many rows still gets a float32-summed
    weight gradient (compared with the reference at bfloat16 tolerance)."""
    t, v = 40, 400
    gen = torch.Generator().manual_seed(5)
    targets = torch.randint(0, v, (t,), generator=gen)
    sets = [sorted({3, *torch.randperm(v, generator=gen)[: 1 + r % 4].tolist()}) for r in range(t)]
    base = {"logits": torch.zeros(t, v), "targets": targets, "sets": sets, "temperature": 0.8,
            "chunk": 4, "entropy_grad": True}
    tol = (2.0**-7, 3e-2) if dtype == torch.bfloat16 else (2.0**-18, 1e-5)
    for with_entropy, over, dense in ((False, "full", False), (True, "support", False), (True, "full", True)):
        spy = _Spy()
        check({**base, "with_entropy": with_entropy, "over": over}, dtype, *tol, spy=spy)
        logits = [s for s in spy.shapes if s[-1] != H]  # the rest are gradients, [n, H]
        assert bool(logits) == dense, (with_entropy, over, spy.shapes)
        if dtype == torch.bfloat16:
            # the weight gradient adds up in float32 one [V_block, H] block at a time:
            # no float32 [V, H] copy (the largest: the [T, H] hidden accumulator, the
            # [E, H] products of the E = K + T support elements, [chunk, V] blocks)
            elements = sum(len(x) for x in sets) + t
            most = max(t * H, elements * H, 4 * v)
            assert max(spy.float32) <= most < v * H, sorted(spy.float32)[-3:]


@settings(max_examples=10, deadline=None)
@given(configs(max_cp=4), st.integers(0, 2**31 - 1), st.sampled_from(["full", "support"]))
def test_response_path_takes_the_sets_of_its_rows(cfg: Config, seed: int, over: str) -> None:
    """Over random layouts (padding, empty responses, ranks holding nothing):
    ``response_log_probs_from_hidden(..., support=)`` on each rank equals
    ``response_log_probs`` on its materialized logits with the same whole-tensor
    support, values and the gradients of hidden and weight."""
    vocab = 30
    _, ids, offsets = response_sets(cfg, seed, vocab)
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in cfg.total]
    weight = torch.randn(vocab, H, generator=gen, dtype=torch.float64)
    length = local_length(cfg)
    for rank in range(cfg.cp):
        layout = cfg.layout(rank).with_local_length(length)
        support = Support.from_responses(ids, offsets, layout)
        base = torch.randn(length, H, generator=gen, dtype=torch.float64)
        got = []
        for path in ("hidden", "logits"):
            hidden, w = base.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            if path == "hidden":
                lp, ent = response_log_probs_from_hidden(  # type: ignore[call-overload]
                    hidden, w, tokens, layout, with_entropy=True, temperature=0.7, chunk_size=3,
                    support=support, entropy_over=over,
                )
            else:
                lp, ent = response_log_probs(  # type: ignore[call-overload]
                    hidden @ w.T, tokens, layout, with_entropy=True, temperature=0.7,
                    support=support, entropy_over=over,
                )
            # (no samples: the zero term keeps the loss in the graph)
            loss = sum((x.sum() * (1 + i) + 0.5 * y.sum() for i, (x, y) in enumerate(zip(lp, ent))),
                       0 * (hidden.sum() + w.sum()))
            torch.autograd.backward(loss)
            got.append((lp + ent, hidden.grad, w.grad))
        (shares, dh, dw), (want, want_dh, want_dw) = got
        assert [x.shape for x in shares] == [x.shape for x in want]
        for x, y in zip(shares, want):
            assert x.grad_fn is not None  # empty shares too: in the graph
            torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        torch.testing.assert_close(dh, want_dh, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(dw, want_dw, rtol=1e-10, atol=1e-12)


def test_support_refusals_on_the_hidden_path() -> None:
    """A whole-tensor support of the wrong length, an id outside the vocabulary (named
    by the caller's row: sample 0's first response row is row 4) and a bad
    ``entropy_over`` are refused before any work."""
    total, response, vocab = [9, 6, 12], [4, 0, 7], 17
    tokens = [torch.zeros(n, dtype=torch.int64) for n in total]
    weight = torch.randn(vocab, H)
    layout = Layout(total, response)
    hidden = torch.randn(sum(total), H)
    short = Support(torch.zeros(0, dtype=torch.int64), torch.zeros(sum(total), dtype=torch.int64))
    with refused(LayoutError, f"support has {sum(total) - 1} rows but hidden has {sum(total)}"):
        response_log_probs_from_hidden(hidden, weight, tokens, layout, support=short)
    far = Support.from_responses([torch.full((r,), vocab + 2) for r in response],
                                 [torch.arange(r + 1) for r in response], layout)
    with refused(LayoutError, rf"support row 4: id {vocab + 2} is outside the vocabulary"):
        response_log_probs_from_hidden(hidden, weight, tokens, layout, support=far)
    with refused(LayoutError, "entropy_over='all' is not one of"):
        log_probs_and_entropy_from_hidden(hidden, weight, torch.zeros(sum(total), dtype=torch.int64),
                                     support=far, entropy_over="all")  # type: ignore[call-overload]
    with refused(TypeError, "support must be a cpslice.Support or None, got list"):
        log_probs_and_entropy_from_hidden(hidden, weight, torch.zeros(sum(total), dtype=torch.int64),
                                     support=[[1]])  # type: ignore[call-overload]
