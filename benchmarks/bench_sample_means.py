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
from cpslice import Layout, extract_responses, gather_responses, sample_max, sample_means
from cpslice import shard_responses as shard
from cpslice._layout.plan import needed_length, resolve_length, response_base, selection
from cpslice._layout.redistribute import _route

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


class _Batch:
    """One rank's batch: ``n`` samples of about ``mean`` response tokens in zigzag at cp
    ``CP``, its log-probs (a ``[T]`` leaf) and the rollout's shares; and, for the
    per-sample all-gathers, where every rank's share of each sample sits in the whole
    response."""

    def __init__(self, rank: int, n: int, mean: int) -> None:
        rng = random.Random(0)
        self.n = n
        self.response = [rng.randint(mean // 2, mean + mean // 2) for _ in range(n)]
        self.total = [r + rng.randint(16, mean // 2) for r in self.response]
        gen = torch.Generator().manual_seed(0)
        old_whole = [-torch.rand(r, generator=gen) for r in self.response]
        adv_whole = [torch.full((r,), float(torch.randn(1, generator=gen))) for r in self.response]
        self.masks = [torch.rand(r, generator=gen) > 0.1 for r in self.response]
        self.layouts = [Layout(self.total, self.response, cp_mode="zigzag", cp_rank=q, cp_size=CP)
                        for q in range(CP)]
        self.layout = self.layouts[rank]
        self.world = dist.group.WORLD  # the CP group: every process
        self.values = torch.randn(needed_length(self.layout), requires_grad=True)
        self.old = shard(old_whole, self.layout)
        self.adv_sums = torch.stack([a.sum() for a in shard(adv_whole, self.layout)])
        self.mask_f = [m.float() for m in self.masks]
        self.mask_sums = torch.stack([m.sum() for m in self.mask_f])
        self.pad, self.order = self._places()

    def _places(self) -> tuple[list[int], list[Tensor]]:
        """Per sample, the longest share on any rank, and for the gathered ``[CP * pad_i]``
        which element is response position ``k``."""
        sels = [selection(q, needed_length(q), "response") for q in self.layouts]
        places = [s.sources(response_base(q)) for s, q in zip(sels, self.layouts)]
        starts = [[0, *torch.tensor(s.counts).cumsum(0).tolist()] for s in sels]
        share = [[s.counts[i] for s in sels] for i in range(self.n)]  # [sample][rank]
        pad = [max(c) for c in share]
        order = []
        for i in range(self.n):
            idx = torch.empty(self.response[i], dtype=torch.int64)
            for q in range(CP):
                pos = places[q][starts[q][i] : starts[q][i + 1]]
                idx[pos] = q * pad[i] + torch.arange(share[i][q])
            order.append(idx)
        return pad, order


class _Methods:
    """Each table's methods over one batch, forward and backward; each returns what it
    computed (detached), its gradient left in ``batch.values.grad``."""

    def __init__(self, batch: _Batch) -> None:
        self.b = batch

    def _log_ratios(self) -> tuple[list[Tensor], list[Tensor]]:
        """This rank's log-prob shares and their log-ratios to the rollout's."""
        lp, _ = extract_responses(self.b.values, self.b.layout)
        return lp, [a - b for a, b in zip(lp, self.b.old)]

    def _whole(self, lp: list[Tensor], i: int) -> tuple[Tensor, Tensor]:
        """Sample ``i``'s whole log-probs and old log-probs, all-gathered (slime's way)."""
        gap = self.b.pad[i] - lp[i].shape[0]
        full_lp = _gather_share(torch.nn.functional.pad(lp[i], (0, gap)))[self.b.order[i]]
        with torch.no_grad():
            full_old = _gather_share(torch.nn.functional.pad(self.b.old[i], (0, gap)))[self.b.order[i]]
        return full_lp, full_old

    def _ratio_step(self, ratio: Tensor) -> Tensor:
        """GSPO's loss part of ``ratio``, backward; the ratio."""
        torch.autograd.backward((ratio * self.b.adv_sums).sum())
        return ratio.detach()

    def ours(self) -> Tensor:
        _, d = self._log_ratios()
        return self._ratio_step(sample_means(d, self.b.masks, self.b.layout, cp_group=self.b.world).exp())

    def per_sample(self) -> Tensor:
        lp, _ = extract_responses(self.b.values, self.b.layout)
        means = []
        for i in range(self.b.n):
            full_lp, full_old = self._whole(lp, i)
            means.append(((full_lp - full_old) * self.b.mask_f[i]).sum() / self.b.mask_sums[i])
        return self._ratio_step(torch.stack(means).exp())

    def gathered(self) -> Tensor:
        _, d = self._log_ratios()
        full = gather_responses(d, self.b.layout, cp_group=self.b.world)
        return self._ratio_step(torch.stack([(f * m).sum() for f, m in zip(full, self.b.mask_f)])
                                .div(self.b.mask_sums).exp())

    @staticmethod
    def _statistics(lp: Tensor, old: Tensor) -> Tensor:
        """``[r, M]`` per token: d, the k3 KL, -log p, the chi-square term."""
        d = lp - old
        return torch.stack([d, torch.exp(-d) - 1 + d, -lp, (torch.exp(d) - 1) ** 2], -1)

    def _corrections(self, means: Tensor, largest: Tensor) -> Tensor:
        """The step's loss: the ratio of the samples their largest log-ratio does not
        reject (here the half above the median is, alike on every rank), and the KL and
        chi-square means; backward. Returns the statistics and the max."""
        keep = (largest <= largest.median()).float()
        loss = ((means[:, 0].exp() * keep * self.b.adv_sums).sum() + 0.1 * means[:, 1].sum()
                + 0.01 * means[:, 3].sum())
        torch.autograd.backward(loss)
        return torch.cat([means.detach(), largest[:, None]], 1)

    def ours_stats(self) -> Tensor:
        lp, d = self._log_ratios()
        stats = [self._statistics(a, b) for a, b in zip(lp, self.b.old)]
        largest = sample_max(d, self.b.masks, self.b.layout, cp_group=self.b.world)
        return self._corrections(sample_means(stats, self.b.masks, self.b.layout, cp_group=self.b.world), largest)

    def one_per_statistic(self) -> Tensor:
        lp, d = self._log_ratios()
        stats = [self._statistics(a, b) for a, b in zip(lp, self.b.old)]
        means = [sample_means([s[:, j] for s in stats], self.b.masks, self.b.layout, cp_group=self.b.world)
                 for j in range(M)]
        largest = sample_max(d, self.b.masks, self.b.layout, cp_group=self.b.world)
        return self._corrections(torch.stack(means, 1), largest)

    def per_sample_stats(self) -> Tensor:
        lp, _ = extract_responses(self.b.values, self.b.layout)
        means, largest = [], []
        for i in range(self.b.n):
            full_lp, full_old = self._whole(lp, i)
            means.append((self._statistics(full_lp, full_old) * self.b.mask_f[i][:, None]).sum(0)
                         / self.b.mask_sums[i])
            d = (full_lp - full_old).detach()[self.b.masks[i]]
            largest.append(d.max() if len(d) else d.new_tensor(float("-inf")))
        return self._corrections(torch.stack(means), torch.stack(largest))

    def result(self, fn: Callable[[], Tensor]) -> tuple[Tensor, Tensor]:
        """What ``fn`` returns and the gradient it leaves."""
        self.b.values.grad = None
        ratio = fn()
        grad: Tensor | None = self.b.values.grad  # set by fn's backward
        assert grad is not None
        return ratio, grad.clone()

    def check(self) -> None:
        """Every method of a table gives its first's results and gradients."""
        for first, others in ((self.ours, (self.per_sample, self.gathered)),
                              (self.ours_stats, (self.one_per_statistic, self.per_sample_stats))):
            ref, ref_grad = self.result(first)
            for fn in others:
                got, grad = self.result(fn)
                assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (fn.__name__, (got - ref).abs().max())
                assert torch.allclose(grad, ref_grad, rtol=1e-4, atol=1e-6), fn.__name__


def _tables(m: _Methods, rank: int, repeat: int) -> tuple[list[Row], list[Row]]:
    """Both tables' rows: each method's collectives, bytes sent and median time."""
    b = m.b
    itemsize = 4
    ring = 2 * (CP - 1) / CP
    whole = Layout(b.total, b.response)
    route = _route(b.layout, resolve_length(b.layout), whole, resolve_length(whole), CP, 0)
    a2a_fwd = sum(int(i.numel()) for j, i in enumerate(route.send_index) if j != rank)
    a2a_bwd = sum(s for j, s in enumerate(route.recv_splits) if j != rank)
    gathers = 3 * (CP - 1) * sum(b.pad) * itemsize
    rows: list[Row] = [
        ("sample_means", 2, int(2 * ring * b.n) * itemsize, median_ms(m.ours, repeat)),
        ("per-sample all-gather", 3 * b.n, gathers, median_ms(m.per_sample, repeat)),
        ("gather_responses", 2, (a2a_fwd + a2a_bwd) * itemsize, median_ms(m.gathered, repeat)),
    ]
    # an all_reduce of N elements sends ring * N: the means' [n, M] forward and backward
    # (in one call or in M), the maximum's [2, n] (values, NaN flags) forward only
    means_bytes, max_bytes = int(2 * ring * M * b.n) * itemsize, int(ring * 2 * b.n) * itemsize
    stats_rows: list[Row] = [
        ("sample_means [n, 4] + sample_max", 3, means_bytes + max_bytes, median_ms(m.ours_stats, repeat)),
        ("sample_means per statistic + sample_max", 2 * M + 1, means_bytes + max_bytes,
         median_ms(m.one_per_statistic, repeat)),
        ("per-sample all-gather", 3 * b.n, gathers, median_ms(m.per_sample_stats, repeat)),
    ]
    return rows, stats_rows


def _worker(rank: int, port: int, n: int, mean: int, repeat: int, out: Any) -> None:
    dist.init_process_group("gloo", store=join_store(port), rank=rank, world_size=CP)
    # CP ranks share this machine's cores: one intra-op thread each, no oversubscription
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // CP))
    methods = _Methods(_Batch(rank, n, mean))
    methods.check()
    rows, stats_rows = _tables(methods, rank, repeat)
    if rank == 0:
        out.put((n, sum(methods.b.response), rows, stats_rows))
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
