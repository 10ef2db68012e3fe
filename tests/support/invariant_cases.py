"""Invariant mode's cases: rows with the edges of the reduction, the spec as a rollout
engine writes it (the function of docs/invariance.md's block, taken from the page), the
decode-time reference (cpslice one row per call, TP 1, no layout), the gloo worker
that checks every layout, CP and TP size against it with ``torch.equal``, and the one
that checks top-k ties across TP shards."""

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from cpslice import (
    Layout,
    LayoutError,
    _probe,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    pack,
    response_log_probs,
    shard_responses,
    topk_log_probs,
    topk_log_probs_from_hidden,
)

from ._dist import tp_groups
from ._docs import DOCS, blocks, run_block

Spec = Callable[..., tuple[Tensor, Tensor]]


def spec() -> Spec:
    """``rollout_log_probs`` of docs/invariance.md (its block run as a reader would)."""
    (source,) = blocks(DOCS / "invariance.md", "python")
    fn: Spec = run_block(source, "invariance.md")["rollout_log_probs"]
    return fn


def edge_rows(targets: Tensor, v: int, dtype: torch.dtype, seed: int) -> Tensor:
    """``[t, v]`` logits for rows whose targets are ``targets``, with a peaked row, a
    masked token, a row with whole tiles masked, one with every tile but its target's
    masked, and one of exact ties (never a target masked: its log-prob would be -inf)."""
    t = targets.shape[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, v, generator=gen) * 4
    tiles = -(-v // 128)
    if t >= 5 and tiles >= 3:
        x[0, (int(targets[0]) + 1) % v] += 60.0
        x[1, (int(targets[1]) + 5) % v] = -math.inf
        own = int(targets[2]) // 128
        for k in ((own + 1) % tiles, (own + 2) % tiles):
            x[2, k * 128 : (k + 1) * 128] = -math.inf
        own = int(targets[3]) // 128
        x[3, : own * 128] = -math.inf
        x[3, (own + 1) * 128 :] = -math.inf
        x[4, :] = x[4, 0]  # every logit tied
    return x.to(dtype)


def peaked(t: int, v: int, seed: int) -> tuple[Tensor, Tensor]:
    """``[t, v]`` float32 logits, each row with one dominant logit (``S`` near 1, so that
    ``log S`` shows a change in the sums' last bit), and targets."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, v, generator=gen) * 2
    x[torch.arange(t), torch.randint(0, v, (t,), generator=gen)] += 9.0
    return x, torch.randint(0, v, (t,), generator=gen)


def decode(logits: Tensor, targets: Tensor, g_lp: Tensor, g_h: Tensor, **options: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Decode-time log-probs, entropies and logits' gradients: one row per call, TP 1."""
    lps, hs = [logits.new_zeros(0, dtype=torch.float32)], [logits.new_zeros(0, dtype=torch.float32)]
    grads = [logits.new_zeros((0, logits.shape[1]))]
    for t in range(logits.shape[0]):
        x = logits[t : t + 1].detach().requires_grad_(True)
        lp, h = log_probs_and_entropy(x, targets[t : t + 1], with_entropy=True, invariant=True, **options)
        torch.autograd.backward((lp * g_lp[t]).sum() + (h * g_h[t]).sum())
        assert x.grad is not None
        lps.append(lp.detach())
        hs.append(h.detach())
        grads.append(x.grad)
    return torch.cat(lps), torch.cat(hs), torch.cat(grads)


def shard_first(m: Tensor, s: Tensor, a: Tensor | None, tau: float | Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """A planted merge order: each half of the tiles summed first, then the halves (the
    order a per-shard merge gives at TP 2): the bits now depend on where shards end."""
    half = (m.shape[0] + 1) // 2
    big = m.amax(0)
    delta = (m - torch.where(big == -math.inf, 0.0, big)) / tau
    terms = torch.exp(delta) * s
    total = terms[:half].sum(0) + terms[half:].sum(0)
    ent = None
    if a is not None:
        e = torch.where(s > 0, torch.exp(delta) * (a + delta * s), 0.0)
        ent = e[:half].sum(0) + e[half:].sum(0)
    return big, total, ent


# --- the gloo worker: every layout, CP 1 / 2 / 4, TP 1 / 2 / 4, against decode time

TOTAL = (1, 3, 9, 17, 6, 12)  # a single token, samples shorter than 2 * cp, a long one
RESPONSE = (0, 2, 5, 10, 0, 7)  # empty responses too
VOCAB = 512  # 4 tiles: TP 4 holds one each
SEQ = 24  # bshd rows (a multiple of 2 * cp for zigzag)
# float32 with a cap and a padded vocabulary; bfloat16 plain
OPTIONS: dict[str, dict[str, Any]] = {"float32": {"softcap": 20.0, "vocab_size": 500}, "bfloat16": {}}


def _batch(dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor], list[float], list[Tensor], list[Tensor]]:
    gen = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, 500, (t,), generator=gen) for t in TOTAL]
    # row p predicts token p + 1 (the last row's target is never read)
    logits = [edge_rows(torch.cat([tok[1:], tok[:1]]), VOCAB, dtype, 100 + i) for i, tok in enumerate(tokens)]
    temps = [0.7 + 0.1 * i for i in range(len(TOTAL))]
    g_lp = [torch.randn(r, generator=gen) for r in RESPONSE]
    g_h = [torch.randn(r, generator=gen) for r in RESPONSE]
    return logits, tokens, temps, g_lp, g_h


