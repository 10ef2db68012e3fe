"""Layouts of any token order (``Layout.from_order``), single process, every rank in
turn, against an oracle that reads the order itself: row ``j`` of rank ``r`` holds
stream position ``order[r*T + j]`` (bshd: row ``b``'s column ``order[b, r*S/c + j]``),
never cpslice's pieces. Random permutations, permutations of blocks, torch's
per-document head-tail order (document-major), and every closed form's own order, which
``from_order`` must give back as that closed form. The distributed readings (reducers,
redistribution) with torch's own balancers are tests/distributed/test_balancers.py's."""

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

import cpslice
from cpslice import Layout, LayoutError

from ..support.oracle import Config
from ..support.strategies import configs, samples

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Case:
    """One batch of samples laid out by ``order`` over ``cp`` ranks."""

    total: tuple[int, ...]
    response: tuple[int, ...]
    fmt: str
    seq: int | None
    widths: tuple[int, ...]
    offsets: tuple[int, ...]
    order: Tensor
    cp: int

    def layout(self, rank: int) -> Layout:
        bshd = self.fmt == "bshd"
        return Layout.from_order(
            self.order, self.total, self.response, cp_rank=rank, cp_size=self.cp,
            qkv_format="bshd" if bshd else "thd", max_seq_len=self.seq,
            padded_lengths=None if bshd else self.widths, row_offsets=self.offsets if bshd else None)

    def whole(self) -> Layout:
        """The same samples in one unsharded local tensor: its rows are stream positions."""
        if self.fmt == "bshd":
            return Layout(self.total, self.response, qkv_format="bshd", max_seq_len=self.seq,
                          row_offsets=self.offsets)
        return Layout(self.total, self.response, padded_lengths=self.widths)

    def stream_rows(self, rank: int) -> list[int]:
        """The stream position of each local row of ``rank`` (the oracle)."""
        if self.fmt == "thd":
            t = sum(self.widths) // self.cp
            return self.order[rank * t:(rank + 1) * t].tolist()
        assert self.seq is not None
        width = self.seq // self.cp
        return [b * self.seq + int(col) for b in range(len(self.total))
                for col in self.order[b, rank * width:(rank + 1) * width]]

    def token(self, q: int) -> tuple[int, int] | None:
        """``(sample, position)`` of stream position ``q``, or None for padding."""
        start = 0
        for i, w in enumerate(self.widths):
            if q < start + w:
                p = q - start - self.offsets[i]
                return (i, p) if 0 <= p < self.total[i] else None
            start += w
        raise AssertionError(q)


def _head_tail(widths: list[int], cp: int) -> list[int]:
    """torch's per-document head-tail: inside each document, rank r's chunks r and
    2c-1-r, emitted document-major (what ``_PerDocumentHeadTailLoadBalancer`` returns)."""
    out: list[int] = []
    start = 0
    for w in widths:
        chunk = w // (2 * cp)
        for r in range(cp):
            for c in (r, 2 * cp - 1 - r):
                out += range(start + c * chunk, start + (c + 1) * chunk)
        start += w
    return out


