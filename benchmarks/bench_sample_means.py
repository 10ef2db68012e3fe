"""GSPO's sequence-level ratio: sample_means against gathering whole responses, cp 4.

Zigzag CP at cp 4 on gloo (spawned processes). Each rank holds its zigzag shares of
every sample's log-probs (extracted from a ``[T]`` leaf, so gradients flow) and of the
rollout's old log-probs. Every method computes, on every rank, ``ratio_i = exp(mean of
log_prob - old_log_prob over the whole masked response)`` and the same loss part
``sum_i ratio_i * (this rank's advantages of sample i, summed)``, then runs backward:

- ``sample_means``: one ``all_reduce`` of ``[n]`` float32 forward, one backward;
- per-sample all-gather (slime's way, written here as the baseline): for every
  sample and every list (log-probs, old log-probs), an all-gather of the rank's
  share (padded to the longest share of that sample on any rank), then the whole
  response is put together and averaged; backward, one exchange per sample of the
  log-probs' gradient (an ``all_to_all``: what a reduce-scatter sends);
- ``gather_responses`` of the per-token log-ratio: one ``all_to_all`` forward, one
  backward, whole responses on every rank.

Bytes are what one rank sends, forward + backward, counted from the sizes (a ring
all-reduce of ``N`` elements sends ``2 (c-1)/c N``; an all-gather of ``m`` per rank
sends ``(c-1) m``). Times are medians of forward + backward, every method returning
the same ratios (checked).

Run: ``.venv/bin/python -m benchmarks.bench_sample_means [--quick]``.
"""

import argparse
import os
import random
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks.harness import join_store, median_ms, spawn_ranks

CP = 4
Row = tuple[str, int, int, float]  # method, collectives per step, bytes sent, ms


