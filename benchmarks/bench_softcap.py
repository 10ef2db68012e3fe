"""Soft-capped logits (Gemma 2 and 3), forward + backward: ``softcap=`` inside the chunk
kernels against the uncapped path and against materializing the capped logits.

Every method computes each row's log-prob of its target and the entropy of
``softmax(c * tanh(x / c) / temperature)`` (``c`` = 30, Gemma's final logit cap) over
``[T, V]`` logits and back-propagates a random upstream gradient on both:

- ``uncapped``: ``log_probs_and_entropy(logits, ...)`` without a cap, the compiled
  kernels (``CPSLICE_BACKEND=compiled``): the time and memory the capped path is held to;
- ``softcap``: the same with ``softcap=c``: the cap and its ``tanh`` derivative inside
  the compiled kernels;
- ``materialized``: the recipe it replaces, written out here: ``c * tanh(x / c)`` as a
  new ``[T, V]`` tensor, then ``log_probs_and_entropy`` on it (compiled);
- ``softcap-eager``: ``softcap=c`` with the eager kernels (``CPSLICE_BACKEND=eager``).

The logits are drawn ``N(0, 4^2)``: a row's largest (about 17) is bent by the cap (to
about 15), and no ``exp`` of the uncapped path underflows. At a much wider spread
(``N(0, 20^2)``) many of the uncapped path's ``exp(d)`` fall below float32's smallest
normal number, which this CPU computes several times slower, and the uncapped time
roughly doubles while the capped one (every capped logit within ``[-c, c]``) does not:
a comparison that flatters the cap.

Each method runs in a fresh subprocess. After one warm-up step (the compile) the
allocator's free heap is returned and the peak RSS reset
(``harness.peak_growth``); peak memory is the growth of the peak RSS during the
next step beyond the RSS before it, the logits existing, in ``[T, V]`` buffers of the
logits' dtype (the gradient, one such buffer, included). Time is the median of a few
further steps. Targets: ``softcap`` within 1.15x the time of ``uncapped`` and the same
peak memory.

Run: ``.venv/bin/python -m benchmarks.bench_softcap [--quick] [--threads N]
[--dtypes float32,bfloat16]``
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import peak_growth  # noqa: E402

METHODS = ("uncapped", "softcap", "materialized", "softcap-eager")
CAP = 30.0
TEMPERATURE = 0.9
SCALE = 4.0  # the logits' standard deviation (module docstring)


@dataclass
class Result:
    method: str
    dtype: str
    t: int
    v: int
    peak_buffers: float  # peak RSS growth in [T, V] buffers of the logits' dtype
    median_ms: float


def _step(method: str, logits: Tensor, targets: Tensor, g: tuple[Tensor, Tensor]) -> None:
    from cpslice import log_probs_and_entropy

    if method == "materialized":
        capped = CAP * torch.tanh(logits / CAP)
        lp, h = log_probs_and_entropy(capped, targets, with_entropy=True, temperature=TEMPERATURE)
    else:
        cap = None if method == "uncapped" else CAP
        lp, h = log_probs_and_entropy(logits, targets, with_entropy=True, temperature=TEMPERATURE, softcap=cap)
    torch.autograd.backward((lp * g[0]).sum() + (h * g[1]).sum())
    logits.grad = None


def _child(method: str, dtype_name: str, t: int, v: int, repeat: int, threads: int) -> Result:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    logits = (torch.randn(t, v) * SCALE).to(getattr(torch, dtype_name)).requires_grad_(True)
    targets = torch.randint(0, v, (t,))
    g = (torch.randn(t), torch.randn(t))
    _step(method, logits, targets, g)  # warm-up: lazy imports, the compile
    peak = peak_growth(lambda: _step(method, logits, targets, g))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _step(method, logits, targets, g)
        times.append(time.perf_counter() - start)
    unit = t * v * logits.element_size()
    return Result(method, dtype_name, t, v, peak / unit, 1e3 * statistics.median(times))


def _in_subprocess(method: str, dtype: str, t: int, v: int, repeat: int, threads: int) -> Result:
    cmd = [sys.executable, __file__, "--child", method, dtype, str(t), str(v), str(repeat), str(threads)]
    env = {**os.environ, "CPSLICE_BACKEND": "eager" if method.endswith("eager") else "compiled"}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(quick: bool = False, threads: int = 0, dtypes: Sequence[str] = ("float32", "bfloat16")) -> list[Result]:
    """One Result per (dtype, method), each in a fresh subprocess."""
    t, v, repeat = (512, 4096, 2) if quick else (4096, 32768, 5)
    return [_in_subprocess(m, d, t, v, repeat, threads) for d in dtypes for m in METHODS]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"T={first.t} V={first.v} softcap={CAP:g} temperature={TEMPERATURE} with entropy, forward + backward")
    say(f"{'dtype':<10}{'method':<15}{'peak [T,V] buffers':>20}{'median ms':>12}")
    for r in results:
        say(f"{r.dtype:<10}{r.method:<15}{r.peak_buffers:>20.2f}{r.median_ms:>12.1f}")
    by = {(r.dtype, r.method): r for r in results}
    for dtype in dict.fromkeys(r.dtype for r in results):
        cap, plain = by.get((dtype, "softcap")), by.get((dtype, "uncapped"))
        if cap is None or plain is None:
            continue
        ratio = cap.median_ms / plain.median_ms
        mark = "" if ratio <= 1.15 else " !"
        say(f"{dtype} softcap/uncapped: time {ratio:.2f}x (target <= 1.15x){mark}, memory "
            f"{cap.peak_buffers / plain.peak_buffers:.2f}x")
        recipe = by.get((dtype, "materialized"))
        if recipe is not None:
            say(f"  softcap/materialized: time {cap.median_ms / recipe.median_ms:.2f}x, memory "
                f"{cap.peak_buffers / recipe.peak_buffers:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per method (0: torch's default); 1 on a shared machine")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated logits dtypes")
    parser.add_argument("--child", nargs=6, metavar=("METHOD", "DTYPE", "T", "V", "REPEAT", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, dtype, t, v, repeat, threads = args.child
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        print(json.dumps(_child(method, dtype, int(t), int(v), int(repeat), int(threads)).__dict__))
        return 0
    report(run(args.quick, args.threads, args.dtypes.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
