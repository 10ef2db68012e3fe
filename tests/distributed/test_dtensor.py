"""DTensor inputs (``cpslice._vocab.dtensor``) on real gloo worlds: logits sharded
``Shard(-1)`` and LM-head weights sharded ``Shard(0)`` over the TP mesh dimension, on a
1-D mesh of 2 and of 4, a 2-D ``("dp", "tp")`` mesh of 2 x 2, and the non-square 2-D
meshes of 1 x 2 and 2 x 1 with the vocabulary over either dimension (TP 2 first or
second, and TP 1 replicated over the other dimension's 2 ranks).

Every vocabulary function gives, for the DTensor, exactly what it gives for the local
shard with the mesh dimension's group as ``tp_group`` (values, and gradients to the
local shard, ``torch.equal``), and matches the float64 reference of the full logits;
the results are plain tensors. Every other placement is refused, naming the argument,
the placements and what to pass instead, on every rank before any collective. Each
world runs its checks in one task; its meshes are made once per rank process
(``_mesh``) and shared by every task after."""

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

import cpslice
from cpslice import Layout, LayoutError, Support

from ..support._dist import run_distributed, tp_groups
from ..support._docs import block_defining
from ..support.token_sets import Sets, csr
from ..support.transform_reference import distribution, entropy

_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...] | None], DeviceMesh] = {}
"""The meshes of this rank process, by shape and names: each made once
(``init_device_mesh`` is collective, and a mesh over part of the world makes gloo
groups, each costing its rank CPU while it idles); a mesh dimension over the whole
world uses the default group."""


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    """The mesh of ``shape``; a 2-D one named ``("dp", "tp")`` unless ``names`` says."""
    names = names or (("dp", "tp") if len(shape) == 2 else None)
    if (shape, names) not in _MESHES:
        _MESHES[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape, names]


# --- comparing a DTensor call with the plain one


def _weights(x: Tensor) -> Tensor:
    """Fixed upstream gradients for a result of ``x``'s shape (float64)."""
    return torch.cos(torch.arange(x.numel(), dtype=torch.float64) * 0.7 + 0.3).reshape(x.shape)


def _flat(out: object) -> list[Tensor]:
    if out is None:
        return []
    if isinstance(out, Tensor):
        return [out]
    assert isinstance(out, (tuple, list))
    return [t for o in out for t in _flat(o)]


def _run(call: Callable[..., object], inputs: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor | None]]:
    """The results of ``call`` on fresh leaves of ``inputs`` (plain tensors, each asserted),
    and the leaves' gradients of ``sum(weights * result)``."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = _flat(call(*leaves))
    assert all(type(o) is Tensor for o in out), [type(o) for o in out]
    terms = [(o.double() * _weights(o)).sum() for o in out if o.requires_grad]
    if terms:
        torch.autograd.backward(sum(terms[1:], terms[0]))
    return [o.detach() for o in out], [leaf.grad for leaf in leaves]


def _same(
    with_dtensor: Callable[..., object], plain: Callable[..., object], inputs: Sequence[Tensor]
) -> tuple[list[Tensor], list[Tensor | None]]:
    """``with_dtensor`` and ``plain`` on the same inputs give equal results and equal
    gradients, and leave the inputs as they were; the plain call's."""
    before = [x.clone() for x in inputs]
    got, want = _run(with_dtensor, inputs), _run(plain, inputs)
    assert len(got[0]) == len(want[0])
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert (a is None) == (b is None) and (a is None or b is None or torch.equal(a, b))
    assert all(torch.equal(x, b) for x, b in zip(inputs, before))
    return want


def _close(got: Tensor, want: Tensor, atol: float = 2e-5) -> None:
    torch.testing.assert_close(got.double(), want.double(), rtol=0.0, atol=atol)


def _refused(match: str, call: Callable[[], object]) -> None:
    with pytest.raises(LayoutError, match=match):
        call()


# --- the float64 reference


