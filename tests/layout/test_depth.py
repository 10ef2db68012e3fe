"""Depth-``d`` targets (multi-token prediction, docs/layouts.md "Depth-``d`` targets")
against a float64 reference that rolls the whole sample (tests/support/depth_reference.py):
``shifted_targets``, ``response_rows``, ``extract_responses``, ``shard_responses``,
``response_log_probs`` and ``response_log_probs_from_hidden`` at depths 0 to 3, values
and gradients, on every layout (no CP thd and bshd with row offsets, padded samples,
zigzag and allgather over 2 and 4 ranks, token orders, ``from_cu_seqlens``, shared
prefixes), in one process over every rank and on real gloo worlds of 2 and 4; the docs'
worked example of a padded sample shorter than ``2c`` under zigzag (Megatron's
#4494/#4495/#6205); random layouts; the refusals of a bad ``depth``."""

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cpslice import (
    Layout,
    LayoutError,
    extract_responses,
    gather_responses,
    redistribute,
    response_log_probs,
    response_log_probs_from_hidden,
    response_rows,
    sample_max,
    sample_means,
    sample_min,
    shard_responses,
    shifted_targets,
    sum_of_sample_means,
    sum_of_tokens,
)

from ..support._dist import run_distributed
from ..support.checked import refused
from ..support.depth_reference import Case, Out, check, compute, covers, data, length, reference
from ..support.oracle import least_length
from ..support.strategies import configs

DEPTHS = (0, 1, 2, 3)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # the index arithmetic of these small layouts is many tiny ops: on a shared machine
    # extra intra-op threads only wait for each other (put back after each test)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _failures(case: Case, depth: int, outs: list[Out], hidden: bool = False) -> list[str]:
    """Every rank's result against the whole-sample reference (``hidden``: the hidden
    states' path's too, the weight's gradient summed over the ranks)."""
    ref = reference(case, data(case), depth, hidden)
    bad = covers(case, depth)
    for rank, out in enumerate(outs):
        bad += check(case, rank, depth, out, ref)
    weights = [o.grad_w for o in outs if o.grad_w is not None]
    if weights:
        err = float((sum(weights, torch.zeros(())).double() - ref.grad_w).abs().max())
        if err > 2e-5 * (1 + float(ref.grad_w.abs().max())):
            bad.append(f"{case.name} depth {depth}: weight grad off by {err:.3g}")
    return bad


def _in_process(case: Case, depths: tuple[int, ...] = DEPTHS, hidden: bool = True) -> list[str]:
    return [b for d in depths for b in _failures(case, d, [compute(case, r, d, hidden) for r in range(case.cp)],
                                                 hidden)]


# prompts of 1 and 2 tokens (shorter than d + 1 at depths 1-3), a single-token sample, an
# empty response, a response of every position but the first
_TOTAL, _RESPONSE = (6, 1, 4, 2, 9, 5), (3, 0, 3, 1, 2, 0)

SINGLE = [
    Case("no CP thd", _TOTAL, _RESPONSE, seed=1),
    Case("no CP thd align 4", _TOTAL, _RESPONSE, align=4, seed=2, scalar_temperature=True),
    Case("no CP bshd row_offsets", (6, 1, 4, 9), (3, 0, 3, 2), fmt="bshd", seq=11, offsets=(0, 5, 7, 2), seed=3),
    Case("no CP shared prefix", (5, 7, 6, 3, 2, 4), (2, 4, 3, 1, 0, 2), shared=(3, 1, 2), seed=4),
    Case("zigzag 2 padded, short samples", (3, 2, 1, 5, 7), (2, 1, 0, 3, 6), mode="zigzag", cp=2, align=4, seed=5),
    Case("order 2 shared prefix", (4, 6, 3), (2, 4, 1), shared=(2, 1), mode="order", cp=2, padded=(8, 4),
         order=(9, 2, 0, 7, 4, 11, 1, 8, 5, 3, 10, 6), seed=6),
    Case("order 2 bshd row_offsets", (6, 1, 4, 9), (3, 0, 3, 2), fmt="bshd", seq=10, offsets=(0, 5, 4, 1),
         mode="order", cp=2, order=(0, 1, 8, 9, 4, 2, 3, 6, 7, 5), seed=7),
]


