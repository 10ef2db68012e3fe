"""The vocabulary-parallel cases, run by test_logprob_tp.py on every rank of a gloo world
of 4: TP 4 on the world group, then TP 2 on its two subgroups (``tp_groups``). Each
rank's values equal the float64 full-vocabulary reference, its gradient the
reference's columns (the logits path) or rows (the LM-head weight) of its shard, and
each path enters only the collectives it should (counted):

- ``logits_worker``: log_probs_and_entropy (``LOGITS_CASES``: one all-gather forward,
  none backward), two of them again through the compiled kernels, and the range check
  that refuses an id before any collective;
- ``support_worker``: the same under supports (``SUPPORT_CASES``);
- ``linear_worker``: log_probs_and_entropy_from_hidden (``LINEAR_CASES``: one all-gather
  forward, one all-reduce backward, the full hidden gradient on every rank), then
  with supports (``LINEAR_SUPPORT_CASES``).

Each worker returns ``[(tp size, cases checked), ...]`` per TP group."""

import math
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import LayoutError, _probe, log_probs_and_entropy, log_probs_and_entropy_from_hidden
from cpslice._vocab.backends import selection as _backend

from ._dist import tp_groups
from .compiled import ran
from .reference import (
    EPS32,
    grad_atol,
    grad_close,
    linear_reference,
    linear_support_reference,
    reference,
    support_reference,
    tolerance,
    value_atol,
)
from .token_sets import csr, head, tp_sets

# --- the logits path

# (T, V_local, temperature, with_entropy, entropy_grad, dtype, chunk_size)
LogitsCase = tuple[int, int, float, bool, bool, str, int | None]
LOGITS_CASES: list[LogitsCase] = [
    (9, 7, 1.0, True, True, "float32", None),
    (9, 7, 0.5, True, True, "float32", 2),
    (5, 3, 1.7, True, False, "float32", 1),
    (6, 5, 1.0, False, True, "float32", 4),
    (8, 6, 1.7, True, True, "bfloat16", 3),
    (0, 4, 1.0, True, True, "float32", None),
    (0, 4, 1.0, False, True, "float32", 2),
    (1, 1, 0.5, True, True, "float32", None),
]
# No entropy, 6 rows in chunks of 4 (overlapping tail); bfloat16 with entropy, 8 in 3.
COMPILED_CASES = [LOGITS_CASES[3], LOGITS_CASES[4]]