class _Reference:
    """The float64 log-probs of full ``[T, V]`` logits (or of ``hidden @ weight.T``)
    under the options, differentiable w.r.t. the float64 leaves."""

    def __init__(self, logits: Tensor | None, head: tuple[Tensor, Tensor] | None,
                 tau: float | Tensor, cap: float | None, vocab: int | None) -> None:
        if head is not None:
            self.hidden, self.weight = (x.detach().double().requires_grad_(True) for x in head)
            x = self.hidden @ self.weight.T
        else:
            assert logits is not None
            self.logits = logits.detach().double().requires_grad_(True)
            x = self.logits
        self.lp = distribution(x, tau, cap, vocab)

    def restricted(self, targets: Tensor, sets: Sets) -> Tensor:
        """Each row's target's log-prob under the softmax restricted to its set (and the
        target), the full one for an empty set."""
        rows = []
        for t, s in enumerate(sets):
            kept = self.lp[t, sorted(set(s) | {int(targets[t])})] if s else self.lp[t]
            rows.append(self.lp[t, targets[t]] - torch.logsumexp(kept, 0))
        return torch.stack(rows) if rows else self.lp[:0, 0]

    def grads(self, *outs: Tensor) -> list[Tensor]:
        """The leaves' gradients of ``sum(weights * out)`` over ``outs``."""
        leaves = [self.hidden, self.weight] if hasattr(self, "hidden") else [self.logits]
        loss = sum(((o * _weights(o)).sum() for o in outs), torch.zeros((), dtype=torch.float64))
        return list(torch.autograd.grad(loss, leaves))


def _rep(x: Tensor, mesh: DeviceMesh) -> DTensor:
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim)


# --- the logits path


def _logits_family(mesh: DeviceMesh, placements: list[Placement], group: Any, tp: int, tp_rank: int,
                   v_local: int = 4) -> int:
    """Each logits function with a DTensor ``placements`` on ``mesh`` against the local
    shard with ``group``, and against the reference. The number of functions checked."""
    t, cap = 6, 4.0
    vocab = tp * v_local - 1  # the last id padded
    gen = torch.Generator().manual_seed(17)
    full = torch.randn(t, tp * v_local, generator=gen) * 3
    targets = torch.randint(0, vocab, (t,), generator=gen)
    tau = 0.6 + torch.rand(t, generator=gen)
    sets: Sets = [[0, 3], [], [vocab - 1, 1, 2], [], [4 % vocab], list(range(min(vocab, 5)))]
    ids, offsets = csr(sets).ids, csr(sets).offsets
    local = full[:, tp_rank * v_local : (tp_rank + 1) * v_local]
    cols = slice(tp_rank * v_local, (tp_rank + 1) * v_local)
    keys: dict[str, Any] = {"softcap": cap, "vocab_size": vocab}

    def dt(x: Tensor) -> DTensor:
        return DTensor.from_local(x, mesh, placements)

    # the main function: per-row temperatures, a support, softcap, vocab_size, the entropy;
    # targets, temperatures and the support's tensors as replicated DTensors
    outs, (grad,) = _same(
        lambda x: cpslice.log_probs_and_entropy(
            dt(x), _rep(targets, mesh), with_entropy=True, temperature=_rep(tau, mesh),
            support=Support(_rep(ids, mesh), _rep(offsets, mesh)), **keys),
        lambda x: cpslice.log_probs_and_entropy(
            x, targets, with_entropy=True, temperature=tau, support=csr(sets), tp_group=group, **keys),
        [local],
    )
    ref = _Reference(full, None, tau, cap, vocab)
    ref_lp, ref_h = ref.restricted(targets, sets), entropy(ref.lp)
    _close(outs[0], ref_lp)
    _close(outs[1], ref_h)
    assert grad is not None
    _close(grad, ref.grads(ref_lp, ref_h)[0][:, cols])

    ks = torch.randint(0, vocab, (t, 3), generator=gen)
    outs, (grad,) = _same(lambda x: cpslice.log_probs_at(dt(x), ks, temperature=0.8, **keys),
                          lambda x: cpslice.log_probs_at(x, ks, temperature=0.8, tp_group=group, **keys), [local])
    ref = _Reference(full, None, 0.8, cap, vocab)
    want = ref.lp.gather(1, ks)
    _close(outs[0], want)
    assert grad is not None
    _close(grad, ref.grads(want)[0][:, cols])

    outs, _ = _same(lambda x: cpslice.topk_log_probs(dt(x), 3, **keys),
                    lambda x: cpslice.topk_log_probs(x, 3, tp_group=group, **keys), [local])
    best = torch.topk(_Reference(full, None, 1.0, cap, vocab).lp, 3)
    _close(outs[0], best.values)
    assert torch.equal(outs[1], best.indices)
    return 3


