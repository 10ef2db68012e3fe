"""``vocab_divergence`` through the Triton backend's kernels on the CPU, under Triton's
interpreter (``TRITON_INTERPRET=1``, set for the session by conftest.py): every kind in
float32 and bfloat16 with a per-row temperature, a cap and a padded vocabulary against
float64, a Triton launch asserted for each pass (a silent fallback fails); invariant mode
declines there and runs the eager spec (its launches say so); and the rows of an index
(a per-sample call's response rows) on every backend: those rows computed, no other read
or written."""

from typing import Any

import pytest
import torch

from cpslice import _probe, vocab_divergence
from cpslice._types import Divergence
from cpslice._vocab import divergence as _divergence
from cpslice._vocab import pairs
from cpslice._vocab.args import options as call_options
from cpslice._vocab.backends import selection

from ..support.divergence_cases import KINDS, check, logits, reference, value_atol
from ..support.triton_cases import launched

pytest.importorskip("triton")  # in the dev install (requirements-dev.txt): never skipped by `make test`

T, V = 5, 300


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("kind", "beta"), KINDS, ids=lambda k: str(k))
def test_triton_kernels_against_float64(dtype: torch.dtype, kind: Divergence, beta: float, seen: _probe.Seen) -> None:
    s0, t0 = logits(T, V, dtype, 21)
    tau = torch.linspace(0.6, 1.4, T)
    opts: dict[str, Any] = {"temperature": tau, "vocab_size": 290}
    if kind == "jsd" and beta == 0.3:
        opts["softcap"] = 8.0
    g = torch.randn(T, generator=torch.Generator().manual_seed(22))
    s, t = s0.clone().requires_grad_(), t0.clone().requires_grad_()
    before = len(seen.events)
    with selection.using("triton"):
        value = vocab_divergence(s, t, kind=kind, beta=beta, **opts)
        torch.autograd.backward((value * g).sum())
    mix = {"pair.mix"} if kind == "jsd" and 0 < beta < 1 else set()
    assert launched(seen, before) == {"pair.stats", "pair.grad"} | mix
    want = reference(s0, t0, kind, beta, g, **opts)
    check(value, (s.grad, t.grad), want, dtype, value_atol(s0, t0, tau), float(g.abs().max()) / 0.6)
    assert s.grad is not None and not s.grad[:, 290:].any()


def test_invariant_mode_declines_triton_and_runs_the_eager_spec(seen: _probe.Seen) -> None:
    """The Triton backend declines invariant mode's divergence (docs/backends.md): no Triton
    launch, the eager spec's launches, and the bits of ``CPSLICE_BACKEND=eager``."""
    s0, t0 = logits(T, V, torch.bfloat16, 23)
    s = s0.clone().requires_grad_()
    with selection.using("triton"):
        before = len(seen.events)
        got = vocab_divergence(s, t0, kind="jsd", invariant=True)
        got.sum().backward()  # type: ignore[no-untyped-call]
        assert launched(seen, before) == set()
    assert {e.name for e in seen.events[before:] if e.kind == "launch" and e.backend == "eager"
            and e.invariant} == {"pair_stats", "pair_mix", "pair_grad"}
    with selection.using("eager"):
        assert torch.equal(got, vocab_divergence(s0, t0, kind="jsd", invariant=True))


@pytest.mark.parametrize("backend", ["eager", "compiled", "triton"])
def test_the_rows_of_an_index_alone(backend: str, seen: _probe.Seen) -> None:
    """The driver's ``Options.rows`` (a per-sample call's response rows): each backend's
    kernels compute exactly those rows, their values and gradients those of the whole
    call, every other gradient row zero."""
    s0, t0 = logits(8, V, torch.float32, 24)
    need = torch.tensor([False, True, True, False, False, True, False, True])
    checked = call_options(s0, V, None, temperature=0.8, chunk_size=2)
    for kind, beta in KINDS[:3]:
        call = _divergence.Call(pairs.Plan.of(kind, beta), checked)
        whole = _divergence.divergence(_divergence.LogitsPair(s0, t0), call)
        s, t = s0.clone().requires_grad_(), t0.clone().requires_grad_()
        before = len(seen.events)
        with selection.using(backend, compiler="aot_eager" if backend == "compiled" else None, fresh=True):
            part = _divergence.divergence(_divergence.LogitsPair(s, t), call._replace(
                options=checked._replace(rows=need)))
            torch.autograd.backward(part[need].sum())
        calls = [e for e in seen.events[before:] if e.kind == "call"]
        assert calls and all(e.rows == 4 for e in calls)
        assert {e.backend for e in seen.events[before:] if e.kind == "launch"} == {backend}
        torch.testing.assert_close(part[need], whole[need], rtol=0, atol=value_atol(s0, t0, 0.8))
        for grad in (s.grad, t.grad):
            assert grad is not None and not grad[~need].any() and grad[need].any()
