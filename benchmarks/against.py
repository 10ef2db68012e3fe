"""One benchmark, side by side against another commit, in one run.

Usage (from the repository's root, after ``make install``)::

    .venv/bin/python -m benchmarks.against REV bench_hidden -- --quick --methods cpslice

checks ``REV`` out into a temporary worktree (detached, removed afterwards) and runs
``benchmarks/<bench>.py`` with the given options there and here in turns, ``--rounds``
times each (base first, then this tree), both with this environment's interpreter and
each tree's own ``src/`` first on ``PYTHONPATH``, so that a change in load hits both
sides alike. Each round's output is printed whole; then a summary pairs the two sides'
lines that read the same once their numbers are masked, and gives each number of the
last round of each as ``base -> this (ratio)``. The ratio is only as good as the
machine's quiet: run it with nothing else on the cores, and read the rounds' spread.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _run(tree: Path, bench: str, options: Sequence[str]) -> str:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{tree}")
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{bench}", *options], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{bench} failed in {tree} (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def summary(base: str, this: str) -> list[str]:
    """The lines of ``this`` that have a twin in ``base`` (the same text once their numbers
    are masked), each number as ``base -> this (ratio)``."""
    twins = {NUMBER.sub("#", line): line for line in base.splitlines() if NUMBER.search(line)}
    out = []
    for line in this.splitlines():
        twin = twins.get(NUMBER.sub("#", line))
        if twin is None or twin == line and not NUMBER.search(line):
            continue
        pairs = zip(NUMBER.findall(twin), NUMBER.findall(line), strict=True)
        cells = [f"{a} -> {b}" + (f" ({float(b) / float(a):.2f}x)" if float(a) else "") for a, b in pairs if a != b]
        if cells:
            out.append(f"{line.strip()[:60]:60} | " + "; ".join(cells))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("rev", help="the commit to compare against (e.g. HEAD~1, a branch)")
    parser.add_argument("bench", help="the benchmark's module name (e.g. bench_hidden)")
    parser.add_argument("options", nargs="*", help="the benchmark's options (after --)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, taken in turns")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        base_tree = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base_tree), args.rev],
                       check=True)
        try:
            outputs: dict[str, list[str]] = {"base": [], "this": []}
            for round_ in range(args.rounds):
                for side, tree in (("base", base_tree), ("this", ROOT)):
                    text = _run(tree, args.bench, args.options)
                    outputs[side].append(text)
                    print(f"--- round {round_ + 1}, {side} ({args.rev if side == 'base' else 'this tree'})")
                    print(text, end="")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
    print(f"--- summary: {args.rev} -> this tree, last round")
    for line in summary(outputs["base"][-1], outputs["this"][-1]):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
