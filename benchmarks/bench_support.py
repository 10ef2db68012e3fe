"""Log-probs under a per-row token support (top-p / top-k replay), forward + backward.

Every row keeps ``IDS`` random token ids (the rollout's top-k / top-p set); the
log-prob of each target is taken under the softmax restricted to its set plus the
target. Methods:

- ``support``: ``log_probs_and_entropy(..., support=Support(ids, offsets))``, no
  entropy: ``O(K)`` gathers, no pass over the vocabulary, the gradient a scatter;
- ``support+H``: the same with ``with_entropy=True`` (entropy over the full
  vocabulary, slime's default): one chunked full pass;
- ``slime``: the recipe written out here as the baseline: a dense ``[T, V]`` boolean
  keep-mask from the sets (built with one vectorized index_put here; slime loops over
  tokens in Python), a masked copy of the logits, ``log_softmax`` + ``gather``;
- ``slime+H``: the same plus the full entropy from the unmasked logits;
- ``unrestricted`` / ``unrestricted+H``: cpslice without a support (what the support
  path is compared against for speed).

Each method runs in a fresh subprocess. Peak memory is the growth of the peak RSS
during one forward + backward (after a warm-up step, with the peak reset) beyond the
RSS measured just before it, once the logits, targets and sets exist, in units of
one float32 ``[T, V]`` buffer (the gradient, itself one
such buffer, is included). Time is the median (and the least) of a few further runs
in the process.

Run: ``.venv/bin/python benchmarks/bench_support.py [--quick]``
(or ``python -m benchmarks.bench_support``).
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

METHODS = ("support", "support+H", "slime", "slime+H", "unrestricted", "unrestricted+H")
TEMPERATURE = 0.9
IDS = 16


@dataclass
class Result:
    method: str
    t: int
    v: int
    peak_buffers: float  # peak RSS growth beyond the inputs, in float32 [T, V] buffers
    median_ms: float
    min_ms: float  # on a shared machine the least time is the least disturbed one


def _slime(
    logits: Tensor, targets: Tensor, ids: Tensor, offsets: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The dense recipe: a [T, V] keep-mask, a masked copy, log_softmax over it."""
    rows = logits.shape[0]
    row = torch.repeat_interleave(torch.arange(rows), offsets.diff())
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    keep[row, ids] = True
    keep[torch.arange(rows), targets] = True
    masked = logits.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(masked / TEMPERATURE, -1).gather(1, targets[:, None]).squeeze(1)
    if not with_entropy:
        return logp, None
    lp = torch.log_softmax(logits / TEMPERATURE, -1)
    return logp, -(lp.exp() * lp).sum(-1)


def _step(
    method: str, logits: Tensor, targets: Tensor, ids: Tensor, offsets: Tensor,
    g: tuple[Tensor, Tensor],
) -> None:
    from cpslice import Support, log_probs_and_entropy

    with_entropy = method.endswith("+H")
    if method.startswith("slime"):
        logp, entropy = _slime(logits, targets, ids, offsets, with_entropy)
    else:
        support = Support(ids, offsets) if method.startswith("support") else None
        logp, entropy = log_probs_and_entropy(
            logits, targets, with_entropy=with_entropy, temperature=TEMPERATURE,
            support=support,
        )
    loss = (logp * g[0]).sum()
    if entropy is not None:
        loss = loss + (entropy * g[1]).sum()
    torch.autograd.backward(loss)
    logits.grad = None


def _child(method: str, t: int, v: int, repeat: int, threads: int) -> Result:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    logits = (torch.randn(t, v) * 2).requires_grad_(True)
    targets = torch.randint(0, v, (t,))
    # IDS distinct ids per row (the target in the set for most rows, as top-k keeps it)
    # (drawn in row blocks: a [T, V] draw would raise the peak RSS before the baseline)
    ids = torch.cat([torch.rand(min(256, t - s), v).topk(IDS, 1).indices for s in range(0, t, 256)])
    ids[: t // 2, 0] = torch.where((ids[: t // 2] == targets[: t // 2, None]).any(1), ids[: t // 2, 0],
                                   targets[: t // 2])
    ids = ids.reshape(-1).contiguous()
    offsets = torch.arange(t + 1) * IDS
    g = (torch.randn(t), torch.randn(t))
    # one warm-up step first: the first call's one-time costs (lazy imports, the
    # allocator's first pages) are not the method's memory
    _step(method, logits, targets, ids, offsets, g)
    peak = peak_growth(lambda: _step(method, logits, targets, ids, offsets, g))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _step(method, logits, targets, ids, offsets, g)
        times.append(time.perf_counter() - start)
    return Result(method, t, v, peak / (t * v * 4), 1e3 * statistics.median(times), 1e3 * min(times))


def _in_subprocess(method: str, t: int, v: int, repeat: int, threads: int) -> Result:
    cmd = [sys.executable, __file__, "--child", method, str(t), str(v), str(repeat), str(threads)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(quick: bool = False, threads: int = 0) -> list[Result]:
    """One Result per method, each measured in a fresh subprocess (``threads`` torch
    threads in each, 0: torch's default)."""
    t, v, repeat = (1024, 8192, 3) if quick else (4096, 32768, 3)
    return [_in_subprocess(m, t, v, repeat, threads) for m in METHODS]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"T={first.t} V={first.v} {IDS} ids per row, temperature={TEMPERATURE}, float32 "
        "logits, forward + backward")
    say(f"{'method':<16}{'peak beyond inputs [T,V] f32 bufs':>36}{'median ms':>12}{'min ms':>10}")
    for r in results:
        say(f"{r.method:<16}{r.peak_buffers:>36.2f}{r.median_ms:>12.1f}{r.min_ms:>10.1f}")
    by = {r.method: r for r in results}
    for mine, others in (("support", ("slime", "unrestricted")),
                         ("support+H", ("slime+H", "unrestricted+H"))):
        c = by[mine]
        for other in others:
            o = by[other]
            say(f"{mine}/{other}: memory {c.peak_buffers / o.peak_buffers:.2f}x, "
                f"time {c.median_ms / o.median_ms:.2f}x (min {c.min_ms / o.min_ms:.2f}x)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per method (0: torch's default); 1 on a shared machine")
    parser.add_argument("--child", nargs=5, metavar=("METHOD", "T", "V", "REPEAT", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, t, v, repeat, threads = args.child
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        r = _child(method, int(t), int(v), int(repeat), int(threads))
        print(json.dumps(r.__dict__))
        return 0
    report(run(args.quick, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
