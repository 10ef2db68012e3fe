"""Extraction of a new layout each step: caches cleared, the layout built, extracted.

An RL step's micro-batch is a new set of samples, so its layout is new: nothing of it
is cached. This times ``clear_caches()``, ``Layout(...)`` and ``extract_responses``
(forward, and forward + backward) at bench_extract's sizes (N = 4096 samples, about 1M
positions, zigzag cp 4, rank 1), one torch thread, the median of ``--repeat`` runs. It
uses the public API only, so the same script measures another checkout's ``src/``
(``PYTHONPATH=<checkout>/src``): how issue 27's before and after were compared.

Run: ``.venv/bin/python -m benchmarks.bench_new_layout [--quick] [--repeat N]``
"""

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from cpslice import Layout, clear_caches, extract_responses
from cpslice._types import CpMode, QkvFormat


class Row(NamedTuple):
    layout: str
    n: int
    forward_ms: float
    both_ms: float


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _case(name: str, mode: CpMode, fmt: QkvFormat, cp: int, n: int, target_t: int, repeat: int) -> Row:
    rng = random.Random(0)
    mean = max(2, target_t * cp // n)
    total = [rng.randint(max(2, mean // 2), mean + mean // 2) for _ in range(n)]
    response = [rng.randint(1, t - 1) for t in total]
    seq = max(total) if fmt == "bshd" else None

    def build() -> Layout:
        return Layout(total, response, qkv_format=fmt, max_seq_len=seq, cp_mode=mode,
                      cp_rank=min(1, cp - 1), cp_size=cp)

    length = sum(build().padded_lengths) // cp if mode == "zigzag" else sum(build().padded_lengths)
    values = torch.randn(length, requires_grad=True)

    def forward() -> list[torch.Tensor]:
        clear_caches()
        return extract_responses(values, build())[0]

    def both() -> None:
        torch.autograd.backward(torch.cat(forward()).sum())
        values.grad = None

    return Row(name, n, _median_ms(forward, repeat), _median_ms(both, repeat))


CASES: list[tuple[str, CpMode, QkvFormat, int]] = [
    ("none-thd", "none", "thd", 1), ("zigzag-thd cp4", "zigzag", "thd", 4), ("zigzag-bshd cp4", "zigzag", "bshd", 4)]


def run(quick: bool = False, repeat: int = 15) -> list[Row]:
    """Every case; ``quick``: N = 512, about 128K positions, 3 repeats."""
    torch.set_num_threads(1)
    n, t, reps = (512, 1 << 17, 3) if quick else (4096, 1 << 20, repeat)
    return [_case(name, mode, fmt, cp, n, t, reps) for name, mode, fmt, cp in CASES]


def report(rows: list[Row]) -> str:
    lines = [f"{'layout':<18} {'N':>5} {'forward ms':>10} {'fwd+bwd ms':>10}"]
    lines += [f"{r.layout:<18} {r.n:>5} {r.forward_ms:>10.1f} {r.both_ms:>10.1f}" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per case")
    args = parser.parse_args(argv)
    print(report(run(args.quick, args.repeat)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
