"""End to end on real gloo groups with megatron-core's parallel_state: CP 2 and 4 x
TP 1 and 2, every layout. Each rank's log-prob and entropy shares equal the float64
reference at its positions; its logits' gradient equals the reference gradient at
the rows it holds (zero on padding); redistribution, gathering and the reducers
give the cp_size 1 result. Every expected share, loss weight and gradient row is read
from tests/support/oracle.py (a position-by-position transcription of the layout rules),
never from the pack/shard_responses code under test."""

from typing import Any

import torch
import torch.distributed as dist

from cpslice import (
    Layout,
    pack,
    redistribute,
    response_log_probs,
    sum_of_sample_means,
    sum_of_tokens,
)
from cpslice._types import CpMode

from ..support import oracle
from ..support._dist import destroy_megatron, init_megatron, run_distributed
from ..support.reference import Batch, layout_for, make_batch

KINDS = ["zigzag-thd", "zigzag-bshd", "allgather"]
VOCAB_PER_RANK = 6


def _err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b):
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.numel():
            worst = max(worst, float((x.detach().double() - y.double()).abs().max()))
    return worst


def _check_rank(batch: Batch, layout: Layout, tp_rank: int, tp: int, cp_group: Any,
                tp_group: Any) -> dict[str, float]:
    v = VOCAB_PER_RANK
    cfg, rank = oracle.config_of(layout), layout.cp_rank
    full = pack(batch.logits, layout)  # [T, V]: this CP rank's rows
    logits = full[:, tp_rank * v : (tp_rank + 1) * v].clone().requires_grad_()
    before = logits.detach().clone()
    lp, ent = response_log_probs(
        logits, batch.tokens, layout, with_entropy=True, temperature=batch.temperature,
        tp_group=tp_group if tp > 1 else None, chunk_size=3,
    )
    err = {
        "lp": _err(lp, oracle.shares(batch.ref_lp, cfg, rank)),
        "ent": _err(ent, oracle.shares(batch.ref_ent, cfg, rank)),
    }
    w_lp = oracle.shares(batch.w_lp, cfg, rank)
    w_ent = oracle.shares(batch.w_ent, cfg, rank)
    anchor = logits.sum() * 0
    loss = sum(((a.float() * x).sum() + (b.float() * y).sum()
                for a, x, b, y in zip(w_lp, lp, w_ent, ent)), anchor)
    (grad,) = torch.autograd.grad(loss, logits)
    want = oracle.rows(batch.ref_grad, cfg, rank)[:, tp_rank * v : (tp_rank + 1) * v]
    err["grad"] = float((grad.double() - want).abs().max()) if grad.numel() else 0.0
    assert torch.equal(logits.detach(), before), "the caller's logits were modified"

    # CP: whole responses on every rank, and allgather -> zigzag, with gradients
    lp, ent = response_log_probs(logits, batch.tokens, layout, with_entropy=True,
                                 temperature=batch.temperature,
                                 tp_group=tp_group if tp > 1 else None)
    whole_lp, whole_ent = redistribute((lp, ent), layout, Layout(batch.total, batch.response),
                                       cp_group=cp_group)
    err["gathered"] = max(_err(whole_lp, batch.ref_lp), _err(whole_ent, batch.ref_ent))
    if layout.cp_mode == "allgather":  # -> zigzag (at cp 1, one rank's layout: none)
        zig = Layout(batch.total, batch.response, cp_mode="zigzag", cp_rank=layout.cp_rank,
                     cp_size=layout.cp_size) if layout.cp_size > 1 else Layout(batch.total, batch.response)
        zlp = redistribute(lp, layout, zig, cp_group=cp_group)
        zcfg = oracle.config_of(zig)
        err["to_zigzag"] = _err(zlp, oracle.shares(batch.ref_lp, zcfg, rank))
        target, weights = zig, oracle.shares(batch.w_lp, zcfg, rank)
    else:
        zlp, target, weights = lp, layout, w_lp
    # the reduced losses: parts sum over the CP group to the cp_size 1 value
    means = sum_of_sample_means(zlp, batch.masks, target)
    tokens = sum_of_tokens([w.float() * x for w, x in zip(weights, zlp)], batch.masks, target)
    (grad2,) = torch.autograd.grad(means + tokens + 0 * whole_lp_anchor(whole_lp, whole_ent),
                                   logits)
    parts = torch.stack([means.detach(), tokens.detach()]).double()
    dist.all_reduce(parts, group=cp_group)
    ref_means = sum(
        (lp_[m].sum() / m.sum() if m.any() else torch.zeros((), dtype=torch.float64))
        for lp_, m in zip(batch.ref_lp, batch.masks)
    )
    ref_tokens = sum((w[m] * lp_[m]).sum() for w, lp_, m in zip(batch.w_lp, batch.ref_lp,
                                                                  batch.masks))
    err["reduced"] = float((parts - torch.stack([torch.as_tensor(ref_means).double(),
                                                 torch.as_tensor(ref_tokens).double()])).abs().max())
    # the same loss at cp_size 1, in float64, gives the reference gradient of these rows
    ref_grad2 = []
    for t, r, tok, lg, w, m in zip(batch.total, batch.response, batch.tokens, batch.logits,
                                   batch.w_lp, batch.masks):
        x = lg.double().requires_grad_()
        logp = torch.log_softmax(x / batch.temperature, -1)
        lpx = logp[t - r - 1 : t - 1].gather(1, tok[t - r :, None])[:, 0]
        loss2 = (lpx[m].sum() / m.sum() if m.any() else lpx.sum() * 0) + (w[m] * lpx[m]).sum()
        ref_grad2.append(torch.autograd.grad(loss2, x)[0])
    want2 = oracle.rows(ref_grad2, cfg, rank)[:, tp_rank * v : (tp_rank + 1) * v]
    err["reduced_grad"] = float((grad2.double() - want2).abs().max()) if grad2.numel() else 0.0
    return err


