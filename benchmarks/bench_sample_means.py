"""Sequence-level statistics at cp 4: sample_means (and sample_max) against gathering
whole responses.

Zigzag CP at cp 4 on gloo (spawned processes). Each rank holds its zigzag shares of
every sample's log-probs (extracted from a ``[T]`` leaf, so gradients flow) and of the
rollout's old log-probs. The first table is GSPO's sequence-level ratio: every method
computes, on every rank, ``ratio_i = exp(mean of log_prob - old_log_prob over the whole
masked response)`` and the same loss part
``sum_i ratio_i * (this rank's advantages of sample i, summed)``, then runs backward:

- ``sample_means``: one ``all_reduce`` of ``[n]`` float32 forward, one backward;
- per-sample all-gather (slime's way, written here as the baseline): for every
  sample and every list (log-probs, old log-probs), an all-gather of the rank's
  share (padded to the longest share of that sample on any rank), then the whole
  response is put together and averaged; backward, one exchange per sample of the
  log-probs' gradient (an ``all_to_all``: what a reduce-scatter sends);
- ``gather_responses`` of the per-token log-ratio: one ``all_to_all`` forward, one
  backward, whole responses on every rank.

The second table is the off-policy corrections' step: per sample, ``m = 4`` masked
means of per-token statistics of the log-ratio ``d`` (``d`` itself: GSPO's ratio and
the geometric-mean mask; the k3 KL ``exp(-d) - 1 + d``; the negative log-prob, for the
perplexity; the chi-square term ``(exp(d) - 1)^2``) and the largest ``d`` (rejection
by the largest per-token ratio, no gradient), then a loss of the ratio, the rejection
mask and the KL and chi-square means, and backward:

- ``sample_means`` of ``[r_i, 4]`` + ``sample_max``: one ``all_reduce`` of ``[n, 4]``
  forward, one backward, and one ``all_reduce`` (MAX) of ``[2, n]`` (the maxima and
  their NaN flags);
- one ``sample_means`` per statistic + ``sample_max``: 4 + 4 ``all_reduce``s of ``[n]``, and
  the maximum's;
- per-sample all-gather (slime's way): as above, an all-gather per sample of each list
  the statistics come from (log-probs, old log-probs), every statistic and the maximum
  then computed from the whole responses; backward, one exchange per sample.

Bytes are what one rank sends, forward + backward, counted from the sizes (a ring
all-reduce of ``N`` elements, sum or max, sends ``2 (c-1)/c N``; an all-gather of ``m``
per rank sends ``(c-1) m``). Times are medians of forward + backward, every method of
a table returning the same results and gradients (checked).

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
M = 4  # the statistics of the second table
Row = tuple[str, int, int, float]  # method, collectives per step, bytes sent, ms
Result = tuple[int, int, list[Row], list[Row]]  # samples, tokens, the two tables' rows


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
    from cpslice import Layout, extract_responses, gather_responses, sample_max, sample_means
    from cpslice import shard_responses as shard
    from cpslice._layout.plan import needed_length, resolve_length, response_base, selection
    from cpslice._layout.redistribute import _route

    rng = random.Random(0)
    response = [rng.randint(mean // 2, mean + mean // 2) for _ in range(n)]
    total = [r + rng.randint(16, mean // 2) for r in response]
    gen = torch.Generator().manual_seed(0)
    old_whole = [-torch.rand(r, generator=gen) for r in response]
    adv_whole = [torch.full((r,), float(torch.randn(1, generator=gen))) for r in response]
    masks = [torch.rand(r, generator=gen) > 0.1 for r in response]
    layouts = [Layout(total, response, cp_mode="zigzag", cp_rank=q, cp_size=CP) for q in range(CP)]
    layout = layouts[rank]
    world = dist.group.WORLD  # the CP group: every process
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
        ratio = sample_means([a - b for a, b in zip(lp, old)], masks, layout, cp_group=world).exp()
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
        full = gather_responses([a - b for a, b in zip(lp, old)], layout, cp_group=world)
        ratio = torch.stack([(f * m).sum() for f, m in zip(full, mask_f)]).div(mask_sums).exp()
        torch.autograd.backward(loss_of(ratio))
        return ratio.detach()

    def statistics(lp: Tensor, old: Tensor) -> Tensor:
        """``[r, M]`` per token: d, the k3 KL, -log p, the chi-square term."""
        d = lp - old
        return torch.stack([d, torch.exp(-d) - 1 + d, -lp, (torch.exp(d) - 1) ** 2], -1)

    def corrections(means: Tensor, largest: Tensor) -> Tensor:
        """The step's loss: the ratio of the samples their largest log-ratio does not
        reject (here the half above the median is, alike on every rank), and the KL and
        chi-square means; backward. Returns the statistics and the max."""
        keep = (largest <= largest.median()).float()
        loss = loss_of(means[:, 0].exp() * keep) + 0.1 * means[:, 1].sum() + 0.01 * means[:, 3].sum()
        torch.autograd.backward(loss)
        return torch.cat([means.detach(), largest[:, None]], 1)

    def ours_stats() -> Tensor:
        lp, _ = extract_responses(values, layout)
        stats = [statistics(a, b) for a, b in zip(lp, old)]
        largest = sample_max([a - b for a, b in zip(lp, old)], masks, layout, cp_group=world)
        return corrections(sample_means(stats, masks, layout, cp_group=world), largest)

    def one_per_statistic() -> Tensor:
        lp, _ = extract_responses(values, layout)
        stats = [statistics(a, b) for a, b in zip(lp, old)]
        means = [sample_means([s[:, j] for s in stats], masks, layout, cp_group=world) for j in range(M)]
        largest = sample_max([a - b for a, b in zip(lp, old)], masks, layout, cp_group=world)
        return corrections(torch.stack(means, 1), largest)

    def per_sample_stats() -> Tensor:
        lp, _ = extract_responses(values, layout)
        means, largest = [], []
        for i in range(n):
            gap = pad[i] - lp[i].shape[0]
            full_lp = _gather_share(torch.nn.functional.pad(lp[i], (0, gap)))[order[i]]
            with torch.no_grad():
                full_old = _gather_share(torch.nn.functional.pad(old[i], (0, gap)))[order[i]]
            stats = statistics(full_lp, full_old)
            means.append((stats * mask_f[i][:, None]).sum(0) / mask_sums[i])
            d = (full_lp - full_old).detach()[masks[i]]
            largest.append(d.max() if len(d) else d.new_tensor(float("-inf")))
        return corrections(torch.stack(means), torch.stack(largest))

    def result(fn: Callable[[], Tensor]) -> tuple[Tensor, Tensor]:
        values.grad = None
        ratio = fn()
        grad: Tensor | None = values.grad  # set by fn's backward
        assert grad is not None
        return ratio, grad.clone()

    for first, others in ((ours, (per_sample, gathered)),
                          (ours_stats, (one_per_statistic, per_sample_stats))):
        ref, ref_grad = result(first)
        for fn in others:  # the same results and the same gradients
            got, grad = result(fn)
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (fn.__name__, (got - ref).abs().max())
            assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6), fn.__name__

    itemsize = 4
    ring = 2 * (CP - 1) / CP
    route = _route(layout, resolve_length(layout), whole, resolve_length(whole), CP, 0)
    a2a_fwd = sum(int(i.numel()) for j, i in enumerate(route.send_index) if j != rank)
    a2a_bwd = sum(s for j, s in enumerate(route.recv_splits) if j != rank)
    rows: list[Row] = [
        ("sample_means", 2, int(2 * ring * n) * itemsize, median_ms(ours, repeat)),
        ("per-sample all-gather", 3 * n, 3 * (CP - 1) * sum(pad) * itemsize,
         median_ms(per_sample, repeat)),
        ("gather_responses", 2, (a2a_fwd + a2a_bwd) * itemsize, median_ms(gathered, repeat)),
    ]
    # an all_reduce of N elements sends ring * N: the means' [n, M] forward and backward
    # (in one call or in M), the maximum's [2, n] (values, NaN flags) forward only
    means_bytes, max_bytes = int(2 * ring * M * n) * itemsize, int(ring * 2 * n) * itemsize
    stats_rows: list[Row] = [
        ("sample_means [n, 4] + sample_max", 3, means_bytes + max_bytes,
         median_ms(ours_stats, repeat)),
        ("sample_means per statistic + sample_max", 2 * M + 1, means_bytes + max_bytes,
         median_ms(one_per_statistic, repeat)),
        ("per-sample all-gather", 3 * n, 3 * (CP - 1) * sum(pad) * itemsize,
         median_ms(per_sample_stats, repeat)),
    ]
    if rank == 0:
        out.put((n, sum(response), rows, stats_rows))
    dist.destroy_process_group()


def run(quick: bool = False) -> Result:
    """Spawn CP ranks and measure: (samples, response tokens, the rows of rank 0 of the
    GSPO table and of the statistics table)."""
    n, mean, repeat = (64, 256, 5) if quick else (512, 1024, 5)
    result: Result = spawn_ranks(_worker, CP, (n, mean, repeat), timeout=1200)
    return result


def _table(rows: list[Row]) -> list[str]:
    """The rows side by side, each against the first."""
    width = max(len(name) for name, *_ in rows)
    first_bytes, first_ms = rows[0][2], rows[0][3]
    lines = [f"{'method':<{width}} {'collectives':>11} {'bytes sent':>13} {'x first':>9} "
             f"{'ms':>9} {'x first':>9}"]
    for name, calls, sent, ms in rows:
        lines.append(f"{name:<{width}} {calls:>11} {sent:>13,} {sent / first_bytes:>8.1f}x "
                     f"{ms:>9.1f} {ms / first_ms:>8.2f}x")
    return lines


def report(result: Result) -> str:
    n, tokens, rows, stats_rows = result
    head = f"zigzag cp {CP}, {n} samples, {tokens:,} response tokens; per rank, forward + backward"
    return "\n".join([
        f"GSPO sequence ratio, {head}", *_table(rows), "",
        f"{M} statistics per sample (means) and the largest log-ratio, {head}",
        *_table(stats_rows),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="sample_means, sample_max against gathering responses")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(report(run(args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
