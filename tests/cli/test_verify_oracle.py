"""The verifier's layout oracle (``cpslice._verify.oracle``) against the suite's
(``tests/support/oracle.py``): two transcriptions of docs/layouts.md written apart, which
must place every position of every sample at the same local row of every rank.

Over hypothesis layouts (``tests/strategies.configs``: every mode, thd and bshd,
align and explicit padded widths with a stretched last sample, left-padded bshd rows,
empty responses, ranks holding nothing, extra padding rows): the least local length, each row's place, each
rank's response shares and gradient rows agree.

The verifier reads an order layout from the order itself: the index of each closed form
(``Layout.order``) read as an order places every row where the verifier's closed form
does; torch's per-document head-tail index is read as torch cuts it; and a random
order's rows are what ``cpslice.pack`` writes for ``Layout.from_order``.

A shared-prefix layout's stars (prompt once, then each branch's response) are read as
docs/layouts.md's worked example says, and over random stars the verifier's rows, shares
and gradient rows (a shared row's the sum over its branches) are cpslice's.
"""

import dataclasses
import itertools
from typing import NamedTuple

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cpslice import Layout, LayoutError, pack
from cpslice._verify import oracle as verifier

from ..support import oracle as suite
from ..support.strategies import configs, samples


def _view(cfg: suite.Config, rank: int) -> verifier.RankView:
    return verifier.RankView(cfg.total, cfg.response, cfg.mode, cfg.fmt, cfg.seq, rank,
                             cfg.cp, suite.local_length(cfg), cfg.align, cfg.padded,
                             cfg.row_offsets)


@settings(max_examples=100, deadline=None)
@given(configs(max_cp=4))
def test_the_two_oracles_agree(cfg: suite.Config) -> None:
    least = verifier.least_length(cfg.total, cfg.mode, cfg.fmt, cfg.seq, cfg.cp, cfg.align,
                                  cfg.padded)
    assert least == suite.least_length(cfg)
    whole = [torch.arange(r, dtype=torch.float64) + 100 * i for i, r in enumerate(cfg.response)]
    per_row = [torch.arange(t, dtype=torch.float64) + 100 * i for i, t in enumerate(cfg.total)]
    for rank in range(cfg.cp):
        view = _view(cfg, rank)
        assert verifier.places(view) == suite.local_map(cfg, rank)
        assert [s.tolist() for s in verifier.shares(whole, view)] == [
            s.tolist() for s in suite.shares(whole, cfg, rank)]
        if cfg.total:
            assert torch.equal(verifier.rows(per_row, view), suite.rows(per_row, cfg, rank))


def _order_view(cfg: suite.Config, rank: int, order: torch.Tensor, length: int) -> verifier.RankView:
    """The verifier's view of ``cfg``'s samples placed by ``order`` (thd ``[N]``, bshd
    ``[B, S]``) on ``rank``."""
    rows: list[list[int]] = order.reshape(-1, order.shape[-1]).tolist()
    widths = tuple(suite.widths(cfg))
    thd = cfg.fmt == "thd"
    return verifier.RankView(cfg.total, cfg.response, "order", cfg.fmt,
                             None if thd else len(rows[0]), rank, cfg.cp, length,
                             padded=widths if thd else None,
                             offsets=None if thd else cfg.row_offsets,
                             order=tuple(tuple(r) for r in rows))


@settings(max_examples=60, deadline=None)
@given(configs(max_cp=4))
def test_a_closed_form_read_as_its_order_places_alike(cfg: suite.Config) -> None:
    assume(cfg.total)
    length = suite.local_length(cfg)
    # allgather's pieces are [r*T, (r+1)*T): its order is that of the T that tiles the stream
    assume(cfg.mode != "allgather" or length * cfg.cp == sum(suite.widths(cfg)))
    try:
        index = cfg.layout(0, with_local=cfg.local_length is not None).order()  # extra rows undeclared
    except LayoutError:  # pragma: no cover - every layout left tiles the stream
        raise AssertionError(f"no order for {cfg}") from None
    least = verifier.least_length(cfg.total, "order", cfg.fmt, int(index.shape[-1]), cfg.cp,
                                  padded=suite.widths(cfg) if cfg.fmt == "thd" else None)
    assert least <= length
    for rank in range(cfg.cp):
        assert verifier.places(_order_view(cfg, rank, index, length)) == verifier.places(_view(cfg, rank))


