"""Support (top-p / top-k replay): log-probs and entropy restricted to per-row token sets,
against a float64 reference that masks the logits to the set plus the target, on both
drivers of tests/support/drivers.py where a test says the same of both: the logits path
(``log_probs_and_entropy``) given logits, the hidden-state path
(``log_probs_and_entropy_from_hidden``) given a random LM head ``hidden @ weight.T`` or
logits through the identity head; values and gradients (of hidden and weight too), no
dense pass where none is needed, and every refusal of a support. Only on the logits
path: masked logits in a set, ``Support.from_responses`` against the oracle and CP
invariance (``response_log_probs``). Only on the hidden path: its bfloat16 rounding
against the materialized head, rows with a set computing no logits row,
``response_log_probs_from_hidden`` subsetting a whole-tensor support to its rows.
With TP on gloo: tests/support/tp_cases.py, run by test_logprob_tp.py."""

import contextlib
import math
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
    _probe,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    pack,
    response_log_probs,
    response_log_probs_from_hidden,
)
from cpslice import shard_responses as cp_shard

from ..support._dist import run_distributed, tp_groups
from ..support.checked import refused
from ..support.drivers import BOTH, HIDDEN, LOGITS, Driver
from ..support.oracle import Config, local_length, local_map
from ..support.reference import (
    EPS32,
    grad_atol,
    grad_close,
    head_support_reference,
    identity_grad_atol,
    support_reference,
    tolerance,
    value_atol,
)
from ..support.strategies import configs
from ..support.token_sets import H, Sets, csr, head, response_sets, support_cases

LOGITS_GRAD_REL = {torch.float32: 16 * EPS32, torch.float64: 1e-9, torch.bfloat16: 2e-2}
HEAD_REL = {torch.float64: (1e-12, 1e-9), torch.float32: (2.0**-18, 1e-5), torch.bfloat16: (2.0**-7, 3e-2)}


def check(
    driver: Driver, case: dict[str, Any], form: str = "logits", dtype: torch.dtype = torch.float32,
    spy: TorchDispatchMode | None = None,
) -> None:
    """``driver`` with the case's sets against ``head_support_reference``: given the
    case's logits (``form`` "logits"; to the hidden path through the identity head) or a
    random head of its size (``form`` "head", ``token_sets.head``), in ``dtype``; values,
    the gradients of x and weight, the gradient outside a row's set (given logits), and
    the caller's tensors untouched; the call and backward under ``spy``."""
    targets: Tensor = case["targets"]
    sets: Sets = case["sets"]
    t, v = case["logits"].shape
    x, weight = (case["logits"].to(dtype), None) if form == "logits" else head(t, v, seed=t * 31 + v, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
    support = csr(sets)
    given_ = [a for a in (x, weight, support.ids, support.offsets) if a is not None]
    before = [a.clone() for a in given_]
    h = x.detach().clone().requires_grad_(True)
    w0 = driver.head(x, weight)
    w = None if w0 is None else w0.detach().clone().requires_grad_(True)
    use_h = case["with_entropy"] and case["entropy_grad"]
    with spy or contextlib.nullcontext():
        lp, ent = driver(
            h, targets, w, with_entropy=case["with_entropy"], entropy_grad=case["entropy_grad"],
            temperature=case["temperature"], chunk_size=case["chunk"], support=support,
            entropy_over=case["over"],
        )
        loss = (lp * g_lp).sum() + ((ent * g_h).sum() if ent is not None and use_h else 0.0)
        if ran := bool(t) or driver is HIDDEN:  # zero rows of logits: no graph to run
            torch.autograd.backward(loss)
    g_h = g_h if use_h else torch.zeros(t)
    ref_lp, ref_h, ref_dx, ref_dw = head_support_reference(
        x, weight, targets, sets, case["temperature"], case["over"], g_lp, g_h
    )
    assert bool(lp.isfinite().all()), "a target outside its set still has a finite log-prob"
    assert not ran or h.grad is not None and (w is None or w.grad is not None)
    dx = torch.zeros_like(x) if h.grad is None else h.grad
    dw = None if w is None else torch.zeros_like(w) if w.grad is None else w.grad
    assert dx.dtype == dtype and (dw is None or dw.dtype == dtype)
    if weight is None:
        atol = tolerance(x, case["temperature"])
        rel = LOGITS_GRAD_REL[dtype]
        dx_atol = grad_atol(ref_dx, g_lp, g_h, case["temperature"], rel)
        torch.testing.assert_close(dx.double(), ref_dx, rtol=rel, atol=dx_atol)
        if dw is not None:  # the identity head's
            torch.testing.assert_close(dw.double(), ref_dw, rtol=rel, atol=identity_grad_atol(x, dx_atol, rel, ref_dw))
        outside = ref_dx == 0  # entries outside a row's set get nothing from its log-prob
        assert bool((dx[outside] == 0).all()) or use_h and case["over"] == "full"
    else:
        value_rel, grad_rel = HEAD_REL[dtype]
        atol = value_atol(x, weight, case["temperature"], value_rel)
        grad_close(dx, ref_dx, grad_rel)
        assert dw is not None
        grad_close(dw, ref_dw, grad_rel)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0.0, atol=atol)
    if case["with_entropy"]:
        assert ent is not None
        torch.testing.assert_close(ent.double(), ref_h, rtol=0.0, atol=atol)
    else:
        assert ent is None
    assert all(torch.equal(a, b) for a, b in zip(before, given_))


