"""torch's own context-parallel load balancers, read by ``Layout.from_order``: where torch
keeps them (a private module, pinned here), the index of no balancer, and head-tail's
``[1, S]`` index of a batch of bshd rows."""

from typing import Any

import torch

from cpslice import Layout

from .balancers import CLASSES, load_balancers

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
