"""A local tensor has exactly the rows its layout needs, or the ``local_length`` the
layout declares: one longer than that is never read as padding at its end (the model
run before the CP split, logits gathered once too often). Every function that reads a
local tensor refuses another length with a ``LayoutError`` naming both lengths, before
any collective; a length of the whole stream is named as looking unsharded; declared
trailing padding gives the exact call's bits (docs/layouts.md, "One rank's local
tensor"; docs/recipes.md, "Trailing padding: declare it")."""

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from cpslice import (
    Layout,
    LayoutError,
    _probe,
    extract_responses,
    pack,
    response_distillation,
    response_distillation_from_hidden,
    response_log_probs,
    response_log_probs_from_hidden,
    response_topk_log_probs,
    response_topk_log_probs_from_hidden,
)

from ..support._dist import run_distributed
from ..support.oracle import Config
from ..support.strategies import configs

VOCAB, HIDDEN = 7, 3
Call = Callable[[Tensor, Tensor], object]


def _need(layout: Layout) -> int:
    """The rows the layout needs, read through the public API: ``pack``'s length."""
    return int(pack([torch.zeros(t) for t in layout.total_lengths], layout).shape[0])


def _calls(layout: Layout, tokens: list[Tensor]) -> dict[str, Call]:
    """Each function that reads a local tensor, on ``(logits, hidden)`` of one length."""
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return {
        "extract_responses": lambda x, h: extract_responses(x, layout, x),
        "response_log_probs": lambda x, h: response_log_probs(x, tokens, layout, with_entropy=True),
        "response_log_probs_from_hidden": lambda x, h: response_log_probs_from_hidden(
            h, weight, tokens, layout, with_entropy=True),
    }


def _inputs(length: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(length, VOCAB, dtype=torch.float64, generator=g),
            torch.randn(length, HIDDEN, dtype=torch.float64, generator=g))


def _tokens(layout: Layout) -> list[Tensor]:
    g = torch.Generator().manual_seed(len(layout.total_lengths))
    return [torch.randint(0, VOCAB, (t,), generator=g) for t in layout.total_lengths]


def _refused(call: Call, length: int, need: int) -> str:
    """The message of ``call``'s refusal of a ``length``-row local tensor, which names
    both lengths."""
    with pytest.raises(LayoutError) as info:
        call(*_inputs(length, 0))
    message = str(info.value)
    for n in (length, need):
        assert re.search(rf"\b{n}\b", message), (n, message)
    return message


def test_the_issue_example() -> None:
    """Zigzag over 2 ranks, rank 1: samples of 10, 7 and 13 tokens need 18 rows; the whole
    stream of 30 (or its padded 36) rows is refused as looking unsharded; declared
    trailing padding reads as the exact tensor does, bit for bit."""
    layout = Layout([10, 7, 13], [4, 3, 5], cp_mode="zigzag", cp_rank=1, cp_size=2)
    assert _need(layout) == 18
    tokens = _tokens(layout)
    for name, call in _calls(layout, tokens).items():
        for whole in (30, 36):
            message = _refused(call, whole, 18)
            assert f"has length {whole} but the layout needs exactly 18 rows" in message, name
            assert "looks unsharded" in message and "cpslice.pack(per_sample, layout)" in message, name
            assert f"local_length={whole}" in message, name
        assert "looks unsharded" not in _refused(call, 19, 18), name
    _same_bits(layout, tokens, 30)


def _same_bits(layout: Layout, tokens: list[Tensor], length: int) -> None:
    """``length`` rows, the first ``need`` the exact tensor's and the rest random, under
    ``layout.with_local_length(length)``: every function returns the exact call's bits."""
    need = _need(layout)
    x, h = _inputs(need, 1)
    more_x, more_h = _inputs(length - need, 2)
    exact = _calls(layout, tokens)
    declared = _calls(layout.with_local_length(length), tokens)
    for name in exact:
        want = exact[name](x, h)
        got = declared[name](torch.cat([x, more_x]), torch.cat([h, more_h]))
        assert len(_flat(got)) == len(_flat(want)), name
        for a, b in zip(_flat(got), _flat(want), strict=True):
            assert torch.equal(a, b), name