def _permutation(rng: random.Random, n: int, kind: str) -> list[int]:
    if kind == "random":
        perm = list(range(n))
        rng.shuffle(perm)
        return perm
    block = rng.choice([1, 2, 3, 4, 8])
    blocks = [list(range(s, min(s + block, n))) for s in range(0, n, block)]
    rng.shuffle(blocks)
    return [p for b in blocks for p in b]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    total, response = draw(samples(max_n=5, max_len=16))
    cp = draw(st.integers(1, 4))
    fmt = draw(st.sampled_from(("thd", "bshd")))
    kind = draw(st.sampled_from(("random", "blocks", "head-tail")))
    rng = random.Random(draw(st.integers(0, 2**32)))
    if fmt == "bshd":
        seq = -(-max(total, default=1) // (2 * cp)) * 2 * cp + 2 * cp * draw(st.integers(0, 1))
        offsets = tuple(rng.randint(0, seq - t) for t in total)
        rows = [_head_tail([seq], cp) if kind == "head-tail" else _permutation(rng, seq, kind) for _ in total]
        order = torch.tensor(rows, dtype=torch.int64).view(len(total), seq)
        return Case(total, response, fmt, seq, (seq,) * len(total), offsets, order, cp)
    step = 2 * cp if kind == "head-tail" else 1
    widths = [-(-t // step) * step + step * rng.randint(0, 2) for t in total]
    if widths and kind != "head-tail":  # a stream that cp divides
        widths[-1] += -sum(widths) % cp
    elif not widths:
        widths = []
    flat = _head_tail(widths, cp) if kind == "head-tail" else _permutation(rng, sum(widths), kind)
    return Case(total, response, fmt, None, tuple(widths), (0,) * len(total),
                torch.tensor(flat, dtype=torch.int64), cp)


def _expected_rows(case: Case, rank: int) -> tuple[list[int], list[int], list[list[int]]]:
    """The oracle's response rows of ``rank`` in extraction order, their counts, and
    each sample's response elements held there."""
    held: list[list[tuple[int, int]]] = [[] for _ in case.total]
    for j, q in enumerate(case.stream_rows(rank)):
        tok = case.token(q)
        if tok is not None:
            i, p = tok
            first = case.total[i] - case.response[i] - 1
            if first <= p < case.total[i] - 1:
                held[i].append((p, j))
    rows = [j for h in held for _, j in sorted(h)]
    elements = [[p - (case.total[i] - case.response[i] - 1) for p, _ in sorted(h)] for i, h in enumerate(held)]
    return rows, [len(h) for h in held], elements


@SETTINGS
@given(cases())
def test_every_reading_of_an_order_layout_follows_the_order(case: Case) -> None:
    _check_readings(case)


def test_a_run_that_ends_on_a_sample_boundary_at_the_end_of_the_stream() -> None:
    """The edges of reading an order into pieces that random orders reach only sometimes:
    rank 0's run 2, 3, 4 crosses from sample 0 into sample 1, so runs are cut at the
    samples' starts, and rank 1's last run 5, 6, 7 ends where sample 1 and the stream
    end (no sample after it to cut it at); a run ending at an inner boundary too."""
    for total, response, order in (([3, 5], [1, 3], [2, 3, 4, 0, 1, 5, 6, 7]),
                                   ([3, 2, 3], [1, 1, 2], [1, 2, 3, 4, 0, 5, 6, 7]),
                                   ([2, 2, 4], [1, 1, 2], [4, 5, 6, 7, 0, 1, 2, 3])):
        case = Case(tuple(total), tuple(response), "thd", None, tuple(total), (0,) * len(total),
                    torch.tensor(order), 2)
        _check_readings(case)


def _check_readings(case: Case) -> None:
    """Every reading of ``case``'s order layout, on every rank, against the order itself."""
    tokens = [torch.randint(0, 50, (t,)) for t in case.total]
    full = [torch.randn(r, 2) for r in case.response]
    for rank in range(case.cp):
        layout = case.layout(rank)
        assert layout == Layout.from_order(layout.order(), case.total, case.response, cp_rank=rank,
                                           cp_size=case.cp, qkv_format=layout.qkv_format,
                                           max_seq_len=case.seq, padded_lengths=None if case.seq else case.widths,
                                           row_offsets=case.offsets if case.seq else None)
        assert torch.equal(layout.order(), case.order if case.fmt == "thd" else case.order.expand(len(case.total), -1))
        placed = [case.token(q) for q in case.stream_rows(rank)]
        packed = cpslice.pack(tokens, layout, fill=-1)
        assert packed.tolist() == [-1 if t is None else int(tokens[t[0]][t[1]]) for t in placed]
        targets = cpslice.shifted_targets(tokens, layout, fill=-1)
        assert targets.tolist() == [-1 if t is None or t[1] + 1 >= case.total[t[0]] else int(tokens[t[0]][t[1] + 1])
                                    for t in placed]
        rows, counts, elements = _expected_rows(case, rank)
        got = cpslice.response_rows(layout)
        assert got.rows.tolist() == rows and got.counts == counts
        values = torch.randn(len(placed), 2, requires_grad=True)
        shares, _ = cpslice.extract_responses(values, layout)
        assert [s.shape[0] for s in shares] == counts
        assert torch.equal(torch.cat([values[:0], *shares]), values[rows])
        for f, mine, want in zip(full, cpslice.shard_responses(full, layout), elements, strict=True):
            assert torch.equal(mine, f[want])


@settings(SETTINGS, max_examples=25)
@given(cases(), st.sampled_from(("logits", "hidden", "support", "distillation")))
def test_log_probs_of_an_order_layout_are_the_whole_streams_shares(case: Case, driver: str) -> None:
    """Every rank's per-sample log-probs, entropy and local gradient are the unsharded
    stream's, at the positions the order gives that rank (per-sample temperatures, a
    soft cap, a padded vocabulary; the hidden-state path, a rollout's token sets, a
    teacher's top-k)."""
    vocab, n_rows = 11, sum(case.widths)
    tokens = [torch.randint(0, 9, (t,)) for t in case.total]
    stream = torch.randn(n_rows, 6 if driver == "hidden" else vocab, dtype=torch.float64)
    weight = torch.randn(vocab, 6, dtype=torch.float64)
    tau = [0.7 + 0.1 * i for i in range(len(case.total))]
    # per response token: its own token and two more (a top-p set); a teacher's top-3
    sets = [torch.stack([t[len(t) - r:], (t[len(t) - r:] + 1) % 9, (t[len(t) - r:] + 4) % 9], 1)
            for t, r in zip(tokens, case.response)]
    ids = [x.reshape(-1) for x in sets]
    offsets = [torch.arange(0, 3 * r + 1, 3) for r in case.response]
    teacher = [torch.log_softmax(torch.randn(r, 3, dtype=torch.float64), -1) for r in case.response]

    def run(x: Tensor, layout: Layout) -> tuple[list[Tensor], list[Tensor]]:
        if driver == "hidden":
            return cpslice.response_log_probs_from_hidden(x, weight, tokens, layout, with_entropy=True,
                                                          temperature=tau, softcap=5.0, vocab_size=9)
        if driver == "distillation":
            kl = cpslice.response_distillation(x, teacher, sets, layout, temperature=tau, softcap=5.0, vocab_size=9)
            return kl, [k * 0 for k in kl]
        support = cpslice.Support.from_responses(ids, offsets, layout) if driver == "support" else None
        return cpslice.response_log_probs(x, tokens, layout, with_entropy=True, temperature=tau,
                                          softcap=5.0, vocab_size=9, support=support)

    whole_x = stream.clone().requires_grad_(True)
    lp, ent = run(whole_x, case.whole())
    weights = [torch.randn(r, dtype=torch.float64) for r in case.response]
    total: Tensor = whole_x.sum() * 0 + sum(((w * a).sum() + (w * b).sum() for w, a, b in zip(weights, lp, ent)),
                                    torch.zeros((), dtype=torch.float64))
    torch.autograd.backward(total)
    assert whole_x.grad is not None
    for rank in range(case.cp):
        layout = case.layout(rank)
        at = torch.tensor(case.stream_rows(rank), dtype=torch.int64)
        x = stream[at].clone().requires_grad_(True)
        mine_lp, mine_ent = run(x, layout)
        _, _, elements = _expected_rows(case, rank)
        loss: Tensor = x.sum() * 0
        for i, want in enumerate(elements):
            torch.testing.assert_close(mine_lp[i], lp[i].detach()[want], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(mine_ent[i], ent[i].detach()[want], rtol=1e-12, atol=1e-12)
            loss = loss + (weights[i][want] * (mine_lp[i] + mine_ent[i])).sum()
        torch.autograd.backward(loss)
        assert x.grad is not None
        torch.testing.assert_close(x.grad, whole_x.grad[at], rtol=1e-12, atol=1e-12)


@settings(max_examples=80, deadline=None)
@given(configs(max_cp=4), st.data())
def test_a_closed_forms_order_gives_back_the_closed_form(cfg: Config, data: st.DataObject) -> None:
    assume(cfg.total)  # no samples: every closed form places nothing alike (the order tests hold empty batches)
    rank = data.draw(st.integers(0, cfg.cp - 1))
    closed = cfg.layout(rank, with_local=cfg.local_length is not None)  # no declared tail padding
    try:
        order = closed.order()
    except LayoutError as err:  # allgather pieces that do not tile the stream
        assert closed.cp_mode == "allgather" and "local_length = sum(padded_lengths) / cp_size" in str(err)
        return
    bshd = closed.qkv_format == "bshd"
    again = Layout.from_order(order, closed.total_lengths, closed.response_lengths, cp_rank=rank,
                              cp_size=closed.cp_size, qkv_format=closed.qkv_format,
                              max_seq_len=closed.padded_lengths[0] if bshd else None,
                              padded_lengths=None if bshd else closed.padded_lengths,
                              row_offsets=closed.row_offsets if bshd else None)
    assert torch.equal(again.order(), order)
    if closed.cp_size == 1:  # zigzag and allgather of one rank place as none does: none it is
        assert again.cp_mode == "none"
        return
    assert again.cp_mode == closed.cp_mode and cpslice.extraction_strategy(again) == cpslice.extraction_strategy(closed)
    if bshd and again.max_seq_len != closed.max_seq_len:  # zigzag rows of S padded to W: the order is W's
        return
    expected = closed.with_local_length(again.local_length) if closed.cp_mode == "allgather" else (
        closed.with_local_length(None))
    assert again == expected and hash(again) == hash(expected)


def test_an_order_no_closed_form_places_is_an_order_layout() -> None:
    documents = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5, 8, 9, 14, 15, 10, 11, 12, 13])  # torch's, c = 2
    layout = Layout.from_order(documents, [8, 8], [3, 5], cp_rank=0, cp_size=2)
    assert layout.cp_mode == "order" and cpslice.extraction_strategy(layout) == "order"
    assert layout != Layout([8, 8], [3, 5], cp_mode="zigzag", cp_rank=0, cp_size=2)
    assert layout == Layout.from_order(documents.tolist(), [8, 8], [3, 5], cp_rank=0, cp_size=2)
    assert layout != layout.for_rank(1) and layout.for_rank(1).for_rank(0) == layout
    assert hash(layout.for_rank(1).for_rank(0)) == hash(layout)
    # rank 0 holds all of document 0 (document-major), rank 1 all of document 1
    assert cpslice.response_rows(layout).counts == [3, 0]
    assert cpslice.response_rows(layout.for_rank(1)).counts == [0, 5]
    assert layout.with_local_length(10).local_length == 10
    values = torch.zeros(10)
    assert [s.shape[0] for s in cpslice.extract_responses(values, layout.with_local_length(10))[0]] == [3, 0]
    with pytest.raises(LayoutError, match="too short"):
        cpslice.extract_responses(torch.zeros(7), layout)
    torch_order = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])  # _HeadTailLoadBalancer's, S = 8, c = 2
    assert Layout.from_order(torch_order, [8], [4], cp_rank=1, cp_size=2) == Layout(
        [8], [4], cp_mode="zigzag", cp_rank=1, cp_size=2)