def test_torch_per_document_head_tail_is_read_document_after_document() -> None:
    # torch's _PerDocumentHeadTailLoadBalancer for two documents of 8 at cp 2: as a
    # rearrange index, rank 0 holds document 0 (chunks 0, 3, 1, 2), rank 1 document 1
    index = (0, 1, 6, 7, 2, 3, 4, 5, 8, 9, 14, 15, 10, 11, 12, 13)
    for rank in range(2):
        view = verifier.RankView((8, 8), (4, 3), "order", "thd", None, rank, 2, 9,
                                 padded=(8, 8), order=(index,))
        assert verifier.places(view) == [(rank, p) for p in (0, 1, 6, 7, 2, 3, 4, 5)] + [None]
        assert verifier.share_offsets(view) == [[0, 1, 2, 3] if rank == 0 else [], [0, 1, 2] if rank else []]


@st.composite
def order_configs(draw: st.DrawFn) -> tuple[suite.Config, torch.Tensor]:
    """Samples, a CP size, thd (padded widths whose sum it divides) or bshd (rows of a
    length it divides, left-padded or not), and a random order."""
    total, response = draw(samples(max_n=5).filter(lambda s: len(s[0]) > 0))
    cp = draw(st.integers(1, 4))
    if draw(st.booleans()):
        padded = [t + draw(st.integers(0, 3)) for t in total]
        padded[-1] += -sum(padded) % cp
        n = sum(padded)
        cfg = suite.Config(total, response, "thd", None, "none", cp, None, 0, tuple(padded))
        return cfg, torch.tensor(draw(st.permutations(range(n))))
    seq = -(-max(total) // cp) * cp + cp * draw(st.integers(0, 2))
    offsets = tuple(draw(st.integers(0, seq - t)) for t in total)
    cfg = suite.Config(total, response, "bshd", seq, "none", cp, None, 0, row_offsets=offsets)
    return cfg, torch.tensor([draw(st.permutations(range(seq))) for _ in total])


@settings(max_examples=30, deadline=None)
@given(order_configs(), st.integers(0, 3))
def test_a_random_order_s_rows_are_what_cpslice_packs(case: tuple[suite.Config, torch.Tensor], extra: int) -> None:
    cfg, index = case
    n = int(index.numel())
    length = n // cfg.cp + extra
    per_row = [torch.arange(t, dtype=torch.float64) + 100 * i for i, t in enumerate(cfg.total)]
    for rank in range(cfg.cp):
        layout = Layout.from_order(index, cfg.total, cfg.response, cp_rank=rank, cp_size=cfg.cp,
                                   qkv_format=cfg.fmt, max_seq_len=cfg.seq, padded_lengths=cfg.padded,
                                   row_offsets=cfg.row_offsets)
        view = _order_view(cfg, rank, index, length)
        assert torch.equal(verifier.rows(per_row, view), pack(per_row, layout.with_local_length(length)))


def test_a_star_is_read_as_layouts_md_s_worked_example() -> None:
    # one group of 3, P = 3, R = 2, 4, 3: L* = 12 = W*, C = 3 under zigzag over 2 ranks;
    # rank 0 holds star positions 0-2 (the prompt) and 9-11 (sample 2's positions 3-5),
    # rank 1 star positions 3-5 (sample 0's 3, 4; sample 1's 3) and 6-8 (sample 1's 4-6)
    total, response, groups = (5, 7, 6), (2, 4, 3), (3,)
    assert verifier.star_totals(total, response, groups) == (12,)
    assert verifier.least_length((12,), "zigzag", "thd", None, 2) == 6
    prompt = [[(0, p), (1, p), (2, p)] for p in range(3)]
    want_holders = [prompt + [[(2, 3)], [(2, 4)], [(2, 5)]],
                    [[(0, 3)], [(0, 4)], [(1, 3)], [(1, 4)], [(1, 5)], [(1, 6)]]]
    # the shares as local rows: rank 0 rows 2 | 2 | 2, 3, 4; rank 1 rows 0 | 2, 3, 4 | none
    want_rows = [[[2], [2], [2, 3, 4]], [[0], [2, 3, 4], []]]
    w = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0, 30.0, 40.0]), torch.tensor([100.0, 200.0, 300.0])]
    per_row = [torch.cat([torch.zeros(2), x, torch.zeros(1)]) for x in w]  # w at positions [P - 1, L - 1)
    want_grad = [[0, 0, 1 + 10 + 100, 200, 300, 0, 0], [2, 0, 20, 30, 40, 0, 0]]
    for rank in range(2):
        view = verifier.RankView(total, response, "zigzag", "thd", None, rank, 2, 7, groups=groups)
        assert verifier.holders(view) == want_holders[rank] + [[]]  # the extra row: padding
        assert verifier.places(view) == [h[0] for h in want_holders[rank]] + [None]
        held = verifier.holders(view)
        rows = [[j for j, h in enumerate(held) if any(s == i and t - r - 1 <= p < t - 1 for s, p in h)]
                for i, (t, r) in enumerate(zip(total, response))]
        assert rows == want_rows[rank]
        assert verifier.share_offsets(view) == ([[0], [0], [0, 1, 2]] if rank == 0 else [[1], [1, 2, 3], []])
        # a shared row's gradient: the sum over the branches that read it (row 2 of rank 0)
        assert verifier.rows(per_row, view).tolist() == want_grad[rank]


