"""Support (top-p / top-k replay): log-probs and entropy restricted to per-row token sets,
against a float64 reference that masks the logits to the set plus the target; values
and gradients, Support.from_responses against the oracle, CP invariance, and every
refusal (with TP on gloo: tests/tp_cases.py, run by test_logprob_tp.py)."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from cpslice import Layout, LayoutError, Support, log_probs_and_entropy, pack, response_log_probs
from cpslice import shard_responses as cp_shard

from .oracle import Config, local_length, local_map
from .reference import EPS32, grad_atol, support_reference, tolerance
from .strategies import configs
from .supports import Sets, csr, response_sets, support_cases

PROPS = settings(max_examples=20, deadline=None)


def check(case: dict[str, Any], dtype: torch.dtype = torch.float32, grad_rtol: float = 16 * EPS32) -> None:
    logits: Tensor = case["logits"].to(dtype)
    targets: Tensor = case["targets"]
    sets: Sets = case["sets"]
    t = logits.shape[0]
    gen = torch.Generator().manual_seed(7)
    g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    support = csr(sets)
    before = (logits.clone(), support.ids.clone(), support.offsets.clone())
    x = logits.detach().requires_grad_(True)
    lp, h = log_probs_and_entropy(
        x, targets, with_entropy=case["with_entropy"], entropy_grad=case["entropy_grad"],
        temperature=case["temperature"], chunk_size=case["chunk"], support=support,
        entropy_over=case["over"],
    )
    use_h = case["with_entropy"] and case["entropy_grad"]
    loss = (lp * g_lp).sum()
    if h is not None and use_h:
        loss = loss + (h * g_h).sum()
    (grad,) = torch.autograd.grad(loss, x) if t else (torch.zeros_like(x),)
    g_h = g_h if use_h else torch.zeros(t)
    ref_lp, ref_h, ref_grad = support_reference(logits, targets, sets, case["temperature"], case["over"], g_lp, g_h)
    atol = tolerance(logits, case["temperature"])
    assert bool(lp.isfinite().all()), "a target outside its set still has a finite log-prob"
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0.0, atol=atol)
    if case["with_entropy"]:
        assert h is not None
        torch.testing.assert_close(h.double(), ref_h, rtol=0.0, atol=atol)
    else:
        assert h is None
    assert grad.dtype == dtype
    atol = grad_atol(ref_grad, g_lp, g_h, case["temperature"], grad_rtol)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=grad_rtol, atol=atol)
    outside = ref_grad == 0  # entries outside a row's set get nothing from its log-prob
    assert bool((grad[outside] == 0).all()) or use_h and case["over"] == "full"
    assert all(torch.equal(a, b) for a, b in zip(before, (logits, support.ids, support.offsets)))


@PROPS
@given(support_cases())
def test_float32_matches_float64_masked_reference(case: dict[str, Any]) -> None:
    check(case)


@settings(max_examples=6, deadline=None)
@given(support_cases())
def test_float64_and_bfloat16(case: dict[str, Any]) -> None:
    check(case, torch.float64, grad_rtol=1e-9)
    check(case, torch.bfloat16, grad_rtol=2e-2)


def test_rows_split_across_chunks_and_no_dense_pass_without_entropy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row has a set: without entropy no chunk of the full vocabulary is read."""
    from cpslice._vocab import kernels

    gen = torch.Generator().manual_seed(3)
    t, v = 9, 50
    logits = torch.randn(t, v, generator=gen) * 2
    targets = torch.randint(0, v, (t,), generator=gen)
    sets = [torch.randperm(v, generator=gen)[: 1 + r % 5].tolist() for r in range(t)]
    pieces: list[list[tuple[int, int]]] = []
    real = kernels.pieces

    def spy(runs: list[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
        out = real(runs, chunk)
        pieces.append(out)
        return out

    monkeypatch.setattr(kernels, "pieces", spy)
    for chunk in (1, 2, 4):
        pieces.clear()
        check({"logits": logits, "targets": targets, "sets": sets, "temperature": 0.8,
               "chunk": chunk, "with_entropy": False, "entropy_grad": True, "over": "full"})
        assert pieces == [[], []], "forward and backward make no dense pass"
        pieces.clear()
        check({"logits": logits, "targets": targets, "sets": sets[:4] + [[]] + sets[5:],
               "temperature": 0.8, "chunk": chunk, "with_entropy": True, "entropy_grad": True,
               "over": "support"})
        assert all(sum(e - s for s, e in p) <= chunk for p in pieces), "only the empty row, chunk-sized"
        pieces.clear()
        check({"logits": logits, "targets": targets, "sets": sets, "temperature": 0.8,
               "chunk": chunk, "with_entropy": True, "entropy_grad": True, "over": "full"})
        assert all(sum(e - s for s, e in p) == t for p in pieces), "full entropy: every row"


def test_masked_logits_in_a_set() -> None:
    logits = torch.tensor([[0.0, -math.inf, 2.0, 1.0], [-math.inf, 1.0, -math.inf, 0.5]])
    targets = torch.tensor([2, 1])
    for over in ("full", "support"):
        check({"logits": logits, "targets": targets, "sets": [[1, 3], [0, 2]],
               "temperature": 0.7, "chunk": 1, "with_entropy": True, "entropy_grad": True,
               "over": over})


# ---------------------------------------------------------------------------
# Support.from_responses against the oracle, and CP invariance.


def _oracle_sets(cfg: Config, rank: int, per: list[Sets]) -> Sets:
    out: Sets = []
    for m in local_map(cfg, rank):
        s: list[int] = []
        if m is not None:
            i, p = m
            first = cfg.total[i] - cfg.response[i] - 1
            if first <= p < cfg.total[i] - 1:
                s = per[i][p - first]
        out.append(s)
    return out


@settings(max_examples=25, deadline=None)
@given(configs(max_cp=4), st.integers(0, 2**31 - 1), st.booleans())
def test_from_responses_matches_the_oracle(cfg: Config, seed: int, as_lists: bool) -> None:
    per, ids, offsets = response_sets(cfg, seed)
    length = local_length(cfg)
    for rank in range(cfg.cp):
        layout = cfg.layout(rank).with_local_length(length)
        if as_lists:
            support = Support.from_responses([x.tolist() for x in ids], [o.tolist() for o in offsets], layout)
        else:
            support = Support.from_responses(tuple(ids), tuple(offsets), layout)
        want = _oracle_sets(cfg, rank, per)
        assert support.num_rows == length
        got = [support.ids[a:b].tolist() for a, b in zip(support.offsets[:-1].tolist(), support.offsets[1:].tolist())]
        assert got == want


@pytest.mark.parametrize(("kind", "cp"), [("zigzag-thd", 4), ("zigzag-bshd", 2), ("allgather", 4)])
def test_cp_invariance_against_no_cp(kind: str, cp: int) -> None:
    """Each rank's shares equal its share of the no-CP result; together they cover it."""
    from .reference import layout_for, make_batch

    for seed in (11,):
        batch = make_batch(seed, n=7, cp=cp, vocab=9)
        cfg = Config(tuple(batch.total), tuple(batch.response), "thd", None, "none", 1, None, 0)
        per, ids, offsets = response_sets(cfg, seed, vocab=9)
        results: dict[str, list[Tensor]] = {}
        for over in ("full", "support"):
            one = Layout(batch.total, batch.response)
            logits = pack(batch.logits, one)
            base, base_h = response_log_probs(
                logits, batch.tokens, one, with_entropy=True, temperature=batch.temperature,
                support=Support.from_responses(ids, offsets, one), entropy_over=over, chunk_size=3,
            )
            # the no-CP result itself against the float64 masked reference, sample by sample
            for i, (t, r) in enumerate(zip(batch.total, batch.response)):
                span = slice(t - r - 1, t - 1)
                sets: Sets = [[] for _ in range(t - r - 1)] + per[i] + [[]]
                zero = torch.zeros(t)
                targets = torch.cat([batch.tokens[i][1:], batch.tokens[i][:1]])
                ref_lp, ref_h, _ = support_reference(batch.logits[i], targets, sets, batch.temperature, over,
                                                     zero, zero)
                torch.testing.assert_close(base[i].double(), ref_lp[span], rtol=0.0, atol=1e-5)
                torch.testing.assert_close(base_h[i].double(), ref_h[span], rtol=0.0, atol=1e-5)
            held = [0] * len(batch.total)
            for rank in range(cp):
                layout = layout_for(batch, kind, rank, cp)
                logits = pack(batch.logits, layout)
                support = Support.from_responses(ids, offsets, layout)
                lp, h = response_log_probs(
                    logits, batch.tokens, layout, with_entropy=True, temperature=batch.temperature,
                    support=support, entropy_over=over, chunk_size=3,
                )
                for got, want in ((lp, cp_shard(base, layout)), (h, cp_shard(base_h, layout))):
                    for a, b in zip(got, want):
                        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-5)
                held = [n + x.numel() for n, x in zip(held, lp)]
            assert held == list(batch.response), "the ranks' shares cover every response token"
            results[over] = base
        assert len(results) == 2


# ---------------------------------------------------------------------------
# Refusals.

I64 = torch.int64


@pytest.mark.parametrize(
    ("ids", "offsets", "error", "match"),
    [
        ([1, 2], [0, 2], TypeError, "Support ids must be an int64 torch.Tensor"),
        (torch.tensor([1.0]), torch.tensor([0, 1]), TypeError, r"Support ids has dtype torch.float32"),
        (torch.tensor([1]), torch.tensor([0, 1], dtype=torch.int32), TypeError, "Support offsets has dtype"),
        (torch.tensor([[1]]), torch.tensor([0, 1]), LayoutError, r"Support ids has shape \(1, 1\)"),
        (torch.tensor([1]), torch.tensor([], dtype=I64), LayoutError, "offsets is empty"),
        (torch.tensor([1]), torch.tensor([1, 1]), LayoutError, r"offsets\[0\] = 1"),
        (torch.tensor([1, 2]), torch.tensor([0, 2, 1, 2]), LayoutError,
         r"decrease at row 1: offsets\[1\] = 2 > offsets\[2\] = 1"),
        (torch.tensor([1, 2]), torch.tensor([0, 1]), LayoutError, "ends at 1 but ids has 2"),
        (torch.tensor([1, -2]), torch.tensor([0, 1, 2]), LayoutError, "row 1: id -2 < 0"),
        (torch.tensor([1, 5, 3, 5]), torch.tensor([0, 1, 4]), LayoutError, "row 1: id 5 appears twice"),
    ],
)
def test_support_refusals(ids: object, offsets: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Support(ids, offsets)  # type: ignore[arg-type]


def test_same_id_in_different_rows_is_fine_and_support_is_frozen() -> None:
    s = Support(torch.tensor([3, 3]), torch.tensor([0, 1, 2]))
    assert s.num_rows == 2 and "rows=2" in repr(s)
    with pytest.raises(AttributeError, match="immutable"):
        s.ids = torch.tensor([1])


def test_log_prob_refusals() -> None:
    logits, targets = torch.zeros(2, 4), torch.tensor([0, 1])
    with pytest.raises(TypeError, match="support must be a cpslice.Support"):
        log_probs_and_entropy(logits, targets, support=[[1], [2]])  # type: ignore[call-overload]
    with pytest.raises(LayoutError, match="support has 3 rows but logits has 2"):
        log_probs_and_entropy(logits, targets, support=csr([[1], [2], []]))
    with pytest.raises(LayoutError, match=r"support row 1: id 4 is outside the vocabulary \[0, 4\)"):
        log_probs_and_entropy(logits, targets, support=csr([[1], [4]]))
    with pytest.raises(LayoutError, match="entropy_over='sets' is not one of 'full'"):
        log_probs_and_entropy(logits, targets, support=csr([[1], []]), entropy_over="sets")  # type: ignore[call-overload]


def test_from_responses_refusals() -> None:
    layout = Layout([5, 4], [2, 3])
    good_ids, good_off = [[1, 2, 3], [4, 5]], [[0, 1, 3], [0, 1, 1, 2]]
    Support.from_responses(good_ids, good_off, layout)
    bad: list[tuple[object, object, type[Exception], str]] = [
        (torch.tensor([1]), good_off, TypeError, "ids must be a list or tuple"),
        (good_ids[:1], good_off, LayoutError, "ids has 1 entries but the layout has 2 samples"),
        ([[1, 2, 3], torch.tensor([4.0, 5.0])], good_off, TypeError, r"sample 1: ids\[1\] has dtype torch.float32"),
        ([[1, 2, 3], "45"], good_off, TypeError, r"sample 1: ids\[1\] is a str"),
        (good_ids, [[0, 1, 3], [0, 1, 2]], LayoutError,
         r"sample 1: offsets\[1\] has 3 entries but the response has 3 tokens"),
        (good_ids, [[1, 1, 3], [0, 1, 1, 2]], LayoutError, r"sample 0: offsets\[0\]\[0\] = 1"),
        (good_ids, [[0, 1, 3], [0, 2, 1, 2]], LayoutError, r"sample 1: offsets\[1\] decreases at token 1: 2 > 1"),
        (good_ids, [[0, 1, 2], [0, 1, 1, 2]], LayoutError, r"sample 0: offsets\[0\] ends at 2 but ids\[0\] has 3"),
        ([[1, 2, 2], [4, 5]], good_off, LayoutError, "sample 0, response token 1: id 2 appears twice"),
        ([[1, 2, 3], [4, -5]], good_off, LayoutError, "sample 1, response token 2: id -5 < 0"),
    ]
    for ids, off, error, match in bad:
        with pytest.raises(error, match=match):
            Support.from_responses(ids, off, layout)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="allgather layout's pieces"):
        Support.from_responses(good_ids, good_off, Layout([5, 4], [2, 3], cp_mode="allgather", cp_size=2))


def test_an_unchecked_id_outside_the_vocabulary_gives_nan_not_a_silent_drop() -> None:
    """On a device the range check would cost a sync: the row's log-prob is NaN instead
    (the kernel is called directly here, past the CPU check)."""
    from cpslice._vocab.engine import Options
    from cpslice._vocab.logits import apply

    logits, targets = torch.randn(3, 4), torch.tensor([0, 1, 2])
    lp, _ = apply(logits, targets, Options(False, True, 1.0, None, 2, csr([[1], [9], []]), False))
    assert not bool(lp[1].isfinite()) and bool(lp[[0, 2]].isfinite().all())