@pytest.mark.parametrize("case", SINGLE, ids=[c.name for c in SINGLE])
def test_every_rank_in_one_process_against_the_whole_sample_roll(case: Case) -> None:
    assert _in_process(case) == []


def _families(world: int) -> list[Case]:
    """Every CP layout family at ``world`` ranks."""
    c, two = world, 2 * world
    return [
        # Megatron's failing case: padded thd, samples shorter than 2c (some all padding on a rank)
        Case(f"zigzag {c} padded short", (3, 2, 1, two - 1, 5, two + 3), (2, 1, 0, two - 2, 2, 4),
             mode="zigzag", cp=c, padded=(two, two, two, two, 2 * two, 2 * two), seed=10 + c),
        Case(f"zigzag {c} bshd row_offsets", (6, 1, 4, 9), (3, 0, 3, 2), fmt="bshd", seq=11,
             offsets=(0, 5, 7, 2), mode="zigzag", cp=c, extra=1, seed=11 + c),
        Case(f"allgather {c}", _TOTAL, _RESPONSE, mode="allgather", cp=c, extra=2, seed=12 + c),
        Case(f"allgather {c} from_cu_seqlens", _TOTAL, _RESPONSE, mode="allgather", cp=c, cu=True,
             padded=(8, 2, 4, 3, 9, 6), seed=13 + c),
        Case(f"zigzag {c} from_cu_seqlens", (5, 1, 9), (4, 0, 2), mode="zigzag", cp=c, cu=True,
             padded=(2 * two, two, 3 * two), seed=14 + c),
        Case(f"order {c}", (5, 3, 7, 1), (2, 2, 6, 0), mode="order", cp=c,
             order=tuple(torch.randperm(16, generator=torch.Generator().manual_seed(c)).tolist()), seed=15 + c),
        Case(f"zigzag {c} shared prefix", (5, 7, 6, 3, 2, 4), (2, 4, 3, 1, 0, 2), shared=(3, 1, 2),
             mode="zigzag", cp=c, seed=16 + c),
        Case(f"allgather {c} shared prefix", (2, 5, 4, 6), (1, 4, 3, 5), shared=(3, 1), mode="allgather",
             cp=c, extra=1, seed=17 + c),
    ]


def _worlds(world: int) -> list[Case]:
    """A world's cases: the padded short samples at both sizes, the other families at
    one size or the other (each is in the in-process tests or the random ones too)."""
    every = _families(world)
    return [every[k] for k in ((0, 1, 3, 5, 6) if world == 2 else (0, 2, 4, 5, 7))]


WORLD_DEPTHS = (1, 3)
"""The gloo worlds' depths (the run-time checks make a rank's work several times the
in-process tests'): prompts of 1 and 2 tokens lose 1 or 3 response tokens, and shares
move across chunk and piece boundaries; depths 0 and 2 run in the tests above and in
the random ones."""