def _hidden_family(mesh: DeviceMesh, placements: list[Placement], group: Any, tp: int, tp_rank: int,
                   v_local: int = 3) -> int:
    """Each ``*_from_hidden`` function with a DTensor weight ``placements`` on ``mesh``
    (the hidden states plain and replicated) against the local shard with ``group``."""
    t, h = 5, 4
    vocab = tp * v_local - 1
    gen = torch.Generator().manual_seed(23)
    hidden, weight = torch.randn(t, h, generator=gen), torch.randn(tp * v_local, h, generator=gen)
    targets = torch.randint(0, vocab, (t,), generator=gen)
    sets: Sets = [[1, 0], [], [vocab - 1], [2, 3, 0], []]
    shard = weight[tp_rank * v_local : (tp_rank + 1) * v_local]
    rows = slice(tp_rank * v_local, (tp_rank + 1) * v_local)
    keys: dict[str, Any] = {"softcap": 3.0, "vocab_size": vocab, "temperature": 0.7}

    def dt(w: Tensor) -> DTensor:
        return DTensor.from_local(w, mesh, placements)

    outs, (g_h, g_w) = _same(
        lambda x, w: cpslice.log_probs_and_entropy_from_hidden(
            _rep(x, mesh), dt(w), targets, with_entropy=True, support=csr(sets), **keys),
        lambda x, w: cpslice.log_probs_and_entropy_from_hidden(
            x, w, targets, with_entropy=True, support=csr(sets), tp_group=group, **keys),
        [hidden, shard],
    )
    ref = _Reference(None, (hidden, weight), 0.7, 3.0, vocab)
    ref_lp, ref_h = ref.restricted(targets, sets), entropy(ref.lp)
    _close(outs[0], ref_lp)
    _close(outs[1], ref_h)
    want_h, want_w = ref.grads(ref_lp, ref_h)
    assert g_h is not None and g_w is not None
    _close(g_h, want_h, 1e-4)  # the full hidden gradient, summed over the TP group
    _close(g_w, want_w[rows], 1e-4)

    ks = torch.randint(0, vocab, (t, 2), generator=gen)
    outs, _ = _same(lambda x, w: cpslice.log_probs_at_from_hidden(x, dt(w), ks, **keys),
                    lambda x, w: cpslice.log_probs_at_from_hidden(x, w, ks, tp_group=group, **keys),
                    [hidden, shard])
    _close(outs[0], ref.lp.gather(1, ks))
    outs, _ = _same(lambda x, w: cpslice.topk_log_probs_from_hidden(x, dt(w), 2, **keys),
                    lambda x, w: cpslice.topk_log_probs_from_hidden(x, w, 2, tp_group=group, **keys),
                    [hidden, shard])
    _close(outs[0], torch.topk(ref.lp, 2).values)
    return 3


# --- the per-sample functions

TOTAL, RESPONSE = [7, 5], [3, 2]


def _response_rows() -> tuple[list[int], list[slice]]:
    """The rows (of the no-CP thd layout of TOTAL, RESPONSE) whose logits predict the
    response tokens, and each sample's response tokens."""
    rows, tokens, start = [], [], 0
    for total, response in zip(TOTAL, RESPONSE):
        rows += list(range(start + total - response - 1, start + total - 1))
        tokens.append(slice(total - response, total))
        start += total
    return rows, tokens


