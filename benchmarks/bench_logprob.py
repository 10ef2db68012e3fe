"""Log-probs + entropy, forward and backward: cpslice against the recipes people write.

Methods, all back-propagating a random upstream gradient through what they return:

- ``cpslice``: ``log_probs_and_entropy(..., with_entropy=True)`` with the eager kernels
  (``CPSLICE_BACKEND=eager``: chunked forward, backward recomputing the softmax chunk by
  chunk into one gradient buffer);
- ``compiled``: the same call with the kernels compiled by ``torch.compile``
  (``CPSLICE_BACKEND=compiled``); its first call includes the compilation;
- ``megatron``: megatron-core's ``vocab_parallel_cross_entropy`` on a 1-rank gloo TP
  group: log-probs only, no entropy, no temperature (it overwrites float32 logits in
  place, so each step gets a fresh copy, made outside the timing);
- ``naive``: ``lp = log_softmax(logits / temp)``, ``lp.gather``, ``-(lp.exp() * lp).sum``
  through autograd;
- ``saved``: a fused autograd Function that computes the same in one forward and
  saves the ``[T, V]`` softmax for its backward.

Each method and dtype runs in a fresh subprocess (torch's default threads). After
one warm-up step (for ``compiled``, the compile), the peak RSS is reset
(``/proc/self/clear_refs``) and the peak memory is the growth of the peak RSS
(``VmHWM``) during one more step beyond the RSS before it, in units of one ``[T, V]``
buffer of the logits' dtype (the gradient, one such buffer, is included). Time is the
median (and the best) of a few further steps; ``cpu ms`` is the median process CPU
time of a step, which other load on the machine disturbs less (with ``--threads 1``).
``compiled`` runs twice, in two processes sharing one fresh compiler cache directory:
the first call's time in each says what the first compile costs and whether a later
process reuses the cache.

Run: ``.venv/bin/python benchmarks/bench_logprob.py [--quick] [--methods cpslice,compiled,megatron]
[--dtypes float32,bfloat16]`` (or ``python -m benchmarks.bench_logprob``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import host_store, peak_growth  # noqa: E402

METHODS = ("cpslice", "compiled", "megatron", "naive", "saved")
DTYPES = ("float32", "bfloat16")
TEMPERATURE = 0.9


@dataclass
class Result:
    method: str
    dtype: str
    t: int
    v: int
    peak_buffers: float  # peak RSS growth during one step, in [T, V] buffers of the dtype
    median_ms: float
    best_ms: float
    cpu_ms: float  # median process CPU time of a step (all threads): robust to other load
    first_s: float  # the first step (for compiled: compile included)
    second_first_s: float | None = None  # compiled: first step of a second process


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


Step = Callable[[Tensor, Tensor, tuple[Tensor, Tensor]], None]
Prepare = Callable[[Tensor], None]


def _nothing(logits: Tensor) -> None:
    pass


def _megatron_step() -> tuple[Prepare, Step]:
    """vocab_parallel_cross_entropy on a 1-rank gloo TP group (log-probs only)."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    dist.init_process_group("gloo", store=host_store(), rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    fresh: list[Tensor] = []

    def prepare(logits: Tensor) -> None:  # its float32 input is overwritten: a copy each step
        fresh.append(logits.detach().clone().requires_grad_(True))

    def step(logits: Tensor, targets: Tensor, g: tuple[Tensor, Tensor]) -> None:
        x = fresh.pop()
        logp = -vocab_parallel_cross_entropy(x, targets)
        torch.autograd.backward((logp * g[0]).sum())

    return prepare, step


def _cpslice_step() -> Step:
    from cpslice import log_probs_and_entropy

    def step(logits: Tensor, targets: Tensor, g: tuple[Tensor, Tensor]) -> None:
        logp, entropy = log_probs_and_entropy(
            logits, targets, with_entropy=True, temperature=TEMPERATURE
        )
        torch.autograd.backward((logp * g[0]).sum() + (entropy * g[1]).sum())
        logits.grad = None

    return step


def _naive_step(logits: Tensor, targets: Tensor, g: tuple[Tensor, Tensor]) -> None:
    lp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    logp = lp.gather(1, targets[:, None]).squeeze(1)
    entropy = -(lp.exp() * lp).sum(-1)
    del lp
    torch.autograd.backward((logp * g[0]).sum() + (entropy * g[1]).sum())
    logits.grad = None


def _saved_step(logits: Tensor, targets: Tensor, g: tuple[Tensor, Tensor]) -> None:
    logp, entropy = _saved_apply(logits, targets, TEMPERATURE)
    torch.autograd.backward((logp * g[0]).sum() + (entropy * g[1]).sum())
    logits.grad = None


def _make_step(method: str) -> tuple[Prepare, Step]:
    """``(prepare, step)``: ``prepare(logits)`` runs before each step, outside the timing."""
    if method in ("cpslice", "compiled"):
        return _nothing, _cpslice_step()  # which kernels: CPSLICE_BACKEND, set by the parent
    if method == "megatron":
        return _megatron_step()
    return _nothing, (_naive_step if method == "naive" else _saved_step)


