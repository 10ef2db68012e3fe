"""Shared-prefix stars (``shared_prefix=``, docs/layouts.md "Shared prefixes"): every
reading of a shared layout against the loop-by-loop oracle of tests/support/stars.py, and every
result against the float64 reference of the SAME samples packed without sharing (each
sample its own copy of its prompt): the branches' outputs are the unshared samples',
and a shared row's gradient is the sum of its copies' (the prompt's last row predicts
each branch's first response token). Single process over every rank of random stars
(none, zigzag, allgather, any token order), then one gloo task per world size for the
collectives (gather_responses, redistribute, the reducers, a TP group)."""

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

import cpslice
from cpslice import Layout, LayoutError, Support

from ..support import oracle
from ..support._dist import run_distributed
from ..support.distill_reference import divergence
from ..support.oracle import Config
from ..support.stars import (
    Data,
    Ref,
    Sets,
    Stars,
    csr,
    local_grad,
    local_input,
    make_data,
    per_sample,
    pick,
    reference,
    response_sets,
    star_grads,
    stars,
    weighted,
)

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

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


def _position(case: Stars, i: int, s: int) -> int:
    """Sample ``i``'s position at star position ``s`` (-1: none)."""
    rows = case.star_rows(i)
    return rows.index(s) if s in rows else -1


@SETTINGS
@given(stars(), st.integers(0, 2))
def test_every_reading_follows_the_star_rules(case: Stars, depth: int) -> None:
    _check_readings(case, depth)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_padded_star_without_cp(depth: int) -> None:
    """Padded stars in one local tensor, which random stars reach only sometimes: the
    padding rows after each star (given extents, align, cu_seqlens) hold no token, attend
    only themselves and are read by nothing, a star of one sample among them."""
    for case in (Stars((2, 1), (3, 2), (2, 3, 1), padded=(12, 6)),
                 Stars((3, 1), (2, 1), (1, 2, 0, 3), align=4),
                 Stars((1, 2), (2, 3), (2, 1, 2), padded=(8, 9), cu=True)):
        assert case.layout(0).cp_mode == "none" and sum(case.widths) > sum(case.star_lengths)
        _check_readings(case, depth)


def _check_readings(case: Stars, depth: int) -> None:
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
        copies = [c.requires_grad_(True) for c in per_sample(case, data)]
        x = cpslice.pack(copies, layout, fill=0.5)
        assert torch.equal(x, torch.stack([torch.full((7,), 0.5, dtype=torch.float64) if e is None
                                            else data.star_x[e[0]][e[1]] for e in entries]))
        upstream = torch.randn(t, 7, dtype=torch.float64)
        torch.autograd.backward(x, upstream)
        for i, c in enumerate(copies):  # a prompt row's gradient goes to the copy packed: the group's first
            want_c = torch.zeros_like(c)
            for row, entry in enumerate(entries):
                if entry is not None and (i, _position(case, i, entry[1])) == case.holders(*entry)[0]:
                    want_c[_position(case, i, entry[1])] = upstream[row]
            assert c.grad is not None and torch.equal(c.grad, want_c)
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


DRIVERS = ("logits", "hidden", "support", "support-hidden", "topk", "topk-hidden", "distill", "distill-hidden")
V, IDS, H, K = 9, 7, 4, 3


