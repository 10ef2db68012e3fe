"""``cpslice bench``: every benchmark of a source checkout's ``benchmarks/`` folder, run
one after another as one report.

A benchmark is a module ``benchmarks/bench_<what>.py`` with module-level
``run(quick: bool)``, which measures, and ``report(rows)``, which returns its text (or
prints it); its title is its docstring's first line. The folder is read each time, so
a benchmark added later is listed without editing this file. A benchmark that raises,
or lacks ``run(quick)`` or ``report(rows)``, is reported and the others still run.
Exit status 1 when one failed, or when there is no ``benchmarks/`` folder (an
installed copy).
"""

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, cast

import torch

from .._vocab.backends import selection
from .._vocab.which import backend_for
from .args import EXIT_FAILURE, Subcommand, one_line

# The repository root when cpslice runs from a source checkout (src/cpslice/_cli/bench.py).
SOURCE_ROOT = Path(__file__).resolve().parents[3]


class Benchmark(NamedTuple):
    """One ``benchmarks/bench_*.py``: its module name and its one-line title."""

    name: str
    title: str


def discover(folder: Path) -> list[Benchmark]:
    """The ``bench_*.py`` modules of ``folder`` in name order, each titled by its
    docstring's first line (without a final period or colon), read without importing
    it; by its name when it has no docstring or does not parse (its import then fails
    and is reported)."""
    found = []
    for path in sorted(folder.glob("bench_*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
        except SyntaxError:
            doc = None
        first = doc.strip().splitlines()[0].rstrip(".:") if doc else ""
        found.append(Benchmark(path.stem, first or path.stem))
    return found


def entry_point(module: ModuleType, name: str, argument: object) -> Callable[[object], object]:
    """``module.<name>``, checked to be a function that takes ``argument`` alone."""
    fn = getattr(module, name, None)
    try:
        inspect.signature(fn).bind(argument)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(
            f"{module.__name__} has no module-level run(quick) and report(rows): cpslice "
            f"bench calls run(quick), then report(its result) ({name} is {fn!r})"
        ) from None
    return cast(Callable[[object], object], fn)


def _bench_report(module: ModuleType, quick: bool) -> str:
    """``module.run(quick)`` then ``module.report(rows)``: its returned text, or what it
    printed (bench_logprob's report prints through ``say``)."""
    run, report = entry_point(module, "run", quick), entry_point(module, "report", None)
    rows = run(quick)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        text = report(rows)
    return text if isinstance(text, str) else printed.getvalue().rstrip("\n")


def kernels_line() -> str:
    """Which kernels the benchmarks' vocabulary calls run (``cpslice.backend_for``): a
    float32 ``[4096, 32768]`` call on the CPU (and on CUDA, where there is one), default
    and invariant, under ``CPSLICE_BACKEND``; a selection that cannot run there says why."""
    parts = []
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        logits = torch.empty_strided((4096, 32768), (0, 1), device=device)  # one row of storage
        try:
            parts.append(f"{device} {backend_for(logits)} (invariant: {backend_for(logits, invariant=True)})")
        except RuntimeError as error:
            parts.append(f"{device}: {str(error).splitlines()[0]}")
    return f"kernels (CPSLICE_BACKEND={selection.selected.name}) of a float32 [4096, 32768] call: {'; '.join(parts)}"


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: a few minutes on two cores"
    )
    parser.add_argument(
        "--checkout", type=Path, default=SOURCE_ROOT, metavar="DIR",
        help="the source checkout whose benchmarks/ to run (default: the one cpslice runs "
        "from, when it is installed from a checkout)",
    )


def _bench(args: argparse.Namespace) -> int:
    """Run the benchmarks of the source checkout's ``benchmarks/`` as one report."""
    quick = cast(bool, args.quick)
    root = cast(Path, args.checkout).resolve()
    folder = root / "benchmarks"
    benchmarks = discover(folder)
    if not benchmarks:  # not a usage error: nothing to run in this installation
        one_line(
            "cpslice bench",
            f"bench needs a source checkout: no bench_*.py in {folder} (cpslice is "
            "installed without its benchmarks/ folder); clone the repository and "
            "pip install -e . there, or pass --checkout DIR",
        )
        return EXIT_FAILURE
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    sys.stdout.write(f"cpslice bench{' --quick' if quick else ''}: {len(benchmarks)} benchmarks "
                     f"from {folder}, torch {torch.__version__}, {os.cpu_count()} CPUs\n{kernels_line()}\n")
    failed = 0
    for name, title in benchmarks:
        sys.stdout.write(f"\n== {title} ({name}) ==\n")
        sys.stdout.flush()
        start = time.perf_counter()
        try:
            text = _bench_report(importlib.import_module(f"benchmarks.{name}"), quick)
        except Exception:  # noqa: BLE001 - reported, and the other benchmarks still run
            failed += 1
            sys.stdout.write("failed; its traceback is on stderr\n")
            sys.stderr.write(f"cpslice bench: {name} failed:\n{traceback.format_exc()}")
            continue
        sys.stdout.write(f"{text}\n({time.perf_counter() - start:.1f} s)\n")
        sys.stdout.flush()
    if failed:
        sys.stdout.write(f"\n{failed} of {len(benchmarks)} benchmarks failed\n")
    return 1 if failed else 0


COMMAND = Subcommand(
    "run every benchmark of the source checkout's benchmarks/ folder (each bench_*.py) "
    "as one report; needs a source checkout",
    _bench_arguments,
    _bench,
    backend=True,
)