# (driver, form, hypothesis examples, dtypes): each driver given its own input
MASKED = [
    (LOGITS, "logits", 20, (torch.float32,)),
    (LOGITS, "logits", 6, (torch.float64, torch.bfloat16)),
    (HIDDEN, "head", 20, (torch.float64, torch.float32)),
    (HIDDEN, "head", 6, (torch.bfloat16,)),
]


def _id(value: object) -> str:
    if isinstance(value, tuple):
        return "+".join(str(d).removeprefix("torch.") for d in value)
    return str(value)


@pytest.mark.parametrize(("driver", "form", "examples", "dtypes"), MASKED, ids=_id)
def test_matches_the_masked_reference(
    driver: Driver, form: str, examples: int, dtypes: tuple[torch.dtype, ...]
) -> None:
    @settings(max_examples=examples, deadline=None)
    @given(support_cases())
    def run(case: dict[str, Any]) -> None:
        for dtype in dtypes:
            check(driver, case, form, dtype)

    run()


def test_rows_split_across_chunks_and_no_dense_pass_without_entropy() -> None:
    """Every row has a set: without entropy no row of the full vocabulary is read. The
    logits path's kernels; the hidden path's matmuls: test_rows_with_a_set_compute_no_logits_row..."""
    gen = torch.Generator().manual_seed(3)
    t, v = 9, 50
    logits = torch.randn(t, v, generator=gen) * 2
    targets = torch.randint(0, v, (t,), generator=gen)
    sets = [torch.randperm(v, generator=gen)[: 1 + r % 5].tolist() for r in range(t)]

    def asked(case: dict[str, Any]) -> list[list[int]]:
        """The rows each dense kernel call was given (its index, or every row of its tile)."""
        with _probe.watch() as seen:
            check(LOGITS, case)
        return [list(range(e.rows)) if e.index is None else e.index.tolist() for e in seen.of("call")]

    for chunk in (1, 2, 4):
        assert asked({"logits": logits, "targets": targets, "sets": sets, "temperature": 0.8,
                      "chunk": chunk, "with_entropy": False, "entropy_grad": True, "over": "full"}) == [[], []], \
            "forward and backward make no dense pass"
        assert asked({"logits": logits, "targets": targets, "sets": sets[:4] + [[]] + sets[5:],
                      "temperature": 0.8, "chunk": chunk, "with_entropy": True, "entropy_grad": True,
                      "over": "support"}) == [[4], [4]], "only the empty row"
        assert asked({"logits": logits, "targets": targets, "sets": sets, "temperature": 0.8,
                      "chunk": chunk, "with_entropy": True, "entropy_grad": True, "over": "full"}) == \
            [list(range(t))] * 2, "full entropy: every row"