def _response_family(mesh: DeviceMesh, placements: list[Placement], group: Any, tp: int, tp_rank: int) -> int:
    """The per-sample functions, from DTensor logits and weights, against the plain calls
    and the reference (per-sample temperatures, softcap, vocab_size; the tokens and the
    teacher's tensors as replicated DTensors)."""
    v_local, h, k = 4, 3, 2
    vocab = tp * v_local - 1
    layout = Layout(TOTAL, RESPONSE)
    gen = torch.Generator().manual_seed(31)
    tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in TOTAL]
    hidden, weight = torch.randn(sum(TOTAL), h, generator=gen), torch.randn(tp * v_local, h, generator=gen)
    full = hidden @ weight.T
    cols = slice(tp_rank * v_local, (tp_rank + 1) * v_local)
    local, shard = full[:, cols].contiguous(), weight[cols]
    t_ids = [torch.randint(0, vocab, (r, k), generator=gen) for r in RESPONSE]
    t_lp = [torch.log_softmax(torch.randn(r, k + 3, generator=gen), -1)[:, :k] for r in RESPONSE]
    keys: dict[str, Any] = {"temperature": [0.7, 1.3], "softcap": 5.0, "vocab_size": vocab}
    rows, spans = _response_rows()
    tau = torch.tensor([0.7] * RESPONSE[0] + [1.3] * RESPONSE[1], dtype=torch.float64)
    z = distribution(full.double()[rows], tau, 5.0, vocab)
    want_lp = z.gather(1, torch.cat([tok[s] for tok, s in zip(tokens, spans)])[:, None])[:, 0]
    rep_tokens = [_rep(x, mesh) for x in tokens]

    def dt(x: Tensor, dim: int) -> DTensor:
        return DTensor.from_local(x, mesh, [Shard(dim) if isinstance(p, Shard) else p for p in placements])

    outs, _ = _same(lambda x: cpslice.response_log_probs(dt(x, 1), rep_tokens, layout, with_entropy=True, **keys),
                    lambda x: cpslice.response_log_probs(x, tokens, layout, with_entropy=True, tp_group=group, **keys),
                    [local])
    _close(torch.cat(outs[: len(TOTAL)]), want_lp)
    _close(torch.cat(outs[len(TOTAL):]), entropy(z))
    outs, _ = _same(
        lambda x, w: cpslice.response_log_probs_from_hidden(x, dt(w, 0), tokens, layout, **keys),
        lambda x, w: cpslice.response_log_probs_from_hidden(x, w, tokens, layout, tp_group=group, **keys),
        [hidden, shard])
    _close(torch.cat(outs), want_lp, 1e-4)

    student = z.gather(1, torch.cat(t_ids))
    want_div = cpslice.topk_divergence(student, torch.cat(t_lp).double())
    rep_lp, rep_ids = [_rep(x, mesh) for x in t_lp], [_rep(x, mesh) for x in t_ids]
    outs, _ = _same(lambda x: cpslice.response_distillation(dt(x, 1), rep_lp, rep_ids, layout, **keys),
                    lambda x: cpslice.response_distillation(x, t_lp, t_ids, layout, tp_group=group, **keys),
                    [local])
    _close(torch.cat(outs), want_div, 1e-4)
    outs, _ = _same(
        lambda x, w: cpslice.response_distillation_from_hidden(x, dt(w, 0), t_lp, t_ids, layout, **keys),
        lambda x, w: cpslice.response_distillation_from_hidden(x, w, t_lp, t_ids, layout, tp_group=group, **keys),
        [hidden, shard])
    _close(torch.cat(outs), want_div, 1e-4)

    best = torch.topk(z, k)
    outs, _ = _same(lambda x: cpslice.response_topk_log_probs(dt(x, 1), k, layout, **keys),
                    lambda x: cpslice.response_topk_log_probs(x, k, layout, tp_group=group, **keys), [local])
    _close(torch.cat(outs[: len(TOTAL)]), best.values)
    assert torch.equal(torch.cat(outs[len(TOTAL):]), best.indices)
    outs, _ = _same(
        lambda x, w: cpslice.response_topk_log_probs_from_hidden(x, dt(w, 0), k, layout, **keys),
        lambda x, w: cpslice.response_topk_log_probs_from_hidden(x, w, k, layout, tp_group=group, **keys),
        [hidden, shard])
    _close(torch.cat(outs[: len(TOTAL)]), best.values, 1e-4)
    return 6


# --- what is refused


