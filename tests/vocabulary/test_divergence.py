"""``cpslice.vocab_divergence`` on one process: every kind (``"jsd"`` at both ends of
``beta`` too) in float32 and bfloat16 with every softmax option against the float64
definitions, values and both gradients; the edges of zero probability (-inf logits on
either side, a row all -inf but one, T = 0), identical student and teacher (exactly 0),
``[..., V]`` inputs, forward-only under ``torch.no_grad()``, invariant mode's bits across
the batch, the chunking and the column splits of the pair walk, the compiled bodies
against the eager ones, and the argument checks. tests/vocabulary/test_triton.py's
sibling for the Triton kernels is tests/vocabulary/test_divergence_triton.py; TP 2 on
gloo is tests/distributed/test_divergence_tp.py."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpslice import LayoutError, _probe, vocab_divergence
from cpslice._types import Divergence
from cpslice._vocab import divergence as _divergence
from cpslice._vocab import pairs
from cpslice._vocab.args import options as call_options
from cpslice._vocab.backends import selection

from ..support.compiled import ran
from ..support.divergence_cases import KINDS, check, logits, reference, value_atol

T, V = 6, 300
OPTIONS: list[dict[str, Any]] = [
    {},
    {"temperature": 0.7, "chunk_size": 1},
    {"temperature": "per-row", "softcap": 8.0},
    {"vocab_size": 260, "chunk_size": 4},
]


def _options(opts: dict[str, Any], t: int) -> dict[str, Any]:
    out = dict(opts)
    if out.get("temperature") == "per-row":
        out["temperature"] = torch.linspace(0.6, 1.4, t)
    return out


def _run(s0: torch.Tensor, t0: torch.Tensor, kind: Divergence, beta: float, g: torch.Tensor,
         **opts: Any) -> tuple[torch.Tensor, tuple[torch.Tensor | None, torch.Tensor | None]]:
    s, t = s0.clone().requires_grad_(), t0.clone().requires_grad_()
    value = vocab_divergence(s, t, kind=kind, beta=beta, **opts)
    torch.autograd.backward((value * g).sum())
    return value, (s.grad, t.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize(("kind", "beta"), KINDS, ids=lambda k: str(k))
def test_against_float64(dtype: torch.dtype, options: dict[str, Any], kind: Divergence, beta: float) -> None:
    opts = _options(options, T)
    s0, t0 = logits(T, V, dtype, 3)
    g = torch.randn(T, generator=torch.Generator().manual_seed(4))
    value, grads = _run(s0, t0, kind, beta, g, **opts)
    keep = {k: opts[k] for k in ("temperature", "softcap", "vocab_size") if k in opts}
    want = reference(s0, t0, kind, beta, g, **keep)
    tau = opts.get("temperature", 1.0)
    check(value, grads, want, dtype, value_atol(s0, t0, tau),
          float(g.abs().max()) / (float(tau.min()) if isinstance(tau, torch.Tensor) else tau))
    vocab = opts.get("vocab_size")
    if vocab is not None:
        assert all(not gr[:, vocab:].any() for gr in grads if gr is not None)
    # which rows are +inf: the weighing side's mass on an id the other gives -inf (a cap
    # makes -inf logits -cap: none)
    computed = {0.0: "forward", 1.0: "reverse"}.get(beta, kind) if kind == "jsd" else kind
    inf_rows = set() if "softcap" in opts else {"forward": {1}, "reverse": {2, 3}, "jsd": set()}[computed]
    assert {i for i in range(T) if value[i] == math.inf} == inf_rows


@pytest.mark.parametrize("beta", [1e-30, 1.0 - 2.0**-53])
def test_jsd_next_to_the_ends_of_beta_is_finite(beta: float) -> None:
    """``beta`` a hair inside ``(0, 1)``: the JSD itself (near 0, not the KL the ends map
    to), finite, its gradients finite, against float64, with -inf logits on both sides
    (the mixture's ``log(beta)`` and ``log(1 - beta)`` never meet ``0 * inf``)."""
    s0, t0 = logits(T, V, torch.float32, 14)
    g = torch.ones(T)
    value, grads = _run(s0, t0, "jsd", beta, g)
    assert bool(value.isfinite().all())
    check(value, grads, reference(s0, t0, "jsd", beta, g), torch.float32, value_atol(s0, t0, 1.0))


@pytest.mark.parametrize(("kind", "beta"), KINDS[:3], ids=lambda k: str(k))
def test_identical_sides_give_exactly_zero(kind: Divergence, beta: float) -> None:
    """``KL(p || p)`` and the jsd of a distribution with itself: exactly 0, and so is every
    gradient entry (-inf logits and a cap included), in both modes."""
    x, _ = logits(T, V, torch.float32, 5)
    for invariant in (False, True):
        value, grads = _run(x, x, kind, beta, torch.ones(T), softcap=10.0, invariant=invariant)
        assert torch.equal(value, torch.zeros(T))
        assert all(gr is not None and not gr.any() for gr in grads)


def test_edges_zero_rows_and_one_finite_logit() -> None:
    """T = 0 (empty results and gradients, in the graph), and a row whose logits are all
    -inf but one on both sides (a point mass: 0 where both agree, +inf forward where the
    student puts its mass elsewhere)."""
    for kind in ("forward", "jsd"):
        e = torch.zeros((0, 7), requires_grad=True)
        value = vocab_divergence(e, torch.zeros(0, 7), kind=kind)
        value.sum().backward()  # type: ignore[no-untyped-call]
        assert value.shape == (0,) and e.grad is not None and e.grad.shape == (0, 7)
    s = torch.full((2, 7), -math.inf)
    t = torch.full((2, 7), -math.inf)
    s[0, 2] = t[0, 2] = 1.0
    s[1, 3], t[1, 4] = 0.0, 5.0
    assert vocab_divergence(s, t).tolist() == [0.0, math.inf]
    assert vocab_divergence(s, t, kind="jsd", beta=0.5)[0] == 0.0
    assert math.isclose(float(vocab_divergence(s, t, kind="jsd", beta=0.5)[1]), math.log(2.0), rel_tol=1e-6)


def test_a_masked_row_of_infinite_kl_gets_a_zero_gradient() -> None:
    """A row whose upstream gradient is 0 (a masked token) gets exactly zero gradients,
    its KL +inf or not: never ``0 * inf``."""
    s0, t0 = logits(T, V, torch.float32, 6)
    g = torch.ones(T)
    g[1] = g[2] = 0.0  # forward's and reverse's +inf rows
    for kind in ("forward", "reverse"):
        _, grads = _run(s0, t0, kind, 0.5, g)
        for gr in grads:
            assert gr is not None and not gr[1:3].any() and not gr.isnan().any()


def test_leading_dimensions_and_per_row_temperature() -> None:
    """``[B, S, V]`` logits (a transposed teacher: one copy) and a ``[B, S]`` temperature:
    the ``[B, S]`` results of the flattened call, the gradients in the inputs' shapes."""
    gen = torch.Generator().manual_seed(7)
    s = torch.randn(2, 3, 50, generator=gen, requires_grad=True)
    t = torch.randn(3, 2, 50, generator=gen).transpose(0, 1).requires_grad_()
    tau = torch.rand(2, 3, generator=gen) + 0.5
    got = vocab_divergence(s, t, kind="jsd", beta=0.3, temperature=tau)
    got.sum().backward()  # type: ignore[no-untyped-call]
    assert got.shape == (2, 3) and s.grad is not None and t.grad is not None and t.grad.shape == (2, 3, 50)
    flat = vocab_divergence(s.detach().reshape(6, 50), t.detach().reshape(6, 50), kind="jsd", beta=0.3,
                            temperature=tau.reshape(6))
    assert torch.equal(got.detach().reshape(6), flat)


def test_forward_only_keeps_nothing(seen: _probe.Seen) -> None:
    """Under ``torch.no_grad()``, or with neither side requiring grad, the forward alone: no
    ``save`` event and the same values; with grad, one."""
    s0, t0 = logits(T, V, torch.float32, 8)
    with torch.no_grad():
        a = vocab_divergence(s0.requires_grad_(), t0, kind="jsd")
    b = vocab_divergence(s0.detach(), t0, kind="jsd")
    assert seen.count("save") == 0 and torch.equal(a, b) and not a.requires_grad
    c = vocab_divergence(s0, t0, kind="jsd")
    assert seen.count("save", name="_Divergence") == 1 and torch.equal(b, c.detach())


@pytest.mark.parametrize(("kind", "beta"), KINDS[:3], ids=lambda k: str(k))
def test_invariant_bits_across_batch_chunks_and_splits(kind: Divergence, beta: float) -> None:
    """Invariant mode: a row's divergence and both gradients the same bits alone (T = 1),
    in a permuted batch at ``chunk_size`` 2, and walked in column splits of 128 (as a
    hidden-state pair head walks them), bfloat16 and every option."""
    t, v = 5, 600
    s0, t0 = logits(t, v, torch.bfloat16, 9)
    tau = torch.linspace(0.6, 1.4, t)
    opts: dict[str, Any] = {"softcap": 20.0, "vocab_size": 590, "invariant": True}
    g = torch.ones(t)
    value, grads = _run(s0, t0, kind, beta, g, temperature=tau, **opts)
    perm = torch.tensor([3, 0, 4, 2, 1])
    p_value, p_grads = _run(s0[perm], t0[perm], kind, beta, g, temperature=tau[perm], chunk_size=2, **opts)
    assert torch.equal(p_value, value[perm])
    assert all(a is not None and b is not None and torch.equal(a, b[perm]) for a, b in zip(p_grads, grads))
    for i in (0, 3):
        one, one_grads = _run(s0[i : i + 1], t0[i : i + 1], kind, beta, g[:1], temperature=tau[i : i + 1], **opts)
        assert torch.equal(one, value[i : i + 1])
        assert all(a is not None and b is not None and torch.equal(a, b[i : i + 1]) for a, b in zip(one_grads, grads))
    x, y = s0.float(), t0.float()
    checked = call_options(x, v, None, temperature=tau, softcap=20.0, vocab_size=590, invariant=True)
    call = _divergence.Call(pairs.Plan.of(kind, beta), checked)
    split = _divergence.divergence(_divergence.LogitsPair(x, y, split=256), call)
    assert torch.equal(split, value)


def test_splits_merge_as_the_whole_row() -> None:
    """The default reduction walked in column splits (a hidden-state pair head's walk):
    each split's statistics merged (``C`` with its weight side's scale alone) give the
    whole row's divergence, within float64 rounding."""
    s, t = (x.double() for x in logits(T, V, torch.float32, 10))
    checked = call_options(s, V, None, temperature=0.8, vocab_size=290)
    for kind, beta in KINDS[:3]:
        call = _divergence.Call(pairs.Plan.of(kind, beta), checked)
        whole = _divergence.divergence(_divergence.LogitsPair(s, t), call)
        split = _divergence.divergence(_divergence.LogitsPair(s, t, split=70), call)
        torch.testing.assert_close(split, whole, rtol=0, atol=1e-12)


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 4), st.integers(1, 140), st.sampled_from(KINDS), st.floats(0.3, 2.0),
       st.booleans(), st.integers(0, 2**16))
