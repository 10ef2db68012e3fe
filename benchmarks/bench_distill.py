"""Top-k distillation, forward + backward: the student's log-probs at the teacher's ``k``
ids and the divergence, cpslice against the recipes frameworks use.

Every row has ``k`` teacher ids and log-probs (``K`` = 64, the teacher's top-k);
each method computes the student's ``log_softmax(logits / temperature)`` at those ids,
``topk_divergence`` (forward KL with the tail bin) against the teacher, and
back-propagates the mean into the student's logits (or hidden states and LM head):

- ``cpslice``: ``log_probs_at(logits, ids)`` (chunk kernels, compiled where
  ``CPSLICE_BACKEND=auto`` says so; the gradient the one ``[T, V]`` buffer);
- ``log-probs``: ``log_probs_and_entropy(logits, targets)`` without entropy on the same
  logits: the time the target is measured against;
- ``dense``: NeMo-RL's and TRL's way, written out here: the full ``log_softmax`` of the
  float32 logits, gathered at the ids, through autograd;
- ``verl``: verl's way, written out here: a ``[T, V]`` float32 softmax saved by an
  autograd Function for its backward (the gradient from the saved probabilities);
- ``hidden``: ``log_probs_at_from_hidden(hidden, weight, ids)`` (``H`` = 1024; float32 only:
  this CPU's bfloat16 matmul is emulated), against
- ``head``: the materialized head, ``hidden @ weight.T`` then ``log_probs_at``.

Each method runs in a fresh subprocess. After one warm-up step the allocator's free heap
is returned and the peak RSS reset (``harness.peak_growth``); peak memory is the
growth of the peak RSS during the next step beyond the RSS before it, the inputs
existing, in units of one ``[T, V]`` buffer of the logits' dtype (the logits' gradient,
itself one such buffer, included) and, for the hidden-state methods, in float32 ``[T,
V]`` buffers beyond the two gradients. Time is the median of a few further steps.
Targets: ``cpslice`` within 1.1 logits-dtype buffers and 1.2x the time of
``log-probs``; ``hidden`` within 0.25 float32 buffers.

Run: ``.venv/bin/python -m benchmarks.bench_distill [--quick] [--threads N]
[--dtypes float32,bfloat16] [--methods cpslice,log-probs,...]``
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

LOGITS_METHODS = ("cpslice", "log-probs", "dense", "verl")
HIDDEN_METHODS = ("hidden", "head")
METHODS = LOGITS_METHODS + HIDDEN_METHODS
TEMPERATURE = 0.9
K = 64
H = 1024
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


@dataclass
class Result:
    method: str
    dtype: str
    t: int
    v: int
    peak_buffers: float  # peak RSS growth in [T, V] buffers of the logits' dtype (hidden: float32)
    median_ms: float


class _SavedSoftmax(torch.autograd.Function):
    """verl's recipe: a float32 softmax of the whole logits saved for backward."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, ids: Tensor, temp: float) -> Tensor:
        p = torch.softmax(logits.float() / temp, -1)
        ctx.temp = temp
        ctx.save_for_backward(p, ids)
        return torch.log(p.gather(1, ids))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        p, ids = ctx.saved_tensors
        temp: float = ctx.temp
        grad = p * -g.sum(1, keepdim=True)
        grad.scatter_add_(1, ids, g)
        return (grad / temp).to(p.dtype), None, None


def _student(method: str, x: tuple[Tensor, ...], ids: Tensor, targets: Tensor) -> Tensor:
    from cpslice import log_probs_and_entropy, log_probs_at, log_probs_at_from_hidden

    if method == "cpslice":
        return log_probs_at(x[0], ids, temperature=TEMPERATURE)
    if method == "log-probs":
        return log_probs_and_entropy(x[0], targets, temperature=TEMPERATURE)[0]
    if method == "dense":
        return torch.log_softmax(x[0].float() / TEMPERATURE, -1).gather(1, ids)
    if method == "verl":
        apply = _SavedSoftmax.apply
        out: Tensor = apply(x[0], ids, TEMPERATURE)  # type: ignore[no-untyped-call]
        return out
    if method == "hidden":
        return log_probs_at_from_hidden(x[0], x[1], ids, temperature=TEMPERATURE)
    return log_probs_at(x[0] @ x[1].T, ids, temperature=TEMPERATURE)


def _step(method: str, x: tuple[Tensor, ...], ids: Tensor, targets: Tensor, teacher: Tensor) -> None:
    from cpslice import topk_divergence

    student = _student(method, x, ids, targets)
    loss = student.mean() if method == "log-probs" else topk_divergence(student, teacher).mean()
    torch.autograd.backward(loss)
    for leaf in x:
        leaf.grad = None