def _child(method: str, dtype_name: str, t: int, v: int, repeat: int) -> Result:
    prepare, step = _make_step(method)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    logits = (torch.randn(t, v) * 2).to(dtype).requires_grad_(True)
    targets = torch.randint(0, v, (t,))
    g = (torch.randn(t), torch.randn(t))

    cpu: list[float] = []

    def timed() -> float:
        prepare(logits)
        start, start_cpu = time.perf_counter(), time.process_time()
        step(logits, targets, g)
        cpu.append(time.process_time() - start_cpu)
        return time.perf_counter() - start

    first = timed()
    prepare(logits)
    peak = peak_growth(lambda: step(logits, targets, g))
    times = [timed() for _ in range(repeat)]
    buffer = t * v * logits.element_size()
    return Result(method, dtype_name, t, v, peak / buffer, 1e3 * statistics.median(times),
                  1e3 * min(times), 1e3 * statistics.median(cpu[-repeat:]), first)


def _in_subprocess(
    method: str, dtype: str, t: int, v: int, repeat: int, env: dict[str, str] | None = None
) -> Result:
    threads = os.environ.get("CPSLICE_BENCH_THREADS", "0")
    cmd = [sys.executable, __file__, "--threads", threads, "--child", method, dtype, str(t), str(v),
           str(repeat)]
    child_env = {**os.environ, "CPSLICE_BACKEND": "compiled" if method == "compiled" else "eager", **(env or {})}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=child_env)
    fields: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Result(**fields)


def run(
    quick: bool = False, methods: Sequence[str] = METHODS, dtypes: Sequence[str] = ("float32",)
) -> list[Result]:
    """One Result per method and dtype, each measured in a fresh subprocess."""
    t, v, repeat = (1024, 16384, 3) if quick else (4096, 32768, 5)
    results = []
    for dtype in dtypes:
        for m in methods:
            if m != "compiled":
                results.append(_in_subprocess(m, dtype, t, v, repeat))
                continue
            with tempfile.TemporaryDirectory(prefix="cpslice-inductor-") as cache:
                env = {"TORCHINDUCTOR_CACHE_DIR": cache}
                r = _in_subprocess(m, dtype, t, v, repeat, env)
                r.second_first_s = _in_subprocess(m, dtype, t, v, 1, env).first_s
            results.append(r)
    return results


def report(results: Sequence[Result], say: Callable[[str], None] = print) -> None:
    first = results[0]
    say(f"T={first.t} V={first.v} temperature={TEMPERATURE}, forward + backward of log-probs "
        f"and entropy (megatron: log-probs only), torch {torch.__version__}, "
        f"{os.environ.get('CPSLICE_BENCH_THREADS') or torch.get_num_threads()} threads")
    say(f"{'method':<10}{'dtype':<10}{'peak [T,V] bufs':>16}{'median ms':>11}{'best ms':>9}{'cpu ms':>9}"
        f"{'first call s':>14}")
    for r in results:
        second = "" if r.second_first_s is None else f" (next process {r.second_first_s:.1f})"
        say(f"{r.method:<10}{r.dtype:<10}{r.peak_buffers:>16.2f}{r.median_ms:>11.1f}{r.best_ms:>9.1f}{r.cpu_ms:>9.1f}"
            f"{r.first_s:>14.1f}{second}")
    for dtype in dict.fromkeys(r.dtype for r in results):
        by = {r.method: r for r in results if r.dtype == dtype}
        for mine, other in [("compiled", "cpslice"), ("compiled", "megatron"), ("cpslice", "megatron"),
                            ("cpslice", "naive"), ("cpslice", "saved")]:
            if mine in by and other in by:
                a, b = by[mine], by[other]
                say(f"{dtype}: {mine}/{other}: time {a.median_ms / b.median_ms:.2f}x "
                    f"(best {a.best_ms / b.best_ms:.2f}x, cpu {a.cpu_ms / b.cpu_ms:.2f}x), "
                    f"memory {a.peak_buffers / b.peak_buffers:.2f}x")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, of {','.join(METHODS)} (default all)")
    parser.add_argument("--dtypes", default="float32",
                        help=f"comma-separated, of {','.join(DTYPES)} (default float32)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in each child (default: torch's default)")
    parser.add_argument("--child", nargs=5, metavar=("METHOD", "DTYPE", "T", "V", "REPEAT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        method, dtype, t, v, repeat = args.child
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        r = _child(method, dtype, int(t), int(v), int(repeat))
        print(json.dumps(r.__dict__))
        return 0
    methods = [m for m in args.methods.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for name, given, valid in (("method", methods, METHODS), ("dtype", dtypes, DTYPES)):
        bad = [x for x in given if x not in valid]
        if bad:
            parser.error(f"unknown {name} {bad[0]!r}; one of {', '.join(valid)}")
    if args.threads > 0:
        os.environ["CPSLICE_BENCH_THREADS"] = str(args.threads)
    report(run(args.quick, methods, dtypes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