@dataclass
class Call:
    """One driver's call: its options, the rollout's sets, the teacher's top-k."""

    driver: str
    tau: list[float] | None
    softcap: float | None
    vocab_size: int | None
    sets: Sets | None
    over: Literal["full", "support"]
    kind: Literal["forward", "reverse", "jsd"]
    teacher: list[tuple[Tensor, Tensor]]  # per sample [R_i, K] log-probs and ids
    depth: int = 0  # the log-prob drivers'
    chunk: int | None = None

    def run(self, x: Tensor, w: Tensor | None, layout: Layout, tokens: list[Tensor]) -> list[list[Tensor]]:
        """The driver's per-sample results (log-probs and entropy, top-k values, or
        divergences), asserting the top-k ids against ``self.teacher`` is not its job."""
        tau: float | list[float] = 1.0 if self.tau is None else self.tau
        cap, vs, chunk = self.softcap, self.vocab_size, self.chunk
        if self.driver.startswith("topk"):
            if w is None:
                values, ids = cpslice.response_topk_log_probs(x, K, layout, temperature=tau, softcap=cap, vocab_size=vs,
                                                              chunk_size=chunk)
            else:
                values, ids = cpslice.response_topk_log_probs_from_hidden(x, w, K, layout, temperature=tau,
                                                                          softcap=cap, vocab_size=vs, chunk_size=chunk)
            return [values, ids]
        if self.driver.startswith("distill"):
            t_lp, t_ids = [t[0] for t in self.teacher], [t[1] for t in self.teacher]
            if w is None:
                return [cpslice.response_distillation(x, t_lp, t_ids, layout, kind=self.kind, temperature=tau,
                                                      softcap=cap, vocab_size=vs, chunk_size=chunk)]
            return [cpslice.response_distillation_from_hidden(x, w, t_lp, t_ids, layout, kind=self.kind,
                                                              temperature=tau, softcap=cap, vocab_size=vs,
                                                              chunk_size=chunk)]
        support = None if self.sets is None else Support.from_responses(*csr(self.sets), layout)
        if w is None:
            lp, ent = cpslice.response_log_probs(x, tokens, layout, with_entropy=True, temperature=tau, softcap=cap,
                                                 vocab_size=vs, support=support, entropy_over=self.over,
                                                 chunk_size=chunk, depth=self.depth)
        else:
            lp, ent = cpslice.response_log_probs_from_hidden(x, w, tokens, layout, with_entropy=True, temperature=tau,
                                                             softcap=cap, vocab_size=vs, support=support,
                                                             entropy_over=self.over, chunk_size=chunk,
                                                             depth=self.depth)
        return [lp, ent]


def _masked(values: list[Tensor], masks: list[Tensor], mean: bool) -> Tensor:
    """The reference's sum over samples of masked means (or of the masked sums)."""
    out = torch.zeros((), dtype=torch.float64)
    for v, m in zip(values, masks):
        s = (v * m.double()).sum()
        if not mean:
            out = out + s
        elif bool(m.any()):
            out = out + s / m.double().sum()
    return out


def _wanted(call: Call, case: Stars, data: Data, ref: Ref, w_k: list[Tensor]) -> tuple[list[list[Tensor]], Tensor]:
    """The reference's per-sample results (as ``Call.run`` returns them) and its loss."""
    zero = torch.zeros((), dtype=torch.float64)
    if call.driver.startswith("topk"):
        top = [torch.topk(f, K) for f in ref.full]
        loss = sum(((t.values * w).sum() for t, w in zip(top, w_k)), zero)
        return [[t.values for t in top], [t.indices for t in top]], loss
    if call.driver.startswith("distill"):
        div = [divergence(f.gather(1, t[1]), t[0], call.kind, 0.5, "bin") for f, t in zip(ref.full, call.teacher)]
        return [div], sum(((d * w).sum() for d, w in zip(div, data.w_lp)), zero)
    loss = weighted((ref.lp, ref.ent), data, case, None)
    if not call.depth:
        loss = loss + _masked(ref.lp, data.masks, True) + _masked(ref.ent, data.masks, False)
    return [ref.lp, ref.ent], loss


def _part(call: Call, got: list[list[Tensor]], case: Stars, data: Data, rank: int, layout: Layout,
          w_k: list[Tensor]) -> Tensor:
    """The rank's loss part, the reference's loss read on its shares."""
    zero = torch.zeros((), dtype=torch.float64)
    if call.driver.startswith("topk"):
        return sum(((v * u).sum() for v, u in zip(got[0], pick(w_k, case, rank))), zero)
    if call.driver.startswith("distill"):
        return sum(((d * u).sum() for d, u in zip(got[0], pick(data.w_lp, case, rank))), zero)
    lp, ent = got
    if call.depth:  # the reducers read the layout at depth 0: the loss weights alone
        return weighted((lp, ent), data, case, rank, call.depth)
    return weighted((lp, ent), data, case, rank) + cpslice.sum_of_sample_means(lp, data.masks, layout) + (
        cpslice.sum_of_tokens(ent, data.masks, layout))


@settings(SETTINGS, max_examples=30)
@given(stars(), st.sampled_from(DRIVERS), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
       st.sampled_from(("forward", "reverse", "jsd")), st.integers(0, 2), st.sampled_from((None, None, 1, 3)),
       st.integers(0, 2**31))