def _full_logits(case_index: int, t: int, vocab: int, dtype: torch.dtype) -> Tensor:
    """The same full [T, V] logits on every rank, with peaked and masked rows."""
    gen = torch.Generator().manual_seed(100 + case_index)
    full = torch.randn(t, vocab, generator=gen) * 4
    if t >= 3:
        full[0, -1] += 1e4  # peak in the last shard
        full[1, 0] = -math.inf  # a masked token in the first shard
        full[2, vocab - vocab // 2 :] = -math.inf  # whole last shard(s) masked on a row
    return full.to(dtype)


def _targets(case_index: int, t: int, vocab: int) -> Tensor:
    """Targets in every shard (ids spread over the vocabulary), masked ones avoided."""
    gen = torch.Generator().manual_seed(200 + case_index)
    spread = (torch.arange(t) * vocab) // max(t, 1)
    targets = torch.where(torch.rand(t, generator=gen) < 0.5, spread, vocab - 1 - spread)
    if t >= 3:
        targets[1] = 1 if vocab > 1 else 0
        targets[2] = 0
    return targets


def _run_logits(cases: list[LogitsCase], group: Any, tp: int, tp_rank: int, seen: _probe.Seen) -> int:
    checked = 0
    for i, (t, v_local, temp, with_entropy, entropy_grad, dtype_name, chunk) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        vocab = tp * v_local
        full = _full_logits(i, t, vocab, dtype)
        targets = _targets(i, t, vocab)
        shard = full[:, tp_rank * v_local : (tp_rank + 1) * v_local].clone()
        before = shard.clone()
        x = shard.detach().requires_grad_(True)
        gen = torch.Generator().manual_seed(300 + i)
        g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
        n0 = seen.count("collective")
        logp, entropy = log_probs_and_entropy(
            x, targets, with_entropy=with_entropy, entropy_grad=entropy_grad,
            temperature=temp, tp_group=group, chunk_size=chunk,
        )
        assert seen.count("collective") == n0 + 1, "forward must enter exactly one collective"
        assert seen.of("collective")[-1].name == "all_gather", seen.of("collective")[-1]
        use_h = with_entropy and entropy_grad
        loss = (logp * g_lp).sum()
        if entropy is not None and use_h:
            loss = loss + (entropy * g_h).sum()
        torch.autograd.backward(loss)
        assert seen.count("collective") == n0 + 1, "backward must enter no collective"
        g_h = g_h if use_h else torch.zeros(t)
        ref_lp, ref_h, ref_grad = reference(full, targets, temp, g_lp, g_h)
        atol = tolerance(full, temp)
        torch.testing.assert_close(logp.double(), ref_lp, rtol=0.0, atol=atol)
        if with_entropy:
            assert entropy is not None
            assert entropy.requires_grad == entropy_grad
            torch.testing.assert_close(entropy.double(), ref_h, rtol=0.0, atol=atol)
        else:
            assert entropy is None
        assert x.grad is not None and x.grad.dtype == dtype and x.grad.shape == (t, v_local)
        cols = ref_grad[:, tp_rank * v_local : (tp_rank + 1) * v_local]
        tol = 1e-2 if dtype == torch.bfloat16 else 16 * EPS32
        atol = grad_atol(ref_grad, g_lp, g_h, temp, tol)
        torch.testing.assert_close(x.grad.double(), cols, rtol=tol, atol=atol)
        assert torch.equal(shard, before)
        checked += 1
    return checked


def _run_compiled(rank: int, world: int, seen: _probe.Seen) -> None:
    """``COMPILED_CASES`` through the compiled kernels (aot_eager) on the same groups;
    raises on any mismatch with the float64 reference, or if the compiled path did not
    run (only the kernels of this call count: the world's ranks outlive a task)."""
    with _backend.using("compiled", compiler="aot_eager", fresh=True), _probe.watch() as compiled:
        for group, tp, tp_rank in tp_groups(rank, world):
            assert _run_logits(COMPILED_CASES, group, tp, tp_rank, seen) == 2
    # the float32 case in chunks of 4 rows, the bfloat16 one in chunks of 3
    assert ran(compiled, 4) == ran(compiled, 3) == {"chunk_stats", "chunk_grad"}
    assert compiled.count("launch", backend="eager") == 0


def logits_worker(rank: int, world: int) -> list[tuple[int, int]]:
    with _probe.watch() as seen:
        done = [(tp, _run_logits(LOGITS_CASES, group, tp, tp_rank, seen))
                for group, tp, tp_rank in tp_groups(rank, world)]
        if world == 4:
            _run_compiled(rank, world, seen)
    # The eager range check refuses an id >= tp_size * V_local, before any collective.
    with pytest.raises(LayoutError, match=rf"targets\[0\] = {world * 3} is outside"):
        log_probs_and_entropy(
            torch.zeros(1, 3), torch.tensor([world * 3]), tp_group=dist.group.WORLD
        )
    dist.barrier()
    return done


# --- the logits path under supports

Over = Literal["full", "support"]
SUPPORT_CASES: list[tuple[int, int, float, bool, Over, int | None]] = [
    # (T, V_local, temperature, with_entropy, entropy_over, chunk)
    (7, 5, 0.7, False, "full", 2),
    (7, 5, 1.0, True, "full", None),
    (7, 5, 1.3, True, "support", 3),
    (6, 3, 1.0, True, "support", 1),
    (0, 4, 1.0, True, "support", None),
]


def _run_support(group: Any, tp: int, tp_rank: int, seen: _probe.Seen) -> int:
    done = 0
    for i, (t, v_local, temp, with_entropy, over, chunk) in enumerate(SUPPORT_CASES):
        vocab = tp * v_local
        gen = torch.Generator().manual_seed(600 + i)
        full = torch.randn(t, vocab, generator=gen) * 3
        targets = torch.randint(0, vocab, (t,), generator=gen)
        sets = tp_sets(i, t, vocab, targets)
        g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
        x = full[:, tp_rank * v_local : (tp_rank + 1) * v_local].clone().requires_grad_(True)
        n0 = seen.count("collective")
        lp, h = log_probs_and_entropy(
            x, targets, with_entropy=with_entropy, temperature=temp, tp_group=group,
            chunk_size=chunk, support=csr(sets), entropy_over=over,
        )
        assert seen.count("collective") == n0 + 1, "forward enters exactly one collective"
        assert seen.of("collective")[-1].name == "all_gather", seen.of("collective")[-1]
        loss = (lp * g_lp).sum() + ((h * g_h).sum() if h is not None else 0.0)
        torch.autograd.backward(loss)
        assert seen.count("collective") == n0 + 1, "backward enters none"
        g_h = g_h if with_entropy else torch.zeros(t)
        ref_lp, ref_h, ref_grad = support_reference(full, targets, sets, temp, over, g_lp, g_h)
        atol = tolerance(full, temp)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0.0, atol=atol)
        if h is not None:
            torch.testing.assert_close(h.double(), ref_h, rtol=0.0, atol=atol)
        cols = ref_grad[:, tp_rank * v_local : (tp_rank + 1) * v_local]
        assert x.grad is not None
        tol = 16 * EPS32
        torch.testing.assert_close(x.grad.double(), cols, rtol=tol,
                                   atol=grad_atol(ref_grad, g_lp, g_h, temp, tol))
        done += 1
    return done