def test_random_shapes_against_float64(t: int, v: int, kind_beta: tuple[Divergence, float], tau: float, mask: bool,
                                       seed: int) -> None:
    """Any ``T`` (0 too) and ``V`` (1 too), a random mask of -inf logits on each side that
    leaves every row some mass: values and gradients against float64."""
    gen = torch.Generator().manual_seed(seed)
    s0, t0 = torch.randn(t, v, generator=gen) * 4, torch.randn(t, v, generator=gen) * 4
    if mask and t:
        for x in (s0, t0):
            x[torch.rand(t, v, generator=gen) < 0.3] = -math.inf
            x[:, 0] = 0.0
    kind, beta = kind_beta
    g = torch.randn(t, generator=gen)
    value, grads = _run(s0, t0, kind, beta, g, temperature=tau)
    check(value, grads, reference(s0, t0, kind, beta, g, temperature=tau), torch.float32, value_atol(s0, t0, tau),
          float(g.abs().max()) / tau if t else 0.0)


@pytest.mark.parametrize(("kind", "beta"), KINDS[:3], ids=lambda k: str(k))
def test_compiled_bodies_match_the_eager_ones(kind: Divergence, beta: float, seen: _probe.Seen) -> None:
    """The compiled backend runs the eager backend's bodies, compiled (dynamo's ``aot_eager``:
    the graphs inductor compiles), on chunks of a fixed shape: the same values and
    gradients within float32 rounding, the rows of every chunk computed."""
    s0, t0 = logits(T, V, torch.bfloat16, 11)
    g = torch.randn(T, generator=torch.Generator().manual_seed(12))
    opts = {"temperature": torch.linspace(0.6, 1.4, T), "softcap": 9.0, "chunk_size": 4}
    with selection.using("eager"):
        want, want_grads = _run(s0, t0, kind, beta, g, **opts)
    with selection.using("compiled", compiler="aot_eager", fresh=True):
        got, grads = _run(s0, t0, kind, beta, g, **opts)
    names = {"default_stats", "default_grad"} | ({"default_mix"} if kind == "jsd" else set())
    assert ran(seen, 4) == names  # 6 rows: chunks of 4 rows, the last one overlapping
    torch.testing.assert_close(got, want, rtol=0, atol=value_atol(s0, t0, 0.6), equal_nan=True)
    for a, b in zip(grads, want_grads):
        assert a is not None and b is not None
        torch.testing.assert_close(a.float(), b.float(), rtol=2.0**-7, atol=2.0**-7 * float(b.float().abs().max()))


