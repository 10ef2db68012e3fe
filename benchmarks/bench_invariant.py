"""Invariant mode (``invariant=True``) against the default, log-probs + entropy, forward and
backward, side by side in one run.

Methods, all ``log_probs_and_entropy(..., with_entropy=True, temperature=0.9)``
back-propagating a random upstream gradient:

- ``default``: ``invariant=False`` as a user gets it (``CPSLICE_BACKEND`` unset: the
  compiled kernels at this size, compiled in the warm-up step);
- ``eager``: ``invariant=False`` with the eager kernels (``CPSLICE_BACKEND=eager``);
- ``invariant``: ``invariant=True`` as a user gets it (its own compiled kernels on the
  CPU, which give the eager bits; compiled in the warm-up step).

Each dtype runs in a fresh subprocess (torch's default threads), all three methods in
it, so that they are timed side by side: after one warm-up step of each, the peak
memory of each is the growth of the peak RSS during one more step beyond the RSS
before it (``harness.peak_growth``), in ``[T, V]`` buffers of the logits' dtype (the
gradient, one such buffer, included); then ``repeat`` rounds each time one step of
every method in turn, so that a slower or faster stretch of the machine falls on all
of them alike. Time is the median (and the best) over the rounds, ``cpu ms`` the median
process CPU time of a step. One more step of each, untimed, is watched by the
instrumentation hook (``cpslice._probe``, docs/dev/instrumentation.md): its kernel launches
by backend and its host reads.

Run: ``.venv/bin/python benchmarks/bench_invariant.py [--quick] [--dtypes float32,bfloat16]``
(or ``python -m benchmarks.bench_invariant``).
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import peak_growth  # noqa: E402

if TYPE_CHECKING:
    from cpslice import _probe

METHODS = ("default", "eager", "invariant")
DTYPES = ("float32", "bfloat16")
TEMPERATURE = 0.9


@dataclass
class Result:
    method: str
    dtype: str
    t: int
    v: int
    peak_buffers: float
    median_ms: float
    best_ms: float
    cpu_ms: float
    launches: str
    host_reads: int


def _children(dtype_name: str, t: int, v: int, repeat: int) -> list[Result]:
    from cpslice import _probe, log_probs_and_entropy
    from cpslice._vocab.backends import selection as backend

    torch.manual_seed(0)
    logits = (torch.randn(t, v) * 2).to(getattr(torch, dtype_name)).requires_grad_(True)
    targets = torch.randint(0, v, (t,))
    g_lp, g_h = torch.randn(t), torch.randn(t)

    def step(method: str) -> None:
        with backend.using("eager" if method == "eager" else "auto"):  # CPSLICE_BACKEND, as a user sets it
            lp, h = log_probs_and_entropy(logits, targets, with_entropy=True, temperature=TEMPERATURE,
                                          invariant=method == "invariant")
            torch.autograd.backward((lp * g_lp).sum() + (h * g_h).sum())
        logits.grad = None

    for m in METHODS:
        step(m)  # warm-up (the compile, for default and invariant)
    seen: dict[str, _probe.Seen] = {}
    for m in METHODS:
        with _probe.watch() as seen[m]:  # one step watched, apart from the timed ones
            step(m)
    peaks = {m: peak_growth(functools.partial(step, m)) for m in METHODS}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(repeat):
        for m in METHODS:
            start, start_cpu = time.perf_counter(), time.process_time()
            step(m)
            cpu[m].append(time.process_time() - start_cpu)
            times[m].append(time.perf_counter() - start)
    buffer = t * v * logits.element_size()
    return [Result(m, dtype_name, t, v, peaks[m] / buffer, 1e3 * statistics.median(times[m]), 1e3 * min(times[m]),
                   1e3 * statistics.median(cpu[m]), _launches(seen[m]), seen[m].count("host_read")) for m in METHODS]


def _launches(seen: "_probe.Seen") -> str:
    """A step's kernel launches by backend, e.g. ``compiled 32``."""
    from cpslice import _probe

    return " ".join(f"{b} {n}" for b in _probe.BACKENDS if (n := seen.count("launch", backend=b)))


def _in_subprocess(dtype: str, t: int, v: int, repeat: int) -> list[Result]:
    env = dict(os.environ)
    env.pop("CPSLICE_BACKEND", None)
    cmd = [sys.executable, __file__, "--child", dtype, str(t), str(v), str(repeat)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return [Result(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def run(quick: bool = False, dtypes: Sequence[str] = ("float32",)) -> list[Result]:
    """One Result per method and dtype, each dtype measured in a fresh subprocess."""
    t, v, repeat = (512, 8192, 3) if quick else (4096, 32768, 9)
    return [r for d in dtypes for r in _in_subprocess(d, t, v, repeat)]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"T={first.t} V={first.v} temperature={TEMPERATURE}, forward + backward of log-probs and "
        f"entropy, torch {torch.__version__}, {torch.get_num_threads()} threads")
    say(f"{'method':<11}{'dtype':<10}{'peak [T,V] bufs':>16}{'median ms':>11}{'best ms':>9}{'cpu ms':>9}"
        f"  {'launches a step':<16}{'host reads':>10}")
    for r in results:
        say(f"{r.method:<11}{r.dtype:<10}{r.peak_buffers:>16.2f}{r.median_ms:>11.1f}{r.best_ms:>9.1f}"
            f"{r.cpu_ms:>9.1f}  {r.launches:<16}{r.host_reads:>10}")
    for dtype in dict.fromkeys(r.dtype for r in results):
        by = {r.method: r for r in results if r.dtype == dtype}
        for other in ("default", "eager"):
            a, b = by["invariant"], by[other]
            say(f"{dtype}: invariant/{other}: time {a.median_ms / b.median_ms:.2f}x "
                f"(best {a.best_ms / b.best_ms:.2f}x, cpu {a.cpu_ms / b.cpu_ms:.2f}x), "
                f"memory {a.peak_buffers / b.peak_buffers:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--dtypes", default="float32",
                        help=f"comma-separated, of {','.join(DTYPES)} (default float32)")
    parser.add_argument("--child", nargs=4, metavar=("DTYPE", "T", "V", "REPEAT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        dtype, t, v, repeat = args.child
        print(json.dumps([r.__dict__ for r in _children(dtype, int(t), int(v), int(repeat))]))
        return 0
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        parser.error(f"unknown dtype {bad[0]!r}; one of {', '.join(DTYPES)}")
    report(run(args.quick, dtypes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
