"""Rows outside the response: a row whose value no function returns (a prompt row, a
padding row between samples, before the first or after the last) is never read. Its
logits (or hidden state) may be NaN, +-inf or huge: the returned values and every
gradient are those of a batch whose such rows are finite, bit for bit, and its own
gradient row is exactly zero; on the logits path and the hidden-state path, with and
without a support, in default and invariant mode, through the compiled and the eager
kernels. The kernels are given the response rows as an index (``_vocab.rows``), so
their chunks never hold another row, however short the gaps between responses (the
default chunk is far longer than these)."""

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

from cpslice import (
    Layout,
    Support,
    _probe,
    response_distillation,
    response_distillation_from_hidden,
    response_log_probs,
    response_log_probs_from_hidden,
    response_topk_log_probs,
    response_topk_log_probs_from_hidden,
    response_vocab_distillation,
    topk_log_probs,
)
from cpslice._vocab.backends import selection as _backend

# padding after every sample (two rows, three, two): rows 0-2 are a prompt before the
# first response (rows 3-5), 6-10 between it and the next (11-12), 13-19, then 22-24 after
TOTAL, RESPONSE, PADDED = [7, 5, 6], [3, 2, 2], [9, 8, 8]
ROWS = sum(PADDED)
RESPONSE_ROWS = [3, 4, 5, 11, 12, 20, 21]
OUTSIDE = [r for r in range(ROWS) if r not in RESPONSE_ROWS]
V, H, K = 40, 6, 3

Run = Callable[[Tensor], list[Tensor]]  # the call on logits (or hidden), its differentiable outputs


@pytest.fixture(params=["eager", "compiled", "triton"])
def kernels_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """The eager kernels (``CPSLICE_BACKEND=eager``), the compiled ones traced by
    ``aot_eager`` (invariant mode's checked against its eager bits), or the Triton ones
    through Triton's interpreter (``TRITON_INTERPRET=1``, set for the session by
    conftest.py); only these tests' kernels counted."""
    with _backend.using(request.param, compiler="aot_eager", fresh=True):
        yield request.param


def _layout() -> Layout:
    return Layout(TOTAL, RESPONSE, padded_lengths=PADDED)


