"""On a CUDA machine, one process, side by side: ``log_probs_and_entropy`` forward +
backward with every backend (``triton``, ``compiled``, ``eager``) in the default and the
invariant mode, bfloat16 and float32 logits, at T = 16384 rows with V = 151936 (Qwen's
vocabulary) and 151936 / 4 (a TP 4 shard); log-prob only and ``softcap=30`` for the
Triton default; the peers that import (the naive recipe, eager and through
torch.compile; Liger's cross-entropy where installed).

Each method's time (median of ``--repeat`` CUDA-event timed steps after a warm-up that
includes its compiles) is set against the bandwidth floor: one read of the logits
forward, one read and one gradient write backward, at the copy bandwidth measured at
the start; its peak memory beyond the logits and their targets; its error against
float64 on the first 256 rows (log-prob, entropy and the logits' gradient); and which
Triton kernels one step launched (``cpslice._probe``'s launch events of the warm-up step:
a fallback shows as none). The script prints its own elapsed time.

Run: ``PYTHONPATH=src:. python3 -m benchmarks.gpu_bench`` (torch with CUDA and Triton,
jaxtyping; no megatron). ``--quick`` runs only the bfloat16 V = 151936 case.
``benchmarks/gpu_check.py``, the one prepared GPU command, runs ``table`` for that case
with the Triton methods (the hidden-state path is its own benchmark there); every
measurement goes through ``gpu_device.Device``, so that its smoke run (``--smoke``)
runs this code on the CPU too.
"""

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

import cpslice
from cpslice import _probe
from cpslice._vocab.backends import selection as backend
from cpslice._vocab.backends.triton import default as triton_default

from .gpu_device import Device

T = 16384
VOCABS = (151936, 151936 // 4)
REF_ROWS = 256
Step = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]
QUICK = ("triton default", "triton log-prob only", "triton softcap 30", "triton invariant", "torch.compile naive",
         "liger cross-entropy")
"""The methods of ``--quick``, and of ``gpu_check``'s logits stage."""


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


def bandwidth(device: Device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted; 1 MiB
    on the CPU)."""
    size = 2**30 if device.cuda else 2**20
    src = torch.empty(size, dtype=torch.uint8, device=device.where)
    dst = torch.empty_like(src)
    ms = device.median_ms(lambda: dst.copy_(src), 10, warmup=3)
    return 2 * size / (ms / 1e3)


def reference(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 log-prob, entropy and d(sum lp + sum H)/dx of the first REF_ROWS rows."""
    x64 = x[:REF_ROWS].detach().double().requires_grad_()
    logp = torch.log_softmax(x64, -1)
    lp = logp.gather(1, targets[:REF_ROWS, None])[:, 0]
    h = -(logp.exp() * logp).sum(1)
    (lp.sum() + h.sum()).backward()  # type: ignore[no-untyped-call]
    assert x64.grad is not None
    return lp.detach(), h.detach(), x64.grad