def _ranks(rank: int, world: int, cases: list[Case]) -> list[list[Out]]:
    torch.set_num_threads(1)  # the ranks share the machine's cores (put back after the task)
    return [[compute(case, rank, d) for d in WORLD_DEPTHS] for case in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_on_gloo_worlds_against_the_whole_sample_roll(world: int) -> None:
    """Each rank of a real gloo world computes its targets, shares, log-probs, entropy
    and the logits' gradient on its own local tensors; placed by the reference's rules,
    they are the whole-sample roll's."""
    cases = _worlds(world)
    per_rank = run_distributed(_ranks, world, cases, timeout=120)
    bad = [b for k, case in enumerate(cases) for j, d in enumerate(WORLD_DEPTHS)
           for b in _failures(case, d, [outs[k][j] for outs in per_rank])]
    assert bad == []


def test_the_docs_padded_sample_shorter_than_2c_under_zigzag() -> None:
    # docs/layouts.md: L = 3, R = 2 (P = 1), W = 4, zigzag over 2 ranks, C = 1: rank 0
    # holds positions 0 and 3, rank 1 positions 1 and 2; at depth 1 position 0 predicts
    # token 2 and nothing predicts token 1
    tokens = [torch.tensor([4, 9, 2])]
    lay = [Layout([3], [2], cp_mode="zigzag", cp_rank=r, cp_size=2, padded_lengths=[4]) for r in range(2)]
    assert shifted_targets(tokens, lay[0], fill=-1, depth=1).tolist() == [2, -1]
    assert shifted_targets(tokens, lay[1], fill=-1, depth=1).tolist() == [-1, -1]
    assert shifted_targets(tokens, lay[0], fill=-1).tolist() == [9, -1]  # depth 0: position 0 -> token 1
    assert shifted_targets(tokens, lay[1], fill=-1).tolist() == [2, -1]  # position 1 -> token 2
    rows0, rows1 = response_rows(lay[0], depth=1), response_rows(lay[1], depth=1)
    assert (rows0.rows.tolist(), rows0.counts, rows1.rows.tolist(), rows1.counts) == ([0], [1], [], [0])
    whole = [torch.tensor([5.0, 6.0])]  # response tokens 1 and 2: at depth 1 only token 2 is predicted
    assert [s.tolist() for s in shard_responses(whole, lay[0], depth=1)] == [[6.0]]
    assert [s.tolist() for s in shard_responses(whole, lay[1], depth=1)] == [[]]
    logits = torch.randn(2, 7, dtype=torch.float64)
    for r in range(2):
        x = logits.float().requires_grad_()
        (lp,), (ent,) = response_log_probs(x, tokens, lay[r], with_entropy=True, temperature=0.7, depth=1)
        (share,), _ = extract_responses(x, lay[r], depth=1)
        if r == 0:
            want = torch.log_softmax(logits[0] / 0.7, -1)
            torch.testing.assert_close(lp.double(), want[[2]], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(ent.double(), -(want.exp() * want).sum()[None], rtol=1e-6, atol=1e-6)
            assert torch.equal(share, x[:1])
        else:  # nothing: zero-length views, in the graph, never None
            assert lp.shape == ent.shape == (0,) and lp.requires_grad and ent.requires_grad
            assert share.shape == (0, 7) and share._base is x
        (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), x)
        assert r == 0 or float(grad.abs().max()) == 0.0
        assert float(grad[1].abs().max()) == 0.0  # position 3 (padding) never predicts
        assert torch.equal(x.detach(), logits.float())  # the caller's tensors are unchanged
    assert tokens[0].tolist() == [4, 9, 2] and whole[0].tolist() == [5.0, 6.0]


def test_depth_zero_is_the_default_and_numpy_ints_count() -> None:
    plain, shared = _families(2)[0], _families(2)[6]  # zigzag 2: padded short samples; a shared prefix
    for c in (plain, shared):
        dd = data(c)
        for r in range(2):
            lay, tau = c.layout(r), dd.temperature
            x = torch.randn(length(c), 11)
            h, w = torch.randn(length(c), 5), torch.randn(11, 5)
            for zero in (0, np.int64(0)):
                for a, b in ((response_log_probs(x, dd.tokens, lay, with_entropy=True, temperature=tau),
                              response_log_probs(x, dd.tokens, lay, with_entropy=True, temperature=tau,
                                                 depth=zero)),
                             (response_log_probs_from_hidden(h, w, dd.tokens, lay, with_entropy=True, temperature=tau),
                              response_log_probs_from_hidden(h, w, dd.tokens, lay, with_entropy=True, temperature=tau,
                                                             depth=zero)),
                             (extract_responses(x, lay, x), extract_responses(x, lay, x, depth=zero))):
                    assert all(torch.equal(p, q) for p, q in zip(a[0], b[0], strict=True))
                    assert all(torch.equal(p, q) for p, q in zip(a[1], b[1], strict=True))
                rows = response_rows(lay)
                assert response_rows(lay, depth=zero).rows.tolist() == rows.rows.tolist()
                whole = [torch.randn(n) for n in c.response]
                assert all(torch.equal(p, q) for p, q in
                           zip(shard_responses(whole, lay), shard_responses(whole, lay, depth=zero), strict=True))
                if c.shared is None:
                    assert torch.equal(shifted_targets(dd.tokens, lay), shifted_targets(dd.tokens, lay, depth=zero))
    tokens = data(plain).tokens
    assert torch.equal(shifted_targets(tokens, plain.layout(0), depth=np.int64(2)),
                       shifted_targets(tokens, plain.layout(0), depth=2))


@st.composite
def _shared_cases(draw: st.DrawFn) -> Case:
    """A shared-prefix layout: 1-3 groups of 1-3 branches, prompts of 1-5 tokens (shorter
    than d + 1 too), responses of 0-5; no CP, zigzag, allgather or a random token order
    of the stream of stars, over 1-4 ranks, stars padded or not."""
    total: list[int] = []
    response: list[int] = []
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    stars = []
    for g in sizes:
        prompt = draw(st.integers(1, 5))
        rs = draw(st.lists(st.integers(0, 5), min_size=g, max_size=g))
        total += [prompt + r for r in rs]
        response += rs
        stars.append(prompt + sum(rs))
    mode = draw(st.sampled_from(("none", "zigzag", "allgather", "order")))
    cp = 1 if mode == "none" else draw(st.integers(2 if mode == "zigzag" else 1, 4))  # zigzag: cp >= 2
    step = 2 * cp if mode == "zigzag" else 1
    padded: tuple[int, ...] | None = tuple(-(-s // step) * step + step * draw(st.integers(0, 1)) for s in stars)
    order: tuple[int, ...] | None = None
    if mode == "order" and padded is not None:
        widths = list(padded)
        widths[-1] += -sum(widths) % cp
        padded = tuple(widths)
        order = tuple(draw(st.permutations(range(sum(widths)))))
    elif not draw(st.booleans()):
        padded = None
    return Case("shared", tuple(total), tuple(response), mode=mode, cp=cp, padded=padded, shared=tuple(sizes),
                order=order, extra=draw(st.integers(0, 2)) if mode != "order" else 0, seed=draw(st.integers(0, 9)))


@st.composite
def _cases(draw: st.DrawFn) -> Case:
    """A random layout of the oracle's strategies (no CP, zigzag and allgather, thd and
    bshd, padded samples, row offsets, empty responses, single-token samples, ranks that
    hold nothing), or a shared-prefix one."""
    if draw(st.booleans()):
        return draw(_shared_cases())
    cfg = draw(configs(max_cp=4, max_n=5))
    extra = cfg.extra
    if cfg.local_length is not None:  # an allgather piece's length given: the least plus extra
        extra = cfg.local_length - least_length(dataclasses.replace(cfg, local_length=None, extra=0))
    return Case("random", cfg.total, cfg.response, mode=cfg.mode, cp=cfg.cp, fmt=cfg.fmt, seq=cfg.seq,
                padded=cfg.padded, align=cfg.align, offsets=cfg.row_offsets, extra=extra,
                seed=draw(st.integers(0, 9)))


@settings(max_examples=20, deadline=None)
@given(case=_cases(), depth=st.integers(0, 3), hidden=st.booleans())
def test_random_layouts_and_depths(case: Case, depth: int, hidden: bool) -> None:
    assert _failures(case, depth, [compute(case, r, depth, hidden) for r in range(case.cp)], hidden) == []


def test_refusals() -> None:
    tokens = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])]
    lay = Layout([4, 2], [2, 1])
    x, h, w = torch.randn(6, 7), torch.randn(6, 3), torch.randn(7, 3)
    shares, masks = [torch.ones(2), torch.ones(1)], [torch.ones(2), torch.ones(1)]
    calls: dict[str, Callable[[Any], object]] = {
        "shifted_targets": lambda d: shifted_targets(tokens, lay, depth=d),
        "response_rows": lambda d: response_rows(lay, depth=d),
        "extract_responses": lambda d: extract_responses(x, lay, depth=d),
        "shard_responses": lambda d: shard_responses([torch.ones(2), torch.ones(1)], lay, depth=d),
        "response_log_probs": lambda d: response_log_probs(x, tokens, lay, depth=d),
        "response_log_probs_from_hidden": lambda d: response_log_probs_from_hidden(h, w, tokens, lay, depth=d),
        "sum_of_sample_means": lambda d: sum_of_sample_means(shares, masks, lay, depth=d),
        "sum_of_tokens": lambda d: sum_of_tokens(shares, masks, lay, depth=d),
        "sample_means": lambda d: sample_means(shares, masks, lay, depth=d),
        "sample_max": lambda d: sample_max(shares, masks, lay, depth=d),
        "sample_min": lambda d: sample_min(shares, masks, lay, depth=d),
        "redistribute": lambda d: redistribute(shares, lay, lay, depth=d),
        "gather_responses": lambda d: gather_responses(shares, lay, depth=d),
    }
    for call in calls.values():
        for negative in (-1, -3, np.int64(-2)):
            with pytest.raises(LayoutError, match=rf"depth {int(negative)} < 0 \(at depth d the logit at position p "
                               r"predicts token p \+ 1 \+ d; d = 0 is the next token\)"):
                call(negative)
        for bad, kind in ((1.0, "a float"), (True, "a bool"), ("1", "a str"), (None, "a NoneType")):
            with refused(TypeError, rf"^depth {re.escape(repr(bad))} is {kind}, not an int$"):
                call(bad)
    shared = Layout([4, 3], [2, 1], shared_prefix=[2])
    with refused(LayoutError, r"shared_prefix \[2\] puts a prompt's rows in several samples"):
        shifted_targets([torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 5])], shared, depth=1)


