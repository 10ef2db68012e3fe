"""``cpslice.entropy`` and ``entropy_from_hidden`` over a real gloo TP group of 2, on
``[2, 3, V_local]`` logits: each rank's entropy equals the float64 full-vocabulary
reference and its gradient the reference's columns of its shard (a per-row temperature,
softcap and vocab_size; a support over its sets); the forward enters exactly one
all-gather, of 3 statistics a row (no picked logit: one fewer than
``log_probs_and_entropy``'s), the backward none; invariant mode's bits are
``log_probs_and_entropy``'s and the single process's; the hidden-state form enters one
all-gather forward and one all-reduce backward, the full hidden gradient on each rank."""

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import _probe, entropy, entropy_from_hidden, log_probs_and_entropy

from ..support._dist import run_distributed
from ..support.reference import EPS32, entropy64
from ..support.token_sets import Sets, csr

V_LOCAL = 128  # invariant mode's tile: a TP shard holds whole tiles
LEAD = (2, 3)
SETS: Sets = [[], [3], [0, 200], [], [7, 130, 255], [250]]  # sets within a shard and across both


def _weights() -> Tensor:
    return torch.cos(torch.arange(6, dtype=torch.float64) * 0.9 + 0.2).reshape(LEAD)


def _one_collective(seen: _probe.Seen, since: int, name: str, elements: int) -> None:
    events = seen.of("collective")[since:]
    assert [(e.name, e.elements) for e in events] == [(name, elements)], events


def _logits_cases(rank: int, seen: _probe.Seen) -> int:
    """Each case's entropy and gradient on this rank's shard against the reference."""
    group, world = dist.group.WORLD, dist.get_world_size()
    gen = torch.Generator().manual_seed(31)
    full = torch.randn(*LEAD, world * V_LOCAL, generator=gen) * 3
    full[0, 0, 5] = -torch.inf
    tau = 0.5 + torch.rand(LEAD, generator=gen)
    cases: list[tuple[dict[str, Any], Sets | None, int]] = [  # (keywords, sets, statistics a row)
        ({}, None, 3),
        ({"temperature": tau, "softcap": 6.0, "vocab_size": 250}, None, 3),
        ({"temperature": tau.reshape(-1), "support": csr(SETS), "entropy_over": "support"}, SETS, 6),
    ]
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    for opts, sets, rows in cases:
        x = full[..., cols].clone().requires_grad_(True)
        n0 = len(seen.of("collective"))
        h = entropy(x, tp_group=group, **opts)
        _one_collective(seen, n0, "all_gather", rows * 6)
        torch.autograd.backward((h * _weights()).sum())
        assert len(seen.of("collective")) == n0 + 1, "backward enters none"
        x64 = full.double().requires_grad_(True)
        want = entropy64(x64, opts.get("temperature", 1.0), opts.get("softcap"), opts.get("vocab_size"), sets)
        torch.autograd.backward((want * _weights()).sum())
        assert h.shape == LEAD and x.grad is not None and x64.grad is not None
        torch.testing.assert_close(h.double(), want.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(x.grad.double(), x64.grad[..., cols], rtol=0, atol=64 * EPS32)
    # invariant mode: log_probs_and_entropy's entropy and the single process's, bit for bit
    shard = full[..., cols]
    got = entropy(shard, tp_group=group, temperature=tau, invariant=True)
    targets = torch.zeros(LEAD, dtype=torch.int64)
    assert torch.equal(got, log_probs_and_entropy(shard, targets, with_entropy=True, temperature=tau,
                                                  tp_group=group, invariant=True)[1])
    assert torch.equal(got, entropy(full, temperature=tau, invariant=True))
    return len(cases) + 1


def _hidden_case(rank: int, seen: _probe.Seen) -> int:
    """The hidden-state form: this rank's rows of the LM head, the full hidden gradient."""
    group, world = dist.group.WORLD, dist.get_world_size()
    gen = torch.Generator().manual_seed(37)
    hidden, weight = torch.randn(6, 4, generator=gen), torch.randn(world * V_LOCAL, 4, generator=gen)
    rows = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    hs, w = hidden.clone().requires_grad_(True), weight[rows].clone().requires_grad_(True)
    n0 = len(seen.of("collective"))
    h = entropy_from_hidden(hs, w, tp_group=group, temperature=0.8, chunk_size=4)
    _one_collective(seen, n0, "all_gather", 3 * 6)
    torch.autograd.backward((h * _weights().reshape(-1)).sum())
    _one_collective(seen, n0 + 1, "all_reduce", hidden.numel())
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    want = entropy64(h64 @ w64.T, 0.8)
    torch.autograd.backward((want * _weights().reshape(-1)).sum())
    assert hs.grad is not None and w.grad is not None and h64.grad is not None and w64.grad is not None
    torch.testing.assert_close(h.double(), want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(hs.grad.double(), h64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad[rows], rtol=1e-5, atol=1e-5)
    return 1


def _worker(rank: int, world: int) -> int:
    with _probe.watch() as seen:
        return _logits_cases(rank, seen) + _hidden_case(rank, seen)


def test_entropy_over_a_tp_group_of_2() -> None:
    assert run_distributed(_worker, 2, timeout=200) == [5, 5]
