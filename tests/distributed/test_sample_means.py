"""sample_means, sample_max and sample_min on real gloo process groups against float64
no-CP references, and the GSPO and OPSM examples of docs/api-guide.md under zigzag CP.

One spawned run of 4 ranks does all the distributed work (cp 4 on the world group,
cp 2 on two subgroups of 2, zigzag and allgather; the [n, m] statistics and the
extremes under zigzag); each rank builds its local tensor from the naive oracle's map
of rows to positions, extracts its shares, and returns its results, gradients and
every all_reduce it made (shape and op); the parent compares them with references
computed here.
"""

import dataclasses
import math
import re
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import (
    Layout,
    LayoutError,
    extract_responses,
    pack,
    response_log_probs,
    sample_max,
    sample_means,
    sample_min,
    shard_responses,
)
from cpslice._types import CpMode

from ..support._dist import run_distributed, tp_groups
from ..support._docs import block_defining
from ..support.lengths import edge_lengths, sparse_lengths
from ..support.oracle import Config, least_length, local_map
from ..support.sample_stats import masked_extreme, masked_means

WORLD = 4
GROUPS = (4, 2)  # cp sizes: the world group, and two subgroups {0, 1}, {2, 3}
MODES: tuple[CpMode, ...] = ("zigzag", "allgather")
# the same, with every sample padded to a multiple of 4 * cp (verl's tp * cp * 2 at tp 2)
ALIGNED = ("zigzag aligned", "allgather aligned")
CASES = ("mixed", "denominators", "sparse", "bfloat16", "float16")
LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
VOCAB = 16
# the [r_i, m] cases: zigzag, m = 3 statistics, each weighted so in the loss
COLUMN_CASES = ("mixed", "denominators", "sparse")
WEIGHTS = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
EXTREME_CASES = ("mixed", "sparse")  # fully masked samples; ranks that hold nothing


# ---------------------------------------------------------------- the batches


class Case:
    """One batch: whole per-sample values, masks, advantages and denominators; each CP
    group of the world (``replica``) gets a batch of its own, so that a collective on
    the wrong group cannot give the right numbers; with ``nan_on``, one unmasked value
    of the first response that rank holds is NaN."""

    def __init__(self, name: str, cp: int, mode: str, replica: int = 0, nan_on: int | None = None) -> None:
        seed = 10 * cp + (MODES + ALIGNED).index(mode) + 1000 * replica
        base = cast(CpMode, mode.split()[0])
        gen = torch.Generator().manual_seed(seed)
        self.dtype = LOW.get(name, torch.float64)
        if name in LOW:  # long responses of values near 1.4: a low-precision sum stalls
            total, response = [1500, 9, 1300], [1400, 5, 1200]
        elif name == "sparse":  # ranks that hold no response at all
            total, response = sparse_lengths(base, cp)
        else:
            total, response = edge_lengths(9, cp, seed)
        self.total, self.response = total, response
        n = len(total)
        self.values: list[Tensor] = []
        self.masks: list[Tensor] = []
        for i, r in enumerate(response):
            if name in LOW:
                v = (1.4 + 0.05 * torch.randn(r, generator=gen, dtype=torch.float64))
                v = v.to(self.dtype).double()  # what the rank holds, exactly
                m: Tensor = torch.rand(r, generator=gen) > 0.2
            else:
                v = torch.randn(r, generator=gen, dtype=torch.float64)
                kind = i % 3  # masks of every dtype keep their meaning
                if kind == 0:
                    m = torch.rand(r, generator=gen) > 0.3
                elif kind == 1:
                    m = torch.randint(0, 3, (r,), generator=gen)  # int weights 0, 1, 2
                else:
                    m = torch.rand(r, generator=gen, dtype=torch.float64).round(decimals=1)
                if i == 1:
                    m = torch.zeros_like(m)  # a fully masked sample
                # what is masked may hold anything
                v = torch.where(m == 0, torch.tensor([float("-inf"), float("nan")]).repeat(r)[:r], v)
            self.values.append(v)
            self.masks.append(m)
        if nan_on is not None:
            i, k = _held_token(self, cp, nan_on)
            self.values[i] = self.values[i].clone()
            self.values[i][k] = math.nan
        self.advantages = [torch.randn(r, generator=gen, dtype=torch.float64) for r in response]
        self.denominators: list[float] | Tensor | None = None
        if name == "denominators":
            d = [float(r) + 0.5 * i for i, r in enumerate(response)]
            d[max(range(n), key=lambda i: response[i])] = 0.0  # mean 0, never NaN
            self.denominators = d if mode == "zigzag" else torch.tensor(d)
        self.n = n

    def config(self, mode: str, cp: int) -> Config:
        base = cast(CpMode, mode.split()[0])
        align = 4 * cp if mode in ALIGNED else None
        cfg = Config(tuple(self.total), tuple(self.response), "thd", None, base, cp, None, 0,
                     None, align)
        if base == "allgather":
            cfg = dataclasses.replace(cfg, local_length=least_length(cfg))
        return cfg

    def columns(self) -> list[Tensor]:
        """``[R_i, 3]`` statistics per token: v, 2v + 1, -v (masked: -inf, +inf or NaN)."""
        return [torch.stack([v, 2 * v + 1, -v], 1) for v in self.values]

    def whole(self, columns: bool) -> list[Tensor]:
        return self.columns() if columns else self.values

    def reference(self, columns: bool = False) -> tuple[Tensor, Tensor, list[Tensor]]:
        """float64 no-CP: the means, the loss sum_i (exp(mean_i) . w) * sum(adv_i) (w:
        ``WEIGHTS`` for columns, 1 otherwise), its gradients."""
        leaves = [v.clone().requires_grad_() for v in self.whole(columns)]
        mean = masked_means(leaves, self.masks, self.denominators)
        loss = sum((_weighted(mean[i].exp(), columns) * a.sum() for i, a in enumerate(self.advantages)),
                   torch.zeros((), dtype=torch.float64))
        grads: list[Tensor] = []
        if loss.requires_grad:
            grads = list(torch.autograd.grad(loss, leaves, allow_unused=True,
                                             materialize_grads=True))
        return mean.detach(), loss.detach(), grads


