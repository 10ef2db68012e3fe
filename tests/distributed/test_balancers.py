"""torch's own context-parallel load balancers, read by ``Layout.from_order`` on real gloo CP
groups of 2 and 4 ranks.

The indices come from torch 2.13's ``_HeadTailLoadBalancer``, ``_PerDocumentHeadTailLoadBalancer``
and ``_PTRRLoadBalancer`` (over ``create_block_mask``'s BlockMask), for packed rows of
documents (thd: lone tokens, empty responses, responses across pieces and blocks, padded
documents, two packed rows read as one stream by docs/recipes.md's ``stream_order``) and for
rows of one sample each (bshd, left-padded). Each rank's tensors are what torch's own
``_context_parallel_shard`` leaves on it, and on every rank:

- the layout is the placement torch made (``pack``, ``shifted_targets`` against the labels
  shifted before the rearrangement, ``Layout.order``), and a closed form where one exists;
- ``response_log_probs`` (temperatures per sample, a softcap, a padded vocabulary, supports)
  gives the float64 reference's log-probs and entropy at the rank's positions, and the
  logits' gradient of a loss of random weights (``sample_means`` in it) at its rows;
- ``sample_means``, ``sample_max``, ``sample_min`` and ``gather_responses`` give the
  reference's; ``redistribute`` to another (random) order and, in turn, to zigzag, to
  allgather and to whole responses, and back, with gradients, moves exactly the shares the
  indices name.

The expected shares are read from the index (tests/support/balancers.py), never from cpslice's pieces.
In one process: the private module torch keeps the balancers in is pinned (a failure naming
it, never a skip, when torch moves it), the identity order is the contiguous split, and
head-tail's ``[1, S]`` index serves every bshd row.
"""

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import (
    Layout,
    Support,
    gather_responses,
    pack,
    redistribute,
    response_log_probs,
    sample_max,
    sample_means,
    sample_min,
    shard_responses,
    shifted_targets,
)

from ..support import oracle
from ..support._dist import run_distributed
from ..support._docs import block_defining
from ..support.balancers import (
    CLASSES,
    Case,
    bshd_cases,
    held,
    load_balancers,
    places,
    rows_cases,
    share_offsets,
    stream,
    thd_cases,
    torch_shard,
)
from ..support.reference import tolerance

Result = tuple[str, float, float]  # what, error, tolerance
IGNORE = -100


# ---------------------------------------------------------------- one process


def test_torch_keeps_its_load_balancers_in_the_private_module() -> None:
    """Fails (never skips) when torch moves or renames them: the recipe imports them there."""
    lb = load_balancers()
    assert all(isinstance(getattr(lb, name), type) for name in CLASSES)
    # the code's indices, which docs/recipes.md quotes (head-tail's docstring shows another)
    assert lb._HeadTailLoadBalancer(8, 2, "cpu")._generate_indices().tolist() == [[0, 1, 6, 7, 2, 3, 4, 5]]
    per_document = lb._PerDocumentHeadTailLoadBalancer([[8, 8]], 2, "cpu")._generate_indices()
    assert per_document.tolist() == [[0, 1, 6, 7, 2, 3, 4, 5, 8, 9, 14, 15, 10, 11, 12, 13]]
    # context_parallel's choice: head-tail where 2 * cp divides S (load balancing is on by
    # default), else no rearrangement
    assert isinstance(lb._create_default_load_balancer(8, 2, "cpu"), lb._HeadTailLoadBalancer)
    assert lb._create_default_load_balancer(6, 2, "cpu") is None


def test_no_balancer_is_the_contiguous_split() -> None:
    """Without a balancer each rank holds its contiguous piece: the identity order is the
    allgather layout (docs/recipes.md)."""
    total, response = [10, 7, 13], [4, 3, 5]
    for rank in range(2):
        got = Layout.from_order(torch.arange(30)[None], total, response, cp_rank=rank, cp_size=2)
        assert got == Layout(total, response, cp_mode="allgather", cp_rank=rank, cp_size=2, local_length=15)