def _flat(result: Any) -> list[Tensor]:
    """Every tensor of a ``(list, list)`` result, in order."""
    return [t for part in result for t in part]


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[Config, int, bool]:
    """A random layout of any mode and format (tests/support/strategies.py's edges: empty
    responses, single tokens, samples shorter than 2 * cp, ranks holding nothing, padded
    samples, left-padded rows), a rank of it, and whether a thd one is read as an order."""
    cfg = draw(configs(max_cp=4, max_n=5))
    return cfg, draw(st.integers(0, cfg.cp - 1)), draw(st.booleans())


def _layout(cfg: Config, rank: int, as_order: bool) -> Layout:
    """``cfg``'s layout on ``rank`` without local_length, or its order's."""
    layout = cfg.layout(rank, with_local=False)
    if not (as_order and cfg.fmt == "thd" and cfg.mode != "allgather" and cfg.total):
        return layout
    return Layout.from_order(layout.order(), layout.total_lengths, layout.response_lengths, cp_rank=rank,
                             cp_size=layout.cp_size, padded_lengths=layout.padded_lengths)


@settings(max_examples=60, deadline=None)
@given(case=_layouts(), delta=st.integers(-3, 5).filter(bool), extra=st.integers(1, 4))
def test_any_other_length_is_refused_naming_both(case: tuple[Config, int, bool], delta: int, extra: int) -> None:
    layout = _layout(*case)
    need = _need(layout)
    whole = {sum(layout.padded_lengths), layout.cp_size * need, sum(layout.total_lengths)}
    tokens = _tokens(layout)
    for name, call in _calls(layout, tokens).items():
        call(*_inputs(need, 0))  # the exact length reads
        for length in {need + delta, *whole} - {need}:
            if length < 0:
                continue
            message = _refused(call, length, need)
            unsharded = layout.cp_size > 1 and length > need and length in whole
            assert ("looks unsharded" in message) == unsharded, (name, length, message)
    declared = layout.with_local_length(need + extra)
    for name, call in _calls(declared, tokens).items():
        call(*_inputs(need + extra, 0))
        assert "but the layout's local_length is" in _refused(call, need, need + extra), name
    if layout.cp_mode != "allgather":  # an allgather piece's length moves its pieces: no padding
        _same_bits(layout, tokens, need + extra)


def _tp_refusals(rank: int, world: int) -> list[str]:
    """On a gloo world of 2 as the TP (and CP) group: every function that reads a local
    tensor refuses the unsharded one before any collective."""
    import torch.distributed as dist

    group = dist.group.WORLD
    layout = Layout([10, 7, 13], [4, 3, 5], cp_mode="zigzag", cp_rank=rank, cp_size=world)
    tokens = _tokens(layout)
    x, h = torch.randn(30, VOCAB), torch.randn(30, HIDDEN)
    w = torch.randn(VOCAB, HIDDEN)
    lp = [torch.zeros(r, 2) for r in layout.response_lengths]
    ids = [torch.zeros(r, 2, dtype=torch.int64) for r in layout.response_lengths]
    calls: dict[str, Callable[[], object]] = {
        "response_log_probs": lambda: response_log_probs(x, tokens, layout, with_entropy=True, tp_group=group),
        "response_log_probs_from_hidden": lambda: response_log_probs_from_hidden(
            h, w, tokens, layout, with_entropy=True, tp_group=group),
        "response_distillation": lambda: response_distillation(x, lp, ids, layout, tp_group=group),
        "response_distillation_from_hidden": lambda: response_distillation_from_hidden(
            h, w, lp, ids, layout, tp_group=group),
        "response_topk_log_probs": lambda: response_topk_log_probs(x, 2, layout, tp_group=group),
        "response_topk_log_probs_from_hidden": lambda: response_topk_log_probs_from_hidden(
            h, w, 2, layout, tp_group=group),
    }
    bad = []
    for name, call in calls.items():
        with _probe.watch() as seen:
            try:
                call()
                bad.append(f"{name}: no error")
            except LayoutError as err:
                if "has length 30 but the layout needs exactly 18 rows" not in str(err):
                    bad.append(f"{name}: {err}")
        if seen.of("collective"):
            bad.append(f"{name}: {seen.of('collective')}")
    return bad


def test_refused_before_any_collective() -> None:
    assert run_distributed(_tp_refusals, 2, timeout=120) == [[], []]