def _held_token(case: Case, cp: int, rank: int) -> tuple[int, int]:
    """``(sample, index)`` of the first unmasked response token ``rank`` holds under zigzag."""
    for where in local_map(case.config("zigzag", cp), rank):
        if where is not None:
            i, p = where
            k = p - (case.total[i] - case.response[i] - 1)
            if 0 <= k < case.response[i] and case.masks[i][k] != 0:
                return i, k
    raise AssertionError(f"rank {rank} of {cp} holds no unmasked response token")


def _weighted(stats: Tensor, columns: bool) -> Tensor:
    """A sample's ``exp(mean)`` as one number: ``WEIGHTS . stats`` for columns."""
    return (stats * WEIGHTS).sum() if columns else stats


def _local(cfg: Config, rank: int, per_sample: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The rank's local per-position tensor ``[T, *m]`` holding ``per_sample``
    (``[R_i, *m]``) at the response span."""
    rows = local_map(cfg, rank)
    out = torch.zeros(len(rows), *per_sample[0].shape[1:], dtype=torch.float64)
    for row, where in enumerate(rows):
        if where is not None:
            i, p = where
            k = p - (cfg.total[i] - cfg.response[i] - 1)
            if 0 <= k < cfg.response[i]:
                out[row] = per_sample[i][k]
    return out.to(dtype)


def _to_samples(cfg: Config, rank: int, local: Tensor) -> list[Tensor]:
    """The inverse of ``_local``: per sample, the rank's rows at their response index."""
    out = [torch.zeros(r, *local.shape[1:], dtype=torch.float64) for r in cfg.response]
    for row, where in enumerate(local_map(cfg, rank)):
        if where is not None:
            i, p = where
            k = p - (cfg.total[i] - cfg.response[i] - 1)
            if 0 <= k < cfg.response[i]:
                out[i][k] = local[row].double()
    return out


# ---------------------------------------------------------------- the ranks


DOC_LOSSES = ("gspo_loss", "opsm_loss", "corrected_pg_loss")


def _doc_functions() -> dict[str, Any]:
    """The namespaces of docs/api-guide.md's blocks of the GSPO / OPSM losses and of the
    off-policy corrections."""
    page = "docs/api-guide.md"
    return {**block_defining(page, "gspo_loss"), **block_defining(page, "corrected_pg_loss")}


def _rl_batch(cp: int) -> dict[str, Any]:
    """Tokens, float64 logits and rollout tensors; old log-probs are the current ones
    shifted by 0.1 or 1.0 per sample, so OPSM (delta 0.5) keeps some and drops some."""
    gen = torch.Generator().manual_seed(100 + cp)
    total, response = edge_lengths(8, cp, 100 + cp)
    tokens = [torch.randint(0, VOCAB, (t,), generator=gen) for t in total]
    logits = [torch.randn(t, VOCAB, generator=gen, dtype=torch.float64) for t in total]
    old, adv, masks = [], [], []
    for i, (t, r, tok, lg) in enumerate(zip(total, response, tokens, logits)):
        lp = torch.log_softmax(lg[t - r - 1 : t - 1], -1).gather(1, tok[t - r :, None])[:, 0]
        shift = 0.1 if i % 2 else 1.0
        old.append(lp + shift + 0.05 * torch.randn(r, generator=gen, dtype=torch.float64))
        adv.append(torch.full((r,), (-1.0) ** (i // 2) * (0.5 + i / 10), dtype=torch.float64))
        masks.append(torch.rand(r, generator=gen) > 0.2)
    return dict(total=total, response=response, tokens=tokens, logits=logits, old=old,
                adv=adv, masks=masks)


def _rl_loss(fn: Any, batch: dict[str, Any], layout: Layout, group: Any) -> tuple[float, list[Any]]:
    leaves = [lg.clone().requires_grad_() for lg in batch["logits"]]
    logits = pack(leaves, layout)
    loss = fn(logits, batch["tokens"], layout, batch["old"], batch["adv"], batch["masks"],
              cp_group=group)
    loss.backward()
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]
    return float(loss.detach()), [g.tolist() for g in grads]


Calls = list[tuple[list[int], str, list[int]]]  # every all_reduce: shape, op, the group's ranks


def _means(case: Case, mode: str, cp: int, me: int, group: Any, calls: Calls, *,
           columns: bool) -> dict[str, Any]:
    """One rank's sample_means of ``case`` (``[n]``, or ``[n, 3]`` with ``columns``), its
    loss part and gradients, and the all_reduces forward and backward."""
    cfg = case.config(mode, cp)
    layout = cfg.layout(me)
    local = _local(cfg, me, case.whole(columns), case.dtype).requires_grad_()
    shares, _ = extract_responses(local, layout)
    adv, _ = extract_responses(_local(cfg, me, case.advantages, torch.float64), layout)
    calls.clear()
    means = sample_means(shares, case.masks, layout, cp_group=group, denominators=case.denominators)
    forward = list(calls)
    part = sum((_weighted(means[i].double().exp(), columns) * a.sum() for i, a in enumerate(adv)),
               means[:0].double().sum())
    torch.autograd.backward(part)
    assert local.grad is not None
    # plain Python across the queue: a tensor would be shared through a file
    # descriptor that dies with this process
    return dict(
        means=means.double().tolist(), dtype=str(means.dtype), part=float(part.detach()),
        grads=[g.tolist() for g in _to_samples(cfg, me, local.grad)],
        held=sum(s.shape[0] for s in shares), forward=forward, backward=calls[len(forward):],
    )


def _extremes(case: Case, cp: int, me: int, group: Any, calls: Calls, *,
              columns: bool) -> dict[str, Any]:
    """One rank's sample_max and sample_min of ``case`` under zigzag, from shares of a
    leaf that requires grad, and each call's all_reduces."""
    cfg = case.config("zigzag", cp)
    layout = cfg.layout(me)
    local = _local(cfg, me, case.whole(columns), torch.float64).requires_grad_()
    shares, _ = extract_responses(local, layout)
    out: dict[str, Any] = dict(held=sum(s.shape[0] for s in shares))
    for fn in (sample_max, sample_min):
        calls.clear()
        got = fn(shares, case.masks, layout, cp_group=group)
        out[fn.__name__] = dict(values=got.tolist(), dtype=str(got.dtype),
                                grad=got.requires_grad, calls=list(calls))
    return out


def _worker(rank: int, world: int) -> dict[Any, Any]:
    torch.set_num_threads(1)
    pair = tp_groups(rank, world)[1][0]  # {0, 1} or {2, 3}, made once per rank
    calls: Calls = []
    _count_all_reduces(world, calls)
    docs = _doc_functions()
    out: dict[Any, Any] = {}
    for cp in GROUPS:
        group = dist.group.WORLD if cp == WORLD else pair
        out |= _reductions(rank, cp, group, calls)
        out |= _refusals(rank, cp, group, calls)
        # docs/api-guide.md's examples, zigzag
        batch = _rl_batch(cp)
        layout = Layout(batch["total"], batch["response"], cp_mode="zigzag", cp_rank=rank % cp,
                        cp_size=cp)
        for fn in DOC_LOSSES:
            out[cp, "docs", fn, rank] = _rl_loss(docs[fn], batch, layout, group)
    return out


def _count_all_reduces(world: int, calls: Calls) -> None:
    """In this spawned rank, every ``dist.all_reduce`` is the real one, recorded in
    ``calls`` (shape, op, the group's ranks)."""
    real = dist.all_reduce

    def counted(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:  # the real collective
        op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
        on = kwargs.get("group", args[1] if len(args) > 1 else None)
        ranks = list(range(world)) if on is None else dist.get_process_group_ranks(on)
        calls.append((list(tensor.shape), op.name, ranks))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted


def _reductions(rank: int, cp: int, group: dist.ProcessGroup | None, calls: Calls) -> dict[Any, Any]:
    """This rank's means (per mode, aligned, in columns) and extremes (an unmasked NaN
    on each rank in turn too) in its CP group of size ``cp``."""
    me, replica = rank % cp, rank // cp
    out: dict[Any, Any] = {}
    for mode in MODES + ALIGNED:
        for name in CASES if mode in MODES else ("mixed", "sparse"):
            out[cp, mode, name, rank] = _means(Case(name, cp, mode, replica), mode, cp, me,
                                               group, calls, columns=False)
    for name in COLUMN_CASES:
        out[cp, "columns", name, rank] = _means(Case(name, cp, "zigzag", replica), "zigzag",
                                                cp, me, group, calls, columns=True)
    for name in EXTREME_CASES:
        for columns in (False, True):
            out[cp, "extremes", name, columns, rank] = _extremes(
                Case(name, cp, "zigzag", replica), cp, me, group, calls, columns=columns)
    for holder in range(cp):  # an unmasked NaN on each rank in turn
        for columns in (False, True):
            out[cp, "nan", holder, columns, rank] = _extremes(
                Case("mixed", cp, "zigzag", replica, nan_on=holder), cp, me, group, calls,
                columns=columns)
    return out


def _refusals(rank: int, cp: int, group: dist.ProcessGroup | None, calls: Calls) -> dict[Any, Any]:
    """A layout for another group size, and ``cp_group=None`` under CP: refused on every
    rank before any collective; ``cp_group=None`` without CP: fine."""
    me = rank % cp
    out: dict[Any, Any] = {}
    wrong = Layout([5], [2], cp_mode="zigzag", cp_rank=me % (6 - cp), cp_size=6 - cp)
    try:
        sample_means(shard_responses([torch.zeros(2)], wrong), [torch.ones(2)], wrong,
                     cp_group=group)
    except LayoutError as e:
        out[cp, "wrong group", rank] = str(e)
    # cp_group=None is no group (as tp_group=None is no TP)
    mine = Layout([5], [2], cp_mode="zigzag", cp_rank=me, cp_size=cp)
    for reducer in (sample_means, sample_max):
        calls.clear()
        try:
            reducer(shard_responses([torch.zeros(2)], mine), [torch.ones(2)], mine,
                    cp_group=None)
        except LayoutError as e:
            out[cp, "no group", reducer.__name__, rank] = (str(e), len(calls))
    whole = Layout([5], [2])
    calls.clear()
    out[cp, "no cp", rank] = (
        sample_means([torch.ones(2)], [torch.ones(2)], whole, cp_group=None).tolist(),
        sample_max([torch.ones(2)], [torch.ones(2)], whole, cp_group=None).tolist(),
        len(calls),
    )
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[Any, Any]:
    merged: dict[Any, Any] = {}
    for result in run_distributed(_worker, WORLD, timeout=240):
        merged.update(result)
    return merged


def _replicas(cp: int) -> list[list[int]]:
    """The ranks of each CP group of size ``cp`` in the world of 4 (its index: the
    ``replica`` of its ``Case``)."""
    return [list(range(WORLD))] if cp == WORLD else [[0, 1], [2, 3]]


# ---------------------------------------------------------------- the checks


def _check_means(ranks: dict[Any, Any], cp: int, key: str, name: str, mode: str, *,
                 columns: bool) -> None:
    """The ranks' results under ``key`` equal their CP group's case's float64 no-CP means
    (``[n]``, or ``[n, 3]`` with ``columns``), each from one all_reduce (sum) of that
    shape each way on that group, whatever the rank holds; their loss parts sum to the
    no-CP loss and its gradients."""
    for index, replica in enumerate(_replicas(cp)):
        case = Case(name, cp, mode, index)
        means, loss, grads = case.reference(columns)
        assert means.shape == ((case.n, 3) if columns else (case.n,)) and not torch.isnan(means).any()
        got = [ranks[cp, key, name, r] for r in replica]
        for r, result in zip(replica, got):
            got_means = torch.tensor(result["means"], dtype=torch.float64)
            assert torch.allclose(got_means, means, rtol=1e-12, atol=1e-12), (r, name)
            assert result["forward"] == result["backward"] == [(list(means.shape), "SUM", replica)], r
        assert abs(sum(g["part"] for g in got) - float(loss)) < 1e-9
        for i, want in enumerate(grads):
            total = torch.stack([torch.tensor(g["grads"][i], dtype=torch.float64).view(want.shape)
                                 for g in got]).sum(0)
            assert torch.allclose(total, want, rtol=1e-12, atol=1e-12), (name, i)
        if name == "sparse":
            assert any(g["held"] == 0 for g in got), "some rank holds nothing"


@pytest.mark.parametrize("cp", GROUPS)
@pytest.mark.parametrize(
    ("mode", "name"),
    [(m, n) for m in MODES for n in ("mixed", "denominators", "sparse")]
    + [(m, n) for m in ALIGNED for n in ("mixed", "sparse")],
)
def test_means_and_gradients_equal_the_float64_no_cp_ones(
    ranks: dict[Any, Any], cp: int, mode: str, name: str
) -> None:
    _check_means(ranks, cp, mode, name, mode, columns=False)


@pytest.mark.parametrize("cp", GROUPS)
@pytest.mark.parametrize("name", COLUMN_CASES)
def test_m_statistics_in_one_all_reduce_equal_the_float64_no_cp_ones(
    ranks: dict[Any, Any], cp: int, name: str
) -> None:
    _check_means(ranks, cp, "columns", name, "zigzag", columns=True)


@pytest.mark.parametrize("cp", GROUPS)
@pytest.mark.parametrize("name", EXTREME_CASES)
@pytest.mark.parametrize("columns", [False, True], ids=["[n]", "[n, m]"])
def test_extremes_in_one_all_reduce_equal_the_whole_response_ones(
    ranks: dict[Any, Any], cp: int, name: str, columns: bool
) -> None:
    wants = []
    for index, replica in enumerate(_replicas(cp)):
        case = Case(name, cp, "zigzag", index)
        whole = case.whole(columns)
        # what the test is about is in the batch: a sample with nothing unmasked, and (the
        # mixed batch) -inf and NaN, and +inf in the columns, at masked positions, where
        # they would win
        assert any(not bool((m != 0).any()) for m in case.masks)
        masked = torch.cat([v[m == 0].flatten() for v, m in zip(whole, case.masks)])
        if name == "mixed":
            assert masked.isnan().any() and masked.isneginf().any()
            assert masked.isposinf().any() or not columns
        for fn, op, largest in (("sample_max", "MAX", True), ("sample_min", "MIN", False)):
            want = masked_extreme(whole, case.masks, largest)
            assert want.isinf().any() and not want.isnan().any()
            wants.append(want)
            for r in replica:
                got = ranks[cp, "extremes", name, columns, r][fn]
                assert torch.equal(torch.tensor(got["values"], dtype=torch.float64), want), (fn, r)
                assert got["dtype"] == "torch.float64" and not got["grad"], (fn, r)
                # one, of [2, n] or [2, n, m] (the values and their NaN flags), on its group
                assert got["calls"] == [([2, *want.shape], op, replica)], (fn, r)
    if cp < WORLD:  # the two groups' batches differ: a world all_reduce would mix them
        assert not torch.equal(wants[0], wants[2])
    if name == "sparse":
        assert any(ranks[cp, "extremes", name, columns, r]["held"] == 0 for r in range(WORLD))


@pytest.mark.parametrize("cp", GROUPS)
@pytest.mark.parametrize("columns", [False, True], ids=["[n]", "[n, m]"])
def test_an_unmasked_nan_on_any_rank_is_nan_on_every_rank(
    ranks: dict[Any, Any], cp: int, columns: bool
) -> None:
    """Whichever rank holds the unmasked NaN, its sample's extremes are NaN on every rank
    of the group, and every other sample's are the exact whole-response ones."""
    for index, replica in enumerate(_replicas(cp)):
        for holder in range(cp):
            case = Case("mixed", cp, "zigzag", index, nan_on=holder)
            sample, _ = _held_token(case, cp, holder)
            for fn, largest in (("sample_max", True), ("sample_min", False)):
                want = masked_extreme(case.whole(columns), case.masks, largest)
                assert bool(want[sample].isnan().all()) and int(want.isnan().sum()) == want[sample].numel()
                for r in replica:
                    got = torch.tensor(ranks[cp, "nan", holder, columns, r][fn]["values"],
                                       dtype=torch.float64)
                    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                               msg=f"{fn}: NaN on rank {holder}, seen by rank {r}")


@pytest.mark.parametrize("cp", GROUPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(LOW))
def test_low_precision_means_over_long_responses(
    ranks: dict[Any, Any], cp: int, mode: CpMode, name: str
) -> None:
    # float32 accumulation: the result is the float64 mean rounded once to the dtype
    # (a sum accumulated in bfloat16 stalls near 1024 and is off by tens of percent)
    ulp = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[name]
    for r in range(WORLD):
        means, _, _ = Case(name, cp, mode, r // cp).reference()
        result = ranks[cp, mode, name, r]
        assert result["dtype"] == str(LOW[name])
        got = torch.tensor(result["means"], dtype=torch.float64)
        assert torch.allclose(got, means, rtol=1.01 * ulp, atol=0), r


@pytest.mark.parametrize("cp", GROUPS)
@pytest.mark.parametrize("fn", DOC_LOSSES)
def test_doc_losses_sum_over_cp_to_the_no_cp_loss_and_gradients(
    ranks: dict[Any, Any], cp: int, fn: str
) -> None:
    batch = _rl_batch(cp)
    docs = _doc_functions()
    loss, grads = _rl_loss(docs[fn], batch, Layout(batch["total"], batch["response"]), None)
    for replica in _replicas(cp):
        parts = [ranks[cp, "docs", fn, r] for r in replica]
        assert abs(sum(p[0] for p in parts) - loss) < 1e-10
        for i, want in enumerate(grads):
            total = torch.stack([torch.tensor(p[1][i], dtype=torch.float64)
                                 for p in parts]).sum(0)
            assert torch.allclose(total, torch.tensor(want, dtype=torch.float64),
                                  rtol=1e-10, atol=1e-12), i
    if fn == "opsm_loss":  # the batch exercises both outcomes of the mask
        negative = [bool((a * m).sum() < 0) for a, m in zip(batch["adv"], batch["masks"])]
        assert any(negative[i] and i % 2 == 0 for i in range(len(negative)))  # dropped
        assert any(negative[i] and i % 2 for i in range(len(negative)))  # kept
    if fn == "corrected_pg_loss":  # the geometric-mean mask keeps some and drops some
        whole = Layout(batch["total"], batch["response"])
        lp, _ = response_log_probs(pack(batch["logits"], whole), batch["tokens"], whole)
        _, keep, _ = docs["rollout_corrections"](lp, batch["old"], batch["masks"], whole)
        assert 0 < int(keep.sum()) < len(keep), keep


@pytest.mark.parametrize("cp", GROUPS)
def test_a_layout_for_another_group_is_refused_on_every_rank(ranks: dict[Any, Any], cp: int) -> None:
    for r in range(WORLD):
        message = ranks.get((cp, "wrong group", r), "no error")
        assert re.search(rf"the layout is rank {r % cp % (6 - cp)} of cp_size {6 - cp} but this process "
                         rf"is rank {r % cp} of a group of {cp}; pass the CP group", message), message


@pytest.mark.parametrize("cp", GROUPS)
def test_no_cp_group_under_cp_is_refused_on_every_rank(ranks: dict[Any, Any], cp: int) -> None:
    for r in range(WORLD):
        for fn in ("sample_means", "sample_max"):
            message, calls = ranks.get((cp, "no group", fn, r), ("no error", -1))
            assert message.startswith(
                f"{fn} at cp_size {cp} needs cp_group=, the CP process group (megatron-core: "
                "parallel_state.get_context_parallel_group(); dist.group.WORLD when every "
                "process is one CP group); None means no group, as tp_group=None means no TP"
            ), message
            assert calls == 0, (fn, r)  # refused before any collective
        assert ranks[cp, "no cp", r] == ([1.0], [1.0], 0)  # without CP, None is fine
