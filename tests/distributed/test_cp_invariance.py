"""CP invariance and collective symmetry on real gloo groups with megatron-core.

The same batch at cp_size 1, 2 and 4, both CP modes (allgather redistributed to
zigzag, zigzag as it is): log-probs, entropy, the reduced loss and the logits'
gradient mapped back to global positions equal cp_size 1. And every rank enters
the same collectives in the same order, forward and backward, including ranks that
hold no response at all; a hang fails through the join timeout."""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cpslice import (
    Layout,
    _probe,
    extract_responses,
    gather_responses,
    pack,
    redistribute,
    response_log_probs,
    response_rows,
    shard_responses,
    sum_of_sample_means,
    sum_of_tokens,
)
from cpslice._types import CpMode

from ..support._dist import destroy_megatron, init_megatron, run_distributed
from ..support.reference import Batch, make_batch

Result = dict[str, torch.Tensor]


def _step(batch: Batch, layout: Layout, zig: Layout, group: Any) -> tuple[Result, torch.Tensor]:
    """One training step's outputs on this rank: whole responses, loss parts, logits grad."""
    logits = pack(batch.logits, layout).requires_grad_()
    lp, ent = response_log_probs(logits, batch.tokens, layout, with_entropy=True,
                                 temperature=batch.temperature)
    if layout.cp_mode == "allgather":
        lp, ent = redistribute((lp, ent), layout, zig, cp_group=group)
    whole_lp = gather_responses(lp, zig, cp_group=group) if zig.cp_size > 1 else lp
    whole_ent = gather_responses(ent, zig, cp_group=group) if zig.cp_size > 1 else ent
    loss = sum_of_sample_means(lp, batch.masks, zig) + 0.5 * sum_of_tokens(ent, batch.masks, zig)
    (grad,) = torch.autograd.grad(loss, logits)
    out = {"lp": torch.cat(whole_lp).detach(), "ent": torch.cat(whole_ent).detach(),
           "loss": loss.detach().reshape(1)}
    if zig.cp_size > 1:
        dist.all_reduce(out["loss"], group=group)
    # map the gradient back to global positions: which packed row each local row holds
    offsets = torch.cumsum(torch.tensor([0, *batch.total]), 0)[:-1]
    ids = pack([torch.arange(t) + o for t, o in zip(batch.total, offsets.tolist())], layout,
               fill=-1)
    return out, _to_global(grad, ids, sum(batch.total), group if zig.cp_size > 1 else None)


