"""This rank's piece of the vocabulary (``Shard``) and how a call finds it (``shard_of``)."""

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor


class Shard(NamedTuple):
    """This rank's piece of the vocabulary: global ids ``[offset, offset + size)`` of
    ``[0, size * world)`` (all shards of equal size), the TP group (None: no TP), and
    ``vocab``, the ids of the distribution: a padded vocabulary's rows ``>= vocab``
    (megatron pads the LM head to a multiple of ``make_vocab_size_divisible_by * tp``)
    are outside it, so this shard's first ``valid`` columns are its part of it."""

    rank: int
    world: int
    size: int
    group: dist.ProcessGroup | None
    vocab: int

    @property
    def offset(self) -> int:
        return self.rank * self.size

    @property
    def total(self) -> int:
        """The full vocabulary, all shards, padding included."""
        return self.world * self.size

    @property
    def valid(self) -> int:
        """This shard's columns inside the distribution (a prefix; 0 for a shard of padded
        ids only)."""
        return min(self.size, max(0, self.vocab - self.offset))

    def columns(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """For global ``ids`` (any shape): their column in this shard (0 where it does not
        hold them) and whether it holds them (among its valid columns)."""
        local = ids - self.offset
        held = (local >= 0) & (local < self.valid)
        return torch.where(held, local, 0), held


def shard_of(tp_group: dist.ProcessGroup | None, size: int, vocab: int | None = None) -> Shard:
    """The ``Shard`` of ``size`` columns this rank holds of ``tp_group``'s vocabulary, of
    which the distribution's ids are ``[0, vocab)`` (None: all of them)."""
    rank, world = (0, 1) if tp_group is None else (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    return Shard(rank, world, size, tp_group, world * size if vocab is None else vocab)
