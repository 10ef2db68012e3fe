"""On a CUDA machine, one process, side by side: ``log_probs_and_entropy`` forward +
backward with every backend (``triton``, ``compiled``, ``eager``) in the default and the
invariant mode, bfloat16 and float32 logits, at T = 16384 rows with V = 151936 (Qwen's
vocabulary) and 151936 / 4 (a TP 4 shard); log-prob only for the Triton default; the
peers that import (torch.compile of the naive recipe; Liger's cross-entropy where
installed).

Each method's time (median of ``--repeat`` CUDA-event timed steps after a warm-up that
includes its compiles) is set against the bandwidth floor: one read of the logits
forward, one read and one gradient write backward, at the copy bandwidth measured at
the start; its peak memory beyond the logits and their targets; its error against
float64 on the first 256 rows (log-prob, entropy and the logits' gradient); and which
Triton kernels one step launched (``cpslice._probe``'s launch events of the warm-up step:
a fallback shows as none). The script prints its own elapsed time.

Run: ``PYTHONPATH=src python3 -m benchmarks.gpu_bench`` (torch with CUDA and Triton,
jaxtyping; no megatron). ``--quick`` runs only the bfloat16 V = 151936 case.
"""

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

import cpslice
from cpslice import _probe
from cpslice._vocab.backends import selection as backend
from cpslice._vocab.backends.triton import default as triton_default

T = 16384
VOCABS = (151936, 151936 // 4)
REF_ROWS = 256
Step = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]


class Row(NamedTuple):
    name: str
    dtype: str
    vocab: int
    ms: float
    floor: float
    peak_gib: float
    lp_err: float
    h_err: float
    g_err: float
    kernels: str


def _event() -> "torch.cuda.Event":
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), 10, warmup=3)
    return 2 * 2**30 / (ms / 1e3)