def test_a_bshd_order_of_one_row_serves_every_row() -> None:
    """torch's head-tail balancer gives ``[1, S]`` for a ``[B, S]`` batch, and torch applies it
    to every row: ``from_order`` reads it as the ``[S]`` it stands for."""
    lb = load_balancers()
    index = lb._HeadTailLoadBalancer(8, 2, "cpu")._generate_indices()
    mixed = torch.randperm(8, generator=torch.Generator().manual_seed(0))[None]
    args = ([5, 8, 1], [2, 4, 0])
    rows: dict[str, Any] = {"qkv_format": "bshd", "max_seq_len": 8, "row_offsets": [3, 0, 7]}
    for rank in range(2):
        got = Layout.from_order(index, *args, cp_rank=rank, cp_size=2, **rows)
        assert got == Layout.from_order(index[0], *args, cp_rank=rank, cp_size=2, **rows)
        assert got == Layout(*args, cp_mode="zigzag", cp_rank=rank, cp_size=2, **rows)
        placed = Layout.from_order(mixed, *args, cp_rank=rank, cp_size=2, **rows)
        assert placed.cp_mode == "order" and torch.equal(placed.order(), mixed.expand(3, -1))


# ---------------------------------------------------------------- the data and its reference


@dataclass
class Data:
    """One case's stream, per-sample inputs and their float64 reference."""

    logits: Tensor  # [N, V] float32: every stream position, padding included
    tokens: list[Tensor]  # [L_i]
    sets: list[list[list[int]]] | None  # per sample, per response token: kept ids ([] all)
    w_lp: list[Tensor]  # [R_i] loss weights
    w_ent: list[Tensor]
    w_means: Tensor  # [n, 2] weights of the sample means of (log-prob, entropy)
    masks: list[Tensor]  # [R_i] bool
    lp: list[Tensor]  # [R_i] float64 reference
    ent: list[Tensor]
    means: Tensor  # [n, 2]
    most: Tensor  # [n] masked maximum of the log-probs
    least: Tensor  # [n] masked minimum of the entropy
    grad: Tensor  # [N, V] float64: d(reference loss)/d logits


def _sample_reference(x: Tensor, targets: Tensor, tau: float, case: Case,
                      sets: list[list[int]] | None) -> tuple[Tensor, Tensor]:
    """float64 log-probs (under each non-empty set plus the target) and full entropy of one
    sample's span rows ``x``, soft-capped, tempered, over ``[0, vocab_size)``."""
    z = x if case.softcap is None else case.softcap * torch.tanh(x / case.softcap)
    z = z / tau
    valid = torch.arange(x.shape[1]) < (case.vocab_size or x.shape[1])
    full = torch.log_softmax(z.masked_fill(~valid, -math.inf), -1)
    ent = -(full.exp() * torch.where(valid, full, 0.0)).sum(-1)
    keep = valid.expand_as(z).clone()
    for k, s in enumerate(sets or []):
        if s:
            keep[k] = False
            keep[k, s + [int(targets[k])]] = True
    lp = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1).gather(1, targets[:, None])[:, 0]
    return lp, ent


def _masked_means(values: Tensor, mask: Tensor) -> Tensor:
    den = mask.double().sum()
    return (values * mask.double()[:, None]).sum(0) / den if den else values.new_zeros(values.shape[1:])