# ---- the reducers, redistribute and gather_responses of depth-d shares ----


def _whole(case: Case, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random float64 whole responses ``[R_i]`` (requiring grad) and fractional masks."""
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(r, generator=gen, dtype=torch.float64).requires_grad_(True) for r in case.response]
    masks = [torch.randint(0, 3, (r,), generator=gen).double() / 2 for r in case.response]
    return values, masks


def _predicted(case: Case, i: int, depth: int) -> slice:
    """The response elements of sample ``i`` that a position predicts at ``depth``: all
    but the first ``d + 1 - P_i`` (the rule read straight from docs/layouts.md)."""
    return slice(max(0, depth + 1 - (case.total[i] - case.response[i])), None)


def _means(case: Case, values: list[torch.Tensor], masks: list[torch.Tensor], depth: int) -> torch.Tensor:
    """Each sample's masked mean over its predicted tokens, 0 where their mask sums to 0."""
    out = []
    for i, (v, m) in enumerate(zip(values, masks, strict=True)):
        keep = _predicted(case, i, depth)
        den = m[keep].sum()
        out.append((v[keep] * m[keep]).sum() / den if den else v.sum() * 0)
    return torch.stack(out)


REDUCED = [*SINGLE, *_families(2), *_families(4)]


@pytest.mark.parametrize("case", REDUCED, ids=[c.name for c in REDUCED])
def test_the_loss_parts_of_depth_d_shares_sum_to_the_whole_samples(case: Case) -> None:
    """``sum_of_sample_means`` and ``sum_of_tokens`` at ``depth=d``: each share element
    weighted by its predicted token's mask, the tokens no position predicts in no sum;
    the parts over the ranks sum to the float64 whole-sample value, and so do their
    gradients."""
    for depth in DEPTHS:
        values, masks = _whole(case, case.seed + depth)
        means = tokens = torch.zeros((), dtype=torch.float64)
        for rank in range(case.cp):
            layout = case.layout(rank)
            shares = shard_responses(values, layout, depth=depth)
            means = means + sum_of_sample_means(shares, masks, layout, depth=depth)
            tokens = tokens + sum_of_tokens(shares, masks, layout, depth=depth)
        want = _means(case, values, masks, depth)
        want_tokens = sum((v[_predicted(case, i, depth)] * m[_predicted(case, i, depth)]).sum()
                          for i, (v, m) in enumerate(zip(values, masks, strict=True)))
        torch.testing.assert_close(means, want.sum(), rtol=1e-12, atol=1e-12, msg=f"depth {depth}")
        torch.testing.assert_close(tokens, want_tokens, rtol=1e-12, atol=1e-12, msg=f"depth {depth}")
        got = torch.autograd.grad(means + 2 * tokens, values, allow_unused=True, materialize_grads=True)
        ref = torch.autograd.grad(want.sum() + 2 * want_tokens, values, allow_unused=True,
                                  materialize_grads=True)
        for i, (g, r) in enumerate(zip(got, ref, strict=True)):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=f"depth {depth} sample {i}")