def test_results_equal_the_unshared_reference(
    case: Stars, driver: str, tempered: bool, capped: bool, padded_vocab: bool, shared_set: bool,
    kind: Literal["forward", "reverse", "jsd"], depth: int, chunk: int | None, seed: int,
) -> None:
    """Every rank's per-sample results (log-probs and entropy, with a rollout's token sets,
    the teacher's top-k, a distillation divergence; from logits or from hidden states) are
    the unshared reference's at the oracle's elements, and its local gradient the star
    rows' summed one; the loss parts (with ``sum_of_sample_means`` and ``sum_of_tokens``)
    sum over the ranks to the reference's loss. One temperature per group, a soft cap, a
    padded vocabulary; sets equal on the shared rows, or only on unshared rows; chunks of
    1 and 3 rows; log-probs at depths 0-2 (``depth + 1`` shared rows per group). The
    caller's tensors are left as they were."""
    ids = IDS if padded_vocab else V
    # (a divergence's tail bin, 1 - sum of the top-k, is ill-conditioned where the top-k
    # hold almost all the mass: milder logits keep it away from the rounding)
    data = make_data(case, V, seed, hidden=H if driver.endswith("hidden") else None, ids=ids,
                     scale=0.7 if driver.startswith("distill") else 3.0)
    gen = torch.Generator().manual_seed(seed)
    teacher = [torch.topk(torch.log_softmax(torch.randn(r, ids, generator=gen, dtype=torch.float64), -1), K)
               for r in case.response]
    sets = response_sets(case, seed, ids, shared_set) if driver.startswith("support") else None
    call = Call(driver, [0.6 + 0.5 * case.group_of(i) for i in range(case.n)] if tempered else None,
                4.0 if capped else None, IDS if padded_vocab else None, sets,
                "support" if sets is not None and seed % 2 else "full", kind, [(t.values, t.indices) for t in teacher],
                depth if driver in ("logits", "hidden") else 0, chunk)
    w_k = [torch.randn(r, K, generator=gen, dtype=torch.float64) for r in case.response]
    ref = reference(case, data, call.tau, call.softcap, call.vocab_size, sets, call.over, call.depth)
    want, loss = _wanted(call, case, data, ref, w_k)
    torch.autograd.backward(loss + sum((leaf.sum() * 0 for leaf in ref.leaves), torch.zeros((), dtype=torch.float64)))
    grads = star_grads(case, ref)
    parts = torch.zeros((), dtype=torch.float64)
    weight_grad = torch.zeros(V, H, dtype=torch.float64)
    for rank in range(case.cp):
        layout = case.layout(rank)
        x = local_input(case, data, rank).requires_grad_(True)
        w = None if data.weight is None else data.weight.clone().requires_grad_(True)
        kept = [(a.detach().clone(), a._version) for a in (x, *([] if w is None else [w]), *data.tokens)]
        got = call.run(x, w, layout, data.tokens)
        for a, (copy, version) in zip((x, *([] if w is None else [w]), *data.tokens), kept, strict=True):
            assert torch.equal(a, copy) and a._version == version  # the caller's tensors untouched
        for got_list, want_list in zip(got, want, strict=True):
            for mine, expected in zip(got_list, pick([v.detach() for v in want_list], case, rank, call.depth),
                                      strict=True):
                if mine.dtype == torch.int64:  # the top-k ids
                    assert torch.equal(mine, expected)
                else:
                    torch.testing.assert_close(mine, expected, rtol=1e-10, atol=1e-10)
        part = _part(call, got, case, data, rank, layout, w_k)
        torch.autograd.backward(part + x.sum() * 0)
        parts = parts + part.detach()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, local_grad(case, grads, rank), rtol=1e-9, atol=1e-10)
        if w is not None:
            assert w.grad is not None
            weight_grad += w.grad
    torch.testing.assert_close(parts, loss.detach(), rtol=1e-10, atol=1e-10)
    if ref.weight is not None:
        assert ref.weight.grad is not None
        torch.testing.assert_close(weight_grad, ref.weight.grad, rtol=1e-9, atol=1e-10)


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


def _tokens(rows: list[list[int]]) -> list[Tensor]:
    return [torch.tensor(r) for r in rows]