REFUSALS = [
    ([0, 1, 1, 3], [2, 2], "thd", None, LayoutError, r"order\[2\] = 1 repeats order\[1\] .*each position once"),
    ([0, 1, 2, 7], [2, 2], "thd", None, LayoutError, r"order\[3\] = 7 is outside \[0, 4\)"),
    ([0, -1, 2, 3], [2, 2], "thd", None, LayoutError, r"order\[1\] = -1 is outside \[0, 4\)"),
    ([0, 1, 2], [3], "thd", None, LayoutError, r"cp_size 2 does not divide the order's 3 positions"),
    ([0, 1, 2], [2, 2], "thd", None, LayoutError, r"has 3 entries but must have 4"),
    ([[0, 1], [2, 3]], [2, 2], "thd", None, LayoutError, r"shape \[N\] or \[1, N\], got \[2, 2\]"),
    ([[0, 1, 2, 3], [0, 1, 3, 3]], [2, 3], "bshd", 4, LayoutError,
     r"order\[1, 3\] = 3 repeats order\[1, 2\] \(row 1 of a bshd order"),
    ([[0, 1, 2], [0, 1, 2]], [2, 3], "bshd", 4, LayoutError, r"rows have 3 columns but max_seq_len is 4"),
    ([0, 2, 1], [2, 2], "bshd", 3, LayoutError, r"cp_size 2 does not divide max_seq_len 3"),
    (torch.tensor([0.0, 1.0, 2.0, 3.0]), [2, 2], "thd", None, TypeError,
     r"order must hold integers, got torch.float32"),
    (torch.tensor([True, False]), [2], "thd", None, TypeError, r"order must hold integers, got torch.bool"),
    ("0123", [2, 2], "thd", None, TypeError, r"order must be an integer tensor or a sequence of ints, got a str"),
    ([[0, 1], [2]], [2, 2], "thd", None, TypeError, r"order must be an integer tensor or a sequence of ints"),
]


