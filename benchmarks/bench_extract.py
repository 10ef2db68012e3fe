"""Extraction speed: cpslice against the per-sample loop and the bare-gather floor.

For every layout, N samples with the local tensor near T positions, forward +
backward of ``torch.cat(shares).sum()`` (the same loss for every method):

- ``loop``: the per-sample slice-and-cat loop RL frameworks write (slice bounds
  precomputed outside the timing, in its favour);
- ``floor``: a bare ``index_select`` + ``split`` with a precomputed device index;
- ``cpslice``: ``extract_responses``, both *warm* (the layout's plan cached, as when
  log-probs and entropy are extracted with one layout) and *cold* (a new Layout
  built and validated inside the timing, as for every new micro-batch).

Run: ``.venv/bin/python -m benchmarks.bench_extract [--quick]``. Prints median
milliseconds and the ratios loop/cpslice and cpslice/floor side by side.
"""

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cpslice import Layout, extract_responses
from cpslice._plan import runs, selection
from cpslice._types import CpMode, QkvFormat


@dataclass
class Row:
    layout: str
    n: int
    t: int
    loop_ms: float
    floor_ms: float
    warm_ms: float
    cold_ms: float

    @property
    def speedup_vs_loop(self) -> float:
        return self.loop_ms / self.cold_ms

    @property
    def vs_floor(self) -> float:
        return self.cold_ms / self.floor_ms


def _median_ms(fn: Callable[[], None], repeat: int, device: str = "cpu") -> float:
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _step(values: Tensor, shares: list[Tensor]) -> None:
    torch.autograd.backward(torch.cat(shares).sum())
    values.grad = None


def _case(
    name: str, mode: CpMode, fmt: QkvFormat, cp: int, align: int | None, n: int, target_t: int,
    repeat: int, device: str = "cpu",
) -> Row:
    rng = random.Random(0)
    mean = max(2, target_t * cp // n)
    total = [rng.randint(max(2, mean // 2), mean + mean // 2) for _ in range(n)]
    response = [rng.randint(1, t - 1) for t in total]
    seq = max(total) if fmt == "bshd" else None

    def build() -> Layout:
        return Layout(total, response, qkv_format=fmt, max_seq_len=seq, cp_mode=mode,
                      cp_rank=min(1, cp - 1), cp_size=cp, align=align)

    layout = build()
    from cpslice._plan import needed_length

    t = needed_length(layout)
    values = torch.randn(t, device=device, requires_grad=True)
    # The loop's slice bounds, read from the same runs, outside the timing.
    sel = selection(layout, t, "response")
    rs = runs(layout, t)
    firsts: list[int] = (rs.local + (sel.run_first - rs.start)).tolist()
    counts: list[int] = sel.run_count.tolist()
    bounds: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for j, i in enumerate(sel.run_sample.tolist()):
        bounds[i].append((firsts[j], firsts[j] + counts[j]))
    index = sel.rows.to(device)
    per_sample = list(sel.counts)

    def loop() -> None:
        shares = [torch.cat([values[a:b] for a, b in pieces]) for pieces in bounds]
        _step(values, shares)

    def floor() -> None:
        _step(values, list(torch.split(values.index_select(0, index), per_sample)))

    def warm() -> None:
        _step(values, extract_responses(values, layout)[0])

    def cold() -> None:
        _step(values, extract_responses(values, build())[0])

    return Row(
        name, n, t,
        _median_ms(loop, max(3, repeat // 4), device),
        _median_ms(floor, repeat, device),
        _median_ms(warm, repeat, device),
        _median_ms(cold, repeat, device),
    )


# (name, cp_mode, qkv_format, cp_size, align): the aligned cases are verl's and
# Megatron-Bridge's packing, every sample padded to a multiple of tp * cp * 2 (tp
# without CP), here at tp 8 and tp 4.
CASES: list[tuple[str, CpMode, QkvFormat, int, int | None]] = [
    ("none-thd", "none", "thd", 1, None),
    ("none-bshd", "none", "bshd", 1, None),
    ("zigzag-thd cp4", "zigzag", "thd", 4, None),
    ("zigzag-bshd cp4", "zigzag", "bshd", 4, None),
    ("allgather cp4", "allgather", "thd", 4, None),
    ("none-thd a8", "none", "thd", 1, 8),
    ("zigzag-thd cp4 a32", "zigzag", "thd", 4, 32),
    ("allgather cp4 a32", "allgather", "thd", 4, 32),
]


LOOP_TARGET = 20.0
"""loop/cold: cpslice, layout built inside the timing, against the per-sample loop."""
FLOOR_TARGET = 2.0
"""cold/floor: cpslice against a bare gather + split with a precomputed index."""


def run(quick: bool = False, device: str = "cpu") -> list[Row]:
    """Measure every layout; ``quick`` uses N=512, T near 128K."""
    n, t, repeat = (512, 1 << 17, 5) if quick else (4096, 1 << 20, 9)
    torch.manual_seed(0)
    return [
        _case(name, mode, fmt, cp, align, n, t, repeat, device)
        for name, mode, fmt, cp, align in CASES
    ]


def report(rows: list[Row]) -> str:
    lines = [
        f"{'layout':<18} {'N':>5} {'T':>8} {'loop ms':>8} {'floor ms':>8} {'warm ms':>8} "
        f"{'cold ms':>8} {'loop/cold':>9} {'cold/floor':>10} {'warm/floor':>10}"
    ]
    missed = 0
    for r in rows:
        loop_mark = " " if r.speedup_vs_loop >= LOOP_TARGET else "!"
        floor_mark = " " if r.vs_floor <= FLOOR_TARGET else "!"
        missed += (loop_mark == "!") + (floor_mark == "!")
        lines.append(
            f"{r.layout:<18} {r.n:>5} {r.t:>8} {r.loop_ms:>8.2f} {r.floor_ms:>8.2f} "
            f"{r.warm_ms:>8.2f} {r.cold_ms:>8.2f} {r.speedup_vs_loop:>8.1f}x{loop_mark}"
            f"{r.vs_floor:>9.2f}x{floor_mark}{r.warm_ms / r.floor_ms:>9.2f}x"
        )
    lines.append(f"targets: loop/cold >= {LOOP_TARGET:g}x, cold/floor <= {FLOOR_TARGET:g}x "
                 "(forward + backward)")
    lines.append(
        f"MISSED: {missed} ratio{'s' if missed != 1 else ''} (marked !) miss the target"
        if missed else "every ratio meets its target"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    print(report(run(args.quick, args.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