def cpslice_step(invariant: bool, with_entropy: bool = True, softcap: float | None = None) -> Step:
    def step(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
        lp, h = cpslice.log_probs_and_entropy(x, targets, with_entropy=with_entropy, invariant=invariant,
                                              softcap=softcap)
        return lp, h

    return step


def naive(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
    """The naive recipe: ``log_softmax`` in float32, the target's log-prob, the entropy."""
    logp = torch.log_softmax(x.float(), -1)
    return logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(1)


def naive_step() -> Step:
    """``naive`` compiled by ``torch.compile`` (at its first call: building the method list
    imports no compiler)."""
    compiled: list[Step] = []

    def step(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
        if not compiled:
            compiled.append(torch.compile(naive, dynamic=False))
        return compiled[0](x, targets)

    return step


def liger_step() -> Step | None:
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy  # type: ignore[import-not-found]
    except ImportError:
        return None

    def f(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor | None]:
        return -liger_cross_entropy(x, targets, reduction="none"), None  # its sum's gradient is right

    return f


def measure(name: str, step: Step, x0: Tensor, targets: Tensor, ref: tuple[Tensor, Tensor, Tensor],
            floor: float, repeat: int, device: Device) -> Row:
    x = x0.detach().requires_grad_()

    def once() -> tuple[Tensor, Tensor | None]:
        x.grad = None
        lp, h = step(x, targets)
        loss = lp.sum() + (0 if h is None else h.sum())
        loss.backward()  # type: ignore[no-untyped-call]
        return lp, h

    with _probe.watch() as seen:  # the one step watched (the timed ones are not)
        lp, h = once()  # warm-up: compiles
    device.sync()
    assert x.grad is not None
    lp_err = float((lp.detach()[:REF_ROWS].double() - ref[0]).abs().max())
    h_err = float("nan") if h is None else float((h.detach()[:REF_ROWS].double() - ref[1]).abs().max())
    g_err = float("nan") if h is None else float((x.grad[:REF_ROWS].double() - ref[2]).abs().max())
    del lp, h
    x.grad = None
    peak = device.peak_growth(once) / 2**30
    x.grad = None
    ms = device.median_ms(once, repeat, warmup=0)
    x.grad = None
    ran = Counter(e.name for e in seen.of("launch", backend="triton"))
    kernels = ",".join(f"{k}x{v}" for k, v in sorted(ran.items())) or "-"
    return Row(name, str(x0.dtype).removeprefix("torch."), x0.shape[1], ms, ms / floor, peak, lp_err, h_err, g_err,
               kernels)


def show(row: Row) -> None:
    print(f"| {row.name:<28} | {row.dtype:<8} | {row.vocab:>6} | {row.ms:8.2f} | {row.floor:5.2f}x | "
          f"{row.peak_gib:6.2f} | {row.lp_err:.1e} | {row.h_err:.1e} | {row.g_err:.1e} | {row.kernels} |", flush=True)


def sweep(x: Tensor, bw: float, device: Device) -> None:
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
                        ms = device.median_ms(lambda: triton_default.stats(x, 1.0, None, m, s, a), 5, warmup=2)
                    else:
                        ms = device.median_ms(lambda: triton_default.grad(x, 1.0, None, m, s, a, b, out), 5, warmup=2)
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


def methods(names: Sequence[str] | None) -> list[tuple[str, str, Step]]:
    """The methods of the table (``names``: those alone), each with the backend it runs
    under."""
    every: list[tuple[str, str, Step]] = [
        ("triton default", "triton", cpslice_step(False)),
        ("triton log-prob only", "triton", cpslice_step(False, with_entropy=False)),
        ("triton softcap 30", "triton", cpslice_step(False, softcap=30.0)),
        ("triton invariant", "triton", cpslice_step(True)),
        ("compiled default", "compiled", cpslice_step(False)),
        ("compiled invariant", "compiled", cpslice_step(True)),
        ("eager default", "eager", cpslice_step(False)),
        ("eager invariant", "eager", cpslice_step(True)),
        ("naive", "eager", naive),
        ("torch.compile naive", "eager", naive_step()),
    ]
    liger = liger_step()
    if liger is not None:
        every.append(("liger cross-entropy", "eager", liger))
    return [m for m in every if names is None or m[0] in names]


def table(device: Device, t: int, vocab: int, dtype: torch.dtype, bw: float, repeat: int,
          chosen: list[tuple[str, str, Step]], skip: Collection[str] = ()) -> list[Row]:
    """The markdown table's lines of ``chosen`` methods on ``[t, vocab]`` logits of ``dtype``
    (its header printed first), each printed as it is measured; a method that fails is
    a line that says so. Returns the rows."""
    gen = torch.Generator(device=device.where).manual_seed(0)
    x0 = (3 * torch.randn(t, vocab, device=device.where, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, (t,), device=device.where, generator=gen)
    ref = reference(x0, targets)
    size = x0.element_size() * x0.numel()
    floor = 3 * size / bw * 1e3
    print("| method | dtype | V | ms | x floor | peak GiB past logits | lp err | H err | grad err "
          "| Triton launches a step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"|  floor (3 passes over the logits) | {str(dtype)[6:]} | {vocab} | {floor:.2f} | 1.00x | "
          f"{size / 2**30:.2f} (one gradient) | | | | |", flush=True)
    rows = []
    for name, which, step in chosen:
        if name in skip:
            continue
        try:
            with backend.using(which):
                rows.append(measure(name, step, x0, targets, ref, floor, repeat, device))
            show(rows[-1])
        except Exception as error:  # a peer or backend that fails is reported, not fatal
            print(f"| {name} | {dtype} | {vocab} | failed: {type(error).__name__}: {error} |", flush=True)
        device.release()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time the Triton default at several BLOCK, WARPS")
    parser.add_argument("--skip", default="", help="comma-separated method names to leave out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; nothing measured")
        return 0
    began = time.perf_counter()
    device = Device("cuda")
    bw = bandwidth(device)
    print(f"{device.name()}: copy bandwidth {bw / 1e12:.2f} TB/s; torch {torch.__version__}")
    skip = set(filter(None, args.skip.split(",")))
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float32)
    vocabs = VOCABS[:1] if args.quick else VOCABS
    chosen = methods(QUICK if args.quick else None)
    for dtype in dtypes:
        for vocab in vocabs:
            if args.sweep and dtype == torch.bfloat16 and vocab == VOCABS[0]:
                gen = torch.Generator(device="cuda").manual_seed(0)
                sweep((3 * torch.randn(T, vocab, device="cuda", generator=gen)).to(dtype), bw, device)
                device.release()
            table(device, T, vocab, dtype, bw, args.repeat, chosen, skip)
    print(f"elapsed {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