def support_worker(rank: int, world: int) -> list[tuple[int, int]]:
    with _probe.watch() as seen:
        done = [(tp, _run_support(group, tp, tp_rank, seen)) for group, tp, tp_rank in tp_groups(rank, world)]
    # an id beyond tp_size * V_local is refused before any collective
    with pytest.raises(LayoutError, match=rf"support row 0: id {world * 3} is outside"):
        log_probs_and_entropy(torch.zeros(1, 3), torch.tensor([0]), tp_group=dist.group.WORLD,
                              support=csr([[world * 3]]))
    dist.barrier()
    return done


# --- the hidden-state path: the LM-head weight split

# (T, H, V_local, temperature, with_entropy, entropy_grad, dtype, chunk_size)
LINEAR_CASES: list[tuple[int, int, int, float, bool, bool, str, int | None]] = [
    (9, 6, 7, 1.0, True, True, "float32", None),
    (9, 6, 7, 0.5, True, True, "float32", 2),
    (5, 4, 3, 1.7, True, False, "float32", 1),
    (6, 5, 5, 1.0, False, True, "float32", 4),
    (8, 8, 6, 1.7, True, True, "bfloat16", 3),
    (0, 4, 4, 1.0, True, True, "float32", None),
    (1, 3, 1, 0.5, True, True, "float32", None),
]
# (T, V_local, temperature, with_entropy, entropy_over, chunk)
LINEAR_SUPPORT_CASES: list[tuple[int, int, float, bool, str, int]] = [
    (7, 5, 0.7, False, "full", 2),
    (7, 5, 1.3, True, "support", 3),
    (6, 3, 1.0, True, "full", 1),
]


