"""``cpslice.vocab_divergence`` over a real gloo TP group of 2, each rank holding the same
vocabulary shard of both models' ``[2, 3, V_local]`` logits: every kind's values equal the
float64 full-vocabulary definition, and each rank's gradients (student and teacher) the
reference's columns of its shard, with a per-row temperature, a cap, a padded vocabulary
and -inf logits on both sides; ``"forward"`` and ``"reverse"`` enter exactly one
all-gather of ``[5, T]``, ``"jsd"`` two (``[4, T]``, then ``[2, T]``), backward none;
invariant mode's values and per-shard gradients are the single process's bits (TP 1);
a DTensor ``Shard(-1)`` pair gives the local pair's bits."""

import math
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import _probe, vocab_divergence

from ..support._dist import run_distributed
from ..support.divergence_cases import KINDS, check, reference, value_atol

V_LOCAL = 128  # invariant mode's tile: a TP shard holds whole tiles
LEAD = (2, 3)


def _logits(world: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(41)
    s = torch.randn(*LEAD, world * V_LOCAL, generator=gen) * 3
    t = torch.randn(*LEAD, world * V_LOCAL, generator=gen) * 3
    s[0, 1, 200] = -math.inf  # the student -inf where the teacher has mass (rank 1's shard): forward +inf
    t[1, 0, 5] = -math.inf  # the teacher -inf at rank 0's shard: reverse +inf
    s[1, 2, 7] = t[1, 2, 7] = -math.inf
    return s, t


def _collectives(seen: _probe.Seen, since: int) -> list[tuple[str, int]]:
    return [(e.name, e.elements) for e in seen.of("collective")[since:]]


def _cases(rank: int, seen: _probe.Seen) -> int:
    """Each kind's values and this shard's gradients against the float64 reference."""
    group, world = dist.group.WORLD, dist.get_world_size()
    full_s, full_t = _logits(world)
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    tau = 0.6 + torch.rand(LEAD, generator=torch.Generator().manual_seed(42))
    g = torch.cos(torch.arange(6, dtype=torch.float32)).reshape(LEAD)
    rows = 6
    done = 0
    options: list[dict[str, Any]] = [{"temperature": tau}, {"softcap": 9.0}, {"vocab_size": 250},
                                     {"temperature": 0.8}, {}]
    for (kind, beta), opts in zip(KINDS, options):
        s, t = full_s[..., cols].clone().requires_grad_(), full_t[..., cols].clone().requires_grad_()
        n0 = len(seen.of("collective"))
        value = vocab_divergence(s, t, kind=kind, beta=beta, tp_group=group, chunk_size=2, **opts)
        jsd = kind == "jsd" and 0 < beta < 1
        want = [("all_gather", 4 * rows), ("all_gather", 2 * rows)] if jsd else [("all_gather", 5 * rows)]
        assert _collectives(seen, n0) == want, (kind, beta)
        torch.autograd.backward((value * g).sum())
        assert len(seen.of("collective")) == n0 + len(want), "backward enters none"
        ref, ref_s, ref_t, finite = reference(full_s.reshape(6, -1), full_t.reshape(6, -1), kind, beta,
                                              g.reshape(6), **{k: v.reshape(6) if isinstance(v, Tensor) else v
                                                               for k, v in opts.items()})
        assert s.grad is not None and t.grad is not None
        tau_min = float(tau.min()) if "temperature" in opts and isinstance(opts["temperature"], Tensor) else 0.8
        check(value.reshape(6), (s.grad.reshape(6, -1), t.grad.reshape(6, -1)),
              (ref, ref_s[:, cols], ref_t[:, cols], finite), torch.float32,
              value_atol(full_s, full_t, tau_min), 1.0 / tau_min)
        done += 1
    return done


def _invariant(rank: int, seen: _probe.Seen) -> int:
    """Invariant mode: TP 2's values and this shard's gradients are the single process's
    bits on the full logits (one all-gather of 5 statistics per local tile; jsd two)."""
    group, world = dist.group.WORLD, dist.get_world_size()
    full_s, full_t = _logits(world)
    full_s, full_t = full_s.to(torch.bfloat16), full_t.to(torch.bfloat16)
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    tau = 0.6 + torch.rand(LEAD, generator=torch.Generator().manual_seed(43))
    opts: dict[str, Any] = {"temperature": tau, "softcap": 20.0, "vocab_size": 250, "invariant": True}
    for kind, beta in KINDS[:3]:
        s, t = full_s[..., cols].clone().requires_grad_(), full_t[..., cols].clone().requires_grad_()
        n0 = len(seen.of("collective"))
        value = vocab_divergence(s, t, kind=kind, beta=beta, tp_group=group, **opts)
        value.sum().backward()  # type: ignore[no-untyped-call]
        assert len(seen.of("collective")) == n0 + (2 if kind == "jsd" else 1)
        one_s, one_t = full_s.clone().requires_grad_(), full_t.clone().requires_grad_()
        one = vocab_divergence(one_s, one_t, kind=kind, beta=beta, chunk_size=1, **opts)
        one.sum().backward()  # type: ignore[no-untyped-call]
        assert torch.equal(value, one), kind
        assert s.grad is not None and t.grad is not None and one_s.grad is not None and one_t.grad is not None
        assert torch.equal(s.grad, one_s.grad[..., cols]) and torch.equal(t.grad, one_t.grad[..., cols]), kind
    return 1


def _dtensor(rank: int) -> int:
    """A DTensor ``Shard(-1)`` pair over a 1-D mesh: the local pair's bits, the mesh's group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full_s, full_t = _logits(world)
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    s = distribute_tensor(full_s, mesh, [Shard(-1)], src_data_rank=None).requires_grad_(True)
    t = distribute_tensor(full_t, mesh, [Shard(-1)], src_data_rank=None)
    got = vocab_divergence(s, t, kind="jsd", beta=0.4)
    local = full_s[..., cols].clone().requires_grad_()
    want = vocab_divergence(local, full_t[..., cols], kind="jsd", beta=0.4, tp_group=dist.group.WORLD)
    assert type(got) is Tensor and torch.equal(got, want)
    torch.autograd.backward(got.sum())
    torch.autograd.backward(want.sum())
    assert s.grad is not None and local.grad is not None
    assert torch.equal(cast(DTensor, s.grad).to_local(), local.grad)
    return 1


def _worker(rank: int, world: int) -> int:
    with _probe.watch() as seen:
        return _cases(rank, seen) + _invariant(rank, seen) + _dtensor(rank)


def test_vocab_divergence_over_a_tp_group_of_2() -> None:
    assert run_distributed(_worker, 2, timeout=200) == [7, 7]