def layouts(cp_rank: int, cp: int) -> list[tuple[str, Layout]]:
    """Every layout kind at this CP size, for this rank."""
    perm = torch.randperm(sum(TOTAL), generator=torch.Generator().manual_seed(3))
    kw: dict[str, Any] = {"cp_rank": cp_rank, "cp_size": cp}
    offsets = [SEQ - t for t in TOTAL]
    out = [("from_order", Layout.from_order(perm, TOTAL, RESPONSE, **kw)),
           ("padded", Layout(TOTAL, RESPONSE, align=8, cp_mode="zigzag" if cp > 1 else "none", **kw))]
    if cp == 1:
        out += [("none-thd", Layout(TOTAL, RESPONSE)),
                ("none-bshd", Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=SEQ)),
                ("row-offsets", Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=SEQ, row_offsets=offsets))]
    else:
        width = pack([torch.zeros(t) for t in TOTAL], Layout(TOTAL, RESPONSE, cp_mode="allgather", **kw)).shape[0]
        out += [("zigzag-thd", Layout(TOTAL, RESPONSE, cp_mode="zigzag", **kw)),
                ("zigzag-bshd", Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=SEQ, cp_mode="zigzag", **kw)),
                ("row-offsets", Layout(TOTAL, RESPONSE, qkv_format="bshd", max_seq_len=SEQ, cp_mode="zigzag",
                                       row_offsets=offsets, **kw)),
                ("allgather", Layout(TOTAL, RESPONSE, cp_mode="allgather", local_length=width, **kw))]
    return out


def _check(layout: Layout, group: Any, tp: int, tp_rank: int, dtype_name: str, refs: dict[str, Any]) -> int:
    """One layout on this rank: each share and each local logits row equal decode time's,
    bit for bit; the number of values compared."""
    logits, tokens, temps, g_lp, g_h = refs["batch"]
    v_local = VOCAB // tp
    cols = slice(tp_rank * v_local, (tp_rank + 1) * v_local)
    full = pack(logits, layout)
    x = full[:, cols].clone().requires_grad_(True)
    lp, h = response_log_probs(x, tokens, layout, with_entropy=True, tp_group=group, temperature=temps,
                               invariant=True, **OPTIONS[dtype_name])
    index = shard_responses([torch.arange(r) for r in RESPONSE], layout)
    loss = sum((a * b).sum() for a, b in zip(lp, shard_responses(g_lp, layout)))
    loss = loss + sum((a * b).sum() for a, b in zip(h, shard_responses(g_h, layout)))
    torch.autograd.backward(loss)
    compared = 0
    for i, (j, lp_i, h_i) in enumerate(zip(index, lp, h)):
        want_lp, want_h, want_spec = refs["lp"][i][j], refs["h"][i][j], refs["spec"][i][j]
        assert torch.equal(lp_i, want_lp) and torch.equal(h_i, want_h), (i, lp_i - want_lp, h_i - want_h)
        assert torch.equal(lp_i, want_spec), (i, lp_i - want_spec)
        compared += 2 * len(j)
    sample = pack([torch.full((t,), i) for i, t in enumerate(TOTAL)], layout, fill=-1)
    position = pack([torch.arange(t) for t in TOTAL], layout, fill=-1)
    assert x.grad is not None
    for row, (s, p) in enumerate(zip(sample.tolist(), position.tolist())):
        k = p - (TOTAL[s] - RESPONSE[s] - 1) if s >= 0 else -1
        want = refs["grad"][s][k, cols] if 0 <= k < RESPONSE[s] else torch.zeros_like(x.grad[row])
        assert torch.equal(x.grad[row], want), (s, p, (x.grad[row].float() - want.float()).abs().max())
        compared += 1
    return compared