def _data(case: Case, first: Tensor) -> Data:
    gen = torch.Generator().manual_seed(case.seed)
    n_stream, ids = sum(case.widths), case.vocab_size or case.vocab
    logits = 2 * torch.randn(n_stream, case.vocab, generator=gen)
    tokens = [torch.randint(0, ids, (t,), generator=gen) for t in case.total]
    sets = None
    if case.support:
        sets = [[torch.randperm(ids, generator=gen)[: int(torch.randint(0, ids, (), generator=gen))].tolist()
                 for _ in range(r)] for r in case.response]
    w_lp = [torch.randn(r, generator=gen, dtype=torch.float64) for r in case.response]
    w_ent = [torch.randn(r, generator=gen, dtype=torch.float64) for r in case.response]
    w_means = torch.randn(len(case.total), 2, generator=gen, dtype=torch.float64)
    masks = [torch.rand(r, generator=gen) > 0.3 for r in case.response]
    x = logits.double().requires_grad_()
    lp, ent, means, most, least = [], [], [], [], []
    loss = x.new_zeros(())
    for i, (t, r) in enumerate(zip(case.total, case.response)):
        rows = int(first[i]) + torch.arange(t - r - 1, t - 1)
        a, b = _sample_reference(x[rows], tokens[i][t - r:], case.temperature[i], case,
                                 None if sets is None else sets[i])
        m = _masked_means(torch.stack([a, b], 1), masks[i])
        loss = loss + (w_lp[i] * a).sum() + (w_ent[i] * b).sum() + (w_means[i] * m).sum()
        lp.append(a.detach())
        ent.append(b.detach())
        means.append(m.detach())
        kept = bool(masks[i].any())
        most.append(a.detach()[masks[i]].max() if kept else torch.tensor(-math.inf).double())
        least.append(b.detach()[masks[i]].min() if kept else torch.tensor(math.inf).double())
    (grad,) = torch.autograd.grad(loss, x)
    return Data(logits, tokens, sets, w_lp, w_ent, w_means, masks, lp, ent, torch.stack(means),
                torch.stack(most), torch.stack(least), grad)


def _err(got: list[Tensor] | Tensor, want: list[Tensor] | Tensor) -> float:
    """The largest difference; inf for another shape; equal infinities agree."""
    pairs = list(zip(got, want)) if isinstance(got, list) and isinstance(want, list) else [(got, want)]
    if isinstance(got, list) and isinstance(want, list) and len(got) != len(want):
        return math.inf
    worst = 0.0
    for a, b in pairs:
        assert isinstance(a, Tensor) and isinstance(b, Tensor)
        if a.shape != b.shape:
            return math.inf
        a, b = a.detach().double(), b.detach().double()
        same = (a == b) | (a.isnan() & b.isnan())
        if a.numel():
            worst = max(worst, float(torch.where(same, 0.0, (a - b).abs()).max()))
    return worst


def _picked(whole: list[Tensor], offsets: list[Tensor]) -> list[Tensor]:
    return [w[o] for w, o in zip(whole, offsets)]


# ---------------------------------------------------------------- on every rank


def _placement(case: Case, layout: Layout, rank: int, size: int, shard: list[Tensor], sample: Tensor,
               tokens: list[Tensor]) -> list[Result]:
    """The layout is where torch put every position: exact checks."""
    ids, input_ids, labels, titan = (x.reshape(-1) for x in shard)
    name = f"{case.name}: "
    order = case.order.long()
    reading = held(order, case.fmt, case.widths, rank, size)
    out = [(name + "cp_mode " + layout.cp_mode, float(layout.cp_mode != case.mode), 0.0),
           (name + "torch's shard is the index's reading", _err(ids, reading), 0.0)]
    normal = order.reshape(-1) if case.fmt == "thd" else order.reshape(-1, case.widths[0]).expand(case.rows, -1)
    again = Layout.from_order(layout.order(), case.total, case.response, cp_rank=rank, cp_size=size, **case.geometry())
    out.append((name + "Layout.order", _err(layout.order(), normal) + float(again != layout), 0.0))
    mode = case.mode
    if mode != "order":
        closed = Layout(case.total, case.response, cp_mode=mode, cp_rank=rank, cp_size=size, **case.geometry())
        out.append((name + "the closed form", float(closed != layout), 0.0))
    _, _, first = stream(case.widths, case.offsets, case.total)
    codes = [float(f) + torch.arange(t, dtype=torch.float64) for f, t in zip(first.tolist(), case.total)]
    padding = sample[ids] < 0
    out.append((name + "pack", _err(pack(codes, layout, fill=-1), torch.where(padding, -1, ids).double()), 0.0))
    out.append((name + "pack(tokens) is torch's input_ids", _err(pack(tokens, layout), input_ids), 0.0))
    targets = shifted_targets(tokens, layout, fill=IGNORE)
    out.append((name + "shifted_targets = per-sample labels, rearranged", _err(targets, labels), 0.0))
    read = targets != IGNORE
    out.append((name + "shifted_targets = torchtitan's labels where read", _err(targets[read], titan[read]), 0.0))
    return out