def _poisoned(x: Tensor) -> Tensor:
    """``x`` with every row outside the responses replaced by one that breaks a softmax:
    NaN, all -inf, +inf, huge of both signs, all at the float32 maximum."""
    bad = x.detach().clone()
    kinds = [math.nan, -math.inf, math.inf]
    for i, r in enumerate(OUTSIDE):
        kind = i % 5
        if kind < 3:
            bad[r] = kinds[kind]
        elif kind == 3:
            bad[r] = torch.tensor([3e38, -3e38]).repeat(x.shape[1] // 2 + 1)[: x.shape[1]]
        else:
            bad[r] = torch.finfo(x.dtype).max
    return bad


def _outputs_and_grads(run: Run, x: Tensor, extra: Tensor | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """The outputs of ``run`` on ``x`` and the gradients (of ``x``, then of ``extra``) of a
    weighted sum of them, weights fixed by seed."""
    x = x.detach().clone().requires_grad_(True)
    outs = run(x)
    gen = torch.Generator().manual_seed(5)
    loss = sum(((torch.randn(o.shape, generator=gen, dtype=o.dtype) * o).sum() for o in outs), x.sum() * 0)
    torch.autograd.backward(loss)
    assert x.grad is not None
    grads = [x.grad]
    if extra is not None:
        assert extra.grad is not None
        grads.append(extra.grad.clone())
        extra.grad = None
    return [o.detach() for o in outs], grads


def _check(run: Run, x: Tensor, extra: Tensor | None = None) -> None:
    """``run`` on ``x`` and on ``x`` poisoned outside the responses: the same outputs and
    gradients bit for bit, every one finite, and zero gradient rows outside."""
    clean, clean_grads = _outputs_and_grads(run, x, extra)
    got, grads = _outputs_and_grads(run, _poisoned(x), extra)
    for a, b in zip(got, clean):
        assert torch.equal(a, b), "a returned value depends on a row outside the responses"
    assert bool(grads[0][OUTSIDE].eq(0).all()), "a row outside the responses has a gradient"
    for a, b in zip(grads, clean_grads):
        assert bool(a.isfinite().all()), "a gradient is not finite"
        assert torch.equal(a, b)


def _flat(*shares: list[Tensor]) -> list[Tensor]:
    return [torch.cat(s) for s in shares]


def _tokens(gen: torch.Generator) -> list[Tensor]:
    return [torch.randint(0, V, (t,), generator=gen) for t in TOTAL]


def _teacher(gen: torch.Generator) -> tuple[list[Tensor], list[Tensor]]:
    lps, ids = zip(*(topk_log_probs(torch.randn(r, V, generator=gen) * 2, K) for r in RESPONSE))
    return list(lps), list(ids)


def _sets(layout: Layout, gen: torch.Generator) -> Support:
    """Sets on every other response row (the others unrestricted)."""
    ids, offsets = [], []
    for r in RESPONSE:
        sets = [torch.randperm(V, generator=gen)[: 4 if j % 2 == 0 else 0] for j in range(r)]
        ids.append(torch.cat(sets))
        offsets.append(torch.tensor([0] + [len(s) for s in sets]).cumsum(0))
    return Support.from_responses(ids, offsets, layout)


# Triton's interpreter (numpy) warns of the -inf - -inf of a masked slot (its exp is 0 all the same)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_the_logits_of_rows_outside_the_responses_are_never_read(kernels_mode: str, invariant: bool) -> None:
    with _probe.watch() as seen:
        _logits_rows(kernels_mode, invariant)
    if kernels_mode == "compiled":  # the compiled kernels did run
        ran = {e.name for e in seen.of("launch", backend="compiled")}
        want = {"row_kernel", "grad_kernel"} if invariant else {"chunk_stats_at", "chunk_grad_at"}
        assert want <= ran, ran
    elif kernels_mode == "triton":  # the Triton kernels did, reading the response rows only
        ran = {e.name for e in seen.of("launch", backend="triton")}
        want = {"invariant_tiles", "invariant_merge", "invariant_grad"} if invariant else {
            "default.stats", "default.grad"}
        assert want <= ran, ran
        # (a merge reads no logits: a support's per-tile set statistics are merged for every row)
        read = [e.rows for e in seen.of("launch", backend="triton") if e.name != "invariant_merge"]
        assert max(read) <= len(RESPONSE_ROWS), read
    else:
        assert seen.count("launch", backend="compiled") == 0 and seen.count("launch", backend="eager") > 0


def _logits_rows(kernels_mode: str, invariant: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    layout, tokens = _layout(), _tokens(gen)
    logits = torch.randn(ROWS, V, generator=gen) * 3
    lps, ids = _teacher(gen)
    support = _sets(layout, gen)
    inv = invariant
    _check(lambda x: _flat(*response_log_probs(x, tokens, layout, with_entropy=True, temperature=0.8,
                                               invariant=inv)), logits)
    _check(lambda x: _flat(*response_log_probs(x, tokens, layout, with_entropy=True, temperature=0.8,
                                               support=support, invariant=inv)), logits)
    _check(lambda x: _flat(*response_log_probs(x, tokens, layout, with_entropy=True, temperature=0.8,
                                               support=support, entropy_over="support", invariant=inv)), logits)
    _check(lambda x: _flat(response_distillation(x, lps, ids, layout, temperature=0.8, invariant=inv)), logits)
    _check(lambda x: _flat(response_topk_log_probs(x, K, layout, temperature=0.8, invariant=inv)[0]), logits)
    teacher = torch.randn(ROWS, V, generator=gen) * 3  # the teacher's logits: either side poisoned
    _check(lambda x: _flat(response_vocab_distillation(x, teacher, layout, kind="jsd", temperature=0.8,
                                                       invariant=inv)), logits)
    _check(lambda x: _flat(response_vocab_distillation(logits, x, layout, kind="forward", temperature=0.8,
                                                       invariant=inv)), teacher)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_the_hidden_states_of_rows_outside_the_responses_are_never_read(invariant: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    layout, tokens = _layout(), _tokens(gen)
    hidden = torch.randn(ROWS, H, generator=gen)
    w = torch.randn(V, H, generator=gen).requires_grad_(True)
    lps, ids = _teacher(gen)
    support = _sets(layout, gen)
    inv = invariant
    _check(lambda h: _flat(*response_log_probs_from_hidden(h, w, tokens, layout, with_entropy=True, temperature=0.8,
                                                           chunk_size=4, invariant=inv)), hidden, w)
    _check(lambda h: _flat(*response_log_probs_from_hidden(h, w, tokens, layout, with_entropy=True, temperature=0.8,
                                                           chunk_size=4, support=support, invariant=inv)), hidden, w)
    _check(lambda h: _flat(*response_log_probs_from_hidden(h, w, tokens, layout, with_entropy=True, temperature=0.8,
                                                           chunk_size=4, support=support, entropy_over="support",
                                                           invariant=inv)), hidden, w)
    _check(lambda h: _flat(response_distillation_from_hidden(h, w, lps, ids, layout, temperature=0.8, chunk_size=4,
                                                             invariant=inv)), hidden, w)
    _check(lambda h: _flat(response_topk_log_probs_from_hidden(h, w, K, layout, temperature=0.8, chunk_size=4,
                                                               invariant=inv)[0]), hidden, w)


def test_a_set_on_a_row_outside_the_responses_is_not_read() -> None:
    """A support that gives a prompt or padding row a set (``Support`` over the local rows,
    not ``from_responses``): that row's elements count nowhere, whatever its logits."""
    gen = torch.Generator().manual_seed(4)
    layout, tokens = _layout(), _tokens(gen)
    logits = torch.randn(ROWS, V, generator=gen) * 3
    sets = [torch.randperm(V, generator=gen)[:3] if r in (1, 4, 8, 12, 23) else torch.zeros(0, dtype=torch.int64)
            for r in range(ROWS)]
    support = Support(torch.cat(sets), torch.tensor([0] + [len(s) for s in sets]).cumsum(0))
    _check(lambda x: _flat(*response_log_probs(x, tokens, layout, with_entropy=True, support=support)), logits)
    _check(lambda x: _flat(*response_log_probs(x, tokens, layout, with_entropy=True, support=support,
                                               entropy_over="support")), logits)