def _refusals_1d(mesh: DeviceMesh, rank: int, world: int) -> int:
    """Every placement but the vocabulary's ``Shard`` on a 1-D mesh, and replicated
    arguments that are not: refused on every rank, before any collective."""
    t, v_local = 3, 4
    local = torch.randn(t, v_local)
    targets = torch.zeros(t, dtype=torch.int64)
    hidden, weight = torch.randn(t, 2), torch.randn(v_local, 2)
    checks: list[tuple[str, Callable[[], object]]] = [
        (r"logits is a DTensor with placements \(Shard\(dim=0\),\) on a mesh of shape \(\d,\); cpslice "
         r"takes logits with its vocabulary \(the last dimension, Shard\(-1\)\) sharded .* pass "
         r"logits\.to_local\(\) without tp_group",
         lambda: cpslice.log_probs_and_entropy(DTensor.from_local(local, mesh, [Shard(0)]), targets.repeat(world))),
        (r"placements \(Partial\(sum\),\).*a Partial logits is a sum still to be reduced",
         lambda: cpslice.topk_log_probs(DTensor.from_local(local, mesh, [Partial()]), 2)),
        (r"placements \(Replicate\(\),\).*every rank holds the whole vocabulary",
         lambda: cpslice.log_probs_at(_rep(local, mesh), targets[:, None])),
        (rf"vocabulary of {world * v_local - 1} ids is split unevenly over the {world} ranks of mesh "
         rf"dimension 0 \({v_local - (rank == world - 1)} here\).*pass vocab_size={world * v_local - 1}",
         lambda: cpslice.log_probs_and_entropy(DTensor.from_local(
             local[:, : v_local - (rank == world - 1)], mesh, [Shard(1)],
             shape=torch.Size([t, world * v_local - 1]), stride=(world * v_local - 1, 1)), targets)),
        (rf"vocabulary of {world + 1} ids is split unevenly",  # torch.chunk's shards: 2, 1, ...
         lambda: cpslice.log_probs_and_entropy(distribute_tensor(
             torch.randn(t, world + 1), mesh, [Shard(1)], src_data_rank=None), targets)),
        (r"weight is a DTensor with placements \(Shard\(dim=1\),\).*redistribute it to Shard\(0\)",
         lambda: cpslice.log_probs_and_entropy_from_hidden(
             hidden, DTensor.from_local(weight[:, :1], mesh, [Shard(1)]), targets)),
        (r"hidden is a DTensor with placements \(Shard\(dim=0\),\).*cpslice reads hidden whole on every "
         r"rank.*hidden\.full_tensor\(\) gathers sequence-parallel hidden states",
         lambda: cpslice.topk_log_probs_from_hidden(DTensor.from_local(hidden, mesh, [Shard(0)]), weight, 1)),
        (r"targets is a DTensor with placements \(Shard\(dim=0\),\).*its full_tensor\(\) gathers it",
         lambda: cpslice.log_probs_and_entropy(local, DTensor.from_local(targets, mesh, [Shard(0)]))),
        (r"Support ids is a DTensor with placements \(Shard\(dim=0\),\)",
         lambda: Support(DTensor.from_local(targets[:0], mesh, [Shard(0)]), torch.zeros(t + 1, dtype=torch.int64))),
        (r"sample 1: tokens\[1\] is a DTensor with placements \(Shard\(dim=0\),\)",
         lambda: cpslice.response_log_probs(
             torch.randn(12, v_local), [torch.zeros(7, dtype=torch.int64),
                                        DTensor.from_local(targets[:1], mesh, [Shard(0)])], Layout(TOTAL, RESPONSE))),
        (r"temperature is a DTensor with placements \(Shard\(dim=0\),\)",
         lambda: cpslice.log_probs_at(local, targets[:, None], temperature=DTensor.from_local(
             torch.ones(1), mesh, [Shard(0)]))),
    ]
    for match, call in checks:
        _refused(match, call)
    # a [B, S, V] DTensor: its rows, the results [B, S], its local shard's gradient the plain call's
    def three(x: Tensor) -> DTensor:
        return DTensor.from_local(x.reshape(1, t, v_local), mesh, [Shard(2)])

    def plain(x: Tensor) -> list[Tensor]:
        lp, h = cpslice.log_probs_and_entropy(x, targets, with_entropy=True, tp_group=mesh.get_group(0))
        return [lp[None], h[None], cpslice.entropy(x, tp_group=mesh.get_group(0))[None]]

    _same(lambda x: [*cpslice.log_probs_and_entropy(three(x), targets[None], with_entropy=True),
                     cpslice.entropy(three(x))], plain, [local])
    return len(checks) + 1


