"""redistribute against the zero-padded all_reduce, at cp 4 on gloo (spawned processes).

Per rank, forward + backward of moving log-probs and entropy from the allgather
layout to (a) zigzag and (b) whole responses on every rank, against the common
recipe: scatter the shares into zero-padded whole responses and all_reduce them.
Bytes are what this rank sends: all_to_all sends each element once to each rank
that needs it; a ring all_reduce of N elements sends 2 (c-1)/c N. Both methods
take the same per-sample shares and return the same per-sample lists.

Run: ``.venv/bin/python -m benchmarks.bench_redistribute [--quick]``.
"""

import argparse
import os
import random
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from benchmarks.harness import join_store, median_ms, spawn_ranks

CP = 4


def _worker(rank: int, port: int, n: int, mean: int, repeat: int, out: Any) -> None:
    dist.init_process_group("gloo", store=join_store(port), rank=rank, world_size=CP)
    # CP ranks share this machine's cores: one intra-op thread each, no oversubscription
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // CP))
    from cpslice import Layout, extract_responses, redistribute
    from cpslice._layout.plan import needed_length, resolve_length
    from cpslice._layout.redistribute import _route

    rng = random.Random(0)
    total = [rng.randint(mean // 2, mean + mean // 2) for _ in range(n)]
    response = [rng.randint(1, t - 1) for t in total]
    src = Layout(total, response, cp_mode="allgather", cp_rank=rank, cp_size=CP)
    src = src.with_local_length(needed_length(src))
    zig = Layout(total, response, cp_mode="zigzag", cp_rank=rank, cp_size=CP)
    whole = Layout(total, response)
    values = torch.randn(src.local_length or 0, requires_grad=True)
    entropy = torch.randn(src.local_length or 0, requires_grad=True)
    itemsize = values.element_size()

    def ours(dst: Layout) -> Callable[[], None]:
        def step() -> None:
            lp, ent = extract_responses(values, src, entropy)
            a, b = redistribute((lp, ent), src, dst, cp_group=dist.group.WORLD)
            loss = sum((x.sum() + y.sum() for x, y in zip(a, b)), values.sum() * 0)
            torch.autograd.backward(loss)
        return step

    from cpslice._layout.redistribute import _element_ids

    ids = _element_ids(src, resolve_length(src), src.cp_rank, 0)  # where this rank's shares sit in the whole responses
    dst_counts = {dst: _route(src, resolve_length(src), dst, resolve_length(dst), CP, 0).dst_counts
                  for dst in (zig, whole)}

    def padded(dst: Layout) -> Callable[[], None]:
        def step() -> None:
            lp, ent = extract_responses(values, src, entropy)
            buf = torch.zeros(2, sum(response))
            buf = buf.index_put((torch.tensor([0]), ids), torch.cat(lp)).index_put(
                (torch.tensor([1]), ids), torch.cat(ent))
            buf = _all_reduce(buf)
            counts = list(response)
            if dst.cp_mode == "zigzag":
                buf = buf[:, _element_ids(dst, resolve_length(dst), dst.cp_rank, 0)]
                counts = [int(c) for c in torch.tensor(dst_counts[dst])]
            # the same output as redistribute: per-sample shares of each list
            a, b = torch.split(buf[0], counts), torch.split(buf[1], counts)
            loss = sum((x.sum() + y.sum() for x, y in zip(a, b)), values.sum() * 0)
            torch.autograd.backward(loss)
        return step

    rows = []
    for name, dst in (("allgather -> zigzag", zig), ("allgather -> none", whole)):
        route = _route(src, resolve_length(src), dst, resolve_length(dst), CP, 0)
        sent = 2 * sum(int(i.numel()) for j, i in enumerate(route.send_index) if j != rank)
        ar_sent = int(2 * (CP - 1) / CP * 2 * sum(response))
        t_ours = median_ms(ours(dst), repeat)
        t_pad = median_ms(padded(dst), repeat)
        rows.append((name, sent * itemsize, ar_sent * itemsize, t_ours, t_pad))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


# torch leaves Function.apply untyped; typed once here.
_all_reduce = cast(Callable[[torch.Tensor], torch.Tensor], _AllReduce.apply)


def run(quick: bool = False) -> list[tuple[str, int, int, float, float]]:
    """Spawn CP ranks and measure; rows of (case, our bytes, all_reduce bytes, ms, ms)."""
    n, mean, repeat = (256, 256, 5) if quick else (2048, 512, 7)
    rows: list[tuple[str, int, int, float, float]] = spawn_ranks(
        _worker, CP, (n, mean, repeat), timeout=600
    )
    return rows


def report(rows: list[tuple[str, int, int, float, float]]) -> str:
    lines = [f"{'cp 4, per rank, fwd+bwd':<22} {'sent (ours)':>12} {'sent (a_r)':>12} "
             f"{'bytes a_r/ours':>14} {'ms ours':>8} {'ms a_r':>8} {'time a_r/ours':>13}"]
    for name, ours, ar, t_ours, t_ar in rows:
        lines.append(f"{name:<22} {ours:>12,} {ar:>12,} {ar / max(ours, 1):>13.2f}x "
                     f"{t_ours:>8.2f} {t_ar:>8.2f} {t_ar / t_ours:>12.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="redistribute vs zero-padded all_reduce")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(report(run(args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
