"""What every ``cpslice`` subcommand shares: its registry entry, the exit statuses,
and the one-line error (``cpslice <subcommand>: error: <problem>`` on stderr)."""

import argparse
import sys
from collections.abc import Callable
from typing import NamedTuple, NoReturn

EXIT_USAGE = 2
EXIT_FAILURE = 1


class Subcommand(NamedTuple):
    """One ``cpslice`` subcommand: its help line, its arguments and its body; ``backend``:
    whether it computes with the vocabulary kernels (``CPSLICE_BACKEND`` is then checked
    before it runs)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    backend: bool = False


def one_line(prog: str, message: str) -> None:
    """``message`` on one line of stderr, after ``<prog>: error: ``."""
    text = " ".join(message.splitlines())
    sys.stderr.write(f"{prog}: error: {text}\n")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        one_line(self.prog, message)
        raise SystemExit(EXIT_USAGE)