def _leaf_dtensor(mesh: DeviceMesh, tp_rank: int) -> None:
    """A DTensor leaf gets its gradient as a DTensor of its placements, whose local shard
    is the plain call's gradient."""
    full = torch.randn(4, 2 * mesh.size(), generator=torch.Generator().manual_seed(5))
    targets = torch.tensor([0, 3, 1, 2])
    leaf = distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None).requires_grad_(True)
    torch.autograd.backward(cpslice.log_probs_and_entropy(leaf, targets)[0].sum())
    local = full[:, 2 * tp_rank : 2 * tp_rank + 2].clone().requires_grad_(True)
    torch.autograd.backward(cpslice.log_probs_and_entropy(local, targets, tp_group=mesh.get_group(0))[0].sum())
    assert isinstance(leaf.grad, DTensor) and leaf.grad.placements == (Shard(1),)
    assert local.grad is not None and torch.equal(leaf.grad.to_local(), local.grad)


def _recipe(mesh: DeviceMesh, tp_rank: int) -> None:
    """docs/recipes.md's DTensor function, as written there, on this mesh."""
    fn = block_defining("docs/recipes.md", "policy_log_probs")["policy_log_probs"]
    layout = Layout(TOTAL, RESPONSE)
    tokens = [torch.arange(n) % 5 for n in TOTAL]
    full = torch.randn(sum(TOTAL), 3 * mesh.size(), generator=torch.Generator().manual_seed(8))
    local = full[:, 3 * tp_rank : 3 * tp_rank + 3]
    lp, entropy_ = fn(DTensor.from_local(local, mesh, [Shard(-1)]), tokens, layout)
    want = cpslice.response_log_probs(local, tokens, layout, with_entropy=True, tp_group=mesh.get_group(0))
    assert all(torch.equal(a, b) for a, b in zip([*lp, *entropy_], [*want[0], *want[1]]))