def test_inductor_compiles_the_forward_kl(seen: _probe.Seen) -> None:
    """inductor itself (C++ on the CPU), on a tiny shape: forward KL's statistics and the
    student's gradient, against float64."""
    s0, t0 = logits(T, 40, torch.float32, 13)
    g = torch.ones(T)
    s = s0.clone().requires_grad_()
    with selection.using("compiled", fresh=True):
        value = vocab_divergence(s, t0, temperature=0.9)
        value.sum().backward()  # type: ignore[no-untyped-call]
    assert {"default_stats", "default_grad"} <= {e.name for e in seen.of("launch", backend="compiled")}
    ref, ref_s, _, finite = reference(s0, t0, "forward", 0.5, g, temperature=0.9)
    torch.testing.assert_close(value.double()[finite], ref[finite], rtol=0, atol=value_atol(s0, t0, 0.9))
    assert s.grad is not None
    torch.testing.assert_close(s.grad.double()[finite], ref_s[finite], rtol=1e-5, atol=1e-6)


REFUSALS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"student": [[0.0]]}, TypeError, "student must be a torch.Tensor"),
    ({"teacher": torch.zeros(3, 5, dtype=torch.int64)}, TypeError, "teacher has dtype torch.int64; pass floating"),
    ({"student": torch.zeros(5)}, LayoutError, "student has shape \\(5,\\); it must be 2-D"),
    ({"teacher": torch.zeros(3, 4)}, LayoutError, "student has shape \\(3, 5\\) but teacher has \\(3, 4\\)"),
    ({"student": torch.zeros(3, 0), "teacher": torch.zeros(3, 0)}, LayoutError, "student has shape \\(3, 0\\): 0 voc"),
    ({"teacher": torch.zeros(3, 5, device="meta")}, LayoutError, "teacher is on meta but student on cpu"),
    ({"softcap": "8"}, TypeError, "softcap must be a real number"),
    ({"chunk_size": 2.0}, TypeError, "chunk_size 2.0 is a float, not an int"),
    ({"kind": "kl"}, LayoutError, "kind='kl' is not one of 'forward'"),
    ({"beta": 1.5}, LayoutError, "beta=1.5 is not allowed: the mixture weight of jsd must be in \\[0, 1\\]"),
    ({"beta": "0.5"}, TypeError, "beta must be a real number"),
    ({"temperature": 0.0}, LayoutError, "temperature=0.0 is not allowed"),
    ({"vocab_size": 6}, LayoutError, "vocab_size=6 is not allowed"),
    ({"temperature": torch.ones(4)}, LayoutError, "temperature"),
]


@pytest.mark.parametrize(("change", "error", "message"), REFUSALS, ids=lambda c: str(c)[:40])
def test_refusals_name_the_argument(change: dict[str, Any], error: type[Exception], message: str) -> None:
    call: dict[str, Any] = {"student": torch.zeros(3, 5), "teacher": torch.zeros(3, 5), "kind": "jsd"}
    call.update(change)
    with pytest.raises(error, match=message):
        vocab_divergence(call.pop("student"), call.pop("teacher"), **call)