Got = list[tuple[str, int, int]]


def before_initialization() -> str:
    """What ``from_parallel_state`` says before megatron-core's state exists."""
    from cpslice import Layout

    try:
        Layout.from_parallel_state([10], [4])
        return "no error"
    except RuntimeError as e:
        return str(e)


def from_parallel_state_setup(tp: int, cp: int) -> Got:
    """The layouts ``from_parallel_state`` builds in one initialized megatron setup."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cpslice import Layout, LayoutError

    got: Got = []
    modes: tuple[CpMode | None, ...] = (None, "allgather")
    for mode in modes:
        layout = Layout.from_parallel_state([10, 7], [4, 3], cp_mode=mode)
        got.append((layout.cp_mode, layout.cp_rank, layout.cp_size))
    assert got[0][1] == parallel_state.get_context_parallel_rank()
    # the mode parallel_state reads, asked for by name, is the same layout; the other is
    # refused (its message is checked by check_from_parallel_state)
    read: CpMode = "zigzag" if cp > 1 else "none"
    other: CpMode = "none" if cp > 1 else "zigzag"
    asked = Layout.from_parallel_state([10, 7], [4, 3], cp_mode=read, qkv_format="bshd", max_seq_len=12)
    assert asked == Layout.from_parallel_state([10, 7], [4, 3], qkv_format="bshd", max_seq_len=12)
    try:
        Layout.from_parallel_state([10, 7], [4, 3], cp_mode=other)
        refusal = "no error"
    except LayoutError as e:
        refusal = str(e)
    got.append((refusal, got[0][1], cp))
    bshd = Layout.from_parallel_state([10, 7], [4, 3], qkv_format="bshd", max_seq_len=12)
    assert bshd.qkv_format == "bshd" and bshd.max_seq_len == 12
    # verl's packing: every sample padded to a multiple of tp * cp * 2
    verl = Layout.from_parallel_state([10, 7], [4, 3], align=tp * cp * 2)
    assert verl.align == tp * cp * 2 and verl.cp_rank == got[0][1]
    given = Layout.from_parallel_state([10, 7], [4, 3], cp_mode="allgather",
                                       padded_lengths=[11, 9])
    assert given.padded_lengths == (11, 9) and given.cp_mode == "allgather"
    # a shared prefix: two responses on one prompt of 6 tokens, packed as one star
    star = Layout.from_parallel_state([10, 8], [4, 2], shared_prefix=[2])
    assert star == Layout([10, 8], [4, 2], cp_mode=read, cp_rank=got[0][1], cp_size=cp, shared_prefix=[2])
    width = 12 if cp == 1 else -(-12 // (2 * cp)) * 2 * cp  # the star: 6 + 4 + 2 tokens
    assert star.shared_prefix == (2,) and star.padded_lengths == (width,), star
    dist.barrier()
    return got


def check_from_parallel_state(rank: int, before: str, got: dict[tuple[int, int], Got]) -> None:
    """The checks of one rank's results (the spawned run is test_end_to_end's world of 4,
    which initializes megatron-core with (tp, cp) = (1, 4), (2, 2), (1, 2), (2, 1))."""
    assert "parallel_state is not initialized" in before
    for (tp, cp), per_setup in got.items():
        # megatron's default order "tp-cp-...": tp varies fastest, so cp rank = rank // tp
        cp_rank = (rank // tp) % cp
        mode, other = ("zigzag", "none") if cp > 1 else ("none", "zigzag")
        assert per_setup[:2] == [(mode, cp_rank, cp), ("allgather", cp_rank, cp)], (tp, cp)
        refusal, _, _ = per_setup[2]
        assert refusal.startswith(
            f"cp_mode '{other}' but megatron-core's context-parallel world size is {cp}: pass "
            f"cp_mode='{'zigzag' if cp > 1 else 'none'}'"), (tp, cp, refusal)


def whole_lp_anchor(lp: list[torch.Tensor], ent: list[torch.Tensor]) -> torch.Tensor:
    """Keep the gathered outputs in the graph, so backward crosses their all-to-all."""
    return sum((x.sum() + y.sum() for x, y in zip(lp, ent)), torch.zeros(()))


def _worker(rank: int, world: int, setups: list[tuple[int, int, int]]
            ) -> tuple[list[tuple[str, dict[str, float]]], str, dict[tuple[int, int], Got]]:
    from megatron.core import parallel_state as ps

    out = []
    before = before_initialization()
    layouts: dict[tuple[int, int], Got] = {}
    for tp, cp, seed in setups:
        init_megatron(tp, cp)
        try:
            layouts[tp, cp] = from_parallel_state_setup(tp, cp)
            cp_group, tp_group = ps.get_context_parallel_group(), ps.get_tensor_model_parallel_group()
            batch = make_batch(seed, n=7, cp=cp, vocab=VOCAB_PER_RANK * tp)
            # at cp 1 zigzag is no layout (cp_mode None reads none there): none's kinds instead
            for kind in KINDS if cp > 1 else ["allgather", "none-thd", "none-bshd"]:
                base = layout_for(batch, kind, 0, cp)
                allgather = kind == "allgather"
                layout = Layout.from_parallel_state(
                    batch.total, batch.response, qkv_format=base.qkv_format,
                    max_seq_len=base.max_seq_len, cp_mode="allgather" if allgather else None,
                    local_length=base.local_length if allgather else None,
                )
                layout = layout.with_local_length(base.local_length)
                errs = _check_rank(batch, layout, ps.get_tensor_model_parallel_rank(), tp,
                                   cp_group, tp_group)
                out.append((f"tp{tp} cp{cp} {kind} seed{seed}", errs))
        finally:
            destroy_megatron()
    return out, before, layouts


def test_end_to_end_matches_the_float64_reference() -> None:
    # one spawned world of 4 ranks, four megatron-core setups (tp, cp) over it, each on
    # a batch of its own seed (random lengths: test_cp_invariance and the hypothesis
    # tests vary them more); it also checks Layout.from_parallel_state in each setup
    setups = [(1, 4, 0), (2, 2, 1), (1, 2, 2), (2, 1, 3)]
    results = run_distributed(_worker, 4, setups, timeout=240)
    for rank, (rank_results, before, layouts) in enumerate(results):
        check_from_parallel_state(rank, before, layouts)
        assert sorted(layouts) == sorted((tp, cp) for tp, cp, _ in setups)
        for name, errs in rank_results:
            for what, e in errs.items():
                assert e < 2e-5, f"{name}: {what} error {e}"