def _run_linear(group: Any, tp: int, tp_rank: int, seen: _probe.Seen) -> int:
    def calls() -> dict[str, int]:
        every = seen.count("collective")
        gather, reduce = seen.count("collective", name="all_gather"), seen.count("collective", name="all_reduce")
        assert every == gather + reduce, seen.of("collective")
        return {"all_gather": gather, "all_reduce": reduce}

    for i, (t, h, v_local, temp, with_entropy, entropy_grad, dtype_name, chunk) in enumerate(LINEAR_CASES):
        dtype = getattr(torch, dtype_name)
        vocab = tp * v_local
        gen = torch.Generator().manual_seed(100 + i)
        hidden = (torch.randn(t, h, generator=gen) * 2).to(dtype)
        weight = torch.randn(vocab, h, generator=gen).to(dtype)
        targets = torch.randint(0, vocab, (t,), generator=gen)
        g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
        rows = slice(tp_rank * v_local, (tp_rank + 1) * v_local)
        x = hidden.clone().requires_grad_(True)
        w = weight[rows].clone().requires_grad_(True)
        before = calls()
        logp, entropy = log_probs_and_entropy_from_hidden(
            x, w, targets, with_entropy=with_entropy, entropy_grad=entropy_grad,
            temperature=temp, tp_group=group, chunk_size=chunk,
        )
        assert calls() == {**before, "all_gather": before["all_gather"] + 1}
        use_h = with_entropy and entropy_grad
        loss = (logp * g_lp).sum()
        if entropy is not None and use_h:
            loss = loss + (entropy * g_h).sum()
        torch.autograd.backward(loss)
        assert calls() == {"all_gather": before["all_gather"] + 1,
                           "all_reduce": before["all_reduce"] + 1}
        ref_lp, ref_h, ref_dh, ref_dw = linear_reference(
            hidden, weight, targets, temp, g_lp, g_h if use_h else torch.zeros(t)
        )
        bf16 = dtype == torch.bfloat16
        atol = value_atol(hidden, weight, temp, 2.0**-7 if bf16 else 2.0**-18)
        torch.testing.assert_close(logp.double(), ref_lp, rtol=0.0, atol=atol)
        if with_entropy:
            assert entropy is not None and entropy.requires_grad == entropy_grad
            torch.testing.assert_close(entropy.double(), ref_h, rtol=0.0, atol=atol)
        else:
            assert entropy is None
        grad_close(x.grad, ref_dh, 3e-2 if bf16 else 1e-5)
        grad_close(w.grad, ref_dw[rows], 3e-2 if bf16 else 1e-5)
        assert torch.equal(x.detach(), hidden)
    return len(LINEAR_CASES)


def _run_linear_support(group: Any, tp: int, tp_rank: int) -> int:
    """On every rank of ``group``: its values, its shard's weight gradient and the full
    hidden gradient against the reference."""
    for i, (t, v_local, temp, with_entropy, over, chunk) in enumerate(LINEAR_SUPPORT_CASES):
        vocab = tp * v_local
        hidden, weight = head(t, vocab, seed=900 + i, dtype=torch.float32)
        gen = torch.Generator().manual_seed(950 + i)
        targets = torch.randint(0, vocab, (t,), generator=gen)
        sets = tp_sets(i, t, vocab, targets)
        g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
        rows = slice(tp_rank * v_local, (tp_rank + 1) * v_local)
        x, w = hidden.clone().requires_grad_(True), weight[rows].clone().requires_grad_(True)
        lp, ent = log_probs_and_entropy_from_hidden(  # type: ignore[call-overload]
            x, w, targets, with_entropy=with_entropy, temperature=temp, tp_group=group,
            chunk_size=chunk, support=csr(sets), entropy_over=over,
        )
        torch.autograd.backward((lp * g_lp).sum() + ((ent * g_h).sum() if ent is not None else 0.0))
        g_h = g_h if with_entropy else torch.zeros(t)
        ref_lp, ref_h, ref_dh, ref_dw = linear_support_reference(hidden, weight, targets, sets, temp, over, g_lp, g_h)
        atol = value_atol(hidden, weight, temp, 2.0**-18)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0.0, atol=atol)
        if ent is not None:
            torch.testing.assert_close(ent.double(), ref_h, rtol=0.0, atol=atol)
        grad_close(x.grad, ref_dh, 1e-5)
        grad_close(w.grad, ref_dw[rows], 1e-5)
    return len(LINEAR_SUPPORT_CASES)


def linear_worker(rank: int, world: int) -> list[tuple[int, int]]:
    with _probe.watch() as seen:
        done = [(tp, _run_linear(group, tp, tp_rank, seen) + _run_linear_support(group, tp, tp_rank))
                for group, tp, tp_rank in tp_groups(rank, world)]
    dist.barrier()
    return done
