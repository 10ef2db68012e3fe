"""What models do to their logits: ``softcap=``, ``vocab_size=`` and per-row or per-sample
temperatures, on every vocabulary function without TP, against float64 references of
the capped, truncated, tempered ``log_softmax`` (values and gradients, the padded ids'
gradient exactly 0); the compiled kernels with each option; the per-sample forms over
random layouts; every refusal. TP 2 and 4 on gloo: tests/support/transform_cases.py."""

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import cpslice
from cpslice import LayoutError, Support, _probe
from cpslice._vocab.backends import selection as backend

from ..support import distill_reference as dref
from ..support import transform_reference as ref
from ..support._dist import run_distributed
from ..support.checked import refused
from ..support.compiled import ran
from ..support.oracle import Config, local_length
from ..support.oracle import rows as oracle_rows
from ..support.oracle import shares as oracle_shares
from ..support.strategies import configs

EPS32 = 2.0**-24


@st.composite
def options(draw: st.DrawFn) -> dict[str, Any]:
    t = draw(st.integers(0, 9))
    v = draw(st.integers(2, 12))
    vocab_size = draw(st.sampled_from([None, v, max(1, v // 2), 1]))
    logits, targets, taus = ref.inputs(t, v, draw(st.integers(0, 2**31 - 1)), vocab_size)
    return {
        "logits": logits, "targets": targets,
        "tau": taus if draw(st.booleans()) else 0.7,
        "softcap": draw(st.sampled_from([None, 5.0, 30.0])),
        "vocab_size": vocab_size,
        "chunk": draw(st.sampled_from([1, 3, None])),
    }


def _reference(case: dict[str, Any], logits: Tensor) -> tuple[Tensor, Tensor]:
    log_p = ref.distribution(logits, case["tau"], case["softcap"], case["vocab_size"])
    return log_p.gather(1, case["targets"][:, None])[:, 0], ref.entropy(log_p)


def _close(got: Tensor, want: Tensor, atol: float) -> None:
    torch.testing.assert_close(got.double(), want.detach().double(), rtol=0, atol=atol)


def _check(case: dict[str, Any], dtype: torch.dtype, path: str) -> None:
    """One path's log-probs, entropy and gradients against the reference."""
    t, v = case["logits"].shape
    gen = torch.Generator().manual_seed(t * 31 + v)
    g_lp, g_h = torch.randn(t, generator=gen, dtype=torch.float64), torch.randn(t, generator=gen, dtype=torch.float64)
    opts: dict[str, Any] = {"temperature": case["tau"], "softcap": case["softcap"],
                            "vocab_size": case["vocab_size"], "chunk_size": case["chunk"]}
    f64 = dtype == torch.float64
    # float32 accumulation for every dtype: bfloat16 values are as close to the float64
    # reference of the same bfloat16 inputs as float32 ones; only the gradient, rounded
    # once to bfloat16, is coarser
    atol = 1e-10 if f64 else 256 * EPS32 * (1 + 20 / 0.5)
    grad_atol = 1e-10 if f64 else 2.0**-7 if dtype == torch.bfloat16 else 64 * EPS32 * 40
    if path == "logits":
        x = case["logits"].to(dtype).requires_grad_(True)
        lp, h = cpslice.log_probs_and_entropy(x, case["targets"], with_entropy=True, **opts)
        leaves: tuple[Tensor, ...] = (x,)
        x64 = x.detach().double().requires_grad_(True)
        ref_leaves: tuple[Tensor, ...] = (x64,)
        want_lp, want_h = _reference(case, x64)
    else:  # the hidden-state path: logits = hidden @ weight.T with weight the identity-ish head
        hidden = case["logits"].to(dtype).requires_grad_(True)
        weight = torch.eye(v, dtype=dtype).requires_grad_(True)
        lp, h = cpslice.log_probs_and_entropy_from_hidden(hidden, weight, case["targets"], with_entropy=True, **opts)
        leaves = (hidden, weight)
        h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
        ref_leaves = (h64, w64)
        want_lp, want_h = _reference(case, h64 @ w64.T)
    _close(lp, want_lp, atol)
    _close(h, want_h, atol)
    got = torch.autograd.grad((lp * g_lp.to(lp.dtype)).sum() + (h * g_h.to(h.dtype)).sum(), leaves)
    want = torch.autograd.grad((want_lp * g_lp).sum() + (want_h * g_h).sum(), ref_leaves)
    for a, b in zip(got, want):
        scale = max(float(b.abs().max()) if b.numel() else 0.0, 1.0)
        torch.testing.assert_close(a.double(), b, rtol=0, atol=grad_atol * scale)
    if case["vocab_size"] is not None and t:
        padded = got[0][:, case["vocab_size"]:] if path == "logits" else got[1][case["vocab_size"]:]
        assert bool((padded == 0).all()), "a padded id gets exactly zero gradient"


@settings(max_examples=25, deadline=None)
@given(options(), st.sampled_from(["logits", "hidden"]))
def test_every_option_matches_the_float64_reference(case: dict[str, Any], path: str) -> None:
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        _check(case, dtype, path)


@pytest.fixture
def compiled() -> Iterator[None]:
    """The compiled backend (aot_eager), only this test's kernels counted."""
    with backend.using("compiled", compiler="aot_eager", fresh=True):
        yield


@pytest.mark.parametrize(("tau", "softcap", "vocab_size"), [
    ("rows", None, None), (0.7, 5.0, None), (0.7, None, 9), ("rows", 5.0, 9),
])
def test_the_compiled_kernels_with_each_option(compiled: None, tau: Any, softcap: Any, vocab_size: Any) -> None:
    logits, targets, taus = ref.inputs(10, 12, 3, vocab_size)
    case = {"logits": logits, "targets": targets, "tau": taus if tau == "rows" else tau, "softcap": softcap,
            "vocab_size": vocab_size, "chunk": 4}
    names = {"chunk_stats_capped", "chunk_grad_capped"} if softcap else {"chunk_stats", "chunk_grad"}
    for dtype in (torch.float32, torch.bfloat16):
        with _probe.watch() as seen:
            for path in ("logits", "hidden"):
                _check(case, dtype, path)
        assert ran(seen, 4) == names, dtype  # in chunks of 4 rows
        assert seen.count("launch", backend="eager") == 0, dtype
    per_row = {bool(k[6]) for k in backend.selected.ready}  # the selection's compiled variants
    assert per_row == {tau == "rows"}, "a scalar temperature compiles the scalar kernels, one per row its own"


def test_a_scalar_keeps_its_meaning() -> None:
    """A ``[T]`` tensor of one value gives what the scalar gives, and the scalar what it
    gave before these options existed (the plain log_softmax)."""
    logits, targets, _ = ref.inputs(7, 9, 1)
    lp, h = cpslice.log_probs_and_entropy(logits, targets, with_entropy=True, temperature=0.8)
    lp_t, h_t = cpslice.log_probs_and_entropy(logits, targets, with_entropy=True,
                                              temperature=torch.full((7,), 0.8, dtype=torch.float64))
    torch.testing.assert_close(lp_t, lp, rtol=0, atol=1e-13)
    torch.testing.assert_close(h_t, h, rtol=0, atol=1e-13)
    want = torch.log_softmax(logits / 0.8, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_ids_and_top_k_with_the_options(dtype: torch.dtype) -> None:
    """log_probs_at / topk_log_probs (and their hidden forms): capped, tempered per row,
    never choosing or normalizing over a padded id; bfloat16 logits against the float64
    reference of the same bfloat16 values."""
    logits, _, taus = ref.inputs(8, 12, 5, 9)
    logits = logits.to(dtype).double()  # what a bfloat16 rank holds, exactly
    atol = 1e-10 if dtype == torch.float64 else 4e-4
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 9, (8, 3), generator=gen)
    opts: dict[str, Any] = {"temperature": taus, "softcap": 5.0, "vocab_size": 9}
    full = ref.distribution(logits, taus, 5.0, 9)
    x = logits.to(dtype).requires_grad_(True)
    got = cpslice.log_probs_at(x, ids, **opts)
    torch.testing.assert_close(got.double(), full.gather(1, ids), rtol=0, atol=atol)
    values, top = cpslice.topk_log_probs(x, 4, **opts)
    want_v, want_ids = torch.topk(full, 4)
    assert torch.equal(top, want_ids) and bool((top < 9).all())
    torch.testing.assert_close(values.double(), want_v, rtol=0, atol=atol)
    (g,) = torch.autograd.grad(values.sum() + got.sum(), x)
    x64 = logits.clone().requires_grad_(True)
    full64 = ref.distribution(x64, taus, 5.0, 9)
    (want_g,) = torch.autograd.grad(torch.topk(full64, 4).values.sum() + full64.gather(1, ids).sum(), x64)
    torch.testing.assert_close(g.double(), want_g, rtol=0, atol=1e-10 if dtype == torch.float64 else 2.0**-6)
    assert bool((g[:, 9:] == 0).all())
    eye = torch.eye(12, dtype=dtype)
    torch.testing.assert_close(cpslice.log_probs_at_from_hidden(x.detach(), eye, ids, **opts), got.detach(),
                               rtol=0, atol=atol)
    lv, lt = cpslice.topk_log_probs_from_hidden(x.detach(), eye, 4, **opts)
    assert torch.equal(lt, top)
    torch.testing.assert_close(lv, values.detach(), rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_supports_with_the_options(dtype: torch.dtype) -> None:
    """Rows restricted to their sets, the sets capped and tempered as the full rows."""
    logits, targets, taus = ref.inputs(6, 10, 9, 8)
    logits = logits.to(dtype).double()
    sets = [[1, 2], [], [0, 7, 3], [int(targets[3])], [5], []]
    support = Support(torch.tensor([i for s in sets for i in s]),
                      torch.tensor([0, *torch.tensor([len(s) for s in sets]).cumsum(0).tolist()]))
    f64 = dtype == torch.float64
    for path in ("logits", "hidden"):
        x = logits.to(dtype).requires_grad_(True)
        kw: dict[str, Any] = {"temperature": taus, "softcap": 5.0, "vocab_size": 8, "support": support, "chunk_size": 2}
        if path == "logits":
            lp, _ = cpslice.log_probs_and_entropy(x, targets, **kw)
        else:
            lp, _ = cpslice.log_probs_and_entropy_from_hidden(x, torch.eye(10, dtype=dtype), targets, **kw)
        (g,) = torch.autograd.grad(lp.sum(), x)
        x64 = logits.clone().requires_grad_(True)
        capped = 5.0 * torch.tanh(x64 / 5.0) / taus[:, None]
        keep = torch.zeros(6, 10, dtype=torch.bool)
        for row, s in enumerate(sets):
            keep[row, (s + [int(targets[row])]) if s else list(range(8))] = True
        want = torch.log_softmax(torch.where(keep, capped, -math.inf), -1).gather(1, targets[:, None])[:, 0]
        torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-10 if f64 else 4e-4)
        (want_g,) = torch.autograd.grad(want.sum(), x64)
        torch.testing.assert_close(g.double(), want_g, rtol=0, atol=1e-10 if f64 else 2.0**-7)


def _per_sample_case(cfg: Config, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    vocab = 11
    return {
        "full": [5 * torch.randn(n, vocab, generator=gen, dtype=torch.float64) for n in cfg.total],
        "tokens": [torch.randint(0, 8, (n,), generator=gen) for n in cfg.total],
        "taus": (0.5 + torch.rand(len(cfg.total), generator=gen, dtype=torch.float64)).tolist(),
        "vocab": vocab,
    }


def _rows(per_sample: list[Tensor], cfg: Config, rank: int, width: int) -> Tensor:
    if not per_sample:
        return torch.zeros(local_length(cfg), width, dtype=torch.float64)
    return oracle_rows(per_sample, cfg, rank)


@settings(max_examples=10, deadline=None)
@given(configs(max_cp=4), st.integers(0, 2**31 - 1), st.booleans())
def test_per_sample_temperatures_under_every_layout(cfg: Config, seed: int, as_tensor: bool) -> None:
    """response_log_probs, response_log_probs_from_hidden and response_distillation with
    one temperature per sample (a list, or an [n] tensor), softcap and vocab_size: each
    sample's shares against its own float64 reference, for float64 and bfloat16 logits
    (the reference of the same bfloat16 values)."""
    case = _per_sample_case(cfg, seed)
    taus = torch.tensor(case["taus"], dtype=torch.float64) if as_tensor else case["taus"]
    # a cap that is no power of two: dividing by 4.0 is exact in any dtype
    opts: dict[str, Any] = {"temperature": taus, "softcap": 3.0, "vocab_size": 8}
    length = local_length(cfg)
    for dtype in (torch.float64, torch.bfloat16):
        per_sample = [x.to(dtype).double() for x in case["full"]]
        want_lp, want_div, teacher = [], [], []
        for n, r, x, tok, tau in zip(cfg.total, cfg.response, per_sample, case["tokens"], case["taus"]):
            full = ref.distribution(x, tau, 3.0, 8)[n - r - 1 : n - 1]
            want_lp.append(full.gather(1, tok[n - r :, None])[:, 0])
            top = torch.topk(torch.log_softmax(torch.randn(r, 8, dtype=torch.float64), -1), 3)
            teacher.append(top)
            want_div.append(dref.divergence(full.gather(1, top.indices), top.values, "forward", 0.5, "bin"))
        eye = torch.eye(case["vocab"], dtype=dtype)
        atol = 1e-10 if dtype == torch.float64 else 4e-4
        for rank in range(cfg.cp):
            layout = cfg.layout(rank).with_local_length(length)
            local = _rows(per_sample, cfg, rank, case["vocab"]).to(dtype)
            lp, _ = cpslice.response_log_probs(local, case["tokens"], layout, **opts)
            lp_h, _ = cpslice.response_log_probs_from_hidden(local, eye, case["tokens"], layout, **opts)
            t_lp, t_ids = [v for v, _ in teacher], [i for _, i in teacher]
            div = cpslice.response_distillation(local, t_lp, t_ids, layout, **opts)
            div_h = cpslice.response_distillation_from_hidden(local, eye, t_lp, t_ids, layout, **opts)
            for got, want in ((lp, want_lp), (lp_h, want_lp), (div, want_div), (div_h, want_div)):
                for a, b in zip(got, oracle_shares(want, cfg, rank)):
                    torch.testing.assert_close(a.double(), b, rtol=0, atol=atol)


@pytest.mark.parametrize("path", ["logits", "hidden"])
def test_an_id_past_vocab_size_is_nan_where_the_host_does_not_check(path: str) -> None:
    """A device tensor's ids are not read on the host (that would cost a sync): an id in
    ``[vocab_size, V)`` (a padded id the logits have a column for), past ``V`` or
    negative gives NaN in its row, and every other row its value over the distribution's
    ids. The host checks are switched off here (the hook's step ``host_checks``) to take that
    path without a device."""
    cpu = torch.zeros(2, 10)
    with refused(LayoutError, r"ids\[1, 0\] = 8 is outside the vocabulary \[0, 7\) \(1 such ids\)"):
        (cpslice.log_probs_at(cpu, torch.tensor([[1], [8]]), vocab_size=7) if path == "logits" else
         cpslice.log_probs_at_from_hidden(cpu, torch.eye(10), torch.tensor([[1], [8]]), vocab_size=7))
    with _probe.substitute("host_checks", lambda ids: False):
        _device_path(path)


def _device_path(path: str) -> None:
    logits, targets, _ = ref.inputs(6, 10, 21, 7)
    bad = torch.tensor([False, True, False, True, True, False])
    targets = torch.where(bad, torch.tensor([0, 7, 0, 9, -1, 0]), targets)  # 7, 9: padded ids; -1
    head = torch.eye(10, dtype=torch.float64)
    full = ref.distribution(logits, 1.0, None, 7)
    opts: dict[str, Any] = {"vocab_size": 7, "softcap": 5.0}
    full_capped = ref.distribution(logits, 1.0, 5.0, 7)

    def call(fn: str, *rest: Any, **kw: Any) -> Any:
        if path == "logits":
            return getattr(cpslice, fn)(logits, *rest, **kw)
        return getattr(cpslice, f"{fn}_from_hidden")(logits, head, *rest, **kw)

    lp, h = call("log_probs_and_entropy", targets, with_entropy=True, **opts)
    assert torch.equal(lp.isnan(), bad), lp
    want = full_capped.gather(1, targets.clamp(0)[:, None])[:, 0]
    torch.testing.assert_close(lp[~bad], want[~bad], rtol=0, atol=1e-10)
    torch.testing.assert_close(h, ref.entropy(full_capped), rtol=0, atol=1e-10)  # the entropy needs no target
    ids = torch.stack([targets.clamp(0, 6), targets], 1)
    at = call("log_probs_at", ids, vocab_size=7)
    assert torch.equal(at.isnan(), torch.stack([torch.zeros(6, dtype=torch.bool), bad], 1)), at
    torch.testing.assert_close(at[:, 0], full.gather(1, ids[:, :1])[:, 0], rtol=0, atol=1e-10)
    # a set holding a padded id: that row's restricted log-prob is NaN, the others' are not
    support = Support(torch.tensor([1, 2, 8, 3]), torch.tensor([0, 2, 3, 3, 4, 4, 4]))
    good = torch.where(bad, 0, targets)
    lp_s, _ = call("log_probs_and_entropy", good, support=support, vocab_size=7)
    assert torch.equal(lp_s.isnan(), torch.tensor([False, True, False, False, False, False])), lp_s


GOOD = torch.zeros(3, 4)
TARGETS = torch.tensor([0, 1, 3])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"softcap": 0.0}, LayoutError, r"softcap=0.0 is not allowed: it must be finite and > 0"),
        ({"softcap": math.inf}, LayoutError, r"softcap=inf is not allowed"),
        ({"softcap": "big"}, TypeError, r"softcap must be a real number"),
        ({"vocab_size": 0}, LayoutError, r"vocab_size=0 is not allowed: it must be in \[1, 4\]"),
        ({"vocab_size": 5}, LayoutError, r"vocab_size=5 is not allowed: it must be in \[1, 4\]"),
        ({"vocab_size": 2.0}, TypeError, r"vocab_size 2.0 is a float, not an int"),
        ({"vocab_size": 3}, LayoutError, r"targets\[2\] = 3 is outside the vocabulary \[0, 3\)"),
        ({"temperature": torch.ones(2)}, LayoutError,
         r"temperature has shape \(2,\); one temperature per row is \[3\]"),
        ({"temperature": torch.ones(3, dtype=torch.int64)}, TypeError, r"temperature has dtype torch.int64"),
        ({"temperature": torch.tensor([1.0, 0.0, 1.0])}, LayoutError,
         r"temperature\[1\] = 0.0 is not allowed: each row's temperature must be finite and > 0"),
        ({"temperature": torch.tensor([1.0, 1.0, math.nan])}, LayoutError, r"temperature\[2\] = nan"),
        ({"temperature": [1.0, 1.0, 1.0]}, TypeError, r"temperature must be a real number"),
    ],
)
def test_refusals(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with refused(error, match):
        cpslice.log_probs_and_entropy(GOOD, TARGETS, **kwargs)
    with refused(error, match):
        cpslice.log_probs_and_entropy_from_hidden(GOOD, torch.eye(4), TARGETS, **kwargs)


def test_refusals_of_the_per_sample_and_top_k_forms() -> None:
    layout = cpslice.Layout([3, 4], [1, 2])
    tokens = [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3])]
    logits = torch.zeros(7, 5)
    with refused(LayoutError, r"temperature has shape \(3,\); one temperature per sample is \[2\]"):
        cpslice.response_log_probs(logits, tokens, layout, temperature=[1.0, 1.0, 1.0])
    with refused(LayoutError, r"sample 1: temperature\[1\] = -1.0 is not allowed: each sample's temperature"):
        cpslice.response_log_probs(logits, tokens, layout, temperature=torch.tensor([1.0, -1.0]))
    with refused(TypeError, r"sample 0: temperature\[0\] must be a real number"):
        cpslice.response_log_probs_from_hidden(logits, torch.eye(5), tokens, layout,
                                               temperature=["hot", 1.0])  # type: ignore[list-item]
    with refused(LayoutError, r"targets\[5\] = 3 is outside the vocabulary \[0, 3\)"):
        cpslice.response_log_probs(logits, tokens, layout, vocab_size=3)
    with refused(LayoutError, r"k=4 is larger than the vocabulary: 3 ids"):
        cpslice.topk_log_probs(logits, 4, vocab_size=3)
    with refused(LayoutError, r"support row 0: id 4 is outside the vocabulary \[0, 4\)"):
        cpslice.log_probs_and_entropy(logits, torch.zeros(7, dtype=torch.int64), vocab_size=4,
                                      support=Support(torch.tensor([4]), torch.tensor([0, 1, 1, 1, 1, 1, 1, 1])))
    lp = [torch.zeros(1, 2), torch.zeros(2, 2)]
    with refused(LayoutError, r"sample 1: teacher_ids\[1\]\[0, 0\] = 4 is outside the student's vocabulary \[0, 4\)"):
        cpslice.response_distillation(logits, lp, [torch.zeros(1, 2, dtype=torch.int64),
                                                   torch.full((2, 2), 4)], layout, vocab_size=4)


def test_tensor_parallel_options() -> None:
    """TP 4 and 2 on gloo: padded ids split across shards and a shard holding only padded
    ids, soft-capping and per-row temperatures, on the logits and hidden-state paths
    (float32 or float64, and bfloat16) and top-k (tests/support/transform_cases.py)."""
    from ..support.transform_cases import tp_worker

    for done in run_distributed(tp_worker, 4, timeout=240):
        assert done == [(4, 6), (2, 6)]