def reference(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 log-prob, entropy and d(sum lp + sum H)/dx of the first REF_ROWS rows."""
    x64 = x[:REF_ROWS].detach().double().requires_grad_()
    logp = torch.log_softmax(x64, -1)
    lp = logp.gather(1, targets[:REF_ROWS, None])[:, 0]
    h = -(logp.exp() * logp).sum(1)
    (lp.sum() + h.sum()).backward()  # type: ignore[no-untyped-call]
    assert x64.grad is not None
    return lp.detach(), h.detach(), x64.grad


def cpslice_step(invariant: bool, with_entropy: bool = True) -> Step:
    def step(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
        lp, h = cpslice.log_probs_and_entropy(x, targets, with_entropy=with_entropy, invariant=invariant)
        return lp, h

    return step


def naive_step() -> Step:
    @torch.compile(dynamic=False)
    def f(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        logp = torch.log_softmax(x.float(), -1)
        return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(1)

    return f


def liger_step() -> Step | None:
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy  # type: ignore[import-not-found]
    except ImportError:
        return None

    def f(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
        return -liger_cross_entropy(x, targets, reduction="none"), None

    return f


def measure(name: str, step: Step, x0: Tensor, targets: Tensor, ref: tuple[Tensor, Tensor, Tensor],
            floor: float, repeat: int) -> Row:
    x = x0.detach().requires_grad_()
    base = torch.cuda.memory_allocated()

    def once() -> tuple[Tensor, Tensor | None]:
        x.grad = None
        lp, h = step(x, targets)
        loss = lp.sum() + (0 if h is None else h.sum())
        loss.backward()  # type: ignore[no-untyped-call]
        return lp, h

    with _probe.watch() as seen:  # the one step watched (the timed ones are not)
        lp, h = once()  # warm-up: compiles
    torch.cuda.synchronize()
    assert x.grad is not None
    lp_err = float((lp[:REF_ROWS].double() - ref[0]).abs().max())
    h_err = float("nan") if h is None else float((h[:REF_ROWS].double() - ref[1]).abs().max())
    g_err = float("nan") if h is None else float((x.grad[:REF_ROWS].double() - ref[2]).abs().max())
    del lp, h
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = _time(once, repeat, warmup=0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    x.grad = None
    ran = Counter(e.name for e in seen.of("launch", backend="triton"))
    kernels = ",".join(f"{k}x{v}" for k, v in sorted(ran.items())) or "-"
    return Row(name, str(x0.dtype).removeprefix("torch."), x0.shape[1], ms, ms / floor, peak, lp_err, h_err, g_err,
               kernels)


def show(row: Row) -> None:
    print(f"| {row.name:<28} | {row.dtype:<8} | {row.vocab:>6} | {row.ms:8.2f} | {row.floor:5.2f}x | "
          f"{row.peak_gib:6.2f} | {row.lp_err:.1e} | {row.h_err:.1e} | {row.g_err:.1e} | {row.kernels} |", flush=True)


def _time(fn: Callable[[], object], repeat: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of ``repeat`` CUDA-event timed calls of ``fn`` after ``warmup``
    untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = _event(), _event()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def sweep(x: Tensor, bw: float) -> None:
    """Each Triton default kernel alone at several (BLOCK, warps), against its own floor
    (statistics: one read; gradient: one read, one write); the fastest become the
    module's constants for the rest of the run (the evidence for their defaults)."""
    t, v = x.shape
    size = x.element_size() * x.numel()
    m, s, a = (torch.empty(t, device=x.device) for _ in range(3))
    out = torch.empty_like(x)
    b = torch.randn(t, device=x.device)
    best: dict[str, tuple[float, int, int, int]] = {}
    for kernel in ("stats", "grad"):
        floor = (1 if kernel == "stats" else 2) * size / bw * 1e3
        for block in (4096, 8192, 16384):
            for warps in (4, 8, 16):
                for stages in (1, 3):
                    _set(kernel, block, warps, stages)
                    if kernel == "stats":
                        ms = _time(lambda: triton_default.stats(x, 1.0, None, m, s, a))
                    else:
                        ms = _time(lambda: triton_default.grad(x, 1.0, None, m, s, a, b, out))
                    print(f"sweep {kernel} BLOCK={block} warps={warps} stages={stages}: {ms:.3f} ms "
                          f"({ms / floor:.2f}x its floor)", flush=True)
                    if kernel not in best or ms < best[kernel][0]:
                        best[kernel] = (ms, block, warps, stages)
        ms, block, warps, stages = best[kernel]
        _set(kernel, block, warps, stages)
        print(f"sweep {kernel}: BLOCK={block} warps={warps} stages={stages} kept ({ms:.3f} ms, "
              f"{ms / floor:.2f}x its floor)", flush=True)


def _set(kernel: str, block: int, warps: int, stages: int) -> None:
    name = kernel.upper()
    setattr(triton_default, f"{name}_BLOCK", block)
    setattr(triton_default, f"{name}_WARPS", warps)
    setattr(triton_default, f"{name}_STAGES", stages)


def hidden_path(repeat: int) -> None:
    """The hidden-state path at T = 16384, H = 4096, V = 151936, bfloat16: forward +
    backward against the three matmuls' floor (6 T H V flops at the measured bf16 matmul
    rate) and the materialized recipe."""
    t, h, v = T, 4096, VOCABS[0]
    rate = _matmul_rate()
    floor = 6 * t * h * v / rate * 1e3
    print(f"hidden path: bf16 matmul {rate / 1e12:.0f} TFLOP/s, three-matmul floor {floor:.1f} ms")
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden0 = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    weight0 = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (t,), device="cuda", generator=gen)

    def cps(with_entropy: bool) -> Callable[[Tensor, Tensor], Tensor]:
        def f(x: Tensor, w: Tensor) -> Tensor:
            lp, ent = cpslice.log_probs_and_entropy_from_hidden(x, w, targets, with_entropy=with_entropy)
            return lp.sum() + (0 if ent is None else ent.sum())
        return f

    def materialized(x: Tensor, w: Tensor) -> Tensor:
        logp = torch.log_softmax((x @ w.t()).float(), -1)
        return logp.gather(1, targets[:, None]).sum() - (logp.exp() * logp).sum()

    for name, fn in (("cpslice hidden, lp + entropy", cps(True)), ("cpslice hidden, lp only", cps(False)),
                     ("torch materialized, lp + entropy", materialized)):
        try:
            ms, peak = _hidden_step(fn, hidden0, weight0, repeat)
            print(f"| {name} | {ms:.1f} ms | {ms / floor:.2f}x floor | peak {peak:.2f} GiB beyond inputs |",
                  flush=True)
        except Exception as error:
            print(f"| {name} | failed: {type(error).__name__}: {error} |", flush=True)
        torch.cuda.empty_cache()