@pytest.mark.parametrize(("order", "total", "fmt", "seq", "error", "message"), REFUSALS)
def test_a_bad_order_names_its_first_bad_entry_and_the_rule(
    order: object, total: list[int], fmt: str, seq: int | None, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Layout.from_order(order, total, [1] * len(total), cp_rank=0, cp_size=2,  # type: ignore[arg-type]  # refused kinds
                          qkv_format=fmt, max_seq_len=seq)  # type: ignore[arg-type]  # a str format


def test_an_order_layout_refuses_cp_mode_order_and_a_bad_rank() -> None:
    with pytest.raises(LayoutError, match="cp_mode 'order' needs the order itself: build the layout with "
                                          "Layout.from_order"):
        Layout([2], [1], cp_mode="order")  # type: ignore[arg-type]  # refused
    with pytest.raises(LayoutError, match=r"cp_rank 2 is outside \[0, cp_size=2\)"):
        Layout.from_order([0, 1, 2, 3], [4], [1], cp_rank=2, cp_size=2)
    layout = Layout.from_order([0, 3, 1, 2], [4], [1], cp_rank=0, cp_size=2)
    with pytest.raises(LayoutError, match=r"cp_rank 5 is outside \[0, cp_size=2\)"):
        layout.for_rank(5)
    with pytest.raises(LayoutError, match=r"2 local tensors of 6 rows hold 12 rows, not the 9 positions"):
        Layout([4, 5], [1, 1], cp_mode="allgather", cp_rank=0, cp_size=2, local_length=6).order()
