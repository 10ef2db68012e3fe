"""log_probs_and_entropy over a vocabulary split on real gloo TP groups: each rank's
values equal the float64 full-vocabulary reference, its gradient the reference's
columns of its shard; one all-gather per forward, none in backward."""

import math
from typing import Any

import pytest
import torch

from ._dist import run_distributed, tp_groups
from .reference import EPS32, grad_atol, reference, tolerance

# (T, V_local, temperature, with_entropy, entropy_grad, dtype, chunk_size)
Case = tuple[int, int, float, bool, bool, str, int | None]
CASES: list[Case] = [
    (9, 7, 1.0, True, True, "float32", None),
    (9, 7, 0.5, True, True, "float32", 2),
    (5, 3, 1.7, True, False, "float32", 1),
    (6, 5, 1.0, False, True, "float32", 4),
    (8, 6, 1.7, True, True, "bfloat16", 3),
    (0, 4, 1.0, True, True, "float32", None),
    (0, 4, 1.0, False, True, "float32", 2),
    (1, 1, 0.5, True, True, "float32", None),
]


def _full_logits(case_index: int, t: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """The same full [T, V] logits on every rank, with peaked and masked rows."""
    gen = torch.Generator().manual_seed(100 + case_index)
    full = torch.randn(t, vocab, generator=gen) * 4
    if t >= 3:
        full[0, -1] += 1e4  # peak in the last shard
        full[1, 0] = -math.inf  # a masked token in the first shard
        full[2, vocab - vocab // 2 :] = -math.inf  # whole last shard(s) masked on a row
    return full.to(dtype)


def _targets(case_index: int, t: int, vocab: int) -> torch.Tensor:
    """Targets in every shard (ids spread over the vocabulary), masked ones avoided."""
    gen = torch.Generator().manual_seed(200 + case_index)
    spread = (torch.arange(t) * vocab) // max(t, 1)
    targets = torch.where(torch.rand(t, generator=gen) < 0.5, spread, vocab - 1 - spread)
    if t >= 3:
        targets[1] = 1 if vocab > 1 else 0
        targets[2] = 0
    return targets


def _run_cases(group: Any, tp: int, tp_rank: int, calls: list[int]) -> int:
    from cpslice import log_probs_and_entropy

    checked = 0
    for i, (t, v_local, temp, with_entropy, entropy_grad, dtype_name, chunk) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        vocab = tp * v_local
        full = _full_logits(i, t, vocab, dtype)
        targets = _targets(i, t, vocab)
        shard = full[:, tp_rank * v_local : (tp_rank + 1) * v_local].clone()
        before = shard.clone()
        x = shard.detach().requires_grad_(True)
        gen = torch.Generator().manual_seed(300 + i)
        g_lp, g_h = torch.randn(t, generator=gen), torch.randn(t, generator=gen)
        n0 = len(calls)
        logp, entropy = log_probs_and_entropy(
            x, targets, with_entropy=with_entropy, entropy_grad=entropy_grad,
            temperature=temp, tp_group=group, chunk_size=chunk,
        )
        assert len(calls) == n0 + 1, "forward must enter exactly one all-gather"
        use_h = with_entropy and entropy_grad
        loss = (logp * g_lp).sum()
        if entropy is not None and use_h:
            loss = loss + (entropy * g_h).sum()
        torch.autograd.backward(loss)
        assert len(calls) == n0 + 1, "backward must enter no collective"
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


def _worker(rank: int, world: int) -> list[tuple[int, int]]:
    import torch.distributed as dist

    from cpslice import _logprob

    calls: list[int] = []
    real = _logprob._all_gather

    def counting(*args: Any, **kwargs: Any) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    _logprob._all_gather = counting
    done = [(tp, _run_cases(group, tp, tp_rank, calls)) for group, tp, tp_rank in tp_groups(rank, world)]
    if world == 4:
        # The compiled kernels on the same ranks (raises on a mismatch).
        from .test_kernels import compiled_tp_cases

        compiled_tp_cases(rank, world, calls)
    # The eager range check refuses an id >= tp_size * V_local, before any collective.
    from cpslice import LayoutError, log_probs_and_entropy

    with pytest.raises(LayoutError, match=rf"targets\[0\] = {world * 3} is outside"):
        log_probs_and_entropy(
            torch.zeros(1, 3), torch.tensor([world * 3]), tp_group=dist.group.WORLD
        )
    dist.barrier()
    return done


def _all_paths(rank: int, world: int) -> dict[str, list[tuple[int, int]]]:
    """Every vocabulary-parallel check on one spawned world (a spawn costs ~15 s here):
    the logits path, the logits path under supports (test_support), and the hidden-state
    path (test_linear_tp), each counting its own collectives."""
    from cpslice import _linear, _logprob

    from .test_linear_tp import _worker as linear_worker
    from .test_support import _tp_worker as support_worker

    real = (_logprob._all_gather, _linear._all_reduce)
    out = {}
    for name, worker in (("logprob", _worker), ("support", support_worker),
                         ("linear", linear_worker)):
        out[name] = worker(rank, world)
        _logprob._all_gather, _linear._all_reduce = real
    return out


def test_vocab_parallel_matches_full_vocabulary() -> None:
    # one spawned world of 4: TP 4 on the world group, then TP 2 on two subgroups, for
    # the logits path, supports and the hidden-state path
    from .test_linear_support import TP_CASES as LINEAR_SUPPORT_CASES
    from .test_linear_tp import CASES as LINEAR_CASES
    from .test_support import TP_CASES

    world = 4
    results = run_distributed(_all_paths, world, timeout=300)
    expected = [(world, len(CASES)), (2, len(CASES))]
    assert [r["logprob"] for r in results] == [expected] * world
    assert [r["support"] for r in results] == [[(4, len(TP_CASES)), (2, len(TP_CASES))]] * world
    linear = len(LINEAR_CASES) + len(LINEAR_SUPPORT_CASES)
    assert [r["linear"] for r in results] == [[(4, linear), (2, linear)]] * world
