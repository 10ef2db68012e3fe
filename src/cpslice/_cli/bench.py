"""``cpslice bench``: the benchmarks of a source checkout's ``benchmarks/`` folder,
run one after another as one report. A benchmark that raises is reported and the
others still run; exit status 1 when one failed, or without a ``benchmarks/`` folder
(an installed copy)."""

import argparse
import contextlib
import importlib
import io
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import cast

import torch

from .args import EXIT_FAILURE, Subcommand, one_line

SOURCE_ROOT = Path(__file__).resolve().parents[2]

_BENCHMARKS = (
    ("bench_extract", "extraction: cpslice against the per-sample loop and the bare-gather floor"),
    ("bench_logprob", "log-probs + entropy: peak memory and time against naive and save-softmax"),
    ("bench_redistribute", "redistribute against the zero-padded all_reduce, cp 4 on gloo"),
    ("bench_sample_means", "sample_means against per-sample all-gathers and gather_responses"),
)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: under a minute on two cores"
    )


def _bench_report(module: ModuleType, quick: bool) -> str:
    """``module.run(quick)`` then ``module.report(rows)``: its returned text, or what it
    printed (bench_logprob's report prints through ``say``)."""
    run = cast(Callable[[bool], object], module.run)
    report = cast(Callable[[object], object], module.report)
    rows = run(quick)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        text = report(rows)
    return text if isinstance(text, str) else printed.getvalue().rstrip("\n")


def _bench(args: argparse.Namespace) -> int:
    """Run the benchmarks of the source checkout's ``benchmarks/`` as one report."""
    quick = cast(bool, args.quick)
    folder = SOURCE_ROOT / "benchmarks"
    missing = [name for name, _ in _BENCHMARKS if not (folder / f"{name}.py").is_file()]
    if missing:  # not a usage error: nothing to run in this installation
        one_line(
            "cpslice bench",
            f"bench needs a source checkout: no {missing[0]}.py in {folder} (cpslice is "
            "installed without its benchmarks/ folder); clone the repository and "
            "pip install -e . there",
        )
        return EXIT_FAILURE
    if str(SOURCE_ROOT) not in sys.path:
        sys.path.insert(0, str(SOURCE_ROOT))
    sys.stdout.write(f"cpslice bench{' --quick' if quick else ''}: {len(_BENCHMARKS)} benchmarks "
                     f"from {folder}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    failed = 0
    for name, title in _BENCHMARKS:
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
        sys.stdout.write(f"\n{failed} of {len(_BENCHMARKS)} benchmarks failed\n")
    return 1 if failed else 0


COMMAND = Subcommand(
    "run the benchmarks (extraction, log-probs, redistribute) as one report; "
    "needs a source checkout",
    _bench_arguments,
    _bench,
)