def test_masked_logits_in_a_set() -> None:
    # the logits path only: a head's logits are finite (and -inf * 0 is NaN)
    logits = torch.tensor([[0.0, -math.inf, 2.0, 1.0], [-math.inf, 1.0, -math.inf, 0.5]])
    targets = torch.tensor([2, 1])
    for over in ("full", "support"):
        check(LOGITS, {"logits": logits, "targets": targets, "sets": [[1, 3], [0, 2]],
               "temperature": 0.7, "chunk": 1, "with_entropy": True, "entropy_grad": True,
               "over": over})


def _with_row_0_masked(run: Any, *leaves: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``run(*leaves)``'s log-probs and entropy, and the leaves' gradients of a loss that
    masks row 0 out (``torch.where``: its upstream gradients 0, whatever its values)."""
    leaves = tuple(x.detach().clone().requires_grad_(True) for x in leaves)
    lp, h = run(*leaves)
    keep = torch.arange(lp.shape[0]) > 0
    g = torch.linspace(-1.0, 1.0, lp.shape[0])
    torch.autograd.backward((torch.where(keep, lp, 0.0) * g).sum() + (torch.where(keep, h, 0.0) * g.flip(0)).sum())
    grads = [x.grad for x in leaves]
    assert all(x is not None for x in grads)
    return lp.detach(), h.detach(), [x for x in grads if x is not None]


def test_a_set_row_whose_statistics_are_not_finite_touches_nothing_outside_its_set() -> None:
    """``entropy_over="support"``: a row whose set took its log-prob and entropy is no row
    of the dense backward (the logits path's index, the hidden path's blocks), so its
    entropy multiplies nothing there, however non-finite (``gradient.row_grad`` keeps no
    guard for it). Row 0's set holds a ``+inf`` logit (an overflow on the hidden path),
    so its log-prob and entropy are NaN, masked out of the loss: every other row's
    values and gradient are those of the batch with row 0 finite, bit for bit; row 0's
    logits' gradient is 0 outside its set, and the LM head's rows outside its set get
    the same gradient."""
    sets = csr([[1, 5], [], [3, 6], []])
    targets = torch.tensor([1, 2, 3, 4])
    opts: dict[str, Any] = {"with_entropy": True, "support": sets, "entropy_over": "support", "temperature": 0.8}
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 8, generator=gen)
    bad = logits.clone()
    bad[0, 5] = math.inf
    clean, got = (_with_row_0_masked(lambda x: log_probs_and_entropy(x, targets, **opts), x) for x in (logits, bad))
    assert bool(got[0][0].isnan()) and bool(got[1][0].isnan())
    assert torch.equal(got[0][1:], clean[0][1:]) and torch.equal(got[1][1:], clean[1][1:])
    assert torch.equal(got[2][0][1:], clean[2][0][1:])
    outside = torch.ones(8, dtype=torch.bool).index_fill_(0, torch.tensor([1, 5]), False)
    assert not got[2][0][0, outside].any() and not clean[2][0][0, outside].any()
    # the hidden path: row 0's logit at id 5 overflows (1e30 * 1e10), the others' stay 0 there
    hidden, weight = torch.randn(4, 3, generator=gen), torch.randn(8, 3, generator=gen)
    hidden[:, 0], weight[:, 0] = 0.0, 0.0
    weight[5, 0], hidden[0, 0] = 1e10, 1e30
    finite = hidden.clone()
    finite[0, 0] = 1.0
    clean, got = (_with_row_0_masked(lambda h, w: log_probs_and_entropy_from_hidden(h, w, targets, **opts), h,
                                     weight) for h in (finite, hidden))
    assert bool(got[0][0].isnan()) and bool(got[1][0].isnan())
    assert torch.equal(got[0][1:], clean[0][1:]) and torch.equal(got[1][1:], clean[1][1:])
    assert torch.equal(got[2][0][1:], clean[2][0][1:]) and torch.equal(got[2][1][outside], clean[2][1][outside])


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
    from ..support.reference import layout_for, make_batch

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


@BOTH
def test_log_prob_refusals(driver: Driver) -> None:
    logits, targets = torch.zeros(2, 4), torch.tensor([0, 1])  # to the hidden path: the identity head
    with pytest.raises(TypeError, match="support must be a cpslice.Support"):
        driver(logits, targets, support=[[1], [2]])
    with pytest.raises(LayoutError, match=f"support has 3 rows but {driver.name} has 2"):
        driver(logits, targets, support=csr([[1], [2], []]))
    with pytest.raises(LayoutError, match=r"support row 1: id 4 is outside the vocabulary \[0, 4\)"):
        driver(logits, targets, support=csr([[1], [4]]))
    with pytest.raises(LayoutError, match="entropy_over='sets' is not one of 'full'"):
        driver(logits, targets, support=csr([[1], []]), entropy_over="sets")


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
    from cpslice._vocab.call import Options
    from cpslice._vocab.head import log_probs
    from cpslice._vocab.logits import LogitsHead

    logits, targets = torch.randn(3, 4), torch.tensor([0, 1, 2])
    lp, _ = log_probs(LogitsHead(logits), targets, Options(False, True, 1.0, None, 2, csr([[1], [9], []]), False))
    assert not bool(lp[1].isfinite()) and bool(lp[[0, 2]].isfinite().all())


# ---------------------------------------------------------------------------
# The hidden-state path only.

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
    for with_entropy, over, dense in ((False, "full", False), (True, "support", False), (True, "full", True)):
        spy = _Spy()
        check(HIDDEN, {**base, "with_entropy": with_entropy, "over": over}, "head", dtype, spy=spy)
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


# --- Support.from_keep_mask: a top-p / top-k keep mask as slime holds it

def _keep_mask(t: int, v: int, seed: int) -> Tensor:
    """A ``[t, v]`` keep mask: random rows, a row that keeps nothing, one that keeps only
    its last column, and (v >= 4) rows whose kept ids are all in one half."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(t, v, generator=gen) < 0.4
    mask[1] = False
    mask[2] = False
    mask[2, -1] = True
    mask[3, v // 2:] = False
    mask[4, : v // 2] = False
    return mask


def test_from_keep_mask_without_tp_is_the_masks_true_columns() -> None:
    """Each row's set is its True columns, ascending (an all-False row: empty, read as
    unrestricted); the log-probs and entropy under it are the float64 reference's that
    masks the logits to the set plus the target; the mask is left as it was."""
    mask = _keep_mask(7, 10, 0)
    before = mask.clone()
    support = Support.from_keep_mask(mask)
    sets = [row.nonzero()[:, 0].tolist() for row in mask]
    want = csr(sets)
    assert torch.equal(support.ids, want.ids) and torch.equal(support.offsets, want.offsets)
    assert support.num_rows == 7 and torch.equal(mask, before) and type(support) is Support
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 10, (7,), generator=gen)
    g_lp, g_h = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    lp, h = log_probs_and_entropy(logits, targets, with_entropy=True, support=support)
    torch.autograd.backward((lp * g_lp).sum() + (h * g_h).sum())
    ref_lp, ref_h, ref_grad = support_reference(logits, targets, sets, 1.0, "full", g_lp, g_h)
    assert logits.grad is not None
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, ref_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref_grad, rtol=1e-12, atol=1e-12)
    empty = Support.from_keep_mask(torch.zeros(0, 5, dtype=torch.bool))
    assert empty.num_rows == 0 and empty.ids.numel() == 0


def test_from_keep_mask_refusals() -> None:
    good = torch.ones(2, 3, dtype=torch.bool)
    bad: list[tuple[object, object, type[Exception], str]] = [
        ([[True, False]], None, TypeError, r"mask must be a bool torch.Tensor \[T, V_local\] .*, got a list"),
        (good.float(), None, TypeError, r"mask has dtype torch.float32; pass the bool keep mask \[T, V_local\]"),
        (good[0], None, LayoutError, r"mask has shape \(3,\); it must be 2-D \[T, V_local\]"),
        (good[None], None, LayoutError, r"mask has shape \(1, 2, 3\); it must be 2-D \[T, V_local\]"),
        (good, "tp", TypeError, r"tp_group must be a torch.distributed ProcessGroup or None, got a str"),
    ]
    for mask, group, error, match in bad:
        with refused(error, match):
            Support.from_keep_mask(mask, tp_group=group)  # type: ignore[arg-type]


def _keep_mask_worker(rank: int, world: int) -> list[str]:
    """TP 2 on gloo (the whole world of 2, or in a world of 4 the TP group ``[0, 1]`` or
    ``[2, 3]``, whose shard index is the rank in the group, not in the world): each
    rank's ``[T, V_local]`` shard of one keep mask gives, on every rank of its group, the
    ``Support`` of the whole mask; a log-prob (and its gradient) under it is the
    whole-mask one's; only counts and kept ids travel. A shard that keeps nothing at all
    too."""
    group, tp, tp_rank = tp_groups(rank, world)[-1]
    t, v_local = 9, 6
    failures: list[str] = []

    nothing = torch.zeros(t, v_local, dtype=torch.bool)  # the second case's rank 1 keeps no id
    wholes = (_keep_mask(t, tp * v_local, 3), torch.cat([_keep_mask(t, v_local, 4), nothing], 1))
    for case, whole in enumerate(wholes):
        local = whole[:, tp_rank * v_local:(tp_rank + 1) * v_local].clone()
        with _probe.watch() as seen:
            mine = Support.from_keep_mask(local, tp_group=group)
        sent = [(e.name, e.elements) for e in seen.of("collective")]
        want = Support.from_keep_mask(whole)
        if not (torch.equal(mine.ids, want.ids) and torch.equal(mine.offsets, want.offsets)):
            failures.append(f"case {case}: sets {mine.ids.tolist()} {mine.offsets.tolist()}, "
                            f"not {want.ids.tolist()} {want.offsets.tolist()}")
            continue
        kept = int(local.sum())
        if sent != [("all_gather", t), ("all_to_all_single", tp * kept)]:
            failures.append(f"case {case}: exchanged {sent}, not the {t} counts and {kept} kept ids")
        gen = torch.Generator().manual_seed(10 + case)
        logits = torch.randn(t, tp * v_local, generator=gen, dtype=torch.float64)
        targets = torch.randint(0, tp * v_local, (t,), generator=gen)
        x = logits[:, tp_rank * v_local:(tp_rank + 1) * v_local].clone().requires_grad_(True)
        lp, h = log_probs_and_entropy(x, targets, with_entropy=True, support=mine, tp_group=group)
        torch.autograd.backward(lp.sum() + h.sum())
        full = logits.clone().requires_grad_(True)
        want_lp, want_h = log_probs_and_entropy(full, targets, with_entropy=True, support=want)
        torch.autograd.backward(want_lp.sum() + want_h.sum())
        assert x.grad is not None and full.grad is not None
        for name, a, b in (("log-probs", lp, want_lp), ("entropy", h, want_h),
                           ("gradient", x.grad, full.grad[:, tp_rank * v_local:(tp_rank + 1) * v_local])):
            if not torch.allclose(a, b, rtol=1e-12, atol=1e-12):
                failures.append(f"case {case}: {name} {a.tolist()} against {b.tolist()}")
    return failures


def test_from_keep_mask_on_tp_2_is_the_whole_masks_support() -> None:
    for rank, failures in enumerate(run_distributed(_keep_mask_worker, 2, timeout=120)):
        assert failures == [], f"rank {rank}: {failures}"


def test_from_keep_mask_in_tp_groups_that_are_not_the_world() -> None:
    """4 ranks in two TP groups of 2: global ranks 2 and 3 hold shards 0 and 1."""
    for rank, failures in enumerate(run_distributed(_keep_mask_worker, 4, timeout=120)):
        assert failures == [], f"rank {rank}: {failures}"
