"""``cpslice verify``'s arguments: parsed and checked here, then handed to the
verifier (``cpslice._verify``) as one ``Config``. A combination that names no
runnable check is a one-line usage error (exit 2). The verifier's runner (processes,
torch.distributed) is imported only when verify runs."""

import argparse
import sys
from collections.abc import Callable
from typing import cast

from .._verify.cases import (
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TIMEOUT,
    TOLERANCE,
    Config,
    VerifyArgumentError,
    check_sizes,
    select_cases,
)
from .args import EXIT_FAILURE, EXIT_USAGE, Subcommand, one_line


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int >= {minimum}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "A layout passes when its log-probs, entropy and logits' gradient are each within "
        f"{TOLERANCE:g} (absolute) of float64 torch.log_softmax on every rank. A rank that "
        "raises or dies, or ranks that make no progress for --timeout, fail the layout "
        "they were in (the table says why) and stop the run: the layouts after it are "
        "not run. Exit status: 0 when every layout passes; 1 when one fails, or a rank "
        "raises, dies, does not start within --startup-timeout or makes no progress for "
        "--timeout, or megatron-core is not installed; 2 on bad arguments; 130 on Ctrl-C."
    )
    parser.add_argument(
        "--cp-size", type=_count(1), default=2, metavar="N",
        help="context-parallel size (default 2)",
    )
    parser.add_argument(
        "--tp-size", type=_count(1), default=2, metavar="M",
        help="tensor-parallel size: the vocabulary is split over M ranks (default 2); "
        "N x M processes are spawned",
    )
    parser.add_argument(
        "--mode", choices=("zigzag", "allgather", "none", "order", "all"), default="all",
        help="layouts to check (default all: zigzag and allgather with --cp-size > 1, "
        "none and allgather at --cp-size 1; all adds a thd layout of shared prefixes "
        "(shared_prefix=: stars), thd layouts of samples with their "
        "own padded widths, from Layout.from_cu_seqlens, bshd rows left-padded as Hugging "
        "Face trainers hold them, with --cp-size > 1 none bshd on every CP rank, rows "
        "of odd length, and the order layouts). none is the layout without context "
        "parallelism, so it needs --cp-size 1; zigzag needs --cp-size 2 or more; order is "
        "Layout.from_order of a random permutation, of shuffled blocks and of torch's "
        "per-document head-tail balancer",
    )
    parser.add_argument(
        "--format", choices=("thd", "bshd"), default=None,
        help="qkv format to check (default: every format the mode has; allgather is thd only)",
    )
    parser.add_argument(
        "--align", type=_count(1), default=None, metavar="N",
        help="also check every thd layout with each sample padded to a multiple of N "
        "(verl, Megatron-Bridge: tp * cp * 2); under zigzag a multiple of 2 * --cp-size "
        "(default: one extra layout, allgather thd with align 4 * --cp-size)",
    )
    parser.add_argument(
        "--samples", type=_count(1), default=16, metavar="K",
        help="random samples per layout, edge cases first (default 16)",
    )
    parser.add_argument(
        "--seed", type=_count(0), default=0, metavar="S", help="random seed (default 0)"
    )
    parser.add_argument(
        "--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="SEC",
        help=f"once the ranks have started, fail as a hang (and kill them) when none "
        f"finishes a layout for SEC seconds (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--startup-timeout", type=_seconds, default=DEFAULT_STARTUP_TIMEOUT, metavar="SEC",
        help="fail when the ranks have not all spawned, imported megatron-core and joined "
        f"the group within SEC seconds (default {DEFAULT_STARTUP_TIMEOUT:g})",
    )
    parser.add_argument(
        "--compile", action="store_true",
        help="run the log-prob kernels compiled by torch.compile on every rank "
        "(CPSLICE_BACKEND=compiled; the first compile takes a while)",
    )


def config_of(args: argparse.Namespace) -> Config:
    """The run ``cpslice verify``'s parsed arguments ask for: its sizes checked and its
    cases selected.

    Raises:
        VerifyArgumentError: sizes or a selection no run can check (a usage error).
    """
    cp_size = cast(int, args.cp_size)
    tp_size = cast(int, args.tp_size)
    check_sizes(cp_size, tp_size)
    cases = select_cases(
        cp_size, cast(str, args.mode), cast("str | None", args.format), cast("int | None", args.align),
    )
    return Config(
        cp_size, tp_size, cases, samples=cast(int, args.samples), seed=cast(int, args.seed),
        timeout=cast(float, args.timeout), startup_timeout=cast(float, args.startup_timeout),
        compile=cast(bool, args.compile),
    )


def _verify(args: argparse.Namespace) -> int:
    """Check every asked layout end to end on spawned gloo ranks (``_verify``)."""
    from .._verify import runner

    try:
        config = config_of(args)
    except VerifyArgumentError as err:
        one_line("cpslice verify", str(err))
        return EXIT_USAGE
    try:
        return runner.verify_main(config)
    except ImportError as err:  # megatron-core missing: not a usage error
        one_line("cpslice verify", str(err))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        sys.stderr.write("cpslice verify: interrupted\n")
        return 130


COMMAND = Subcommand(
    "check every layout end to end on spawned gloo ranks with megatron-core's "
    "parallel_state (CP x TP) against a float64 reference",
    _verify_arguments,
    _verify,
    backend=True,
)
