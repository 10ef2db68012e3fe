"""Log-probs + entropy, forward and backward: cpslice against the recipes people write.

Methods, all computing log p of the targets and the entropy at ``temperature`` and
back-propagating a random upstream gradient on both:

- ``cpslice``: ``log_probs_and_entropy(..., with_entropy=True)`` (chunked forward,
  backward recomputing the softmax chunk by chunk into one gradient buffer);
- ``naive``: ``lp = log_softmax(logits / temp)``, ``lp.gather``, ``-(lp.exp() * lp).sum``
  through autograd;
- ``saved``: a fused autograd Function that computes the same in one forward and
  saves the ``[T, V]`` softmax for its backward.

Each method runs in a fresh subprocess. Peak memory is the growth of the peak RSS
(``ru_maxrss``) during the first forward + backward beyond the RSS measured once
the logits and targets exist, in units of one float32 ``[T, V]`` buffer (the
gradient, itself one such buffer for float32 logits, is included). Time is the
median of a few further forward + backward runs in the same process.

Run: ``.venv/bin/python benchmarks/bench_logprob.py [--quick]``
(or ``python -m benchmarks.bench_logprob``).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

METHODS = ("cpslice", "naive", "saved")
TEMPERATURE = 0.9


@dataclass
class Result:
    method: str
    t: int
    v: int
    peak_buffers: float  # peak RSS growth beyond the logits, in float32 [T, V] buffers
    median_ms: float


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _SavedSoftmax(torch.autograd.Function):
    """The usual fused kernel: one forward, the softmax saved for backward."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, temp: float
    ) -> tuple[Tensor, Tensor]:
        lp = torch.log_softmax(logits.float() / temp, -1)
        logp = lp.gather(1, targets[:, None]).squeeze(1)
        p = lp.exp()
        entropy = -(p * lp).sum(-1)
        del lp
        ctx.temp = temp
        ctx.save_for_backward(p, targets, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor, g_h: Tensor) -> tuple[Tensor, None, None]:
        p, targets, entropy = ctx.saved_tensors
        temp: float = ctx.temp
        # d/dz: onehot * g_lp - p * (g_lp + g_h * (log p + H)), then / temp.
        t = torch.log(p).add_(entropy[:, None]).mul_(g_h[:, None]).add_(g_lp[:, None])
        grad = t.mul_(p).neg_()
        grad.scatter_add_(1, targets[:, None], g_lp[:, None])
        return grad.div_(temp), None, None


_saved_apply = cast(Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]], _SavedSoftmax.apply)


def _step(method: str, logits: Tensor, targets: Tensor, g: tuple[Tensor, Tensor]) -> None:
    if method == "cpslice":
        from cpslice import log_probs_and_entropy

        logp, entropy = log_probs_and_entropy(
            logits, targets, with_entropy=True, temperature=TEMPERATURE
        )
    elif method == "naive":
        lp = torch.log_softmax(logits / TEMPERATURE, -1)
        logp = lp.gather(1, targets[:, None]).squeeze(1)
        entropy = -(lp.exp() * lp).sum(-1)
        del lp
    else:
        logp, entropy = _saved_apply(logits, targets, TEMPERATURE)
    torch.autograd.backward((logp * g[0]).sum() + (entropy * g[1]).sum())
    logits.grad = None


def _child(method: str, t: int, v: int, repeat: int) -> Result:
    torch.manual_seed(0)
    logits = (torch.randn(t, v) * 2).requires_grad_(True)
    targets = torch.randint(0, v, (t,))
    g = (torch.randn(t), torch.randn(t))
    base = _rss_bytes()
    _step(method, logits, targets, g)
    peak = _maxrss_bytes() - base
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _step(method, logits, targets, g)
        times.append(time.perf_counter() - start)
    return Result(method, t, v, peak / (t * v * 4), 1e3 * statistics.median(times))


def _in_subprocess(method: str, t: int, v: int, repeat: int) -> Result:
    cmd = [sys.executable, __file__, "--child", method, str(t), str(v), str(repeat)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(quick: bool = False) -> list[Result]:
    """One Result per method, each measured in a fresh subprocess."""
    t, v, repeat = (1024, 16384, 3) if quick else (4096, 32768, 3)
    return [_in_subprocess(m, t, v, repeat) for m in METHODS]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"T={first.t} V={first.v} temperature={TEMPERATURE}, float32 logits, "
        "forward + backward of log-probs and entropy")
    say(f"{'method':<10}{'peak beyond logits [T,V] f32 bufs':>36}{'median ms':>12}")
    for r in results:
        say(f"{r.method:<10}{r.peak_buffers:>36.2f}{r.median_ms:>12.1f}")
    by = {r.method: r for r in results}
    c = by["cpslice"]
    for other in ("naive", "saved"):
        o = by[other]
        say(f"cpslice/{other}: memory {c.peak_buffers / o.peak_buffers:.2f}x, "
            f"time {c.median_ms / o.median_ms:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--child", nargs=4, metavar=("METHOD", "T", "V", "REPEAT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, t, v, repeat = args.child
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        r = _child(method, int(t), int(v), int(repeat))
        print(json.dumps(r.__dict__))
        return 0
    report(run(args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
