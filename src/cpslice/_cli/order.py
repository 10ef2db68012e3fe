"""``cpslice plan``'s layouts of a token order: ``--order`` (the index itself, on the
command line or in a file) and ``--balancer`` (the index built for the given samples).

Each builds ``Layout.from_order``'s layout on rank 0; ``source`` says in the plan's
header where its order came from.
"""

import argparse
import json
import re
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

from .._layout.layout import Layout
from .._types import QkvFormat
from .balancers import BALANCERS, DEFAULT_BLOCK, Balancer, balancer_order

_INLINE = re.compile(r"[\d\s,;+-]*\d[\d\s,;+-]*")
_SHAPE = "one row of ints for thd (or for every bshd row), rows of equal length for bshd"


def _rows(rows: list[list[int]], what: str) -> Tensor:
    """``[N]`` for one row, ``[B, S]`` for several (of equal length)."""
    if len({len(r) for r in rows}) > 1:
        raise argparse.ArgumentTypeError(
            f"{what} has rows of {sorted({len(r) for r in rows})} entries ({_SHAPE})")
    return torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=torch.int64)


def _inline(text: str, what: str) -> Tensor:
    """``0,3,1,2`` (thd, or one bshd row for every row) or ``0,1;1,0`` (bshd rows)."""
    try:
        rows = [[int(v) for v in re.split(r"[\s,]+", row.strip())] for row in text.strip().split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{what} is not a list of ints separated by commas, ';' between bshd rows "
            "(e.g. 0,3,1,2)") from None
    return _rows(rows, what)


def _from_file(path: Path) -> Tensor:
    what = f"the order in {str(path)!r}"
    if path.suffix == ".pt":
        loaded: object = torch.load(path, weights_only=True)
        if not isinstance(loaded, Tensor) or loaded.is_floating_point() or loaded.is_complex() \
                or loaded.dtype == torch.bool:
            got = loaded.dtype if isinstance(loaded, Tensor) else type(loaded).__name__
            raise argparse.ArgumentTypeError(f"{what} is not an integer tensor (got {got})")
        return loaded.to(torch.int64)
    text = path.read_text()
    if not text.lstrip().startswith("["):
        return _inline(text, what)
    try:
        data: object = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{what} is not a JSON list of ints ({err})") from None
    rows = data if isinstance(data, list) and data and all(isinstance(r, list) for r in data) else [data]
    if not all(isinstance(r, list) and all(type(v) is int for v in r) for r in rows):
        raise argparse.ArgumentTypeError(f"{what} is not a JSON list of ints, nor a list of such lists")
    return _rows(cast(list[list[int]], rows), what)


def parse_order(text: str) -> Tensor:
    """``--order``: ints separated by commas (``;`` between bshd rows), or the path of a
    file holding the index: ``.pt`` (a tensor saved by ``torch.save``), else text (a
    JSON list, or a list of lists: ``index.tolist()``; or the inline form)."""
    if _INLINE.fullmatch(text):
        return _inline(text, repr(text))
    path = Path(text)
    try:
        return _from_file(path)
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither ints separated by commas (e.g. 0,3,1,2; ';' between bshd "
            f"rows) nor a file that can be read ({err.strerror or err})") from None


def add_order_arguments(parser: argparse.ArgumentParser) -> None:
    """``--order`` or ``--balancer`` (with ``--block-size`` and ``--seed``)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--order", type=parse_order, default=None, metavar="INDEX|FILE",
        help="a load balancer's token order (Layout.from_order): rank r holds positions "
        "order[r*T:(r+1)*T] of the packed stream of padded samples (thd), or of each row's "
        "columns (bshd); ints separated by commas, ';' between bshd rows, or a file (.pt "
        "from torch.save, or a JSON list)",
    )
    group.add_argument(
        "--balancer", choices=BALANCERS, default=None,
        help="build the order for these samples: torch's head-tail or per-document "
        "head-tail load balancer, a random permutation, or shuffled blocks of --block-size "
        "positions (PTRR-like); random and block seeded by --seed",
    )
    parser.add_argument(
        "--block-size", type=int, default=None, metavar="B",
        help=f"--balancer block: positions per block (default {DEFAULT_BLOCK}, torch's PTRR)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, metavar="S",
        help="--balancer random or block: the seed (default 0)",
    )


def check_order_arguments(args: argparse.Namespace) -> str | None:
    """Refuse options that do not go together; the ``LayoutError`` message for it, or
    None."""
    given = args.order is not None or args.balancer is not None
    if given and args.mode is not None:
        flag = "--order" if args.order is not None else "--balancer"
        return (f"{flag} places every position itself, so --mode is not taken with it; "
                "drop --mode (the plan says which closed form, if any, places alike)")
    if args.block_size is not None and args.balancer != "block":
        return "--block-size is for --balancer block"
    if args.block_size is not None and args.block_size < 1:
        return f"--block-size {args.block_size} < 1"
    if args.seed is not None and args.balancer not in ("random", "block"):
        return "--seed is for --balancer random or block"
    return None


_TORCH_CLASSES = {"head-tail": "_HeadTailLoadBalancer",
                  "per-document-head-tail": "_PerDocumentHeadTailLoadBalancer"}


def source(args: argparse.Namespace) -> str:
    """Where the order came from, for the plan's header."""
    if args.order is not None:
        return "--order"
    balancer = cast(Balancer, args.balancer)
    if balancer in _TORCH_CLASSES:
        return f"--balancer {balancer}: torch's {_TORCH_CLASSES[balancer]}"
    extra = f", --block-size {args.block_size or DEFAULT_BLOCK}" if balancer == "block" else ""
    return f"--balancer {balancer}{extra}, --seed {args.seed or 0}"


def order_layout(args: argparse.Namespace, base: Layout, local_length: int | None) -> tuple[Layout, Tensor]:
    """Rank 0's ``Layout.from_order`` of the samples of ``base`` (a layout without CP
    of the same samples and padding), and its order.

    Raises:
        LayoutError: the order is not one of these samples, or the balancer cannot cut them.
        TorchBalancerMissing: torch's balancer moved.
    """
    fmt: QkvFormat = base.qkv_format
    if args.order is not None:
        order = cast(Tensor, args.order)
    else:
        order = balancer_order(cast(Balancer, args.balancer), fmt, base.padded_lengths,
                               cast(int, args.cp_size), seed=args.seed or 0,
                               block=args.block_size or DEFAULT_BLOCK)
    layout = Layout.from_order(
        order, base.total_lengths, base.response_lengths, cp_rank=0, cp_size=cast(int, args.cp_size),
        qkv_format=fmt, max_seq_len=base.max_seq_len,
        padded_lengths=cast("tuple[int, ...] | None", args.padded_lengths),
        align=cast("int | None", args.align),
        row_offsets=cast("tuple[int, ...] | None", args.row_offsets),
        shared_prefix=base.shared_prefix,
    )
    return layout.with_local_length(local_length), order


def order_line(order: Tensor, limit: int) -> str | None:
    """The order as ``--order`` takes it, when it has at most ``limit`` entries."""
    if order.numel() > limit:
        return None
    rows: list[list[int]] = order.reshape(-1, order.shape[-1] if order.dim() else 1).tolist()
    return "order " + ";".join(",".join(str(v) for v in row) for row in rows)
