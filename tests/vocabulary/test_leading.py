"""``[..., V]`` logits (``cpslice._vocab.leading``): ``log_probs_and_entropy``,
``log_probs_at``, ``topk_log_probs`` and ``entropy`` take any leading shape, with
targets, ids and per-row temperatures of it, and give it back: the bits of the 2-D call
on the flattened tensors, values and gradients, zero-size leading dimensions included;
a 2-D call is the engine's call untouched; a view where the leading dimensions merge,
one copy where they do not (measured), the caller's tensor never modified; against
float64; and the refusals, naming both shapes."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from cpslice import LayoutError, entropy, log_probs_and_entropy, log_probs_at, topk_log_probs
from cpslice._vocab import head
from cpslice._vocab.leading import Leading
from cpslice._vocab.logits import LogitsHead

from ..support.checked import refused
from ..support.reference import EPS32, entropy64, softmax64
from ..support.token_sets import csr

V = 11
Call = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, ...]]


def _sets(rows: int) -> list[list[int]]:
    """A set on every other flattened row."""
    return [[t % V, (t + 3) % V] if t % 2 else [] for t in range(rows)]


# each function on (logits, targets, ids, per-row temperature), as a tuple of its results
CALLS: dict[str, Call] = {
    "log_probs_and_entropy": lambda x, t, ids, tau: log_probs_and_entropy(
        x, t, with_entropy=True, temperature=tau, softcap=5.0),
    "support": lambda x, t, ids, tau: log_probs_and_entropy(
        x, t, with_entropy=True, support=csr(_sets(t.numel())), entropy_over="support"),
    "log_probs_at": lambda x, t, ids, tau: (log_probs_at(x, ids, temperature=tau, vocab_size=V - 1),),
    "topk_log_probs": lambda x, t, ids, tau: topk_log_probs(x, 3, temperature=tau),
    "entropy": lambda x, t, ids, tau: (entropy(x, temperature=tau, softcap=5.0, vocab_size=V - 1),),
    "invariant": lambda x, t, ids, tau: (entropy(x, temperature=tau, invariant=True),
                                         log_probs_at(x, ids, invariant=True)),
}


def _inputs(lead: tuple[int, ...], seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, V, generator=gen) * 3
    x.view(-1, V)[::3, 2] = -torch.inf  # a masked token on some rows
    targets = torch.randint(0, V - 1, lead, generator=gen)
    ids = torch.randint(0, V - 1, (*lead, 4), generator=gen)
    return x, targets, ids, 0.5 + torch.rand(lead, generator=gen)


def _run(call: Call, x: Tensor, *rest: Tensor) -> tuple[list[Tensor], Tensor | None]:
    """``call``'s results on a fresh leaf of ``x`` and the leaf's gradient of a fixed
    weighting of the differentiable ones (None: none is)."""
    leaf = x.clone().requires_grad_(True)
    out = list(call(leaf, *rest))
    loss = [(o * torch.cos(torch.arange(o.numel()).reshape(o.shape) * 0.7)).sum() for o in out if o.requires_grad]
    if loss:
        torch.autograd.backward(loss)
    return out, leaf.grad


@pytest.mark.parametrize("lead", [(2, 3), (2, 1, 3), (0, 3), (2, 0)], ids=str)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_leading_shape_is_the_flattened_calls(name: str, lead: tuple[int, ...]) -> None:
    x, targets, ids, tau = _inputs(lead)
    before = x.clone()
    got, grad = _run(CALLS[name], x, targets, ids, tau)
    flat, flat_grad = _run(CALLS[name], x.reshape(-1, V), targets.reshape(-1), ids.reshape(-1, 4), tau.reshape(-1))
    assert len(got) == len(flat)
    for a, b in zip(got, flat):
        assert a.shape == (*lead, *b.shape[1:]), (a.shape, b.shape)
        assert torch.equal(a.reshape(b.shape), b)
    assert (grad is None) == (flat_grad is None)
    if grad is not None and flat_grad is not None:
        assert grad.shape == x.shape and torch.equal(grad.reshape(flat_grad.shape), flat_grad)
    assert torch.equal(x, before)


def test_a_2d_call_is_the_engines_call_untouched() -> None:
    x, targets, ids, tau = _inputs((4,))
    lp, h = log_probs_and_entropy(x, targets, with_entropy=True, temperature=tau)
    logits = LogitsHead(x)
    want = head.log_probs(logits, targets, head.options(logits, targets, with_entropy=True, temperature=tau))
    assert torch.equal(lp, want[0]) and want[1] is not None and torch.equal(h, want[1])
    # the same tensor objects through every step: no view, no copy
    lead = Leading.of("logits", x)
    assert not lead.nd and lead.flat(x) is x and lead.per_row("ids", ids, "k") is ids
    assert lead.temperature(tau) is tau and lead.restore(lp) is lp and lead.restore(None) is None


def test_against_float64() -> None:
    x, targets, ids, tau = _inputs((2, 3), seed=1)
    leaf = x.clone().requires_grad_(True)
    lp, h = log_probs_and_entropy(leaf, targets, with_entropy=True, temperature=tau, softcap=4.0)
    at = log_probs_at(leaf, ids, temperature=tau, softcap=4.0)
    g = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(2))
    torch.autograd.backward(((lp * g[0]) + (h * g[1]) + (at.sum(-1) * g[2])).sum())
    x64 = x.double().requires_grad_(True)
    log_p = softmax64(x64, tau, 4.0)
    lp64 = log_p.gather(-1, targets[..., None])[..., 0]
    h64 = entropy64(x64, tau, 4.0)
    at64 = log_p.gather(-1, ids)
    torch.autograd.backward(((lp64 * g[0]) + (h64 * g[1]) + (at64.sum(-1) * g[2])).sum())
    for got, want in ((lp, lp64), (h, h64), (at, at64)):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want.detach(), rtol=0, atol=64 * EPS32)
    assert leaf.grad is not None and x64.grad is not None
    torch.testing.assert_close(leaf.grad.double(), x64.grad, rtol=0, atol=64 * EPS32)


class _NewStorage(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The sizes (in elements) of the new storages the operators return: a view of an
    input is none."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, Tensor)}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, Tensor) and o.untyped_storage().data_ptr() not in given:
                self.sizes.append(o.untyped_storage().nbytes() // o.element_size())
        return out


@contextmanager
def _copies_of(rows: int) -> Iterator[list[int]]:
    """The new storages of at least ``rows * V`` elements made inside the block."""
    found: list[int] = []
    with _NewStorage() as mode:
        yield found
    found += [n for n in mode.sizes if n >= rows * V]


VIEWS: dict[str, tuple[Callable[[Tensor], Tensor], int]] = {
    # (the logits from a [2, 4, V + 2] tensor, the copies of [T, V] the forward makes)
    "contiguous": (lambda base: base[..., :V].contiguous(), 0),
    "vocabulary slice": (lambda base: base[..., :V], 0),  # rows evenly spaced: a view
    "x[:, :-1]": (lambda base: base[:, :-1, :V], 1),
    "transposed": (lambda base: base[..., :V].transpose(0, 1), 1),
}


@pytest.mark.parametrize("case", sorted(VIEWS))
def test_a_view_where_one_suffices_else_one_copy(case: str) -> None:
    make, copies = VIEWS[case]
    base = torch.randn(2, 4, V + 2, generator=torch.Generator().manual_seed(3))
    before = base.clone()
    x = make(base.clone().requires_grad_(True))  # a non-leaf view, as a model's output slice
    x.retain_grad()
    targets = torch.arange(x.shape[0] * x.shape[1]).reshape(x.shape[:2]) % V
    with _copies_of(targets.numel()) as found:
        lp, h = log_probs_and_entropy(x, targets, with_entropy=True, chunk_size=1)
    assert len(found) == copies, found
    torch.autograd.backward(lp.sum() + h.sum())
    flat = x.detach().reshape(-1, V).clone().requires_grad_(True)
    lp2, h2 = log_probs_and_entropy(flat, targets.reshape(-1), with_entropy=True, chunk_size=1)
    torch.autograd.backward(lp2.sum() + h2.sum())
    assert torch.equal(lp.reshape(-1), lp2) and torch.equal(h.reshape(-1), h2)
    assert x.grad is not None and flat.grad is not None
    assert torch.equal(x.grad.reshape(-1, V), flat.grad)
    assert torch.equal(base, before)


def test_temperature_of_the_leading_shape_or_flattened() -> None:
    x, targets, _, tau = _inputs((2, 3))
    by_shape = entropy(x, temperature=tau)
    assert torch.equal(by_shape, entropy(x, temperature=tau.reshape(-1)))
    assert torch.equal(by_shape, log_probs_and_entropy(x, targets, with_entropy=True, temperature=tau)[1])


LOGITS = torch.zeros(2, 3, V)
REFUSALS: list[tuple[Callable[[], object], type, str]] = [
    (lambda: entropy(torch.zeros(5)), LayoutError, r"logits has shape \(5,\); it must be 2-D \[T, V_local\] or more"),
    (lambda: topk_log_probs(torch.zeros(5), 1), LayoutError, r"logits has shape \(5,\); it must be 2-D"),
    (lambda: log_probs_at(torch.zeros(()), torch.zeros(1, 1, dtype=torch.int64)), LayoutError,
     r"logits has shape \(\); it must be 2-D"),
    (lambda: entropy(torch.zeros(2, 3, 0)), LayoutError, r"shape \(2, 3, 0\): 0 vocabulary columns"),
    (lambda: log_probs_and_entropy(LOGITS, torch.zeros(2, 4, dtype=torch.int64)), LayoutError,
     r"targets has shape \(2, 4\) but logits has shape \(2, 3, 11\); targets must be \[\.\.\.\] = \[2, 3\], "
     r"one per row \(the leading shape of logits, logits\.shape\[:-1\]\)"),
    (lambda: log_probs_and_entropy(LOGITS, torch.zeros(6, dtype=torch.int64)), LayoutError,
     r"targets has shape \(6,\) but logits has shape \(2, 3, 11\); targets must be \[\.\.\.\] = \[2, 3\]"),
    (lambda: log_probs_and_entropy(LOGITS, torch.zeros(2, 3, dtype=torch.int32)), TypeError,
     r"targets has dtype torch\.int32"),
    (lambda: log_probs_at(LOGITS, torch.zeros(2, 3, dtype=torch.int64)), LayoutError,
     r"ids has shape \(2, 3\) but logits has shape \(2, 3, 11\); ids must be \[\.\.\., k\] = \[2, 3, k\], "
     r"k >= 1 per row"),
    (lambda: log_probs_at(LOGITS, torch.zeros(2, 3, 0, dtype=torch.int64)), LayoutError,
     r"ids has shape \(2, 3, 0\) but logits .* k >= 1 per row"),
    (lambda: log_probs_at(LOGITS, torch.zeros(2, 3, 1, dtype=torch.int64) + V), LayoutError,
     r"ids\[0, 0\] = 11 is outside the vocabulary \[0, 11\)"),
    (lambda: entropy(LOGITS, temperature=torch.ones(3, 2)), LayoutError,
     r"temperature has shape \(3, 2\) but logits has shape \(2, 3, 11\); one temperature per row is \[\.\.\.\] = "
     r"\[2, 3\] \(logits\.shape\[:-1\]\) or flattened \[T\] = \[6\]"),
    (lambda: entropy(LOGITS, temperature=torch.zeros(2, 3)), LayoutError,
     r"temperature\[0\] = 0\.0 is not allowed"),
    (lambda: entropy(LOGITS, support=csr([[1]] * 5)), LayoutError, r"5 rows|6 rows"),
    (lambda: entropy(LOGITS, entropy_over="all"), LayoutError,  # type: ignore[arg-type]
     r"entropy_over='all' is not one of"),
]


@pytest.mark.parametrize(("call", "error", "match"), REFUSALS)
def test_refusals(call: Callable[[], object], error: type, match: str) -> None:
    with refused(error, match):
        call()