def _matmul_rate() -> float:
    """FLOP/s of an 8192^3 bfloat16 matmul on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / (_time(lambda: a @ a) / 1e3)


def _hidden_step(fn: Callable[[Tensor, Tensor], Tensor], hidden0: Tensor, weight0: Tensor,
                 repeat: int) -> tuple[float, float]:
    """Median ms of ``fn``'s forward + backward and its peak GiB beyond the inputs."""
    x, w = hidden0.detach().requires_grad_(), weight0.detach().requires_grad_()
    base = torch.cuda.memory_allocated()

    def step() -> None:
        x.grad, w.grad = None, None
        fn(x, w).backward()  # type: ignore[no-untyped-call]

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = _time(step, repeat)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time the Triton default at several BLOCK, WARPS")
    parser.add_argument("--no-hidden", action="store_true", help="leave the hidden-state path out")
    parser.add_argument("--skip", default="", help="comma-separated method names to leave out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; nothing measured")
        return 0
    began = time.perf_counter()
    bw = bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s; torch {torch.__version__}")
    skip = set(filter(None, args.skip.split(",")))
    liger = liger_step()
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float32)
    vocabs = VOCABS[:1] if args.quick else VOCABS
    print("| method | dtype | V | ms | x floor | peak GiB past logits | lp err | H err | grad err "
          "| Triton launches a step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        for vocab in vocabs:
            gen = torch.Generator(device="cuda").manual_seed(0)
            x0 = (3 * torch.randn(T, vocab, device="cuda", generator=gen)).to(dtype)
            targets = torch.randint(0, vocab, (T,), device="cuda", generator=gen)
            ref = reference(x0, targets)
            size = x0.element_size() * x0.numel()
            floor = 3 * size / bw * 1e3
            print(f"|  floor (3 passes over the logits) | {str(dtype)[6:]} | {vocab} | {floor:.2f} | 1.00x | "
                  f"{size / 2**30:.2f} (one gradient) | | | | |", flush=True)
            if args.sweep and dtype == torch.bfloat16 and vocab == VOCABS[0]:
                sweep(x0, bw)
            methods: list[tuple[str, str, Step]] = [
                ("triton default", "triton", cpslice_step(False)),
                ("triton log-prob only", "triton", cpslice_step(False, with_entropy=False)),
                ("triton invariant", "triton", cpslice_step(True)),
                ("compiled default", "compiled", cpslice_step(False)),
                ("compiled invariant", "compiled", cpslice_step(True)),
                ("eager default", "eager", cpslice_step(False)),
                ("eager invariant", "eager", cpslice_step(True)),
                ("torch.compile naive", "eager", naive_step()),
            ]
            if liger is not None:
                methods.append(("liger cross-entropy", "eager", liger))
            for name, which, step in methods:
                if name in skip:
                    continue
                try:
                    with backend.using(which):
                        show(measure(name, step, x0, targets, ref, floor, args.repeat))
                except Exception as error:  # a peer or backend that fails is reported, not fatal
                    print(f"| {name} | {dtype} | {vocab} | failed: {type(error).__name__}: {error} |", flush=True)
                torch.cuda.empty_cache()
            del x0, targets, ref
            torch.cuda.empty_cache()
    if not args.no_hidden:
        hidden_path(args.repeat)
    print(f"elapsed {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
