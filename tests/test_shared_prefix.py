"""Shared-prefix stars (``shared_prefix=``, docs/layouts.md "Shared prefixes"): every
reading of a shared layout against the loop-by-loop oracle of tests/stars.py, and every
result against the float64 reference of the SAME samples packed without sharing (each
sample its own copy of its prompt): the branches' outputs are the unshared samples',
and a shared row's gradient is the sum of its copies' (the prompt's last row predicts
each branch's first response token). Single process over every rank of random stars
(none, zigzag, allgather, any token order), then one gloo task per world size for the
collectives (gather_responses, redistribute, the reducers, a TP group)."""


import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpslice
from cpslice import Layout

from .stars import Stars, make_data, per_sample, pick, stars

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DOCS = Stars((3,), (3,), (2, 4, 3))  # docs/layouts.md's example: L* = 12


def test_the_docs_example_rows() -> None:
    layout = DOCS.layout(0)
    assert layout.padded_lengths == (12,) and layout.shared_prefix == (3,)
    got = cpslice.response_rows(layout)
    assert got.rows.tolist() == [2, 3, 2, 5, 6, 7, 2, 9, 10] and got.counts == [2, 4, 3]
    assert cpslice.position_ids(layout).tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 3, 4, 5]
    zig = [Stars((3,), (3,), (2, 4, 3), "zigzag", 2).layout(r) for r in (0, 1)]
    assert [cpslice.response_rows(z).rows.tolist() for z in zig] == [[2, 2, 2, 3, 4], [0, 2, 3, 4]]
    assert [cpslice.response_rows(z).counts for z in zig] == [[1, 1, 3], [1, 3, 0]]


@SETTINGS
@given(stars(), st.integers(0, 2))
def test_every_reading_follows_the_star_rules(case: Stars, depth: int) -> None:
    """pack, position_ids, response_rows, extract_responses (values and gradient: a shared
    row's is the sum over the branches that read it), shard_responses and (without CP)
    attention_mask, on every rank, against the oracle; the ranks' shares partition every
    response."""
    data = make_data(case, 7, 0, scale=1.0)
    full = [torch.randn(r, 2, dtype=torch.float64) for r in case.response]
    weights = [torch.randn(r, 2, dtype=torch.float64) for r in case.response]
    seen: list[list[int]] = [[] for _ in range(case.n)]
    for rank in range(case.cp):
        layout = case.layout(rank)
        assert layout.shared_prefix == (None if all(g == 1 for g in case.groups) else case.groups)
        assert layout.for_rank(rank) == layout and hash(layout.for_rank(rank)) == hash(layout)
        entries = case.local_map(rank)
        t = len(entries)
        holder = [None if e is None else case.holders(*e)[0] for e in entries]
        packed = cpslice.pack(data.tokens, layout, fill=-1)
        assert packed.tolist() == [-1 if h is None else int(data.tokens[h[0]][h[1]]) for h in holder]
        x = cpslice.pack(per_sample(case, data), layout, fill=0.5)
        assert torch.equal(x, torch.stack([torch.full((7,), 0.5, dtype=torch.float64) if e is None
                                            else data.star_x[e[0]][e[1]] for e in entries]))
        assert cpslice.position_ids(layout).tolist() == [0 if h is None else h[1] for h in holder]
        shares = case.shares(rank, depth)
        rows = cpslice.response_rows(layout, depth=depth)
        assert rows.rows.tolist() == [r for s in shares for r, _ in s]
        assert rows.counts == [len(s) for s in shares]
        values = torch.randn(t, 2, dtype=torch.float64, requires_grad=True)
        ent = values.detach() * 2
        got, got_ent = cpslice.extract_responses(values, layout, ent, depth=depth)
        want_grad = torch.zeros(t, 2, dtype=torch.float64)
        for i, (mine, share) in enumerate(zip(got, shares, strict=True)):
            at = [r for r, _ in share]
            assert torch.equal(mine, values[at]) and torch.equal(got_ent[i], ent[at])
            for (r, e) in share:
                want_grad[r] += weights[i][e]
                seen[i].append(e)
        mine_w = pick(weights, case, rank, depth)
        torch.autograd.backward(sum(((m * w).sum() for m, w in zip(got, mine_w)), values.sum() * 0))
        assert values.grad is not None
        torch.testing.assert_close(values.grad, want_grad, rtol=1e-15, atol=1e-15)
        for mine, want in zip(cpslice.shard_responses(full, layout, depth=depth), pick(full, case, rank, depth),
                              strict=True):
            assert torch.equal(mine, want)
        if case.mode == "none":
            assert torch.equal(cpslice.attention_mask(layout), case.mask())
    for i, s in enumerate(seen):  # every response token predicted at this depth, exactly once
        p = case.prompts[case.group_of(i)]
        lost = max(0, depth + 1 - p)
        assert sorted(s) == list(range(min(lost, case.response[i]), case.response[i]))


def test_top_k_from_hidden_states_keeps_an_order_layouts_element_order() -> None:
    """An order layout's shares need not run in ascending rows: the hidden-state top-k,
    which runs the head on the distinct rows (ascending), must return them in the
    elements' order, as the logits path does, with no shared row on the rank too."""
    layout = Layout.from_order([0, 1, 3, 2, 4], [1, 1, 4], [0, 0, 3], cp_rank=0, cp_size=1,
                               padded_lengths=[1, 4], shared_prefix=[1, 2])
    assert layout.cp_mode == "order" and cpslice.response_rows(layout).rows.tolist() == [1, 3, 2]
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 4, generator=gen, dtype=torch.float64), torch.randn(9, 4, generator=gen, dtype=torch.float64)
    values, ids = cpslice.response_topk_log_probs_from_hidden(h, w, 3, layout)
    want = torch.topk(torch.log_softmax(h[[1, 3, 2]] @ w.T, -1), 3)
    assert torch.equal(ids[2], want.indices)
    torch.testing.assert_close(values[2], want.values, rtol=1e-12, atol=1e-12)