def test_a_depth_d_loss_without_depth_is_refused_where_the_counts_differ() -> None:
    """Shares at depth 1 of a sample with a 1-token prompt hold one element fewer than
    at depth 0: passed without ``depth=`` they are refused, not misread."""
    layout = Layout([4, 3], [3, 1])
    shares = shard_responses([torch.ones(3), torch.ones(1)], layout, depth=1)
    with pytest.raises(LayoutError, match="sample 0"):
        sum_of_sample_means(shares, [torch.ones(3), torch.ones(1)], layout)


def _zigzag(case: Case, rank: int) -> Layout:
    return Layout(list(case.total), list(case.response), cp_mode="zigzag", cp_rank=rank,
                  cp_size=case.cp, shared_prefix=None if case.shared is None else list(case.shared))


def _reduce_ranks(rank: int, world: int, cases: list[Case]) -> list[list[dict[str, Any]]]:
    """Per case and depth: this rank's ``sample_means`` (and its inputs' gradient),
    ``sample_max`` / ``sample_min``, ``gather_responses`` (and its gradient) and
    ``redistribute`` to zigzag of its depth-d shares, over the world's group."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    found = []
    for case in cases:
        per_depth = []
        for depth in WORLD_DEPTHS:
            values, masks = _whole(case, case.seed + depth)
            layout, zig = case.layout(rank), _zigzag(case, rank)
            shares = shard_responses(values, layout, depth=depth)
            means = sample_means(shares, masks, layout, cp_group=group, depth=depth)
            gathered = gather_responses(shares, layout, cp_group=group, depth=depth)
            moved = redistribute(shares, layout, zig, cp_group=group, depth=depth)
            weight = torch.arange(1.0, len(case.total) + 1, dtype=torch.float64)
            loss = (means * weight).sum() + sum((g * g).sum() for g in gathered)
            grads = torch.autograd.grad(loss, values, allow_unused=True, materialize_grads=True)
            per_depth.append({
                "means": means.detach(), "grads": [g.detach() for g in grads],
                "max": sample_max(shares, masks, layout, cp_group=group, depth=depth),
                "min": sample_min(shares, masks, layout, cp_group=group, depth=depth),
                "gathered": [g.detach() for g in gathered], "moved": [m.detach() for m in moved],
                "zig": [s.detach() for s in shard_responses(values, zig, depth=depth)],
            })
        found.append(per_depth)
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_sample_statistics_and_moves_of_depth_d_shares_on_gloo(world: int) -> None:
    """On a real gloo world, depth-d shares of padded short samples, allgather pieces
    and shared prefixes: ``sample_means`` is each sample's mean over its predicted
    tokens on every rank (gradient: the sum over the ranks' parts), ``sample_max`` /
    ``sample_min`` their extremes, ``gather_responses`` the predicted tokens whole,
    ``redistribute`` the shares zigzag's ``shard_responses`` gives."""
    every = _families(world)
    cases = [every[0], every[2], every[6], every[7]]
    per_rank = run_distributed(_reduce_ranks, world, cases, timeout=120)
    for k, case in enumerate(cases):
        for j, depth in enumerate(WORLD_DEPTHS):
            values, masks = _whole(case, case.seed + depth)
            want = _means(case, values, masks, depth)
            wholes = [v[_predicted(case, i, depth)] for i, v in enumerate(values)]
            weight = torch.arange(1.0, len(case.total) + 1, dtype=torch.float64)
            # every rank builds its loss from the means: the gradient is the sum of the parts
            loss = world * (want * weight).sum() + world * sum((w * w).sum() for w in wholes)
            ref = torch.autograd.grad(loss, values, allow_unused=True, materialize_grads=True)
            kept = [x.detach()[(m != 0)[_predicted(case, i, depth)]]
                    for i, (x, m) in enumerate(zip(wholes, masks, strict=True))]
            top = [float(x.max()) if x.numel() else -math.inf for x in kept]
            low = [float(x.min()) if x.numel() else math.inf for x in kept]
            grads = [sum(gs) for gs in zip(*(r[k][j]["grads"] for r in per_rank))]
            where = f"{case.name} depth {depth}"
            for i, (g, r) in enumerate(zip(grads, ref, strict=True)):
                torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=f"{where} grad {i}")
            for rank, out in enumerate(r[k][j] for r in per_rank):
                torch.testing.assert_close(out["means"], want.detach(), rtol=1e-12, atol=1e-12, msg=where)
                assert out["max"].tolist() == top and out["min"].tolist() == low, (where, rank)
                for got, w in zip(out["gathered"], wholes, strict=True):
                    assert torch.equal(got, w.detach()), (where, rank)
                for got, w in zip(out["moved"], out["zig"], strict=True):
                    assert torch.equal(got, w), (where, rank)
