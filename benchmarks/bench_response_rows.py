"""Only the response rows computed: ``response_log_probs`` with entropy, forward +
backward, on batches whose responses are a quarter of the rows against one whose rows
are all response rows, at the same ``T`` and ``V``.

``T = 4096`` rows of float32 logits over ``V = 32768`` ids, without CP:

- ``quarter``: each sample's response is its last quarter (a long prompt, as in a
  multi-turn or tool-use batch): 1024 response rows, 3072 prompt rows whose softmax
  statistics are never computed (their gradient rows are zero), at 8 samples of 512
  tokens (runs of 128 response rows), 16 of 256 (runs of 64) and 64 of 64 (runs of
  16: shorter than one chunk of the kernels, whose chunks gather the rows of several);
- ``all``: 8 samples, each sample's response all but its first token: 4088 response
  rows.

All build the same ``[T, V]`` gradient buffer, so the peak memory is the same; the
time of every ``quarter`` is held to at most 0.45x that of ``all``, whatever the length
of its runs. Each case runs in a fresh subprocess, with the compiled kernels
(``CPSLICE_BACKEND=compiled``) and with the eager ones (``=eager``); after one warm-up step (the
compile) the peak RSS growth of one step is measured (``harness.peak_growth``, in
``[T, V]`` buffers of the logits) and the time is the median of a few more.

Run: ``.venv/bin/python -m benchmarks.bench_response_rows [--quick] [--threads N]``
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

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import peak_growth  # noqa: E402

CASES = ("quarter", "all")
MODES = ("compiled", "eager")  # CPSLICE_BACKEND
SAMPLES = (8, 16, 64)  # of the quarter cases; the all case has the first
TARGET = 0.45


@dataclass
class Result:
    case: str
    compile: str
    t: int
    v: int
    samples: int
    response_rows: int
    peak_buffers: float  # peak RSS growth in [T, V] float32 buffers
    median_ms: float


def _child(case: str, compile_mode: str, t: int, v: int, samples: int, repeat: int, threads: int) -> Result:
    from cpslice import Layout, response_log_probs

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    length = t // samples
    response = [length // 4 if case == "quarter" else length - 1] * samples
    layout = Layout([length] * samples, response)
    tokens = [torch.randint(0, v, (length,)) for _ in range(samples)]
    logits = (torch.randn(t, v) * 2).requires_grad_(True)
    weights = [torch.randn(r) for r in response]

    def step() -> None:
        lp, ent = response_log_probs(logits, tokens, layout, with_entropy=True)
        loss = sum((w * (a + 0.01 * h)).sum() for w, a, h in zip(weights, lp, ent))
        torch.autograd.backward(loss)  # type: ignore[arg-type]
        logits.grad = None

    step()  # warm-up: lazy imports, the compile
    peak = peak_growth(step)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    unit = t * v * logits.element_size()
    return Result(case, compile_mode, t, v, samples, sum(response), peak / unit, 1e3 * statistics.median(times))


def _in_subprocess(case: str, compile_mode: str, t: int, v: int, samples: int, repeat: int, threads: int) -> Result:
    cmd = [sys.executable, __file__, "--child", case, compile_mode, str(t), str(v), str(samples), str(repeat),
           str(threads)]
    env = {**os.environ, "CPSLICE_BACKEND": compile_mode}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def _cases() -> list[tuple[str, int]]:
    return [("all", SAMPLES[0])] + [("quarter", n) for n in SAMPLES]


def run(quick: bool = False, threads: int = 0) -> list[Result]:
    """One Result per (compile mode, case, samples), each in a fresh subprocess."""
    t, v, repeat = (1024, 4096, 2) if quick else (4096, 32768, 5)
    return [_in_subprocess(c, m, t, v, n, repeat, threads) for m in MODES for c, n in _cases()]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"response_log_probs with entropy, forward + backward: T={first.t} V={first.v} float32")
    say(f"{'compiled':<10}{'case':<10}{'samples':>8}{'response rows':>15}{'peak [T,V] buffers':>20}"
        f"{'median ms':>12}{'/ all':>8}")
    by = {(r.compile, r.case): r for r in results if r.case == "all"}
    for r in results:
        full = by.get((r.compile, "all"))
        times = "" if full is None or r.case == "all" else f"{r.median_ms / full.median_ms:.2f}x"
        say(f"{r.compile:<10}{r.case:<10}{r.samples:>8}{r.response_rows:>15}{r.peak_buffers:>20.2f}"
            f"{r.median_ms:>12.1f}{times:>8}")
    for r in results:
        full = by.get((r.compile, "all"))
        if full is None or r.case == "all":
            continue
        ratio = r.median_ms / full.median_ms
        mark = "" if ratio <= TARGET else " !"
        say(f"CPSLICE_BACKEND={r.compile} quarter of {r.samples} samples / all: time {ratio:.2f}x (target <= "
            f"{TARGET}x){mark}, memory {r.peak_buffers / full.peak_buffers:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per case (0: torch's default); 1 on a shared machine")
    parser.add_argument("--child", nargs=7, metavar=("CASE", "COMPILE", "T", "V", "SAMPLES", "REPEAT", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        case, mode, t, v, samples, repeat, threads = args.child
        if case not in CASES:
            parser.error(f"unknown case {case!r}; one of {', '.join(CASES)}")
        print(json.dumps(_child(case, mode, int(t), int(v), int(samples), int(repeat), int(threads)).__dict__))
        return 0
    report(run(args.quick, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
