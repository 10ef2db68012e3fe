"""Token orders (a load balancer's rearrange index) for ``cpslice plan --balancer`` and
``cpslice verify``'s order layouts.

An order is the index ``Layout.from_order`` takes: thd ``[N]`` over the packed stream of
padded samples, bshd ``[B, S]``, each row a permutation of its columns. Built here: a
seeded random permutation, a seeded shuffle of fixed-size blocks (what torch's PTRR
balancer does with its 128-token blocks, without its scheduling), and the index of
torch's own head-tail and per-document head-tail load balancers. Those live in a
private torch module; where it moved, ``TorchBalancerMissing`` says so in one line.

Nothing here reads a layout: the orders are inputs, which the verifier's oracle reads on
its own. torch is imported, its private module only when a torch balancer is asked for.
"""

import importlib
from collections.abc import Sequence
from typing import Literal, cast, get_args

import torch
from torch import Tensor

from .._errors import LayoutError
from .._types import QkvFormat

Balancer = Literal["head-tail", "per-document-head-tail", "random", "block"]
BALANCERS: tuple[Balancer, ...] = get_args(Balancer)
DEFAULT_BLOCK = 128
"""torch's PTRR balancer moves blocks of 128 tokens (flex attention's block size)."""
TORCH_BALANCERS = "torch.distributed.tensor.experimental._context_parallel._load_balancer"
"""Where torch 2.13 keeps its load balancers: a private module, which may move."""

_I64 = torch.int64


class TorchBalancerMissing(ImportError):
    """torch's load balancer is not where this cpslice looks for it."""


def random_order(n: int, seed: int, rows: int = 1) -> Tensor:
    """``[rows, n]`` int64: each row a random permutation of ``range(n)``, seeded."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(rows, n, generator=gen).argsort(1)


def block_order(n: int, block: int, seed: int, rows: int = 1) -> Tensor:
    """``[rows, n]`` int64: ``range(n)`` cut into blocks of ``block`` positions (the last
    one shorter when ``block`` does not divide ``n``), the blocks of each row shuffled,
    seeded; each block's positions stay in order."""
    if block < 1:
        raise LayoutError(f"block size {block} < 1")
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-n // block)
    starts = torch.rand(rows, blocks, generator=gen).argsort(1) * block
    positions = (starts[:, :, None] + torch.arange(block, dtype=_I64)).reshape(rows, blocks * block)
    return positions[positions < n].view(rows, n)


def _torch_balancer(name: str) -> type:
    """torch's load balancer class ``name``, or a ``TorchBalancerMissing`` saying where
    it was looked for."""
    try:
        module = importlib.import_module(TORCH_BALANCERS)
        found = getattr(module, name)
    except (ImportError, AttributeError) as err:
        raise TorchBalancerMissing(
            f"torch {torch.__version__} has no {name} in {TORCH_BALANCERS} ({err}): torch's "
            "load balancers live in a private module, which moved; pass the index itself "
            "(Layout.from_order, cpslice plan --order)"
        ) from None
    return cast(type, found)


def head_tail_order(n: int, size: int) -> Tensor:
    """``[1, n]``: torch's ``_HeadTailLoadBalancer`` index of ``n`` positions over
    ``size`` ranks (chunks ``r`` and ``2 * size - 1 - r`` of the whole sequence on rank
    ``r``).

    Raises:
        LayoutError: ``2 * size`` does not divide ``n``.
        TorchBalancerMissing: torch's balancer moved.
    """
    if n % (2 * size):
        raise LayoutError(
            f"torch's head-tail balancer cuts the {n} positions into 2 * cp_size = "
            f"{2 * size} chunks, and {2 * size} does not divide {n}; pad the samples")
    balancer = _torch_balancer("_HeadTailLoadBalancer")(n, size, "cpu")
    return torch.as_tensor(balancer._generate_indices()).to(_I64).view(1, n)


def per_document_head_tail_order(widths: Sequence[int], size: int) -> Tensor:
    """``[1, N]``: torch's ``_PerDocumentHeadTailLoadBalancer`` index of the documents
    (samples) of ``widths`` positions over ``size`` ranks: document after document,
    for each rank its chunks ``r`` and ``2 * size - 1 - r`` of that document.

    Raises:
        LayoutError: ``2 * size`` does not divide a width.
        TorchBalancerMissing: torch's balancer moved.
    """
    for i, w in enumerate(widths):
        if w % (2 * size):
            raise LayoutError(
                f"torch's per-document head-tail balancer cuts every sample into 2 * cp_size = "
                f"{2 * size} chunks, but sample {i} has {w} positions; pad the samples to a "
                f"multiple (align={2 * size})")
    balancer = _torch_balancer("_PerDocumentHeadTailLoadBalancer")([list(widths)], size, "cpu")
    return torch.as_tensor(balancer._generate_indices()).to(_I64).view(1, -1)


def balancer_order(
    balancer: Balancer, fmt: QkvFormat, widths: Sequence[int], size: int, *, seed: int = 0,
    block: int = DEFAULT_BLOCK,
) -> Tensor:
    """The order ``balancer`` gives the samples of extents ``widths`` (a layout's
    ``padded_lengths``) over ``size`` ranks: thd ``[1, N]`` over the packed stream, bshd
    ``[B, S]`` (head-tail: ``[S]``, every row alike; random and block: each row its own).

    Raises:
        LayoutError: the balancer cannot cut these samples (the message says why), or
            per-document head-tail of bshd rows (each row is one document: head-tail).
        TorchBalancerMissing: torch's balancer moved.
    """
    thd = fmt == "thd"
    n = sum(widths) if thd else (widths[0] if widths else 0)
    rows = 1 if thd else len(widths)
    if balancer == "head-tail":
        return head_tail_order(n, size) if thd else head_tail_order(n, size)[0]
    if balancer == "per-document-head-tail":
        if not thd:
            raise LayoutError("per-document head-tail balances the documents packed in a thd "
                              "stream; a bshd row is one document: use head-tail")
        return per_document_head_tail_order(widths, size)
    if balancer == "random":
        return random_order(n, seed, rows)
    return block_order(n, block, seed, rows)