class _GatherShare(torch.autograd.Function):
    """All-gather of equal-size blocks; backward sends each block's gradient home."""

    @staticmethod
    def forward(ctx: Any, block: Tensor) -> Tensor:
        out = [torch.empty_like(block) for _ in range(CP)]
        dist.all_gather(out, block.contiguous())
        return torch.cat(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        back = torch.empty_like(grad)
        dist.all_to_all_single(back, grad.contiguous())
        return back.view(CP, -1).sum(0)


# torch leaves Function.apply untyped; typed once here.
_gather_share = cast(Callable[[Tensor], Tensor], _GatherShare.apply)


def _worker(rank: int, port: int, n: int, mean: int, repeat: int, out: Any) -> None:
    dist.init_process_group("gloo", store=join_store(port), rank=rank, world_size=CP)
    # CP ranks share this machine's cores: one intra-op thread each, no oversubscription
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // CP))
    from cpslice import Layout, extract_responses, gather_responses, sample_means
    from cpslice import shard_responses as shard
    from cpslice._plan import needed_length, response_base, selection
    from cpslice._redistribute import _route

    rng = random.Random(0)
    response = [rng.randint(mean // 2, mean + mean // 2) for _ in range(n)]
    total = [r + rng.randint(16, mean // 2) for r in response]
    gen = torch.Generator().manual_seed(0)
    old_whole = [-torch.rand(r, generator=gen) for r in response]
    adv_whole = [torch.full((r,), float(torch.randn(1, generator=gen))) for r in response]
    masks = [torch.rand(r, generator=gen) > 0.1 for r in response]
    layouts = [Layout(total, response, cp_mode="zigzag", cp_rank=q, cp_size=CP) for q in range(CP)]
    layout = layouts[rank]
    whole = Layout(total, response)
    values = torch.randn(needed_length(layout), requires_grad=True)
    old, adv = shard(old_whole, layout), shard(adv_whole, layout)
    adv_sums = torch.stack([a.sum() for a in adv])
    mask_f = [m.float() for m in masks]
    mask_sums = torch.stack([m.sum() for m in mask_f])

    # every rank's share of every sample: where it sits in the whole response
    sels = [selection(q, needed_length(q), "response") for q in layouts]
    places = [s.sources(response_base(q)) for s, q in zip(sels, layouts)]
    starts = [[0, *torch.tensor(s.counts).cumsum(0).tolist()] for s in sels]
    share = [[s.counts[i] for s in sels] for i in range(n)]  # [sample][rank]
    pad = [max(c) for c in share]
    # for the gathered [CP * pad_i] of sample i: which element is response position k
    order = []
    for i in range(n):
        idx = torch.empty(response[i], dtype=torch.int64)
        for q in range(CP):
            pos = places[q][starts[q][i] : starts[q][i + 1]]
            idx[pos] = q * pad[i] + torch.arange(share[i][q])
        order.append(idx)

    def loss_of(ratio: Tensor) -> Tensor:
        return (ratio * adv_sums).sum()

    def ours() -> Tensor:
        lp, _ = extract_responses(values, layout)
        ratio = sample_means([a - b for a, b in zip(lp, old)], masks, layout).exp()
        torch.autograd.backward(loss_of(ratio))
        return ratio.detach()

    def per_sample() -> Tensor:
        lp, _ = extract_responses(values, layout)
        means = []
        for i in range(n):
            gap = pad[i] - lp[i].shape[0]
            full_lp = _gather_share(torch.nn.functional.pad(lp[i], (0, gap)))[order[i]]
            with torch.no_grad():
                full_old = _gather_share(torch.nn.functional.pad(old[i], (0, gap)))[order[i]]
            means.append(((full_lp - full_old) * mask_f[i]).sum() / mask_sums[i])
        ratio = torch.stack(means).exp()
        torch.autograd.backward(loss_of(ratio))
        return ratio.detach()

    def gathered() -> Tensor:
        lp, _ = extract_responses(values, layout)
        full = gather_responses([a - b for a, b in zip(lp, old)], layout)
        ratio = torch.stack([(f * m).sum() for f, m in zip(full, mask_f)]).div(mask_sums).exp()
        torch.autograd.backward(loss_of(ratio))
        return ratio.detach()

    def result(fn: Callable[[], Tensor]) -> tuple[Tensor, Tensor]:
        values.grad = None
        ratio = fn()
        grad: Tensor | None = values.grad  # set by fn's backward
        assert grad is not None
        return ratio, grad.clone()

    ref, ref_grad = result(ours)
    for fn in (per_sample, gathered):  # the same ratios and the same gradients
        got, grad = result(fn)
        assert torch.allclose(got, ref, rtol=1e-5), (fn.__name__, (got - ref).abs().max())
        assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6), fn.__name__

    itemsize = 4
    ring = 2 * (CP - 1) / CP
    route = _route(layout, whole, CP)
    a2a_fwd = sum(int(i.numel()) for j, i in enumerate(route.send_index) if j != rank)
    a2a_bwd = sum(s for j, s in enumerate(route.recv_splits) if j != rank)
    rows: list[Row] = [
        ("sample_means", 2, int(2 * ring * n) * itemsize, median_ms(ours, repeat)),
        ("per-sample all-gather", 3 * n, 3 * (CP - 1) * sum(pad) * itemsize,
         median_ms(per_sample, repeat)),
        ("gather_responses", 2, (a2a_fwd + a2a_bwd) * itemsize, median_ms(gathered, repeat)),
    ]
    if rank == 0:
        out.put((n, sum(response), rows))
    dist.destroy_process_group()


def run(quick: bool = False) -> tuple[int, int, list[Row]]:
    """Spawn CP ranks and measure: (samples, response tokens, rows of rank 0)."""
    n, mean, repeat = (64, 256, 5) if quick else (512, 1024, 5)
    result: tuple[int, int, list[Row]] = spawn_ranks(_worker, CP, (n, mean, repeat), timeout=1200)
    return result


def report(result: tuple[int, int, list[Row]]) -> str:
    n, tokens, rows = result
    ours_bytes, ours_ms = rows[0][2], rows[0][3]
    lines = [
        f"GSPO sequence ratio, zigzag cp {CP}, {n} samples, {tokens:,} response tokens; "
        "per rank, forward + backward",
        f"{'method':<22} {'collectives':>11} {'bytes sent':>13} {'x sample_means':>14} "
        f"{'ms':>9} {'x sample_means':>14}",
    ]
    for name, calls, sent, ms in rows:
        lines.append(f"{name:<22} {calls:>11} {sent:>13,} {sent / ours_bytes:>13.1f}x "
                     f"{ms:>9.1f} {ms / ours_ms:>13.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="sample_means against gathering responses")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(report(run(args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