def _numerics(case: Case, layout: Layout, local: Tensor, ids: Tensor, rows: list[tuple[int, int] | None],
              data: Data, size: int) -> list[Result]:
    """Log-probs, entropy, the reducers and the gradient against the float64 reference."""
    group = dist.group.WORLD
    name, logits = f"{case.name}: ", local.clone().requires_grad_()
    support = None
    if data.sets is not None:
        flat = [torch.tensor([k for s in sets for k in s], dtype=torch.int64) for sets in data.sets]
        counts = [torch.tensor([0] + [len(s) for s in sets]).cumsum(0) for sets in data.sets]
        support = Support.from_responses(flat, counts, layout)
    lp, ent = response_log_probs(logits, data.tokens, layout, with_entropy=True, temperature=case.temperature,
                                 softcap=case.softcap, vocab_size=case.vocab_size, support=support)
    offsets = share_offsets(rows, case.total, case.response)
    tol = 2 * tolerance(data.logits, min(case.temperature))
    out = [(name + "log-probs", _err(lp, _picked(data.lp, offsets)), tol),
           (name + "entropy", _err(ent, _picked(data.ent, offsets)), tol)]
    means = sample_means([torch.stack([a, b], 1) for a, b in zip(lp, ent)], data.masks, layout, cp_group=group)
    out.append((name + "sample_means", _err(means, data.means), tol))
    out.append((name + "sample_max", _err(sample_max(lp, data.masks, layout, cp_group=group), data.most), tol))
    out.append((name + "sample_min", _err(sample_min(ent, data.masks, layout, cp_group=group), data.least), tol))
    loss = (means.double() * data.w_means).sum() / size  # every rank's part holds the whole means
    for a, b, wa, wb in zip(lp, ent, _picked(data.w_lp, offsets), _picked(data.w_ent, offsets)):
        loss = loss + (a.double() * wa).sum() + (b.double() * wb).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    want = data.grad[ids]
    out.append((name + "logits gradient", _err(grad, want), 4e-6 * max(1.0, float(want.abs().max()))))
    whole_lp, whole_ent = redistribute(([x.detach() for x in lp], [x.detach() for x in ent]), layout,
                                       Layout(case.total, case.response), cp_group=group)
    out.append((name + "(lp, ent) -> whole responses", max(_err(whole_lp, data.lp), _err(whole_ent, data.ent)), tol))
    out.append((name + "gather_responses", _err(gather_responses(lp, layout, cp_group=group), data.lp), tol))
    return out


Rows = list[tuple[int, int] | None]