class Stars(NamedTuple):
    total: tuple[int, ...]
    response: tuple[int, ...]
    groups: tuple[int, ...]
    mode: str
    cp: int
    align: int | None
    padded: tuple[int, ...] | None
    extra: int  # local rows beyond the least


@st.composite
def star_configs(draw: st.DrawFn) -> Stars:
    """A shared-prefix thd layout of 1 to 4 groups of 1 to 4 samples (prompts of 1 to 6,
    responses of 0 to 6, stars shorter than 2 * cp among them), in a closed form over 1
    to 4 ranks, default, aligned or explicitly padded stars, a few rows longer than needed.
    (Plain arithmetic: a cpslice call in a strategy would draw from ``random``, as the
    checked mode's beartype does.)"""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    total: list[int] = []
    response: list[int] = []
    stars = []
    for g in sizes:
        prompt = draw(st.integers(1, 6))
        rs = draw(st.lists(st.integers(0, 6), min_size=g, max_size=g))
        total += [prompt + r for r in rs]
        response += rs
        stars.append(prompt + sum(rs))
    mode = draw(st.sampled_from(("none", "zigzag", "allgather")))
    cp = 1 if mode == "none" else draw(st.integers(1 if mode == "allgather" else 2, 4))
    step = 2 * cp if mode == "zigzag" else 1
    kind = draw(st.sampled_from(("default", "align", "padded")))
    align = step * draw(st.integers(1, 3)) if kind == "align" else None
    padded = tuple(-(-t // step) * step + step * draw(st.integers(0, 2)) for t in stars) if kind == "padded" else None
    return Stars(tuple(total), tuple(response), tuple(sizes), mode, cp, align, padded, draw(st.integers(0, 2)))


@settings(max_examples=8, deadline=None)
@given(star_configs())
def test_the_verifier_reads_stars_as_cpslice_places_them(case: Stars) -> None:
    """Over random stars: the verifier's first holder of each row is what ``pack`` writes
    there (a group's prompt once), its shares are what ``shard_responses`` reads, and its
    gradient rows, a shared row's the sum over its branches, are autograd's through
    ``extract_responses``."""
    from cpslice import extract_responses, shard_responses

    groups, cp = case.groups, case.cp
    least = verifier.least_length(verifier.star_totals(case.total, case.response, groups), case.mode,
                                  "thd", None, cp, case.align, case.padded)
    base = verifier.RankView(case.total, case.response, case.mode, "thd", None, 0, cp, least + case.extra,
                             case.align, case.padded, groups=groups)
    firsts = [f for f, g in zip([0, *itertools.accumulate(groups)], groups) for _ in range(g)]
    # a sample's prompt values are its group's first sample's (pack checks they are equal)
    per_row = [torch.tensor([100.0 * (firsts[i] if p < t - r else i) + p for p in range(t)])
               for i, (t, r) in enumerate(zip(base.total, base.response))]
    whole = [torch.arange(r, dtype=torch.float64) + 100 * i + 1 for i, r in enumerate(base.response)]
    weights = [torch.cat([torch.zeros(t - r - 1, dtype=torch.float64), w, torch.zeros(1, dtype=torch.float64)])
               for w, t, r in zip(whole, base.total, base.response)]
    for rank in range(cp):
        view = dataclasses.replace(base, rank=rank)
        layout = Layout(base.total, base.response, cp_mode=base.mode, cp_rank=rank, cp_size=cp,  # type: ignore[arg-type]
                        local_length=base.length, padded_lengths=base.padded, align=base.align,
                        shared_prefix=groups)
        written = torch.tensor([0.0 if p is None else float(per_row[p[0]][p[1]]) for p in verifier.places(view)])
        assert torch.equal(pack(per_row, layout), written)
        got = shard_responses(whole, layout)
        assert [s.tolist() for s in verifier.shares(whole, view)] == [s.tolist() for s in got]
        x = torch.zeros(base.length, dtype=torch.float64, requires_grad=True)
        shares, _ = extract_responses(x, layout)
        loss = sum(((s * w).sum() for s, w in zip(shares, verifier.shares(whole, view))), x.sum() * 0)
        (grad,) = torch.autograd.grad(loss, x)
        assert torch.equal(grad, verifier.rows(weights, view))