LAYOUT_REFUSALS: list[tuple[dict[str, object], type[Exception], str]] = [
    ({"shared_prefix": [2]}, LayoutError,
     r"shared_prefix sums to 2 but there are 3 samples \(the group sizes .* count every sample once"),
    ({"shared_prefix": [2, 0, 1]}, LayoutError, r"group 1: shared_prefix size 0 < 1 \(a group holds a sample\)"),
    ({"shared_prefix": [1, 2], "total_lengths": [3, 3, 4]}, LayoutError,
     r"group 1: sample 2 has prompt length 3 \(total_length 4 - response_length 1\) but sample 1, the "
     r"group's first, has 2 \(the samples of a shared_prefix group share one prompt\)"),
    ({"shared_prefix": [3], "qkv_format": "bshd", "max_seq_len": 4}, LayoutError,
     r"shared_prefix is given with qkv_format 'bshd', whose rows hold one sample each; pass qkv_format='thd'"),
    ({"shared_prefix": [2, 1.0]}, TypeError,
     r"group 1: shared_prefix 1.0 is a float, not an int \(a group size counts samples\)"),
    ({"shared_prefix": [True, 2]}, TypeError, r"group 0: shared_prefix True is a bool, not an int"),
    ({"shared_prefix": 3}, TypeError, r"shared_prefix must be a sequence of ints, got an int"),
    ({"shared_prefix": [3], "padded_lengths": [4, 4, 4]}, LayoutError,
     r"padded_lengths has 3 entries but shared_prefix has 1 groups \(.* one entry per group\)"),
    ({"shared_prefix": [3], "padded_lengths": [4.0]}, TypeError, r"group 0: padded_length 4.0 is a float, not an int"),
    ({"shared_prefix": [2, 1], "padded_lengths": [4, 2]}, LayoutError,
     r"group 1: padded_length 2 < star length 3 \(a padded group holds its tokens, then padding\)"),
    ({"shared_prefix": [3], "padded_lengths": [6], "cp_mode": "zigzag", "cp_size": 2}, LayoutError,
     r"group 0: padded_length 6 is not a multiple of 2 \* cp_size = 4"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), LAYOUT_REFUSALS)
def test_layout_refusals_name_the_group_and_the_rule(kwargs: dict[str, object], error: type[Exception],
                                                     message: str) -> None:
    given = {"total_lengths": [3, 3, 3], "response_lengths": [1, 1, 1], **kwargs}
    with pytest.raises(error, match=message):
        Layout(**given)  # type: ignore[arg-type]  # refused values


def test_refusals() -> None:
    """Prompts that differ in a group (pack, the log-prob functions), temperatures that
    differ in a group, token sets that differ on a shared row (empty against not
    included), from_cu_seqlens of the wrong boundaries, shifted_targets and a CP
    attention_mask: each a LayoutError naming the sample, the group and the rule."""
    layout = Layout([3, 3, 4], [1, 1, 2], shared_prefix=[2, 1])
    good = _tokens([[1, 2, 3], [1, 2, 4], [1, 2, 3, 4]])
    bad = _tokens([[1, 2, 3], [1, 5, 4], [1, 2, 3, 4]])
    differ = (r"sample 1: {0}\[1\]\[1\] differs from {0}\[0\]\[1\], the prompt of sample 0, group 0's first "
              r"\(the samples of a shared_prefix group share one prompt")
    logits = torch.randn(6, 9)
    with pytest.raises(LayoutError, match=differ.format("per_sample")):
        cpslice.pack(bad, layout)
    with pytest.raises(LayoutError, match=differ.format("per_sample")):
        cpslice.pack([t.double()[:, None].expand(-1, 2) for t in bad], layout)
    with pytest.raises(LayoutError, match=differ.format("tokens")):
        cpslice.response_log_probs(logits, bad, layout)
    with pytest.raises(LayoutError, match=differ.format("tokens")):
        cpslice.response_log_probs_from_hidden(torch.randn(6, 4), torch.randn(9, 4), bad, layout)
    temps = (r"sample 1: temperature 0.5 differs from sample 0's 1.0, group 0's first \(the samples of a "
             r"shared_prefix group share their prompt's rows, .* one temperature per group\)")
    for tau in ([1.0, 0.5, 2.0], torch.tensor([1.0, 0.5, 2.0])):
        with pytest.raises(LayoutError, match=temps):
            cpslice.response_log_probs(logits, good, layout, temperature=tau)
        with pytest.raises(LayoutError, match=temps):
            cpslice.response_topk_log_probs(logits, 2, layout, temperature=tau)
        with pytest.raises(LayoutError, match=temps):
            cpslice.response_distillation(logits, [torch.zeros(r, 2) for r in (1, 1, 2)],
                                          [torch.zeros(r, 2, dtype=torch.int64) for r in (1, 1, 2)], layout,
                                          temperature=tau)
    sets = (r"sample 1, response token 0: its set differs from sample 0's on the same shared prompt row "
            r"\({} ids against {}\); the branches of a shared_prefix group .* give every branch the same set")
    for first, second in (([1, 2], [3]), ([1, 2], []), ([], [2]), ([1, 2], [1, 3])):
        with pytest.raises(LayoutError, match=sets.format(len(second), len(first))):
            Support.from_responses([first, second, [1]], [[0, len(first)], [0, len(second)], [0, 1, 1]], layout)
    with pytest.raises(LayoutError, match=r"cu_seqlens_padded has 4 entries but there are 2 shared_prefix groups"):
        Layout.from_cu_seqlens([0, 3, 6, 10], [3, 3, 4], [1, 1, 2], shared_prefix=[2, 1])
    with pytest.raises(LayoutError, match=r"group 1: cu_seqlens_padded\[2\] - cu_seqlens_padded\[1\] = 7 - 4 = 3 "
                                          r"< star length 4"):
        Layout.from_cu_seqlens([0, 4, 7], [3, 3, 4], [1, 1, 2], shared_prefix=[2, 1])
    with pytest.raises(LayoutError, match=r"shifted_targets gives one target per row, but this layout's "
                                          r"shared_prefix \[2, 1\] .* call response_log_probs\(logits, tokens, "
                                          r"layout\) \(or extract_responses\), which picks each branch's targets"):
        cpslice.shifted_targets(good, layout)
    with pytest.raises(LayoutError, match=r"attention_mask is the dense mask .* cp_mode is 'zigzag'"):
        cpslice.attention_mask(Layout([3, 3, 4], [1, 1, 2], shared_prefix=[2, 1], cp_mode="zigzag", cp_size=2))


