"""Import time: import cpslice after import torch, each in a fresh process.

Every run is a new interpreter (``CPSLICE_DEBUG`` unset) that imports torch, then
times ``import cpslice`` alone: what a training script pays for cpslice beyond torch.
The report gives the median and the fastest of the runs, the median of ``import
torch`` itself for scale, and whether ``import cpslice`` loaded any of ``WATCHED``
(it should load none: ``torch._dynamo`` is imported by ``torch.compile``, megatron-core
by ``Layout.from_parallel_state``, beartype by debug mode, each when it is used).
Where ``PYTHONDONTWRITEBYTECODE`` is set and no bytecode cache of cpslice exists,
every run compiles cpslice's modules from source (about 0.05 s of the time here).

Before issue 27's light import every planning boundary called ``torch.compiler.disable``
when its module was imported, which imports ``torch._dynamo``. Measured on the 2-core
development machine, ``PYTHONDONTWRITEBYTECODE`` set, 9 runs of each version
interleaved (load average 5.7 to 8.4, other work sharing the cores): before, a median of
2.59 s (``BEFORE_S``; 2.05 to 2.94 s); after, 0.128 s (0.091 to 0.252 s). Target: at most
0.3 s on that machine.

Run: ``.venv/bin/python -m benchmarks.bench_import [--quick] [--runs N]``
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

WATCHED = ("torch._dynamo", "megatron", "beartype")
BEFORE_S = 2.59
"""The median before the boundaries decided lazily (module docstring)."""
TARGET_S = 0.3

CHILD = f"""
import json, sys, time
start = time.perf_counter()
import torch
middle = time.perf_counter()
import cpslice
end = time.perf_counter()
loaded = [m for m in {WATCHED!r} if m in sys.modules]
print(json.dumps({{"torch_s": middle - start, "cpslice_s": end - middle, "loaded": loaded}}))
"""


class Sample(NamedTuple):
    """One fresh process: seconds of ``import torch``, then of ``import cpslice``, and
    the ``WATCHED`` modules loaded after both."""

    torch_s: float
    cpslice_s: float
    loaded: list[str]


@dataclass
class Result:
    runs: int
    median_s: float
    min_s: float
    torch_median_s: float
    loaded: list[str]  # the WATCHED modules any run's import of cpslice loaded
    bytecode: bool  # whether the runs could write bytecode caches


def _child_env() -> dict[str, str]:
    """This environment without ``CPSLICE_DEBUG``, with the folder of the cpslice this
    interpreter would import first on ``PYTHONPATH``, found without importing it."""
    env = {k: v for k, v in os.environ.items() if k != "CPSLICE_DEBUG"}
    spec = importlib.util.find_spec("cpslice")
    if spec is not None and spec.origin is not None:
        root = str(Path(spec.origin).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _one_run(env: dict[str, str]) -> Sample:
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                          capture_output=True, text=True, timeout=300)
    fields = json.loads(done.stdout.strip().splitlines()[-1])
    return Sample(float(fields["torch_s"]), float(fields["cpslice_s"]),
                  [str(m) for m in fields["loaded"]])


def run(quick: bool = False, runs: int = 0) -> Result:
    """``runs`` fresh processes (default 3 with ``quick``, else 11), after one untimed
    run that leaves the operating system's file cache warm."""
    count = runs or (3 if quick else 11)
    env = _child_env()
    _one_run(env)
    samples = [_one_run(env) for _ in range(count)]
    cpslice_s = [s.cpslice_s for s in samples]
    return Result(count, statistics.median(cpslice_s), min(cpslice_s),
                  statistics.median(s.torch_s for s in samples),
                  sorted({m for s in samples for m in s.loaded}),
                  not env.get("PYTHONDONTWRITEBYTECODE"))


def report(result: Result, say: Callable[[str], None] = print) -> None:
    caches = "bytecode caches written" if result.bytecode else "PYTHONDONTWRITEBYTECODE set"
    mark = "" if result.median_s <= TARGET_S else " !"
    say(f"import cpslice after import torch, {result.runs} fresh processes ({caches}):")
    say(f"  median {result.median_s:.3f} s, fastest {result.min_s:.3f} s (target <= "
        f"{TARGET_S} s){mark}; import torch itself: median {result.torch_median_s:.2f} s")
    say(f"  before the lazy boundaries: median {BEFORE_S:.2f} s "
        f"({BEFORE_S / result.median_s:.0f}x this run's)")
    say(f"  loaded by import cpslice: {', '.join(result.loaded) or 'none'} of {', '.join(WATCHED)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="3 runs instead of 11")
    parser.add_argument("--runs", type=int, default=0, help="fresh processes to time")
    args = parser.parse_args(argv)
    report(run(args.quick, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
