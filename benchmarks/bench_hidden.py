"""Log-probs + entropy from the hidden states: cpslice against materializing the logits.

Forward and backward from the hidden states and the LM-head weight: cpslice's
``log_probs_and_entropy_from_hidden`` against building the ``[T, V]`` logits.

Methods, all computing log p of the targets and the entropy of ``softmax(hidden @
weight.T / temperature)`` and back-propagating a random upstream gradient on both into
``hidden`` and ``weight``:

- ``cpslice``: ``log_probs_and_entropy_from_hidden(hidden, weight, targets, with_entropy=True)``
  (chunk logits, never a ``[T, V]`` tensor; backward recomputes them);
- ``materialized``: ``logits = hidden @ weight.T`` then ``log_probs_and_entropy(logits, ...)``
  (cpslice's logits path: the logits and their gradient are the ``[T, V]`` buffers);
- ``naive``: ``lp = log_softmax((hidden @ weight.T).float() / temp)``, ``lp.gather``,
  ``-(lp.exp() * lp).sum`` through autograd.

Each method runs in a fresh subprocess. After one warm-up forward + backward (lazy
imports; in ``CPSLICE_BACKEND=auto``, the first compile of the chunk kernels), the
allocator's free heap is returned to the system and the peak RSS reset (as
``bench_logprob`` does); peak memory is the growth of the peak RSS (``VmHWM``) during
the next forward + backward beyond the RSS before it, less the two gradients (``[T,
H]`` and ``[V, H]`` in the inputs' dtype, which every method must produce), in units
of one float32 ``[T, V]`` buffer. Time is the median of ``--repeat`` further runs (at
least one), as wall time and as the process's CPU time (steadier when
other work shares the machine).

Run: ``.venv/bin/python -m benchmarks.bench_hidden [--dtype bfloat16] [--quick]
[--methods cpslice,materialized] [--repeat N] [--bf16-matmul-in-float32] [--device cuda]``
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import peak_growth  # noqa: E402

METHODS = ("cpslice", "materialized", "naive")
TEMPERATURE = 0.9


@dataclass
class Result:
    method: str
    dtype: str
    t: int
    h: int
    v: int
    peak_buffers: float  # peak RSS growth beyond inputs and their gradients, in f32 [T, V] buffers
    median_ms: float  # wall time
    cpu_ms: float  # CPU time of the process over the same runs (steadier on a shared machine)


def _step(method: str, hidden: Tensor, weight: Tensor, targets: Tensor, g: tuple[Tensor, Tensor]) -> None:
    from cpslice import log_probs_and_entropy, log_probs_and_entropy_from_hidden

    if method == "cpslice":
        logp, entropy = log_probs_and_entropy_from_hidden(
            hidden, weight, targets, with_entropy=True, temperature=TEMPERATURE
        )
    elif method == "materialized":
        logp, entropy = log_probs_and_entropy(
            hidden @ weight.T, targets, with_entropy=True, temperature=TEMPERATURE
        )
    else:
        lp = torch.log_softmax((hidden @ weight.T).float() / TEMPERATURE, -1)
        logp = lp.gather(1, targets[:, None]).squeeze(1)
        entropy = -(lp.exp() * lp).sum(-1)
        del lp
    torch.autograd.backward((logp * g[0]).sum() + (entropy * g[1]).sum())
    hidden.grad = weight.grad = None


def _bf16_matmul_in_float32() -> torch.library.Library:
    """Replace the CPU ``aten::mm`` kernel for this process: a bfloat16 product is
    computed by float32 matmuls of ``[512, K] x [K, 1024]`` operand blocks and rounded
    to bfloat16 (the same output tensor, plus float32 copies of a few MiB); other
    dtypes go through ``bmm``. For CPUs whose bfloat16 matmul is emulated (0.5 GFLOP/s
    on this machine's AVX2 cores against 72 for float32: hours for one method at the
    full size). A kernel override, not a Python dispatch mode: under a dispatch mode
    ``torch.compile`` runs nothing compiled. Keep the returned library alive."""

    def mm(a: Tensor, b: Tensor) -> Tensor:
        if a.dtype != torch.bfloat16:
            return torch.bmm(a[None], b[None])[0]
        out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)
        for i in range(0, a.shape[0], 512):
            rows = a[i : i + 512].float()[None]
            for j in range(0, b.shape[1], 1024):
                out[i : i + 512, j : j + 1024] = torch.bmm(rows, b[:, j : j + 1024].float()[None])[0]
        return out

    lib = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        lib.impl("mm", mm, "CPU")  # type: ignore[no-untyped-call]
    return lib


def _child(
    method: str, dtype_name: str, t: int, h: int, v: int, repeat: int, bf16_in_f32: bool = False,
    device: str = "cpu",
) -> Result:
    override = _bf16_matmul_in_float32() if bf16_in_f32 else None  # noqa: F841 (kept alive)
    import cpslice  # noqa: F401  (imported before the baseline: its modules are not the step's memory)

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    hidden = torch.randn(t, h).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(v, h) / h**0.5).to(device, dtype).requires_grad_(True)
    targets = torch.randint(0, v, (t,)).to(device)
    g = (torch.randn(t).to(device), torch.randn(t).to(device))
    grads = (t * h + v * h) * hidden.element_size()
    cuda = hidden.device.type == "cuda"

    def step() -> None:
        _step(method, hidden, weight, targets, g)
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up: lazy imports, compiled kernels
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - base - grads
    else:
        peak = peak_growth(step) - grads
    times = []
    for _ in range(max(repeat, 1)):
        start, cpu = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    wall = statistics.median(w for w, _ in times)
    cpu_s = statistics.median(c for _, c in times)
    return Result(method, dtype_name, t, h, v, peak / (t * v * 4), 1e3 * wall, 1e3 * cpu_s)


def _in_subprocess(
    method: str, dtype: str, t: int, h: int, v: int, repeat: int, bf16_in_f32: bool, device: str
) -> Result:
    cmd = [sys.executable, __file__, "--child", method, dtype, str(t), str(h), str(v), str(repeat),
           str(int(bf16_in_f32)), device]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"),
         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(
    quick: bool = False, dtype: str = "float32", repeat: int = 3,
    methods: Sequence[str] = METHODS, bf16_in_f32: bool = False, device: str = "cpu",
) -> list[Result]:
    """One Result per method, each measured in a fresh subprocess (``run(quick)`` as
    the other benchmarks)."""
    t, h, v = (2048, 256, 16384) if quick else (4096, 1024, 32768)
    return [_in_subprocess(m, dtype, t, h, v, repeat, bf16_in_f32, device) for m in methods]


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"T={first.t} H={first.h} V={first.v} {first.dtype} hidden and weight, "
        f"temperature={TEMPERATURE}, forward + backward of log-probs and entropy")
    say(f"{'method':<14}{'peak beyond inputs+grads, f32 [T,V] bufs':>42}{'wall ms':>10}{'CPU ms':>10}")
    for r in results:
        say(f"{r.method:<14}{r.peak_buffers:>42.3f}{r.median_ms:>10.0f}{r.cpu_ms:>10.0f}")
    by = {r.method: r for r in results}
    c = by["cpslice"]
    for other in ("materialized", "naive"):
        if other not in by:
            continue
        o = by[other]
        say(f"cpslice/{other}: memory {c.peak_buffers / o.peak_buffers:.3f}x, "
            f"time {c.median_ms / o.median_ms:.2f}x (CPU time {c.cpu_ms / o.cpu_ms:.2f}x)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs after the warm-up (at least 1)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated, cpslice first (bfloat16 matmuls are slow on "
                             "CPUs without native bfloat16: minutes per method)")
    parser.add_argument("--bf16-matmul-in-float32", action="store_true",
                        help="compute bfloat16 matmuls as float32 ones rounded to bfloat16 "
                             "(same tensors plus transient float32 copies: peak memory an "
                             "upper bound; times are not bfloat16 times)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda: peak memory from torch.cuda.max_memory_allocated "
                             "(beyond the allocated bytes before the step), synchronized times")
    parser.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, dtype, t, h, v, repeat, bf16_in_f32, device = args.child
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        r = _child(method, dtype, int(t), int(h), int(v), int(repeat), bf16_in_f32 == "1", device)
        print(json.dumps(r.__dict__))
        return 0
    methods = args.methods.split(",")
    if methods[0] != "cpslice" or not set(methods) <= set(METHODS):
        parser.error(f"--methods: cpslice first, then any of {', '.join(METHODS[1:])}")
    if args.bf16_matmul_in_float32:
        print("bfloat16 matmuls computed in float32 and rounded: peak memory an upper bound, "
              "times not bfloat16 times")
    report(run(args.quick, args.dtype, args.repeat, methods, args.bf16_matmul_in_float32,
               args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