def test_a_shared_prompt_holding_nan_equals_itself() -> None:
    """Float per-sample values whose shared prompt holds NaN at the same position in every
    branch (a model's NaN, a masked -inf turned NaN) pack: NaN equals NaN in the
    equal-prompt check, as the same bits would; the prompt is packed once, NaN and all.
    A NaN against a number still differs, at its position; so do -0.0 and 0.0 not."""
    layout = Layout([3, 3, 4], [1, 1, 2], shared_prefix=[2, 1])
    nan = math.nan
    values = [torch.tensor([1.0, nan, 3.0]), torch.tensor([1.0, nan, 4.0]), torch.tensor([nan, 2.0, 3.0, 4.0])]
    packed = cpslice.pack(values, layout)
    want = torch.tensor([1.0, nan, 3.0, 4.0, nan, 2.0, 3.0, 4.0])
    assert torch.equal(packed.isnan(), want.isnan()) and torch.equal(packed.nan_to_num(7.0), want.nan_to_num(7.0))
    columns = [torch.stack([v, v * 2], 1) for v in values]  # [L_i, 2]: each row's columns compared
    assert torch.equal(cpslice.pack(columns, layout).nan_to_num(7.0), torch.stack([want, want * 2], 1).nan_to_num(7.0))
    signed = [torch.tensor([0.0, nan, 3.0]), torch.tensor([-0.0, nan, 4.0]), values[2]]
    assert cpslice.pack(signed, layout)[0].item() == 0.0
    differ = r"sample 1: per_sample\[1\]\[1\] differs from per_sample\[0\]\[1\], the prompt of sample 0"
    for bad in ([values[0], torch.tensor([1.0, 2.0, 4.0]), values[2]],
                [torch.tensor([1.0, 2.0, 3.0]), values[1], values[2]]):
        with pytest.raises(LayoutError, match=differ):
            cpslice.pack(bad, layout)
    half = columns[1].clone()
    half[1, 1] = 5.0  # one column of the NaN row: a number against NaN
    with pytest.raises(LayoutError, match=differ):
        cpslice.pack([columns[0], half, columns[2]], layout)


# --- the collectives, on the session's gloo worlds: one task per world size

WORLD_CASES = {  # groups of 3, 1 and 2 (P = 1 and an empty response among them)
    mode: Stars((3, 1, 2), (3, 1, 2), (2, 0, 4, 5, 1, 3), mode) for mode in ("zigzag", "allgather")
}
TP_VOCAB = 8


