"""A call whose inputs need no gradient (under ``torch.no_grad()``, or no input requiring
one: old and reference log-probs) runs forward alone: no autograd Function, nothing
saved (``_probe``'s ``save`` events), one GEMM per block on the hidden-state path (the
``block_gemm`` step, counted), and the values of the call with gradients, bit for bit, in
both modes, on both heads, top-k included."""

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import Tensor

from cpslice import (
    _probe,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    log_probs_at,
    log_probs_at_from_hidden,
    topk_log_probs,
    topk_log_probs_from_hidden,
)
from cpslice._vocab.backends import selection

T, H, V = 7, 8, 300
GEN = torch.Generator().manual_seed(2)
HIDDEN, WEIGHT, LOGITS = torch.randn(T, H, generator=GEN), torch.randn(V, H, generator=GEN), torch.randn(T, V)
TARGETS, IDS = torch.randint(0, V, (T,), generator=GEN), torch.randint(0, V, (T, 3), generator=GEN)

Call = Callable[[list[Tensor], bool], tuple[Tensor, ...]]
CALLS: dict[str, tuple[bool, Call]] = {  # name: (hidden-state path, call on its inputs)
    "log_probs_and_entropy": (False, lambda x, inv: log_probs_and_entropy(
        x[0], TARGETS, with_entropy=True, temperature=0.7, invariant=inv)),
    "log_probs_at": (False, lambda x, inv: (log_probs_at(x[0], IDS, softcap=9.0, invariant=inv),)),
    "topk_log_probs": (False, lambda x, inv: topk_log_probs(x[0], 3, invariant=inv)),
    "log_probs_and_entropy_from_hidden": (True, lambda x, inv: log_probs_and_entropy_from_hidden(
        x[0], x[1], TARGETS, with_entropy=True, chunk_size=2, invariant=inv)),
    "log_probs_at_from_hidden": (True, lambda x, inv: (log_probs_at_from_hidden(
        x[0], x[1], IDS, chunk_size=2, invariant=inv),)),
    "topk_log_probs_from_hidden": (True, lambda x, inv: topk_log_probs_from_hidden(
        x[0], x[1], 3, temperature=0.8, chunk_size=2, invariant=inv)),
}


def _run(name: str, invariant: bool, how: str) -> tuple[tuple[Tensor, ...], _probe.Seen, int]:
    """The call ``name`` with gradients (``how="grad"``), under ``torch.no_grad()`` or on
    inputs that require none; its outputs, events and GEMMs."""
    hidden, call = CALLS[name]
    inputs = [HIDDEN.clone(), WEIGHT.clone()] if hidden else [LOGITS.clone()]
    if how != "leaves":
        inputs = [x.requires_grad_() for x in inputs]
    gemms = [0]

    def gemm(a: Tensor, b: Tensor) -> Tensor:
        gemms[0] += 1
        return torch.mm(a, b)

    with selection.using("eager"), _probe.substitute("block_gemm", gemm), _probe.watch() as seen, (
            torch.no_grad() if how == "no_grad" else nullcontext()):
        out = call(inputs, invariant)
    return out, seen, gemms[0]


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("name", list(CALLS))
def test_a_forward_only_call_saves_nothing_and_runs_one_pass(name: str, invariant: bool) -> None:
    want, with_grad, gemms = _run(name, invariant, "grad")
    assert with_grad.count("save") == 1 and any(w.requires_grad for w in want)
    blocks = with_grad.count("call", name="stats")
    hidden = CALLS[name][0]
    assert gemms == (blocks if hidden else 0) and blocks >= (4 if hidden and not invariant else 1)  # 64 x 1024
    for how in ("no_grad", "leaves"):
        got, seen, n = _run(name, invariant, how)
        assert seen.count("save") == 0  # no Function, no Saved record
        assert n == gemms and seen.count("call", name="stats") == blocks  # one pass, the same blocks
        assert seen.count("call", name="grad") == 0
        for g, w in zip(got, want):
            assert not g.requires_grad and g.dtype == w.dtype and torch.equal(g, w.detach()), how


def test_a_temperature_that_requires_grad_gets_none_forward_only() -> None:
    """As inside the autograd Function: the options are not differentiable."""
    tau: Any = torch.full((T,), 0.7, requires_grad=True)
    lp, ent = log_probs_and_entropy(LOGITS, TARGETS, with_entropy=True, temperature=tau)
    assert not lp.requires_grad and not ent.requires_grad
