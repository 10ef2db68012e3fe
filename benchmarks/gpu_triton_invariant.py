"""On a CUDA machine: invariant mode's Triton kernels (``cpslice._vocab.backends.triton.invariant``)
on the GPU against the eager spec on the CPU (ATen), bit for bit (a NaN's payload aside):
per-tile statistics, their merge, merged statistics of a subset of rows and the logits'
gradient, float32 and bfloat16, uncapped and capped, with rows holding the edges
(masked tokens and tiles, ties, subnormal logits, a zero max of both signs, logits past
the cap's saturation); the eager spec on CUDA against the CPU too (information); then
the kernels' time at T 4096, V 32768 (information). Prints one line per case and
``ALL TRITON == CPU EAGER: True`` when every kernel gave the CPU's bits; exits 1 if not.

Run: ``PYTHONPATH=src:. python3 -m benchmarks.gpu_triton_invariant`` (needs torch with
CUDA and triton). ``DEV=cpu TRITON_INTERPRET=1 SHAPE=12,700,690`` runs it through
Triton's interpreter instead (a dry run, small). ``benchmarks/gpu_check.py`` runs
``check`` as one of its stages.
"""

import math
import os
import sys
import traceback
from collections import Counter

import torch
from torch import Tensor

from cpslice import _probe
from cpslice._vocab import invariant as inv
from cpslice._vocab import spec, stats
from cpslice._vocab.backends import eager
from cpslice._vocab.backends.triton import invariant as tri
from cpslice._vocab.softmax import Softmax

DEV = os.environ.get("DEV", "cuda")
SHAPE = tuple(int(v) for v in os.environ.get("SHAPE", "96,20000,19950").split(","))
"""The logits' rows, columns and valid columns (``vocab_size``)."""


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    """Bit for bit, NaN where the other is NaN (its payload outside the guarantee)."""
    assert a is not None and b is not None
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan())
                and torch.equal(a.contiguous().view(bits)[~nan], b.contiguous().view(bits)[~nan]))


def _logits(dtype: torch.dtype, gen: torch.Generator, t: int, v: int) -> Tensor:
    x = torch.randn(t, v, generator=gen) * 6
    x[1, 7] = -math.inf
    x[2, : v // 3] = -math.inf
    x[3] = x[3, 0]
    x[4, 100] += 80.0
    x[5] *= 40
    x[7] *= 1e-39  # subnormal logits: a flushing division or widening would show
    x[8] = -x[8].abs()
    x[8, 128], x[8, 129] = -0.0, 0.0  # a zero tile max of both signs
    return x.to(dtype)


def _case(dtype: torch.dtype, cap: float | None, gen: torch.Generator, where: str, shape: tuple[int, ...]) -> bool:
    T, V, VALID = shape
    cpu, dev = torch.device("cpu"), torch.device(where)
    x = _logits(dtype, gen, T, V)
    tau = torch.rand(T, generator=gen) + 0.5
    r = 1.0 / tau
    n = spec.tiles(V)
    softmax = Softmax(tau, cap, True)
    want = inv.tile_placeholders(n, T, 0, torch.float32, cpu, True)
    inv.stats(x, softmax, VALID, want, [(0, T)], 16)
    xd, rd, taud = x.to(dev), r.to(dev), tau.to(dev)
    got = inv.tile_placeholders(n, T, 0, torch.float32, dev, True)
    tri.tile_stats(xd, None, rd, cap, VALID, got.max, got.sum, got.ent)
    tiles = [_same(w, g) for w, g in zip((want.max, want.sum, want.ent), (got.max, got.sum, got.ent))]
    aten = inv.tile_placeholders(n, T, 0, torch.float32, dev, True)
    inv.stats(xd, Softmax(taud, cap, True), VALID, aten, [(0, T)], 16)
    aten_tiles = [_same(w, g) for w, g in zip((want.max, want.sum, want.ent), (aten.max, aten.sum, aten.ent))]
    assert want.ent is not None and got.ent is not None
    merged = [_same(w, g) for w, g in zip(spec.merge_tiles(want.max.t(), want.sum.t(), want.ent.t(), tau),
                                          tri.merge(got.max, got.sum, got.ent, taud))]
    rows = torch.tensor([5, 0, 3, 2, 90, 17, 4, 1, 7, 8]) % T
    full = stats.placeholders(T, 0, torch.float32, cpu, True)
    inv.merged_stats(x[:, :VALID], softmax, full, None, 16)
    assert full.ent is not None
    part = [_same(w[rows], g) for w, g in zip((full.max, full.sum, full.ent),
                                              tri.merged_stats(xd, rows.to(dev), rd, taud, cap, VALID))]
    log_s = torch.log(full.sum)
    a, b = torch.randn(T, generator=gen) * 0.3, torch.randn(T, generator=gen)
    grad_want = torch.empty_like(x[:, :VALID])
    eager.grad_kernel(x[:, :VALID], r, full.max, log_s, a, b, grad_want, cap)
    grad_got = torch.zeros_like(xd[:, :VALID])
    tri.grad(xd[:, :VALID], None, rd, full.max.to(dev), log_s.to(dev), a.to(dev), b.to(dev), cap, grad_got)
    good = all(tiles + merged + part) and _same(grad_want, grad_got)
    print(f"{dtype} cap={cap}: triton tiles {tiles} merge {merged} merged rows {part} "
          f"grad {_same(grad_want, grad_got)} | eager on {where}: tiles {aten_tiles}", flush=True)
    return good


def _timing(where: str) -> None:
    import triton

    t, v = 4096, 32768
    x = torch.randn(t, v, device=where).to(torch.bfloat16)
    tau = torch.rand(t, device=where) + 0.5
    r = 1.0 / tau
    big, total, _ = tri.merged_stats(x, None, r, tau, None, v)
    out, log_s, a, b = torch.empty_like(x), torch.log(total), torch.zeros_like(total), torch.ones_like(total)
    forward = triton.testing.do_bench(lambda: tri.merged_stats(x, None, r, tau, None, v), rep=200)
    backward = triton.testing.do_bench(lambda: tri.grad(x, None, r, big, log_s, a, b, None, out), rep=200)
    print(f"bfloat16 T={t} V={v}: merged_stats {forward:.3f} ms, grad {backward:.3f} ms "
          f"(one read of the logits: {2 * t * v / 4.0e9:.3f} ms at 4 TB/s)")


def check(where: str, shape: tuple[int, ...] = SHAPE, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
          caps: tuple[float | None, ...] = (None, 30.0, 5.0)) -> bool:
    """Each case of ``dtypes`` and ``caps`` on the device ``where`` (``cuda``; ``cpu`` under
    the interpreter) at ``shape`` (rows, columns, valid columns): whether every kernel gave
    the CPU's bits."""
    gen = torch.Generator().manual_seed(0)
    ok = True
    with _probe.watch() as seen:
        for dtype in dtypes:
            for cap in caps:
                try:
                    ok &= _case(dtype, cap, gen, where, shape)
                except Exception:
                    ok = False
                    traceback.print_exc()
    launches = Counter(e.name for e in seen.of("launch", backend="triton"))
    print("ALL TRITON == CPU EAGER:", ok, dict(launches), flush=True)
    return ok


def main() -> int:
    print("torch", torch.__version__, "device", DEV, flush=True)
    ok = check(DEV)
    if DEV == "cuda":
        _timing(DEV)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