def _unshared_cp(case: Stars) -> Config:
    """The oracle's Config of the same samples unshared, in the same CP mode."""
    least = -(-sum(case.total) // case.cp) if case.mode == "allgather" else None
    return Config(case.total, case.response, "thd", None, case.closed, case.cp, least, 0)


def _world_step(case: Stars, rank: int, group: Any) -> dict[str, Any]:
    """One rank's step on a shared CP layout: log-probs and entropy, gathered whole,
    redistributed to the unshared layout and back, the reducers' complete values, and the
    gradient of a loss built from all of them."""
    layout = case.layout(rank)
    unshared = _unshared_cp(case).layout(rank)
    data = make_data(case, V, 11)
    tau = [0.7 + 0.4 * case.group_of(i) for i in range(case.n)]
    x = local_input(case, data, rank).requires_grad_(True)
    lp, ent = cpslice.response_log_probs(x, data.tokens, layout, with_entropy=True, temperature=tau)
    whole = cpslice.gather_responses(lp, layout, cp_group=group)
    moved_lp, moved_ent = cpslice.redistribute((lp, ent), layout, unshared, cp_group=group)
    back = cpslice.redistribute(moved_lp, unshared, layout, cp_group=group)
    assert all(torch.equal(a, b) for a, b in zip(back, lp, strict=True))
    both = [torch.stack([a, b], 1) for a, b in zip(lp, ent)]
    means = cpslice.sample_means(both, data.masks, layout, cp_group=group)
    most = cpslice.sample_max(lp, data.masks, layout, cp_group=group)
    least = cpslice.sample_min(ent, data.masks, layout, cp_group=group)
    w = _world_weights(case)
    mine = oracle.shares(w["moved"], _unshared_cp(case), rank)
    loss = weighted((lp, ent), data, case, rank) + cpslice.sum_of_sample_means(lp, data.masks, layout) + (
        (means * w["means"]).sum() + sum((a * b).sum() for a, b in zip(whole, w["whole"]))) / case.cp + sum(
        ((a * b).sum() for a, b in zip(moved_lp, mine)), x.sum() * 0)
    torch.autograd.backward(loss)
    return {"lp": lp, "ent": ent, "whole": whole, "moved": (moved_lp, moved_ent), "means": means,
            "max": most, "min": least, "grad": x.grad, "loss": loss.detach()}


def _world_weights(case: Stars) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {"means": torch.randn(case.n, 2, generator=gen, dtype=torch.float64),
            "whole": [torch.randn(r, generator=gen, dtype=torch.float64) for r in case.response],
            "moved": [torch.randn(r, generator=gen, dtype=torch.float64) for r in case.response]}


def _tp_step(tp: int, tp_rank: int, group: Any) -> dict[str, Any]:
    """A shared layout without CP on one TP rank: its vocabulary shard of the logits, and
    of the LM head."""
    case = WORLD_CASES["zigzag"]
    flat = Stars(case.groups, case.prompts, case.response)
    cols = slice(tp_rank * TP_VOCAB // tp, (tp_rank + 1) * TP_VOCAB // tp)
    data, head = make_data(flat, TP_VOCAB, 12), make_data(flat, TP_VOCAB, 13, hidden=H)
    x = local_input(flat, data, 0)[:, cols].contiguous().requires_grad_(True)
    lp, ent = cpslice.response_log_probs(x, data.tokens, flat.layout(0), with_entropy=True, tp_group=group)
    assert head.weight is not None
    h = local_input(flat, head, 0).requires_grad_(True)
    w = head.weight[cols].clone().requires_grad_(True)
    h_lp, h_ent = cpslice.response_log_probs_from_hidden(h, w, head.tokens, flat.layout(0), with_entropy=True,
                                                         tp_group=group)
    torch.autograd.backward(weighted((lp, ent), data, flat, 0) + weighted((h_lp, h_ent), head, flat, 0))
    return {"tp": tp, "lp": lp, "ent": ent, "grad": x.grad, "h_lp": h_lp, "h_ent": h_ent, "h_grad": h.grad,
            "w_grad": w.grad}


def _detached(value: Any) -> Any:
    """Results without their graphs: what a rank can send back."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def world_task(rank: int, world: int) -> dict[str, Any]:
    """Every collective of a shared layout on this rank: the CP steps of both modes over
    the whole world, then the TP steps over each of the session's TP groups."""
    import torch.distributed as dist

    from ..support._dist import tp_groups

    torch.set_num_threads(1)  # the world's ranks share the machine's cores (put back after the task)
    out: dict[str, Any] = {m: _world_step(replace(c, cp=world), rank, dist.group.WORLD)
                           for m, c in WORLD_CASES.items()}
    out["tp"] = [_tp_step(tp, tp_rank, group) for group, tp, tp_rank in tp_groups(rank, world)]
    sent: dict[str, Any] = _detached(out)
    return sent


def _check_world(results: list[dict[str, Any]], world: int) -> None:
    for mode, base in WORLD_CASES.items():
        case = replace(base, cp=world)
        data = make_data(case, V, 11)
        tau = [0.7 + 0.4 * case.group_of(i) for i in range(case.n)]
        ref = reference(case, data, tau)
        w = _world_weights(case)
        lp, ent = [x.detach() for x in ref.lp], [x.detach() for x in ref.ent]
        means = torch.stack([torch.stack([(v * m.double()).sum() / max(float(m.sum()), 1.0) for v in (a, b)])
                             for a, b, m in zip(ref.lp, ref.ent, data.masks)])
        loss = weighted((ref.lp, ref.ent), data, case, None) + _masked(ref.lp, data.masks, True) + (
            means * w["means"]).sum() + sum(((a * b).sum() for a, b in zip(ref.lp, w["whole"])), torch.zeros(())) + sum(
            ((a * b).sum() for a, b in zip(ref.lp, w["moved"])), torch.zeros(()))
        torch.autograd.backward(loss)
        grads = star_grads(case, ref)
        for rank, got in enumerate(results):
            step = got[mode]
            for name, whole in (("lp", lp), ("ent", ent)):
                for mine, want in zip(step[name], pick(whole, case, rank), strict=True):
                    torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-10)
            for mine, want in zip(step["whole"], lp, strict=True):
                torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-10)
            for k, whole in enumerate((lp, ent)):
                for mine, want in zip(step["moved"][k], oracle.shares(whole, _unshared_cp(case), rank), strict=True):
                    torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(step["means"], means.detach(), rtol=1e-10, atol=1e-10)
            for name, values, fn, empty in (("max", lp, torch.amax, -math.inf), ("min", ent, torch.amin, math.inf)):
                want_x = torch.tensor([float(fn(v[m])) if bool(m.any()) else empty for v, m in zip(values, data.masks)],
                                      dtype=torch.float64)
                torch.testing.assert_close(step[name], want_x, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(step["grad"], local_grad(case, grads, rank), rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(sum(r[mode]["loss"] for r in results), loss.detach(), rtol=1e-10, atol=1e-10)
    _check_tp(results)


def _check_tp(results: list[dict[str, Any]]) -> None:
    flat = Stars(*[getattr(WORLD_CASES["zigzag"], f) for f in ("groups", "prompts", "response")])
    data, head = make_data(flat, TP_VOCAB, 12), make_data(flat, TP_VOCAB, 13, hidden=H)
    refs = [reference(flat, d) for d in (data, head)]
    for ref, d in zip(refs, (data, head)):
        torch.autograd.backward(weighted((ref.lp, ref.ent), d, flat, None))
    grads, h_grads = star_grads(flat, refs[0]), star_grads(flat, refs[1])
    for rank, got in enumerate(results):
        for step in got["tp"]:
            tp = step["tp"]
            cols = slice((rank % tp) * TP_VOCAB // tp, (rank % tp + 1) * TP_VOCAB // tp)
            for key, ref in (("", refs[0]), ("h_", refs[1])):
                for mine, want in zip(step[key + "lp"] + step[key + "ent"], ref.lp + ref.ent, strict=True):
                    torch.testing.assert_close(mine, want.detach(), rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(step["grad"], local_grad(flat, grads, 0)[:, cols], rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(step["h_grad"], local_grad(flat, h_grads, 0), rtol=1e-9, atol=1e-10)
            assert refs[1].weight is not None and refs[1].weight.grad is not None
            torch.testing.assert_close(step["w_grad"], refs[1].weight.grad[cols], rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("world", [2, 4])
def test_the_collectives_of_shared_layouts_on_gloo(world: int) -> None:
    """zigzag and allgather stars over 2 and 4 real gloo ranks: each rank's log-probs and
    entropy are the unshared reference's at its elements; gather_responses gives the whole
    responses; redistribute to the unshared layout of the same samples gives that layout's
    shares and back gives the shared ones; sample_means, sample_max and sample_min are the
    reference's; each rank's gradient of a loss through all of them is the star rows'
    summed gradient (the shared row's on the rank that owns it), and the loss parts sum to
    the reference's. Then a TP group's vocabulary shards of the logits and of the head."""
    _check_world(run_distributed(world_task, world, timeout=240), world)


def test_a_shared_layouts_identity_and_its_order() -> None:
    """Groups all of one are no sharing; align equals the padded lengths it stands for, as
    does from_cu_seqlens of a tensor; the repr names the groups; a closed form's order
    gives that closed form back through from_order with the same groups."""
    total, response = [5, 7, 6, 3], [2, 4, 3, 1]
    plain = Layout(total, response)
    assert Layout(total, response, shared_prefix=[1, 1, 1, 1]) == plain
    assert hash(Layout(total, response, shared_prefix=(1, 1, 1, 1))) == hash(plain)
    shared = Layout(total, response, shared_prefix=[3, 1])
    assert shared != plain and shared.shared_prefix == (3, 1) and shared.padded_lengths == (12, 3)
    assert "shared_prefix=[3, 1]" in repr(shared) and "shared_prefix" not in repr(plain)
    aligned = Layout(total, response, shared_prefix=[3, 1], align=4)
    assert aligned == Layout(total, response, shared_prefix=[3, 1], padded_lengths=[12, 4])
    assert aligned == Layout.from_cu_seqlens(torch.tensor([0, 12, 16]), total, response, shared_prefix=[3, 1])
    for mode, local in (("zigzag", None), ("allgather", 8)):
        for rank in (0, 1):
            closed = Layout(total, response, shared_prefix=[3, 1], cp_mode=mode, cp_rank=rank, cp_size=2,  # type: ignore[arg-type]
                            align=4, local_length=local)
            again = Layout.from_order(closed.order(), total, response, cp_rank=rank, cp_size=2, align=4,
                                      shared_prefix=[3, 1])
            assert again.cp_mode == mode and again.with_local_length(local) == closed
            assert closed.for_rank(1 - rank).for_rank(rank) == closed


def test_reducers_and_moves_without_cp() -> None:
    """On a shared layout without CP: sample_means, sample_max and sample_min are the
    unshared reference's; gather_responses and redistribute to the unshared layout (and
    back) give the whole responses; one temperature per group as a tensor or a list."""
    case = Stars((3, 1, 2), (3, 1, 2), (2, 0, 4, 5, 1, 3))
    layout = case.layout(0)
    data = make_data(case, V, 3)
    tau = [0.7 + 0.4 * case.group_of(i) for i in range(case.n)]
    ref = reference(case, data, tau)
    x = local_input(case, data, 0)
    lp, ent = cpslice.response_log_probs(x, data.tokens, layout, with_entropy=True, temperature=tau)
    again, _ = cpslice.response_log_probs(x, data.tokens, layout, temperature=torch.tensor(tau, dtype=torch.float64))
    for a, b, want in zip(lp, again, ref.lp, strict=True):
        torch.testing.assert_close(a, want.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(b, want.detach(), rtol=1e-10, atol=1e-10)
    both = [torch.stack([a, b], 1) for a, b in zip(lp, ent)]
    means = cpslice.sample_means(both, data.masks, layout)
    for i, (a, b, m) in enumerate(zip(ref.lp, ref.ent, data.masks)):
        den = max(float(m.sum()), 1.0)
        want_means = torch.stack([(a.detach() * m).sum() / den, (b.detach() * m).sum() / den])
        torch.testing.assert_close(means[i], want_means, rtol=1e-10, atol=1e-10)
    most = cpslice.sample_max(lp, data.masks, layout)
    least = cpslice.sample_min(ent, data.masks, layout)
    for i, (a, b, m) in enumerate(zip(ref.lp, ref.ent, data.masks)):
        assert float(most[i]) == pytest.approx(float(a.detach()[m].max()) if bool(m.any()) else -math.inf, rel=1e-10)
        assert float(least[i]) == pytest.approx(float(b.detach()[m].min()) if bool(m.any()) else math.inf, rel=1e-10)
    unshared = case.unshared()
    for moved in (cpslice.gather_responses(lp, layout), cpslice.redistribute(lp, layout, unshared),
                  cpslice.redistribute(cpslice.redistribute(lp, layout, unshared), unshared, layout)):
        assert all(torch.equal(a, b) for a, b in zip(moved, lp, strict=True))
