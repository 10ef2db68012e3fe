"""Extraction speed: cpslice against the per-sample loop and the bare-gather floor.

For every layout, N samples with the local tensor near T positions, forward +
backward of ``torch.cat(shares).sum()`` (the same loss for every method):

- ``loop``: the per-sample slice-and-cat loop RL frameworks write (slice bounds
  precomputed outside the timing, in its favour);
- ``floor``: a bare ``index_select`` + ``split`` with a precomputed device index;
- ``cpslice``: ``extract_responses``, both *warm* (the layout's plan cached, as when
  log-probs and entropy are extracted with one layout) and *cold* (a new Layout
  built and validated inside the timing, as for every new micro-batch).

Then layouts of a token order (``Layout.from_order``, torch's context parallelism) at
cp 4, against the closed-form zigzag of the same samples (padded to a multiple of
``2 * cp``, as torch's per-document balancer needs): torch's per-document head-tail
index, and a random permutation of blocks of 128 positions (what torch's PTRR balancer
moves). *first*: the caches cleared, the layout built from the index (read, checked and
run-length encoded into pieces) and its first extraction, forward + backward; *warm*:
extraction with the layout's plan cached. The ratios are against zigzag's.

Run: ``.venv/bin/python -m benchmarks.bench_extract [--quick]``. Prints median
milliseconds and the ratios loop/cpslice and cpslice/floor side by side.
"""

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cpslice import Layout, clear_caches, extract_responses
from cpslice._cli.balancers import block_order, per_document_head_tail_order
from cpslice._layout.plan import runs, selection
from cpslice._types import CpMode, QkvFormat

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.harness import peak_growth  # noqa: E402


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


