"""``cpslice.entropy`` and ``entropy_from_hidden``: the entropy without targets, with its
gradient. Against float64 (values, the logits' gradient; the hidden states' and the
weight's) under every option: a temperature (one, per row), softcap, vocab_size,
chunking, a support with ``entropy_over`` either way (the set alone); invariant mode's
bits are ``log_probs_and_entropy``'s entropy's, values and gradient, whatever the rows
and chunks; a detached metric under ``no_grad``; the Triton kernels through the
interpreter, a launch asserted. TP on gloo: tests/distributed/test_entropy_tp.py."""

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from cpslice import (
    _probe,
    entropy,
    entropy_from_hidden,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
)
from cpslice._vocab.backends import selection as backend

from ..support.reference import EPS32, entropy64
from ..support.token_sets import Sets, csr
from ..support.triton_cases import launched

V = 17
LEAD = (2, 3)
SETS: Sets = [[], [3], [0, 5, 16], [2, 9], [2, 4, 6, 8, 10, 12], [12]]
"""A set on most of the 6 rows: one id (entropy 0), one holding a masked (-inf) logit."""
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "temperature": {"temperature": 0.6},
    "per-row": {"temperature": "per-row"},
    "softcap": {"softcap": 5.0, "temperature": 1.3},
    "vocab_size": {"vocab_size": 13},
    "chunk": {"chunk_size": 1},
    "support": {"support": SETS, "entropy_over": "support", "temperature": "per-row"},
}


def _logits(seed: int = 0, dtype: torch.dtype = torch.float32, v: int = V) -> Tensor:
    """``[2, 3, v]`` logits: a masked token on rows 0 and 3, a peaked row 4."""
    x = torch.randn(*LEAD, v, generator=torch.Generator().manual_seed(seed)) * 3
    x.view(-1, v)[::3, 2] = -torch.inf
    x.view(-1, v)[4, 1] += 40.0
    return x.to(dtype)


def _keywords(name: str) -> dict[str, Any]:
    """``OPTIONS[name]`` as the call takes them: the per-row temperature a ``[2, 3]``
    tensor, the sets a ``Support``."""
    opts = dict(OPTIONS[name])
    if opts.get("temperature") == "per-row":
        opts["temperature"] = torch.linspace(0.5, 1.5, 6).reshape(LEAD)
    if "support" in opts:
        opts["support"] = csr(opts["support"])
    return opts


def _reference(z: Tensor, opts: dict[str, Any]) -> Tensor:
    """The float64 entropy of ``z`` under the call's keywords ``opts``."""
    support = opts.get("support")
    sets = OPTIONS["support"]["support"] if support is not None and opts.get("entropy_over") == "support" else None
    return entropy64(z, opts.get("temperature", 1.0), opts.get("softcap"), opts.get("vocab_size"), sets)


def _weights(shape: tuple[int, ...]) -> Tensor:
    """Fixed upstream gradients of a result of ``shape`` (float64)."""
    return torch.cos(torch.arange(math.prod(shape), dtype=torch.float64) * 0.9 + 0.2).reshape(shape)