def _non_square(rank: int) -> int:
    """The vocabulary sharded over either dimension of a (1, 2) and a (2, 1) mesh of the
    world of 2: TP 2 on the second dimension (dp = 1 first) and on the first (dp = 1
    second), and TP 1 on either, replicated over the other dimension's 2 ranks. The
    shard count is the size of the dimension that shards the vocabulary, whichever it
    is. The number of checks."""
    wide, tall = _mesh((1, 2)), _mesh((2, 1), ("tp", "dp"))
    done = 0
    for mesh, tp_dim in ((wide, 1), (tall, 0), (wide, 0), (tall, 1)):
        tp, tp_rank, group = mesh.size(tp_dim), mesh.get_local_rank(tp_dim), mesh.get_group(tp_dim)
        placements: list[Placement] = [Replicate(), Replicate()]
        placements[tp_dim] = Shard(1)
        done += _logits_family(mesh, placements, group, tp, tp_rank, v_local=8 // tp)
        placements[tp_dim] = Shard(0)
        done += _hidden_family(mesh, placements, group, tp, tp_rank, v_local=6 // tp)
    # a true uneven split over the second dimension: its size and index named
    t, local = 2, torch.randn(2, 4)
    _refused(rf"vocabulary of 7 ids is split unevenly over the 2 ranks of mesh dimension 1 \({4 - rank} here\)",
             lambda: cpslice.log_probs_and_entropy(DTensor.from_local(
                 local[:, : 4 - rank], wide, [Replicate(), Shard(1)], shape=torch.Size([t, 7]), stride=(7, 1)),
                 torch.zeros(t, dtype=torch.int64)))
    return done + 1


def _world_of_2(rank: int, world: int) -> list[int]:
    mesh = _mesh((world,))
    group = mesh.get_group(0)
    assert group is dist.group.WORLD  # a 1-D mesh over the world: the default group
    done = [
        _logits_family(mesh, [Shard(1)], group, world, rank),
        _hidden_family(mesh, [Shard(0)], group, world, rank),
        _response_family(mesh, [Shard(1)], group, world, rank),
        _refusals_1d(mesh, rank, world),
        _non_square(rank),
    ]
    _leaf_dtensor(mesh, rank)
    _recipe(mesh, rank)
    return done


def test_dtensors_on_a_mesh_of_2() -> None:
    results = run_distributed(_world_of_2, 2, timeout=200)
    assert results == [[3, 3, 6, 12, 25]] * 2


# --- a world of 4: a 1-D mesh, and the TP dimension of a 2-D one


def _refusals_2d(mesh: DeviceMesh, rank: int) -> int:
    """On a 2-D mesh: a non-TP dimension not ``Replicate``, ``Partial`` on it, another
    ``tp_group`` than the TP dimension's, a weight sharded on its hidden dimension."""
    local, targets = torch.randn(2, 3), torch.zeros(2, dtype=torch.int64)
    pair = [2 * (rank // 2), 2 * (rank // 2) + 1]
    checks: list[tuple[str, Callable[[], object]]] = [
        (r"placements \(Shard\(dim=0\), Shard\(dim=1\)\) on a mesh of shape \(dp=2, tp=2\).*mesh dimensions "
         r"\[0, 1\] are not Replicate",
         lambda: cpslice.log_probs_and_entropy(DTensor.from_local(local, mesh, [Shard(0), Shard(1)]),
                                               targets.repeat(2))),
        (r"placements \(Partial\(sum\), Shard\(dim=1\)\).*a Partial logits",
         lambda: cpslice.log_probs_at(DTensor.from_local(local, mesh, [Partial(), Shard(1)]), targets[:, None])),
        (rf"tp_group \(ranks \[0, 1, 2, 3\]\) is not the group of the TP mesh dimension 'tp' of logits "
         rf"\(ranks \[{pair[0]}, {pair[1]}\]\); leave tp_group unset",
         lambda: cpslice.log_probs_and_entropy(DTensor.from_local(local, mesh, [Replicate(), Shard(1)]), targets,
                                               tp_group=dist.group.WORLD)),
        (r"weight is a DTensor with placements \(Replicate\(\), Shard\(dim=1\)\)",
         lambda: cpslice.log_probs_at_from_hidden(torch.randn(2, 2), DTensor.from_local(
             torch.randn(3, 1), mesh, [Replicate(), Shard(1)]), targets[:, None])),
    ]
    for match, call in checks:
        _refused(match, call)
    return len(checks)


def _world_of_4(rank: int, world: int) -> list[int]:
    line, square = _mesh((world,)), _mesh((2, 2))
    dp, tp = square.get_group("dp"), square.get_group("tp")
    (_, _, _), (pairs, _, pair_rank) = tp_groups(rank, world)
    done = [
        _logits_family(line, [Shard(1)], dist.group.WORLD, world, rank),
        # the vocabulary over "tp", replicated over "dp": the tp pair's shards
        _logits_family(square, [Replicate(), Shard(1)], tp, 2, square.get_local_rank("tp")),
        _hidden_family(square, [Replicate(), Shard(0)], tp, 2, square.get_local_rank("tp")),
        # over "dp" instead: the dimension that shards the vocabulary is the TP one
        _logits_family(square, [Shard(1), Replicate()], dp, 2, square.get_local_rank("dp")),
        _refusals_2d(square, rank),
    ]
    # tp_group given: the mesh dimension's own group, or one over the same ranks in order
    tp_rank = square.get_local_rank("tp")
    local = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))[:, 2 * tp_rank : 2 * tp_rank + 2]
    targets = torch.tensor([0, 3, 2])
    want = cpslice.log_probs_and_entropy(local, targets, tp_group=tp)[0]
    for given in (tp, pairs):
        got = cpslice.log_probs_and_entropy(DTensor.from_local(local, square, [Replicate(), Shard(1)]),
                                            targets, tp_group=given)[0]
        assert torch.equal(got, want)
    assert pair_rank == tp_rank
    return done


def test_dtensors_on_meshes_of_4() -> None:
    results = run_distributed(_world_of_4, 4, timeout=200)
    assert results == [[3, 3, 3, 3, 4]] * 4


def test_what_is_no_dtensor_passes_through() -> None:
    """Without a mesh: a plain tensor, or anything else, is returned as given."""
    from cpslice._vocab import dtensor

    assert not dtensor.is_dtensor(torch.zeros(1)) and not dtensor.is_dtensor(object())
    assert dtensor.replicated("x", 3) == 3
    assert dtensor.vocab_shard("logits", torch.zeros(1, 1), -1, None)[1] is None