def _destinations(case: Case, turn: int, rank: int, size: int) -> list[tuple[str, Layout, Rows | None]]:
    """The layouts the shares move to, with the rows each holds (None: whole responses):
    another (random) order, and one of zigzag, allgather and whole responses in turn."""
    total, response = case.total, case.response
    sample, pos, _ = stream(case.other_widths, [0] * len(total), total)
    other_rows = places(held(case.other, case.fmt, case.other_widths, rank, size), sample, pos)
    out: list[tuple[str, Layout, Rows | None]] = [("another order", case.other_layout(rank, size), other_rows)]
    if turn % 3 == 0:
        zig = Layout(total, response, cp_mode="zigzag", cp_rank=rank, cp_size=size)
        return out + [("zigzag", zig, oracle.local_map(oracle.config_of(zig), rank))]
    if turn % 3 == 1:
        gather = Layout(total, response, cp_mode="allgather", cp_rank=rank, cp_size=size,
                        local_length=-(-sum(total) // size) + 1)
        return out + [("allgather", gather, oracle.local_map(oracle.config_of(gather), rank))]
    return out + [("whole responses", Layout(total, response), None)]


def _redistribution(case: Case, turn: int, layout: Layout, rows: Rows, rank: int, size: int) -> list[Result]:
    """Exact: shares of code values to every destination and back, and their gradients."""
    group, name = dist.group.WORLD, f"{case.name}: "
    gen = torch.Generator().manual_seed(case.seed + 1)
    code = [1000.0 * i + torch.arange(r, dtype=torch.float64) for i, r in enumerate(case.response)]
    mine = share_offsets(rows, case.total, case.response)
    out = []
    for where, dst, dst_rows in _destinations(case, turn, rank, size):
        theirs = [torch.arange(r) for r in case.response] if dst_rows is None else (
            share_offsets(dst_rows, case.total, case.response))
        src = [x.clone().requires_grad_() for x in _picked(code, mine)]
        moved = redistribute(src, layout, dst, cp_group=group)
        # whole responses come back to this rank's layout by shard_responses (no communication)
        back = shard_responses(moved, layout) if dst_rows is None else redistribute(moved, dst, layout, cp_group=group)
        out.append((f"{name}-> {where}", _err(moved, _picked(code, theirs)), 0.0))
        out.append((f"{name}-> {where} -> back", _err(back, src), 0.0))
        w_back = [torch.randint(-4, 5, (r,), generator=gen).double() for r in case.response]
        w_moved = [torch.randint(-4, 5, (r,), generator=gen).double() for r in case.response]
        loss = sum(((b * w).sum() for b, w in zip(back, _picked(w_back, mine))), torch.zeros((), dtype=torch.float64))
        loss = loss + sum((m * w).sum() for m, w in zip(moved, _picked(w_moved, theirs)))
        grads = list(torch.autograd.grad(loss, src))
        copies = size if dst_rows is None else 1  # every rank holds, and differentiates, the whole
        want = [a + copies * b for a, b in zip(_picked(w_back, mine), _picked(w_moved, mine))]
        out.append((f"{name}-> {where}: gradient", _err(grads, want), 0.0))
    return out


def _balanced(rank: int, world: int, cases: list[Case]) -> list[Result]:
    """Every case on this rank of the world's CP group (the whole world)."""
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)  # the world's ranks share the machine's cores (put back after the task)
    mesh = DeviceMesh("cpu", list(range(world)))
    out: list[Result] = []
    for turn, case in enumerate(cases):
        layout = case.layout(rank, world)
        sample, pos, first = stream(case.widths, case.offsets, case.total)
        data = _data(case, first)
        n_stream = sample.numel()
        token_stream = torch.zeros(n_stream, dtype=torch.int64)
        labels = torch.full((n_stream,), IGNORE, dtype=torch.int64)
        for i, t in enumerate(data.tokens):
            token_stream[int(first[i]):int(first[i]) + t.numel()] = t
            labels[int(first[i]):int(first[i]) + t.numel() - 1] = t[1:]
        titan = torch.cat([token_stream[1:], token_stream[:1] * 0])  # torchtitan: label = x[1:]
        buffers = [x.view(case.rows, n_stream // case.rows, *x.shape[1:])
                   for x in (torch.arange(n_stream), token_stream, labels, titan, data.logits)]
        shard = torch_shard(mesh, buffers, case.index)
        ids = shard[0].reshape(-1)
        rows = places(ids, sample, pos)
        out += _placement(case, layout, rank, world, shard[:4], sample, data.tokens)
        out += _numerics(case, layout, shard[4].reshape(-1, case.vocab), ids, rows, data, world)
        out += _redistribution(case, turn, layout, rows, rank, world)
    return [(f"rank {rank}: {what}", err, tol) for what, err, tol in out]


def _cases(size: int) -> list[Case]:
    rng = random.Random(28 + size)
    stream_order = cast(Callable[[Tensor, int, int], Tensor],
                        block_defining("docs/recipes.md", "stream_order")["stream_order"])
    return thd_cases(size, rng) + rows_cases(size, rng, stream_order) + bshd_cases(size, rng)


@pytest.mark.parametrize("size", [2, 4])
def test_torch_balancers_on_cp_groups(size: int) -> None:
    results = run_distributed(_balanced, size, _cases(size), timeout=180)
    failed = [f"{what}: {err:.3g} > {tol:.3g}" for per_rank in results for what, err, tol in per_rank if not err <= tol]
    assert not failed, "\n".join(failed)