def _to_global(grad: torch.Tensor, ids: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    rows = [(grad, ids)]
    if group is not None:
        size = dist.get_world_size(group)
        g_all = [torch.empty_like(grad) for _ in range(size)]
        i_all = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(g_all, grad.contiguous(), group=group)
        dist.all_gather(i_all, ids, group=group)
        rows = list(zip(g_all, i_all))
    out = torch.zeros(n, grad.shape[1])
    for g, i in rows:
        held = i >= 0
        assert float(g[~held].abs().max()) == 0.0 if (~held).any() else True, "padding got grad"
        out[i[held]] += g[held]
    return out


def _invariance(rank: int, world: int) -> list[tuple[str, float]]:
    from megatron.core import parallel_state as ps

    errors = []
    batches = [make_batch(seed, n=9, cp=4, vocab=7) for seed in (3, 4)]
    bases = []
    for batch in batches:
        one = Layout(batch.total, batch.response)
        bases.append(_step(batch, one, one, None))
    # one parallel_state per cp size (its gloo groups are most of this test's time)
    for cp in (2, 4):
        init_megatron(1, cp)
        try:
            group = ps.get_context_parallel_group()
            for seed, batch, (base, base_grad) in zip((3, 4), batches, bases):
                for allgather in (False, True):
                    layout = Layout.from_parallel_state(batch.total, batch.response,
                                                        cp_mode="allgather" if allgather else None)
                    if allgather:
                        length = pack([torch.zeros(t) for t in batch.total], layout).shape[0]
                        layout = layout.with_local_length(length)
                    zig = Layout(batch.total, batch.response, cp_mode="zigzag",
                                 cp_rank=layout.cp_rank, cp_size=cp)
                    out, grad = _step(batch, layout, zig, group)
                    name = f"seed{seed} cp{cp} {'allgather' if allgather else 'zigzag'}"
                    for key in base:
                        errors.append((f"{name} {key}", float((out[key] - base[key]).abs().max())
                                       if base[key].numel() else 0.0))
                    errors.append((f"{name} grad", float((grad - base_grad).abs().max())))
        finally:
            destroy_megatron()
    return errors


def test_cp_invariance() -> None:
    for per_rank in run_distributed(_invariance, 4, timeout=240):
        for name, err in per_rank:
            assert err < 1e-5, f"{name}: {err}"


def _symmetry(rank: int, world: int) -> list[list[str]]:
    """Each case's collectives, as the library enters them (``cpslice._probe``), forward then
    backward; then the refusals' messages."""
    sequences = []
    # allgather cp4, T=6: ranks 1 and 2 hold no response at all; zigzag cp4: the
    # short samples leave several ranks empty; one sample, one rank holds it all
    # padded samples (align): zigzag chunks and allgather pieces that are all padding
    cases: list[tuple[list[int], list[int], CpMode, int | None]] = [
        ([3, 20], [1, 2], "allgather", None),
        ([2, 3, 1], [1, 0, 0], "zigzag", None),
        ([10], [4], "zigzag", None),
        ([24], [1], "allgather", None),
        ([2, 3, 1], [1, 2, 0], "zigzag", 16),
        ([3, 20], [1, 2], "allgather", 16),
    ]
    for total, response, mode, align in cases:
        with _probe.watch() as forward:
            loss, values = _round_trip(rank, world, total, response, mode, align)
        with _probe.watch() as backward:
            torch.autograd.backward(loss)
        assert values.grad is not None
        sequences.append([e.name for e in forward.of("collective")] + ["forward done"]
                         + [e.name for e in backward.of("collective")] + ["backward done"])
    sequences.append(_redistribute_errors(rank, world))
    return sequences


def _round_trip(rank: int, world: int, total: list[int], response: list[int], mode: CpMode,
                align: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses extracted, redistributed to zigzag and gathered back, checked; the loss
    of their sample means, token sums and gathered values, and the packed values."""
    layout = Layout(total, response, cp_mode=mode, cp_rank=rank, cp_size=world, align=align)
    length = pack([torch.zeros(t) for t in total], layout).shape[0]
    layout = layout.with_local_length(length)
    zig = Layout(total, response, cp_mode="zigzag", cp_rank=rank, cp_size=world)
    # row holding position p of sample i: 1000 * i + p (padding: -1)
    code = [torch.arange(t, dtype=torch.float32) + 1000 * i for i, t in enumerate(total)]
    values = pack(code, layout, fill=-1).requires_grad_()
    shares, ent = extract_responses(values, layout, values * 2)
    lp2, ent2 = redistribute((shares, ent), layout, zig, cp_group=dist.group.WORLD)
    whole = gather_responses(lp2, zig, cp_group=dist.group.WORLD)
    spans = [c[t - r - 1 : t - 1] for c, t, r in zip(code, total, response)]
    assert [w.tolist() for w in whole] == [x.tolist() for x in spans], (mode, align)
    assert [x.tolist() for x in lp2] == [x.tolist() for x in shard_responses(spans, zig)]
    masks = [torch.ones(r, dtype=torch.bool) for r in response]
    loss = sum_of_sample_means(lp2, masks, zig) + sum_of_tokens(ent2, masks, zig)
    loss = loss + sum((w.sum() for w in whole), torch.zeros(()))
    return loss, values


def _redistribute_errors(rank: int, world: int) -> list[str]:
    """Refusals happen before any collective, identically on every rank."""
    from cpslice import LayoutError

    zig = Layout([10, 6], [4, 2], cp_mode="zigzag", cp_rank=rank, cp_size=world)
    shares, _ = extract_responses(torch.zeros(pack([torch.zeros(10), torch.zeros(6)], zig)
                                              .shape[0]), zig)
    world_group = dist.group.WORLD
    bad: list[Callable[[], object]] = [
        lambda: redistribute(shares, zig.for_rank((rank + 1) % world), zig, cp_group=world_group),
        # a dst of the group's size, but another rank's: refused as a src of another rank is
        lambda: redistribute(shares, zig, zig.for_rank((rank + 1) % world), cp_group=world_group),
        lambda: redistribute(shares, Layout([10, 6], [4, 2], cp_mode="zigzag", cp_size=2,
                                            cp_rank=rank % 2), zig, cp_group=world_group),
        lambda: redistribute(shares, zig, Layout([10, 7], [4, 2]), cp_group=world_group),
        lambda: redistribute([torch.zeros(s.shape[0] + 1) for s in shares], zig, zig,
                             cp_group=world_group),
        lambda: redistribute((shares, [s.double() for s in shares]), zig, zig,
                             cp_group=world_group),
        lambda: redistribute(shares, Layout([10, 6], [4, 2], cp_mode="allgather",
                                            cp_rank=rank, cp_size=world), zig,
                             cp_group=world_group),
        # cp_group=None is no group, as tp_group=None is no TP: refused under CP
        lambda: redistribute(shares, zig, zig),
        lambda: gather_responses(shares, zig, cp_group=None),
    ]
    messages = []
    for call in bad:
        try:
            call()
            messages.append("no error")
        except LayoutError as e:
            messages.append(str(e))
    # without CP, cp_group=None is fine: nothing moves
    one = Layout([10, 6], [4, 2])
    whole = [torch.ones(4), torch.ones(2)]
    moved = redistribute(whole, one, one, cp_group=None) + gather_responses(whole, one)
    messages.append(str([m.tolist() for m in moved]))
    return messages


def test_every_rank_enters_the_same_collectives_even_holding_nothing() -> None:
    results = run_distributed(_symmetry, 4, timeout=120)
    messages = [per_rank.pop() for per_rank in results]
    for per_rank in results[1:]:
        assert per_rank == results[0]
    for sequence in results[0]:
        # forward: redistribute + gather; backward: their reverse exchanges
        assert sequence == ["all_to_all_single"] * 2 + ["forward done"] + (
            ["all_to_all_single"] * 2
        ) + ["backward done"], sequence
    wrong_rank, wrong_dst_rank, wrong_size, other_samples, wrong_length, mixed, no_local, *rest = messages[1]
    no_group, no_group_gather, no_cp = rest
    assert "src is rank 2 of cp_size 4 but this process is rank 1 of a group of 4" in wrong_rank
    assert wrong_dst_rank.startswith("dst is rank 2 of cp_size 4 but this process is rank 1 of 4; a dst with CP "
                                     "must be this rank's layout"), wrong_dst_rank
    assert "pass the CP group" in wrong_size
    assert "same samples" in other_samples
    assert "sample 0: values[0] has 1 positions but rank 1's share in src is 0" in wrong_length
    assert "one dtype and trailing shape" in mixed
    assert "local_length=T" in no_local
    for fn, message in (("redistribute", no_group), ("gather_responses", no_group_gather)):
        assert message.startswith(
            f"{fn} at cp_size 4 needs cp_group=, the CP process group (megatron-core: "
            "parallel_state.get_context_parallel_group(); dist.group.WORLD when every process "
            "is one CP group); None means no group, as tp_group=None means no TP"
        ), message
    assert no_cp == str([[1.0] * 4, [1.0] * 2] * 2)


def _left_padded(rank: int, world: int) -> list[str]:
    """``redistribute`` from left-padded bshd rows to thd layouts and back: the shares
    each rank receives, the whole responses, and the gradient of every source row."""
    total, response, offsets = [10, 3, 7, 1], [4, 2, 6, 0], [0, 9, 5, 11]
    rows = Layout(total, response, qkv_format="bshd", max_seq_len=12, row_offsets=offsets,
                  cp_mode="zigzag", cp_rank=rank, cp_size=world)
    zig = Layout(total, response, cp_mode="zigzag", cp_rank=rank, cp_size=world)
    packed = Layout(total, response, cp_mode="allgather", cp_rank=rank, cp_size=world,
                    local_length=6)
    code = [torch.arange(t, dtype=torch.float32) + 1000 * i for i, t in enumerate(total)]
    spans = [c[t - r - 1 : t - 1] for c, t, r in zip(code, total, response)]
    weights = [torch.arange(r, dtype=torch.float32) + 1 for r in response]
    failures = []
    for src, dst in ((rows, zig), (zig, rows), (packed, rows), (rows, packed)):
        name = f"{src.qkv_format} {src.cp_mode} -> {dst.qkv_format} {dst.cp_mode}"
        values = pack(code, src, fill=-1).requires_grad_()
        shares, _ = extract_responses(values, src)
        moved = redistribute(shares, src, dst, cp_group=dist.group.WORLD)
        if [m.tolist() for m in moved] != [x.tolist() for x in shard_responses(spans, dst)]:
            failures.append(f"{name}: shares")
        if [w.tolist() for w in gather_responses(moved, dst, cp_group=dist.group.WORLD)] != [x.tolist() for x in spans]:
            failures.append(f"{name}: whole responses")
        loss = sum(((m * w).sum() for m, w in zip(moved, shard_responses(weights, dst))),
                   values.sum() * 0)
        (grad,) = torch.autograd.grad(loss, values)
        want = torch.zeros_like(grad)
        want[response_rows(src).rows] = torch.cat(shard_responses(weights, src))
        if not torch.equal(grad, want):
            failures.append(f"{name}: gradient")
    return failures


def test_redistribute_between_left_padded_rows_and_thd() -> None:
    for rank, failures in enumerate(run_distributed(_left_padded, 4, timeout=120)):
        assert failures == [], f"rank {rank}: {failures}"


def _from_whole(rank: int, world: int) -> list[str]:
    """``redistribute`` from a layout without CP (whole responses, the same on every
    rank) to one with CP: each rank gets its own share of dst (not the whole responses),
    at depth 0 and 1, and its gradient reaches its own copy at that share only, the ranks'
    gradients summing to the whole one. Then, with torch.distributed up, the refusals of
    a CP call with no group, a layout of no samples included."""
    from cpslice import LayoutError, sample_max, sample_means

    total, response = [10, 3, 7, 1], [4, 2, 6, 0]
    whole = Layout(total, response)
    dsts = {
        "zigzag": Layout(total, response, cp_mode="zigzag", cp_rank=rank, cp_size=world),
        "allgather": Layout(total, response, cp_mode="allgather", cp_rank=rank, cp_size=world,
                            local_length=6),
        "bshd zigzag": Layout(total, response, qkv_format="bshd", max_seq_len=12, row_offsets=[0, 9, 5, 11],
                              cp_mode="zigzag", cp_rank=rank, cp_size=world),
    }
    spans = [torch.arange(r, dtype=torch.float64) + 100 * i for i, r in enumerate(response)]
    weights = [torch.arange(r, dtype=torch.float64) + 1 for r in response]
    failures = []
    for (name, dst), depth in [(d, 0) for d in dsts.items()] + [(("zigzag", dsts["zigzag"]), 1)]:
        name = f"none -> {name} at depth {depth}"
        full = [s.clone().requires_grad_() for s in shard_responses(spans, whole, depth=depth)]
        moved = redistribute(full, whole, dst, cp_group=dist.group.WORLD, depth=depth)
        want = shard_responses(spans, dst, depth=depth)
        if [m.tolist() for m in moved] != [w.tolist() for w in want]:
            failures.append(f"{name}: shares {[m.tolist() for m in moved]}, not {[w.tolist() for w in want]}")
            continue
        whole_w = shard_responses(weights, whole, depth=depth)
        loss = sum(((m * w).sum() for m, w in zip(moved, shard_responses(weights, dst, depth=depth))),
                   torch.zeros((), dtype=torch.float64))
        grads = torch.autograd.grad(loss, full, allow_unused=True, materialize_grads=True)
        # the elements of each whole share this rank holds, read back from its values'
        # codes (at depth d a whole share lacks the tokens no position predicts)
        lost = [len(w0) - len(w) for w0, w in zip(weights, whole_w)]
        held = [(s - 100 * i).long() - n for i, (s, n) in enumerate(zip(want, lost))]
        expected = [torch.zeros_like(w).index_copy_(0, h, w[h]) for w, h in zip(whole_w, held)]
        if not all(torch.equal(g, e) for g, e in zip(grads, expected)):
            failures.append(f"{name}: gradient")
        summed = torch.cat(grads).clone()
        dist.all_reduce(summed)
        if not torch.equal(summed, torch.cat(whole_w)):
            failures.append(f"{name}: the ranks' gradients do not sum to the whole one")
    messages = []
    empty = Layout([], [], cp_mode="zigzag", cp_rank=rank, cp_size=world)
    calls: list[Callable[[], object]] = [
        lambda: redistribute(spans, whole, dsts["zigzag"]),
        lambda: sample_means([], [], empty),
        lambda: sample_max([], [], empty),
    ]
    for call in calls:
        try:
            messages.append(f"accepted: {call()}")
        except LayoutError as e:
            messages.append(str(e))
    return failures + [m for m in messages if "needs cp_group=" not in m]


def test_redistribute_from_whole_responses_to_cp_shares() -> None:
    for rank, failures in enumerate(run_distributed(_from_whole, 4, timeout=120)):
        assert failures == [], f"rank {rank}: {failures}"
