"""The ``cpslice`` command line (also ``python -m cpslice``).

A subcommand is a module of this package (``plan``, ``verify``, ``bench``) whose
``COMMAND`` (an ``args.Subcommand``) adds its arguments and runs it, and one entry
in ``SUBCOMMANDS``. A subcommand that needs heavy or optional imports (megatron-core,
torch.distributed) imports them inside its run function, so that ``cpslice plan``
never loads them.

Every mistake in the arguments, argparse's or a ``LayoutError`` from the library,
ends in one line ``cpslice <subcommand>: error: <problem>`` on stderr and exit
status 2, never a traceback; so does an invalid ``CPSLICE_BACKEND`` for a subcommand
that computes (``verify``, ``bench``: ``Subcommand.backend``), before it starts.
"""

import argparse
import os
import sys
from collections.abc import Sequence
from typing import cast

from .. import __version__
from .._errors import LayoutError
from .._vocab.backends import selection
from . import bench, plan, verify
from .args import EXIT_USAGE, Parser, Subcommand, one_line

SUBCOMMANDS: dict[str, Subcommand] = {
    "plan": plan.COMMAND,
    "verify": verify.COMMAND,
    "bench": bench.COMMAND,
}


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser: argparse.ArgumentParser = Parser(
        prog="cpslice",
        description="Inspect packed, context-parallel layouts of response-aligned tensors.",
    )
    parser.add_argument("--version", action="version", version=f"cpslice {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, command in SUBCOMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(child)
        parsers[name] = child
    return parser, parsers


def _refused_backend(prog: str) -> bool:
    """Whether ``CPSLICE_BACKEND`` holds a value the library refuses (``selection.current``);
    if so, said in one line after ``<prog>: error: ``."""
    try:
        selection.current()
    except ValueError as err:
        one_line(prog, str(err))
        return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cpslice`` on ``argv`` (default ``sys.argv[1:]``); return the exit status.

    0 on success, 2 on bad arguments (one line on stderr, no traceback), 1 when
    the reader of stdout goes away early.
    """
    parser, parsers = _parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said by the subcommand: `cpslice plan: error: ...`
            parsers[cast(str, args.command)].error(
                f"unrecognized arguments: {' '.join(unknown)}"
            )
    except SystemExit as stop:  # --help, or an argument error already reported
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
    name = cast(str, args.command)
    command = SUBCOMMANDS[name]
    if command.backend and _refused_backend(parsers[name].prog):
        return EXIT_USAGE
    try:
        return command.run(args)
    except LayoutError as err:
        one_line(parsers[name].prog, str(err))
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader left early (`cpslice plan ... | head`): stop quietly, and keep
        # the interpreter's final flush from raising again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
