"""Sequence parallelism's way into the hidden-state head.

Under Megatron's ``--sequence-parallel`` the output layer receives each TP rank's
contiguous shard of the rows, ``[T / tp, H]`` (TP rank ``r`` holds rows ``[r T / tp,
(r + 1) T / tp)``), while the hidden-state head needs every row on every rank: each
rank holds a vocabulary shard of every row's logits. ``gather`` is that one step, in
the graph, as Megatron's ``gather_from_sequence_parallel_region``:

- forward, one ``all_gather`` of the shards into ``[T, H]``;
- backward, one ``reduce_scatter`` of the ``[T, H]`` gradient: it sums the TP ranks'
  parts of it (each its vocabulary shard's) and leaves each rank its own rows.

The head behind it must then not sum the hidden gradient itself
(``hidden.GatheredHead``): the reduce-scatter is the backward's one collective.
"""

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _probe

# the *_single names replace the deprecated *_tensor ones (torch >= 2.13)
_all_gather: Callable[..., object] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter: Callable[..., object] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Gather(torch.autograd.Function):
    """``[T / tp, H]`` shards in, ``[T, H]`` out (rank order): one all-gather forward, one
    reduce-scatter (a sum) backward, each a ``_probe`` collective event."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        local = shard.contiguous()
        out = local.new_empty((dist.get_world_size(group) * local.shape[0], local.shape[1]))
        if _probe.active is not None:
            _probe.active.collective("all_gather", local.numel())
        _all_gather(out, local, group=group)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        full = grad.contiguous()
        out = full.new_empty((full.shape[0] // dist.get_world_size(ctx.group), full.shape[1]))
        if _probe.active is not None:
            _probe.active.collective("reduce_scatter", full.numel())
        _reduce_scatter(out, full, group=ctx.group)
        return out, None


_apply = cast(Callable[[Tensor, dist.ProcessGroup], Tensor], _Gather.apply)


def gather(shard: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every TP rank's ``[T / tp, H]`` shard of ``group``, in rank order: ``[T, H]``,
    differentiable (its gradient reduce-scattered back to the shard). Every rank of
    ``group`` must enter it with shards of one length (Megatron pads the sequence to a
    multiple of the TP size), an empty one too, and run backward through it where the
    shard needs a gradient."""
    return _apply(shard, group)