def _child(method: str, dtype_name: str, t: int, v: int, repeat: int, threads: int) -> Result:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    if method in HIDDEN_METHODS:
        x: tuple[Tensor, ...] = (
            (torch.randn(t, H) / H**0.25).to(dtype).requires_grad_(True),
            (torch.randn(v, H) / H**0.25).to(dtype).requires_grad_(True),
        )
        grads = sum(leaf.numel() * leaf.element_size() for leaf in x)
        unit = t * v * 4
    else:
        x = ((torch.randn(t, v) * 2).to(dtype).requires_grad_(True),)
        grads = 0
        unit = t * v * x[0].element_size()
    targets = torch.randint(0, v, (t,))
    # the teacher's top-k ids and log-probs (drawn in row blocks: a [T, V] draw here
    # would raise the peak RSS before the baseline is read)
    parts = [torch.log_softmax(torch.randn(min(256, t - s), v) * 2, -1).topk(K, 1) for s in range(0, t, 256)]
    teacher = torch.cat([p.values for p in parts])
    ids = torch.cat([p.indices for p in parts])
    _step(method, x, ids, targets, teacher)  # warm-up: lazy imports, a first compile
    peak = peak_growth(lambda: _step(method, x, ids, targets, teacher))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        _step(method, x, ids, targets, teacher)
        times.append(time.perf_counter() - start)
    return Result(method, dtype_name, t, v, (peak - grads) / unit, 1e3 * statistics.median(times))


def _in_subprocess(method: str, dtype: str, t: int, v: int, repeat: int, threads: int) -> Result:
    cmd = [sys.executable, __file__, "--child", method, dtype, str(t), str(v), str(repeat), str(threads)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(
    quick: bool = False, threads: int = 0, dtypes: Sequence[str] = ("float32", "bfloat16"),
    methods: Sequence[str] = METHODS,
) -> list[Result]:
    """One Result per (dtype, method), each in a fresh subprocess; the hidden-state
    methods in float32 only."""
    t, v, repeat = (512, 4096, 2) if quick else (4096, 32768, 3)
    return [
        _in_subprocess(m, d, t, v, repeat, threads)
        for d in dtypes for m in methods if d == "float32" or m in LOGITS_METHODS
    ]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"T={first.t} V={first.v} k={K} teacher ids per row, temperature={TEMPERATURE}, forward KL "
        f"with the tail bin, forward + backward (hidden: H={H})")
    say(f"{'dtype':<10}{'method':<11}{'peak [T,V] buffers':>20}{'median ms':>12}")
    for r in results:
        unit = "f32" if r.method in HIDDEN_METHODS else _SHORT.get(r.dtype, r.dtype)
        say(f"{r.dtype:<10}{r.method:<11}{r.peak_buffers:>15.2f} {unit:<4}{r.median_ms:>12.1f}")
    by = {(r.dtype, r.method): r for r in results}
    for dtype in dict.fromkeys(r.dtype for r in results):
        mine = by.get((dtype, "cpslice"))
        if mine is not None:
            mark = "" if mine.peak_buffers <= 1.1 else " !"
            say(f"{dtype} cpslice: peak {mine.peak_buffers:.2f} [T,V] buffers of the logits' dtype "
                f"(target <= 1.1){mark}")
            for other in ("log-probs", "dense", "verl"):
                o = by.get((dtype, other))
                if o is not None:
                    mark = " !" if other == "log-probs" and mine.median_ms > 1.2 * o.median_ms else ""
                    target = " (target <= 1.2x)" if other == "log-probs" else ""
                    say(f"  cpslice/{other}: memory {mine.peak_buffers / o.peak_buffers:.2f}x, "
                        f"time {mine.median_ms / o.median_ms:.2f}x{target}{mark}")
        hidden, head = by.get((dtype, "hidden")), by.get((dtype, "head"))
        if hidden is not None:
            mark = "" if hidden.peak_buffers <= 0.25 else " !"
            say(f"{dtype} hidden: peak {hidden.peak_buffers:.3f} float32 [T,V] buffers beyond inputs and "
                f"gradients (target <= 0.25){mark}")
            if head is not None:
                say(f"  hidden/head: memory {hidden.peak_buffers / head.peak_buffers:.3f}x, "
                    f"time {hidden.median_ms / head.median_ms:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per method (0: torch's default); 1 on a shared machine")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated logits dtypes")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    parser.add_argument("--child", nargs=6, metavar=("METHOD", "DTYPE", "T", "V", "REPEAT", "THREADS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, dtype, t, v, repeat, threads = args.child
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        print(json.dumps(_child(method, dtype, int(t), int(v), int(repeat), int(threads)).__dict__))
        return 0
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; one of {', '.join(METHODS)}")
    report(run(args.quick, args.threads, args.dtypes.split(","), methods))
    return 0


if __name__ == "__main__":
    sys.exit(main())
