"""The verifier's layout oracle (``cpslice._verify.oracle``) against the suite's
(``tests/oracle.py``): two transcriptions of docs/layouts.md written apart, which
must place every position of every sample at the same local row of every rank.

Over hypothesis layouts (``tests/strategies.configs``: every mode, thd and bshd,
align and explicit padded widths with a stretched last sample, left-padded bshd rows,
empty responses, ranks holding nothing, extra padding rows): the least local length, each row's place, each
rank's response shares and gradient rows agree.

The verifier reads an order layout from the order itself: the index of each closed form
(``Layout.order``) read as an order places every row where the verifier's closed form
does; torch's per-document head-tail index is read as torch cuts it; and a random
order's rows are what ``cpslice.pack`` writes for ``Layout.from_order``.
"""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cpslice import Layout, LayoutError, pack
from cpslice._verify import oracle as verifier

from . import oracle as suite
from .strategies import configs, samples


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
        index = cfg.layout(0).order()
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