def _references(dtype_name: str) -> dict[str, Any]:
    """Decode time for every response token: cpslice one row per call and the spec."""
    batch = _batch(getattr(torch, dtype_name))
    logits, tokens, temps, g_lp, g_h = batch
    rollout = spec()
    out: dict[str, Any] = {"batch": batch, "lp": [], "h": [], "grad": [], "spec": []}
    for x, tok, temp, a, b, t, r in zip(logits, tokens, temps, g_lp, g_h, TOTAL, RESPONSE):
        rows, targets = x[t - r - 1 : t - 1], tok[t - r :]
        lp, h, grad = decode(rows, targets, a, b, temperature=temp, **OPTIONS[dtype_name])
        out["lp"].append(lp)
        out["h"].append(h)
        out["grad"].append(grad)
        out["spec"].append(torch.cat([lp[:0], *(rollout(rows[k : k + 1], targets[k : k + 1], temp,
                                                         **OPTIONS[dtype_name])[0] for k in range(r))]))
    return out


def _hidden_tp(whole: Any, rank: int, pair: Any, pair_rank: int) -> dict[str, int]:
    """The hidden-state path with the LM head split over TP 4 and TP 2: each row's
    log-prob, entropy and top-k the bits of one-row calls at TP 1."""
    gen = torch.Generator().manual_seed(12)
    hidden, weight = torch.randn(70, 16, generator=gen), torch.randn(VOCAB, 16, generator=gen) / 2
    targets = torch.randint(0, VOCAB, (70,), generator=gen)

    def call(h: Tensor, w: Tensor, t: Tensor, group: Any = None) -> list[Tensor]:
        lp, ent = log_probs_and_entropy_from_hidden(h, w, t, with_entropy=True, temperature=0.8, tp_group=group,
                                                    invariant=True)
        top, ids = topk_log_probs_from_hidden(h, w, 3, temperature=0.8, tp_group=group, invariant=True)
        return [lp, ent, top, ids]

    rows = [call(hidden[t : t + 1], weight, targets[t : t + 1]) for t in range(70)]
    want = [torch.cat([r[k] for r in rows]) for k in range(4)]
    seen = {}
    for group, tp, tp_rank in ((whole, 4, rank), (pair, 2, pair_rank)):
        v = VOCAB // tp
        got = call(hidden, weight[tp_rank * v : (tp_rank + 1) * v], targets, group)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), tp
        seen[f"hidden tp{tp}"] = 70
    return seen