def _lengths(n: int, target_t: int, cp: int) -> tuple[list[int], list[int]]:
    """``n`` random (total, response) lengths whose stream is near ``target_t * cp``."""
    rng = random.Random(0)
    mean = max(2, target_t * cp // n)
    total = [rng.randint(max(2, mean // 2), mean + mean // 2) for _ in range(n)]
    return total, [rng.randint(1, t - 1) for t in total]


def _step(values: Tensor, shares: list[Tensor]) -> None:
    torch.autograd.backward(torch.cat(shares).sum())
    values.grad = None


def _case(
    name: str, mode: CpMode, fmt: QkvFormat, cp: int, align: int | None, n: int, target_t: int,
    repeat: int, device: str = "cpu",
) -> Row:
    total, response = _lengths(n, target_t, cp)
    seq = max(total) if fmt == "bshd" else None

    def build() -> Layout:
        return Layout(total, response, qkv_format=fmt, max_seq_len=seq, cp_mode=mode,
                      cp_rank=min(1, cp - 1), cp_size=cp, align=align)

    layout = build()
    from cpslice._layout.plan import needed_length

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


@dataclass
class OrderRow:
    layout: str
    n: int
    stream: int  # positions of the stream, N
    t: int
    pieces: int  # over every rank (zigzag: its two chunks per sample and rank)
    build_mib: float  # the peak memory one build adds (the index given, not counted)
    first_ms: float
    warm_ms: float
    target: float | None  # first / zigzag's first at most; None: zigzag itself


ORDER_CP = 4
BLOCK = 128
HEAD_TAIL_TARGET = 1.5
BLOCK_TARGET = 3.0


def _order_cases(n: int, target_t: int, repeat: int, device: str) -> list[OrderRow]:
    """zigzag, torch's per-document head-tail and a block permutation of the same
    samples, each built and extracted from cold (caches cleared) and warm."""
    cp, rank = ORDER_CP, 1
    total, response = _lengths(n, target_t, cp)
    widths = [-(-t // (2 * cp)) * (2 * cp) for t in total]
    stream = sum(widths)
    t = stream // cp
    values = torch.randn(t, device=device, requires_grad=True)
    # the indices, as the balancers give them: outside the timing
    head_tail = per_document_head_tail_order(widths, cp)
    blocks = block_order(stream, BLOCK, 0)

    def zigzag() -> Layout:
        return Layout(total, response, cp_mode="zigzag", cp_rank=rank, cp_size=cp, padded_lengths=widths)

    def of(index: Tensor) -> Callable[[], Layout]:
        return lambda: Layout.from_order(index, total, response, cp_rank=rank, cp_size=cp,
                                         padded_lengths=widths)

    rows = []
    for name, build, target in [("zigzag (closed form)", zigzag, None),
                                ("per-document head-tail", of(head_tail), HEAD_TAIL_TARGET),
                                (f"blocks of {BLOCK}", of(blocks), BLOCK_TARGET)]:
        layout = build()
        placed = layout._order
        pieces = placed.pieces if placed is not None else 2 * n * cp
        build_mib = peak_growth(build) / 2**20

        def first(build: Callable[[], Layout] = build) -> None:
            clear_caches()
            _step(values, extract_responses(values, build())[0])

        def warm(layout: Layout = layout) -> None:
            _step(values, extract_responses(values, layout)[0])

        rows.append(OrderRow(name, n, stream, t, pieces, build_mib, _median_ms(first, repeat, device),
                             _median_ms(warm, repeat, device), target))
    return rows


def run(quick: bool = False, device: str = "cpu") -> list[Row | OrderRow]:
    """Measure every layout; ``quick`` uses N=512, T near 128K."""
    n, t, repeat = (512, 1 << 17, 5) if quick else (4096, 1 << 20, 9)
    torch.manual_seed(0)
    rows: list[Row | OrderRow] = [
        _case(name, mode, fmt, cp, align, n, t, repeat, device)
        for name, mode, fmt, cp, align in CASES
    ]
    return rows + _order_cases(n, t, repeat, device)


def _order_report(rows: list[OrderRow]) -> tuple[list[str], int]:
    """The order layouts' table, and how many of its ratios miss their target."""
    if not rows:
        return [], 0
    closed = rows[0]
    lines = [
        "",
        f"token orders at cp {ORDER_CP} (Layout.from_order) against zigzag: N = {closed.n} samples, "
        f"a stream of {closed.stream} positions, T = {closed.t}",
        f"{'layout':<24} {'pieces':>8} {'build MiB':>9} {'first ms':>9} {'warm ms':>8} "
        f"{'first/zigzag':>12} {'warm/zigzag':>11}",
    ]
    missed = 0
    for r in rows:
        ratio = r.first_ms / closed.first_ms
        mark = " " if r.target is None or ratio <= r.target else "!"
        missed += mark == "!"
        target = "" if r.target is None else f"  (target <= {r.target:g}x)"
        lines.append(f"{r.layout:<24} {r.pieces:>8} {r.build_mib:>9.1f} {r.first_ms:>9.2f} "
                     f"{r.warm_ms:>8.2f} {ratio:>11.2f}x{mark}{r.warm_ms / closed.warm_ms:>10.2f}x{target}")
    lines.append("first: caches cleared, the layout built (from_order reads and checks the index) "
                 "and its first extraction; warm: the plan cached (forward + backward);")
    lines.append(f"build MiB: the peak memory one build adds (the index itself, {8 * closed.stream / 2**20:.0f} "
                 "MiB of int64, not counted); the layout keeps 32 bytes a piece")
    return lines, missed


def report(rows: list[Row | OrderRow]) -> str:
    lines = [
        f"{'layout':<18} {'N':>5} {'T':>8} {'loop ms':>8} {'floor ms':>8} {'warm ms':>8} "
        f"{'cold ms':>8} {'loop/cold':>9} {'cold/floor':>10} {'warm/floor':>10}"
    ] if any(isinstance(r, Row) for r in rows) else []
    missed = 0
    for r in rows:
        if isinstance(r, OrderRow):
            continue
        loop_mark = " " if r.speedup_vs_loop >= LOOP_TARGET else "!"
        floor_mark = " " if r.vs_floor <= FLOOR_TARGET else "!"
        missed += (loop_mark == "!") + (floor_mark == "!")
        lines.append(
            f"{r.layout:<18} {r.n:>5} {r.t:>8} {r.loop_ms:>8.2f} {r.floor_ms:>8.2f} "
            f"{r.warm_ms:>8.2f} {r.cold_ms:>8.2f} {r.speedup_vs_loop:>8.1f}x{loop_mark}"
            f"{r.vs_floor:>9.2f}x{floor_mark}{r.warm_ms / r.floor_ms:>9.2f}x"
        )
    if lines:
        lines.append(f"targets: loop/cold >= {LOOP_TARGET:g}x, cold/floor <= {FLOOR_TARGET:g}x "
                     "(forward + backward)")
    order_lines, order_missed = _order_report([r for r in rows if isinstance(r, OrderRow)])
    lines += order_lines
    missed += order_missed
    lines.append(
        f"MISSED: {missed} ratio{'s' if missed != 1 else ''} (marked !) miss the target"
        if missed else "every ratio meets its target"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--orders", action="store_true", help="the token orders' rows only")
    args = parser.parse_args(argv)
    if args.orders:
        n, t, repeat = (512, 1 << 17, 5) if args.quick else (4096, 1 << 20, 9)
        print(report(list(_order_cases(n, t, repeat, args.device))))
    else:
        print(report(run(args.quick, args.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