def _grad_of(call: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    """``call`` on a fresh leaf of ``x`` and the leaf's gradient of ``_weights . result``."""
    leaf = x.clone().requires_grad_(True)
    out = call(leaf)
    torch.autograd.backward((out * _weights(out.shape).to(out.dtype)).sum())
    assert leaf.grad is not None
    return out.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_against_float64(name: str, dtype: torch.dtype) -> None:
    x = _logits(1, dtype)
    opts = _keywords(name)
    h, grad = _grad_of(lambda leaf: entropy(leaf, **opts), x)
    assert h.shape == LEAD and h.dtype == dtype and grad.dtype == dtype
    x64 = x.double().requires_grad_(True)
    want = _reference(x64, opts)
    torch.autograd.backward((want * _weights(LEAD)).sum())
    assert x64.grad is not None
    tol = 1e-12 if dtype == torch.float64 else 128 * EPS32
    torch.testing.assert_close(h.double(), want.detach(), rtol=0, atol=tol * 10)
    torch.testing.assert_close(grad.double(), x64.grad, rtol=0, atol=tol)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_support_over_the_full_vocabulary_changes_nothing(invariant: bool) -> None:
    x = _logits(2)
    tau = torch.linspace(0.5, 1.5, 6).reshape(LEAD)
    plain = _grad_of(lambda leaf: entropy(leaf, temperature=tau, invariant=invariant), x)
    full = _grad_of(lambda leaf: entropy(leaf, temperature=tau, support=csr(SETS), invariant=invariant), x)
    assert torch.equal(plain[0], full[0]) and torch.equal(plain[1], full[1])


def _targets_in_sets() -> Tensor:
    """Each row's target in its set (where it has one): the restricted set is the set."""
    return torch.tensor([min(s) if s else 7 for s in SETS]).reshape(LEAD)


@pytest.mark.parametrize("name", ["plain", "per-row", "softcap", "vocab_size", "support"])
def test_invariant_bits_are_log_probs_and_entropys(name: str) -> None:
    x = _logits(3, v=300)
    opts = _keywords(name)
    got = _grad_of(lambda leaf: entropy(leaf, invariant=True, **opts), x)
    want = _grad_of(lambda leaf: log_probs_and_entropy(
        leaf, _targets_in_sets(), with_entropy=True, invariant=True, **opts)[1], x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # whatever the other rows and the chunks: the first batch row alone, one row a chunk
    tau = opts.get("temperature", 1.0)
    alone = dict(opts, temperature=tau[:1] if isinstance(tau, Tensor) else tau)
    if "support" in opts:
        alone["support"] = csr(SETS[:3])
    assert torch.equal(entropy(x[:1], invariant=True, chunk_size=1, **alone), got[0][:1])


def test_a_detached_metric_under_no_grad() -> None:
    x = _logits(4).requires_grad_(True)
    with torch.no_grad():
        metric = entropy(x)
    assert not metric.requires_grad
    live = entropy(x)
    assert live.requires_grad and torch.equal(metric, live.detach())


HIDDEN_CASES = ["plain", "softcap", "vocab_size", "support"]


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("name", HIDDEN_CASES)
def test_hidden_form_against_float64(name: str, invariant: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(6, 5, generator=gen) * 1.5, torch.randn(V, 5, generator=gen)
    opts: dict[str, Any] = {k: v.reshape(-1) if isinstance(v, Tensor) else v for k, v in _keywords(name).items()}
    hs, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h = entropy_from_hidden(hs, w, chunk_size=2, invariant=invariant, **opts)
    g = torch.cos(torch.arange(6.0))
    torch.autograd.backward((h * g).sum())
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want = _reference(h64 @ w64.T, opts)
    torch.autograd.backward((want * g.double()).sum())
    assert h.shape == (6,) and hs.grad is not None and w.grad is not None
    assert h64.grad is not None and w64.grad is not None
    torch.testing.assert_close(h.double(), want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(hs.grad.double(), h64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    if invariant:  # the same bits as the log-probs' entropy (targets in the sets)
        _, ent = log_probs_and_entropy_from_hidden(hidden, weight, _targets_in_sets().reshape(-1), with_entropy=True,
                                                   chunk_size=2, invariant=True, **opts)
        assert ent is not None and torch.equal(h.detach(), ent)


@pytest.mark.parametrize("invariant", [False, True])
def test_triton_kernels(seen: _probe.Seen, invariant: bool) -> None:
    pytest.importorskip("triton")  # in the dev install (requirements-dev.txt): never skipped by `make test`
    x = _logits(6, v=140)  # two tiles of invariant mode's 128 columns
    opts: dict[str, Any] = {"temperature": torch.linspace(0.5, 1.5, 6).reshape(LEAD), "softcap": 20.0,
                            "vocab_size": 135, "invariant": invariant}
    before = len(seen.events)
    with backend.using("triton"):
        leaf = x.clone().requires_grad_(True)
        h = entropy(leaf, **opts)
        forward = launched(seen, before)
        torch.autograd.backward((h * _weights(LEAD)).sum())
        if invariant:
            want = _grad_of(lambda y: log_probs_and_entropy(y, _targets_in_sets(), with_entropy=True, **opts)[1], x)
            assert torch.equal(h.detach(), want[0]) and leaf.grad is not None and torch.equal(leaf.grad, want[1])
    stats, grad = ("invariant_tiles", "invariant_grad") if invariant else ("default.stats", "default.grad")
    assert stats in forward and grad not in forward
    assert grad in launched(seen, before)
    x64 = x.double().requires_grad_(True)
    ref = _reference(x64, opts)
    torch.autograd.backward((ref * _weights(LEAD)).sum())
    assert leaf.grad is not None and x64.grad is not None
    torch.testing.assert_close(h.double(), ref.detach(), rtol=0, atol=2e-5)
    # the entropy's gradient carries log p: a few float32 roundings of it
    torch.testing.assert_close(leaf.grad.double(), x64.grad, rtol=0, atol=64 * EPS32 * float(x64.grad.abs().max()))