def worker(rank: int, world: int) -> dict[str, Any]:
    """Every (CP, TP) setup of a world of 4 and every layout of it, both dtypes; then a
    planted merge order at TP 4 and TP 2 must differ somewhere; then the refusal of a
    shard that does not hold whole tiles, at TP 4 and TP 2."""
    assert world == 4
    (whole, _, _), (pair, _, pair_rank) = tp_groups(rank, world)
    # (cp, cp rank, tp group, tp, tp rank)
    setups = [(1, 0, whole, 4, rank), (1, 0, pair, 2, pair_rank), (2, rank // 2, pair, 2, pair_rank),
              (4, rank, None, 1, 0)]
    seen: dict[str, int] = {}
    for dtype_name in OPTIONS:
        refs = _references(dtype_name)
        for cp, cp_rank, group, tp, tp_rank in setups:
            for name, layout in layouts(cp_rank, cp):
                key = f"cp{cp} tp{tp} {name} {dtype_name}"
                seen[key] = _check(layout, group, tp, tp_rank, dtype_name, refs)
    seen.update(_hidden_tp(whole, rank, pair, pair_rank))
    x, targets = peaked(256, VOCAB, 11)
    want = log_probs_and_entropy(x, targets, with_entropy=True, invariant=True)
    planted = {}
    for group, tp, tp_rank in ((whole, 4, rank), (pair, 2, pair_rank)):
        shard = x[:, tp_rank * (VOCAB // tp) : (tp_rank + 1) * (VOCAB // tp)]
        got = log_probs_and_entropy(shard, targets, with_entropy=True, tp_group=group, invariant=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with _probe.substitute("merge_tiles", shard_first):
            got = log_probs_and_entropy(shard, targets, with_entropy=True, tp_group=group, invariant=True)
        planted[tp] = "passed" if all(torch.equal(a, b) for a, b in zip(got, want)) else "caught"
    _refuses_partial_tiles(whole, pair)
    return {"seen": seen, "planted": planted}


def _refuses_partial_tiles(whole: Any, pair: Any) -> None:
    """A shard that does not hold whole tiles is refused at TP 4 (``V_local = 96``) and at
    TP 2 (``V_local = 192``: one tile and a half), by each driver, before any collective."""
    targets = torch.zeros(2, dtype=torch.int64)

    def refused(group: Any, tp: int, v_local: int) -> None:
        x, w = torch.zeros(2, v_local), torch.zeros(v_local, 4)
        calls: list[Callable[[], object]] = [
            lambda: log_probs_and_entropy(x, targets, tp_group=group, invariant=True),
            lambda: topk_log_probs(x, 2, tp_group=group, invariant=True),
            lambda: log_probs_and_entropy_from_hidden(torch.zeros(2, 4), w, targets, tp_group=group, invariant=True),
        ]
        for call in calls:
            with pytest.raises(LayoutError, match=rf"V_local = {v_local} is not a multiple of 128 \(TP size {tp}\)"):
                call()

    with _probe.watch() as seen:
        refused(whole, 4, 96)
        refused(pair, 2, 192)
    assert seen.of("collective") == [], seen.of("collective")


# --- top-k ties across TP shards: the gloo worker

TIE_K = 4
TIE_IDS = [  # the rows of ``tie_rows``: the spec's ids (descending, ties to the smaller id)
    [0, 1, 2, 3],  # every logit tied
    [127, 128, 255, 256],  # tied at the tiles' edges (and TP 4's and TP 2's shards' edges)
    [3, 131, 260, 300],  # tied in three shards, the largest id left out
    [100, 400, 5, 129],  # NaN counted as the largest, then ties
    [450, 260, 20, 130],  # the last places tied, in four shards
    [300, 0, 1, 2],  # one finite logit: the rest tied at -inf
]


def tie_rows() -> Tensor:
    """``[10, VOCAB]`` float32 logits: the rows of ``TIE_IDS``, whose ties straddle the
    128-column tiles and the shards of TP 2 and TP 4, then four rows without ties."""
    x = torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(21)) * 2
    x[0] = 0.5
    x[1, [384, 383, 256, 255, 128, 127]] = 10.0
    x[2, [500, 300, 3, 260, 131]] = 10.0
    x[3, [400, 100]], x[3, [511, 129, 5]] = math.nan, 10.0
    x[4, 450], x[4, 260], x[4, [385, 257, 130, 20]] = 12.0, 11.0, 10.0
    x[5], x[5, 300] = -math.inf, 1.0
    return x


def _same_bits(a: Tensor, b: Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def topk_ties_worker(rank: int, world: int) -> dict[int, Tensor]:
    """``topk_log_probs`` of ``tie_rows`` at TP 4 (the world) and TP 2 (its pairs). In
    invariant mode each row's ids are the spec's, smaller id first among ties
    (``TIE_IDS``, and a stable sort of the whole row), and its log-probs and ids the
    bits of TP 1; in the default mode (ties broken as ``torch.topk`` may) a row's ids
    are some ``k`` ids whose float64 log-probs are its values, descending, the best
    ``k`` of the row. Both modes' log-probs against float64. Returns each TP size's
    default-mode ids, which the test compares across ranks."""
    assert world == 4
    (whole, _, _), (pair, _, pair_rank) = tp_groups(rank, world)
    x = tie_rows()
    finite = torch.arange(x.shape[0]) != 3  # the NaN row: no float64 value to compare
    ref = torch.log_softmax(x.double(), -1)
    spec_ids = torch.sort(x.nan_to_num(nan=math.inf), descending=True, stable=True).indices[:, :TIE_K]
    assert torch.equal(spec_ids[: len(TIE_IDS)], torch.tensor(TIE_IDS))
    want_lp, want_ids = topk_log_probs(x, TIE_K, invariant=True)
    assert torch.equal(want_ids, spec_ids)
    atol = 64 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(want_lp[finite].double(), ref.gather(1, spec_ids)[finite], rtol=0.0, atol=atol)
    defaults = {}
    for group, tp, tp_rank in ((whole, 4, rank), (pair, 2, pair_rank)):
        v = VOCAB // tp
        shard = x[:, tp_rank * v : (tp_rank + 1) * v]
        lp, ids = topk_log_probs(shard, TIE_K, tp_group=group, invariant=True)
        assert torch.equal(ids, spec_ids), (tp, ids)
        assert _same_bits(lp, want_lp), tp
        lp, ids = topk_log_probs(shard[finite], TIE_K, tp_group=group)
        best = ref[finite].topk(TIE_K).values
        torch.testing.assert_close(lp.double(), best, rtol=0.0, atol=atol)  # descending, the best k
        torch.testing.assert_close(ref[finite].gather(1, ids), best, rtol=0.0, atol=atol)  # at their ids
        assert all(len(set(row)) == TIE_K for row in ids.tolist()), (tp, ids)
        defaults[tp] = ids
    return defaults
