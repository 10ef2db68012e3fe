"""Invariant mode (``invariant=True``, docs/invariance.md) with ``torch.equal``, never a
tolerance: a row's results and its logits' gradient are the same bits whatever the other
rows of the call (shuffled and subset batches), the chunk size (1, 7, 256, the default),
the compile setting, the layout, the CP size and rank and the TP size (a gloo world of 4),
in float32 and bfloat16, with supports, per-row temperatures, a soft cap and a padded
vocabulary; they equal the spec's rollout-engine function; a planted change of the merge
order fails. Top-k ties that straddle tiles and TP shards go to the smaller id at TP 2
and 4."""

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from cpslice import (
    Layout,
    _probe,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    log_probs_at,
    log_probs_at_from_hidden,
    pack,
    response_distillation,
    response_distillation_from_hidden,
    response_log_probs_from_hidden,
    response_topk_log_probs,
    response_topk_log_probs_from_hidden,
    topk_log_probs,
    topk_log_probs_from_hidden,
)
from cpslice._vocab import bits as _bits
from cpslice._vocab import invariant as _invariant
from cpslice._vocab import softmax as _softmax
from cpslice._vocab import spec as _spec
from cpslice._vocab import stats as _stats
from cpslice._vocab.backends import compiled as _compiled
from cpslice._vocab.backends import selection as _backend

from ..support._dist import run_distributed
from ..support.invariant_cases import decode, edge_rows, peaked, shard_first, spec, topk_ties_worker, worker
from ..support.reference import grad_close, reference, tolerance, value_atol
from ..support.token_sets import csr

T, V = 20, 700  # 6 tiles, the last one partial
DTYPES = (torch.float32, torch.bfloat16)
CHUNKS = (1, 7, 256, None)


def _data(dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, V - 20, (T,), generator=gen)
    return (edge_rows(targets, V, dtype, seed + 1), targets, torch.rand(T, generator=gen) + 0.5,
            torch.randn(T, generator=gen), torch.randn(T, generator=gen))


def _batches() -> list[tuple[Tensor, int | None]]:
    """(rows of the call, chunk size): every chunk size in order, then shuffled and a
    shuffled subset."""
    gen = torch.Generator().manual_seed(1)
    order = torch.arange(T)
    return [*((order, c) for c in CHUNKS), (torch.randperm(T, generator=gen), 7),
            (torch.randperm(T, generator=gen)[: T // 2], None)]


SETS = [[], [1, 2, 3], list(range(0, 700, 9)), [5], [], [600, 601, 130]] * 4


def _options(name: str, temps: Tensor, rows: Tensor) -> dict[str, Any]:
    if name == "plain":
        return {}
    if name == "temperature-softcap":
        return {"temperature": temps[rows], "softcap": 15.0}
    if name == "vocab_size":
        return {"vocab_size": V - 20, "temperature": 0.8}
    return {"support": csr([SETS[r] for r in rows.tolist()]),
            "entropy_over": "support" if name == "support-entropy" else "full"}


def _float64(logits: Tensor, targets: Tensor, name: str, temps: Tensor, g_lp: Tensor,
             g_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The float64 reference of ``_options(name)``: log-probs, entropies, logits' gradient
    by ``log_softmax`` through autograd (-inf as 1e4 below a row's least logit, so that
    exp gives 0 and no 0 * inf)."""
    options = _options(name, temps, torch.arange(T))
    x = logits.double().requires_grad_(True)
    cap = options.get("softcap")
    y = x if cap is None else torch.tanh(x / cap) * cap
    tau = torch.as_tensor(options.get("temperature", 1.0), dtype=torch.float64).expand(T)
    z = y / tau[:, None]
    keep = torch.isfinite(z) & (torch.arange(V) < options.get("vocab_size", V))
    kept = keep.clone()  # the log-prob's distribution: a row's set and its target
    for t, ids in enumerate(SETS[:T] if "support" in name else []):
        if ids:
            inside = torch.zeros(V, dtype=torch.bool)
            inside[ids + [int(targets[t])]] = True
            kept[t] &= inside
    low = torch.where(keep, z, math.inf).amin(1, keepdim=True) - 1e4

    def log_softmax(mask: Tensor) -> Tensor:
        return torch.log_softmax(torch.where(mask, z, low), -1)

    lp = log_softmax(kept)
    over = log_softmax(kept if name == "support-entropy" else keep)
    logp = lp.gather(1, targets[:, None])[:, 0]
    entropy = -(over.exp() * over).sum(-1)
    torch.autograd.backward((logp * g_lp.double()).sum() + (entropy * g_h.double()).sum())
    assert x.grad is not None
    return logp.detach(), entropy.detach(), x.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["plain", "temperature-softcap", "vocab_size", "support", "support-entropy"])
def test_a_rows_log_prob_entropy_and_gradient_are_its_own(dtype: torch.dtype, name: str) -> None:
    logits, targets, temps, g_lp, g_h = _data(dtype)
    per_row = [_options(name, temps, torch.tensor([t])) for t in range(T)]
    want = [decode(logits[t : t + 1], targets[t : t + 1], g_lp[t : t + 1], g_h[t : t + 1], **per_row[t])
            for t in range(T)]
    want_lp, want_h, want_grad = (torch.cat([w[k] for w in want]) for k in range(3))
    ref_lp, ref_h, ref_grad = _float64(logits, targets, name, temps, g_lp, g_h)  # and right, within rounding
    atol = tolerance(logits.float(), 0.5)
    torch.testing.assert_close(want_lp.double(), ref_lp, rtol=0.0, atol=atol)
    torch.testing.assert_close(want_h.double(), ref_h, rtol=0.0, atol=atol)
    grad_close(want_grad, ref_grad, 1e-5 if dtype == torch.float32 else 1e-2)
    if name in ("plain", "temperature-softcap", "vocab_size"):  # the spec's function, whole batch
        options = _options(name, temps, torch.arange(T))
        lp, h = spec()(logits, targets, options.get("temperature", 1.0), options.get("softcap"),
                       options.get("vocab_size"))
        assert torch.equal(lp, want_lp) and torch.equal(h, want_h)
    for rows, chunk in _batches():
        x = logits[rows].clone().requires_grad_(True)
        lp, h = log_probs_and_entropy(x, targets[rows], with_entropy=True, chunk_size=chunk, invariant=True,
                                      **_options(name, temps, rows))
        torch.autograd.backward((lp * g_lp[rows]).sum() + (h * g_h[rows]).sum())
        assert torch.equal(lp, want_lp[rows]), (chunk, (lp - want_lp[rows]).abs().max())
        assert torch.equal(h, want_h[rows]), (chunk, (h - want_h[rows]).abs().max())
        assert x.grad is not None and torch.equal(x.grad, want_grad[rows]), chunk


def _each_row(fn: Callable[[Tensor], tuple[Tensor, ...]], n: int) -> list[Tensor]:
    outs = [fn(torch.tensor([t])) for t in range(n)]
    return [torch.cat([o[k] for o in outs]) for k in range(len(outs[0]))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_top_k_and_log_probs_at_ids_are_a_rows_own(dtype: torch.dtype) -> None:
    logits, _, temps, _, _ = _data(dtype, seed=5)
    ids = torch.randint(0, V, (T, 3), generator=torch.Generator().manual_seed(2))
    g = torch.randn(T, 6, generator=torch.Generator().manual_seed(3))

    def call(rows: Tensor, chunk: int | None = None) -> tuple[Tensor, ...]:
        x = logits[rows].clone().requires_grad_(True)
        top, top_ids = topk_log_probs(x, 3, temperature=temps[rows], softcap=10.0, chunk_size=chunk, invariant=True)
        at = log_probs_at(x, ids[rows], temperature=temps[rows], softcap=10.0, chunk_size=chunk, invariant=True)
        torch.autograd.backward((torch.cat([top, at], 1) * g[rows]).sum())
        assert x.grad is not None
        return top.detach(), top_ids, at.detach(), x.grad

    want = _each_row(call, T)
    assert torch.equal(want[1][4], torch.tensor([0, 1, 2]))  # the tied row: the smallest ids
    for rows, chunk in _batches():
        for got, w in zip(call(rows, chunk), want):
            assert torch.equal(got, w[rows]), chunk


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_hidden_state_path_gives_a_row_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    rows_n, h_dim = 70, 24  # more than one 64-row block
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(rows_n, h_dim, generator=gen).to(dtype)
    weight = (torch.randn(V, h_dim, generator=gen) / 2).to(dtype)
    targets = torch.randint(0, V, (rows_n,), generator=gen)
    ids = torch.randint(0, V, (rows_n, 2), generator=gen)
    g = torch.randn(rows_n, 6, generator=gen)

    def call(rows: Tensor, chunk: int | None = None) -> tuple[Tensor, ...]:
        h = hidden[rows].clone().requires_grad_(True)
        lp, ent = log_probs_and_entropy_from_hidden(h, weight, targets[rows], with_entropy=True, chunk_size=chunk,
                                                    temperature=0.7, invariant=True)
        top, top_ids = topk_log_probs_from_hidden(h, weight, 2, chunk_size=chunk, invariant=True)
        at = log_probs_at_from_hidden(h, weight, ids[rows], chunk_size=chunk, invariant=True)
        torch.autograd.backward((torch.stack([lp, ent], 1) * g[rows, :2]).sum() + (top * g[rows, 2:4]).sum()
                                + (at * g[rows, 4:]).sum())
        assert h.grad is not None
        return lp.detach(), ent.detach(), top.detach(), top_ids, at.detach(), h.grad

    want = _each_row(call, rows_n)
    # and right, within rounding: float64 log_softmax of hidden @ weight.T
    ref_lp, ref_h, _ = reference(hidden.double() @ weight.double().t(), targets, 0.7, g[:, 0], g[:, 1])
    atol = value_atol(hidden, weight, 0.7, 2.0**-7 if dtype == torch.bfloat16 else 2.0**-18)
    torch.testing.assert_close(want[0].double(), ref_lp, rtol=0.0, atol=atol)
    torch.testing.assert_close(want[1].double(), ref_h, rtol=0.0, atol=atol)
    perm = torch.randperm(rows_n, generator=gen)
    for rows, chunk in [(torch.arange(rows_n), 1), (torch.arange(rows_n), 7), (perm, 256), (perm[:33], None)]:
        for got, w in zip(call(rows, chunk), want):
            assert torch.equal(got, w[rows]), chunk


@pytest.mark.slow  # three inductor compilations: 40-60 s each on 2 shared cores
@pytest.mark.parametrize(("dtype", "vocab_size", "kernel"), [
    (torch.float32, None, "grad_kernel"),
    (torch.bfloat16, None, "pairs_kernel"),  # two bfloat16 columns an int32
    (torch.bfloat16, 681, "grad_kernel"),  # an odd width: widened chunk by chunk instead
])
def test_the_compile_setting_changes_no_bit(dtype: torch.dtype, vocab_size: int | None, kernel: str) -> None:
    logits, targets, temps, g_lp, g_h = _data(dtype)
    logits = logits.repeat(300, 1)  # past the compiled kernels' size threshold
    targets = targets.repeat(300).clamp(max=(vocab_size or V) - 1)

    def run() -> tuple[Tensor, Tensor, Tensor]:
        x = logits.clone().requires_grad_(True)
        lp, h = log_probs_and_entropy(x, targets, with_entropy=True, temperature=0.9, vocab_size=vocab_size,
                                      invariant=True)
        torch.autograd.backward(lp.sum() + h.sum())
        assert x.grad is not None
        return lp, h, x.grad

    with _backend.using("eager"):
        eager = run()
    # each compiled shape checked again
    with _backend.using("compiled", fresh=True), _probe.watch() as seen:
        for a, b in zip(run(), eager):
            assert torch.equal(a, b)
    assert {e.name for e in seen.of("launch", backend="compiled", invariant=True)} == {"row_kernel", kernel}
    assert seen.count("launch", backend="eager") == 0  # no kernel turned eager after a difference


@pytest.mark.slow  # an inductor compilation
def test_a_compiled_kernel_that_differs_is_caught_and_the_eager_bits_kept() -> None:
    logits, targets, temps, _, _ = _data(torch.float32)
    logits = logits.repeat(300, 1)
    targets = targets.repeat(300)
    real = _compiled.row_kernel

    def planted(x: Tensor, r: Tensor, tau: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        big, total, ent = real(x, r, tau)
        return big, total * (1 + 2**-20), ent  # a sum off in its last bits

    with _backend.using("eager"):
        want = log_probs_and_entropy(logits, targets, with_entropy=True, invariant=True)
    with _backend.using("compiled", fresh=True):
        with warnings.catch_warnings(record=True) as caught, _probe.substitute("row_kernel", planted):
            warnings.simplefilter("always", RuntimeWarning)  # the filters as they are: torch's own stay quiet
            got = log_probs_and_entropy(logits, targets, with_entropy=True, invariant=True)
        assert any(issubclass(w.category, RuntimeWarning) and "compiled row_kernel differs from the eager one"
                   in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with _probe.watch() as seen:  # the real kernel back, but the compiled kernels stay off
            again = log_probs_and_entropy(logits, targets, with_entropy=True, invariant=True)
        assert all(torch.equal(a, b) for a, b in zip(again, want))
        assert seen.count("launch", backend="compiled") == 0 and seen.count("launch", backend="eager") > 0
        assert _compiled.compiled_ok(logits) is False  # for the rest of the process


def test_the_bfloat16_rounding_of_the_pairs_kernel_is_torchs() -> None:
    gen = torch.Generator().manual_seed(13)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0x00008000, 0x00018000,
                         0x7F800000, 0xFF800000, 0x00000000, 0x80000000], dtype=torch.int64).to(torch.int32)
    g = torch.cat([torch.randn(10000, generator=gen) * 10.0 ** torch.randint(-30, 30, (10000,), generator=gen),
                   ties.view(torch.float32), torch.tensor([math.nan, -math.nan])])
    got = (_bits.bfloat16_bits(g) >> 16).to(torch.int16)
    want = g.to(torch.bfloat16).view(torch.int16)
    nan = g.isnan()
    assert torch.equal(got[~nan], want[~nan])  # ties to even, overflow to inf, zeros' signs
    assert torch.equal(got[nan], torch.full((2,), 0x7FC0, dtype=torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_per_tile_statistics_compiled_give_the_eager_bits(dtype: torch.dtype) -> None:
    # the TP path's per-tile statistics (whole tiles compiled, the partial last one eager)
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(40, 1000, generator=gen) * 3).to(dtype)
    x[5, :400] = -math.inf
    softmax = _softmax.Softmax(torch.rand(40, generator=gen) + 0.5)

    def run() -> _stats.TileStats:
        out = _invariant.tile_placeholders(_spec.tiles(1000), 40, 0, torch.float32, x.device, True)
        _invariant.stats(x, softmax, 1000, out, [(0, 17), (20, 40)], 8)
        return out

    with _backend.using("eager"):
        eager = run()
    with _backend.using("compiled", fresh=True), _probe.watch() as seen, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        compiled = run()
    assert {e.name for e in seen.of("launch", backend="compiled")} == {"tile_kernel"}
    assert not [w for w in caught if "differs from the eager one" in str(w.message)]  # no kernel turned eager
    for a, b in zip(compiled, eager):
        assert a is not None and b is not None and torch.equal(a, b)
    assert torch.equal(eager.sum[17:20], torch.ones(3, 8))  # rows outside the runs left as they were


def test_distillation_gives_a_sample_its_own_bits_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(6)
    total, response = [9, 4, 12], [5, 0, 6]
    logits = [torch.randn(t, 256, generator=gen) * 3 for t in total]

    def call(order: list[int]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        layout = Layout([total[i] for i in order], [response[i] for i in order])
        x = pack([logits[i] for i in order], layout).requires_grad_(True)
        lps, ids = response_topk_log_probs(x.detach(), 4, layout, temperature=0.8, invariant=True)
        teacher = [torch.log_softmax(torch.randn(r, 4, generator=torch.Generator().manual_seed(i)), -1)
                   for i, r in zip(order, (response[i] for i in order))]
        div = response_distillation(x, teacher, ids, layout, temperature=0.8, invariant=True)
        torch.autograd.backward(sum((d.sum() for d in div), x.sum() * 0))
        assert x.grad is not None
        starts = [0, *torch.tensor([total[i] for i in order]).cumsum(0).tolist()]
        grads = [x.grad[starts[k] : starts[k + 1]] for k in range(len(order))]
        back = {i: k for k, i in enumerate(order)}
        return ([lps[back[i]] for i in sorted(order)], [div[back[i]].detach() for i in sorted(order)],
                [grads[back[i]] for i in sorted(order)])

    whole = call([0, 1, 2])
    for order in ([2, 0], [0], [2]):
        got = call(order)
        for part, want in zip(got, whole):
            for k, i in enumerate(sorted(order)):
                assert torch.equal(part[k], want[i]), (order, i)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_hidden_state_path_with_a_support_gives_a_row_its_own_gradient(dtype: torch.dtype) -> None:
    """Rows with a set skip the dense pass: the others' hidden gradient is summed by index,
    in float32 whatever the dtype, and each row's bits are its own."""
    rows_n, h_dim = 10, 8
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(rows_n, h_dim, generator=gen).to(dtype)
    weight = (torch.randn(V, h_dim, generator=gen) / 2).to(dtype)
    targets = torch.randint(0, V, (rows_n,), generator=gen)
    sets = [[1, 2, int(targets[t])] if t % 2 else [] for t in range(rows_n)]

    def call(rows: Tensor) -> tuple[Tensor, ...]:
        h = hidden[rows].clone().requires_grad_(True)
        lp, _ = log_probs_and_entropy_from_hidden(h, weight, targets[rows], support=csr([sets[r] for r in rows]),
                                                  invariant=True)
        torch.autograd.backward(lp.sum())
        assert h.grad is not None
        return lp.detach(), h.grad

    want = _each_row(call, rows_n)
    assert bool(want[1].isfinite().all())
    for got, w in zip(call(torch.arange(rows_n)), want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_response_functions_from_hidden_give_a_sample_its_own_bits(dtype: torch.dtype) -> None:
    """bfloat16 too: the response rows' hidden gradient is summed in float32 by index."""
    gen = torch.Generator().manual_seed(8)
    total, response = [9, 4, 12], [5, 0, 6]
    hidden = [torch.randn(t, 16, generator=gen).to(dtype) for t in total]
    tokens = [torch.randint(0, 300, (t,), generator=gen) for t in total]
    weight = (torch.randn(300, 16, generator=gen) / 2).to(dtype)

    def call(order: list[int]) -> dict[int, list[Tensor]]:
        layout = Layout([total[i] for i in order], [response[i] for i in order])
        h = pack([hidden[i] for i in order], layout).requires_grad_(True)
        lp, ent = response_log_probs_from_hidden(h, weight, [tokens[i] for i in order], layout, with_entropy=True,
                                                 temperature=0.9, invariant=True)
        top, ids = response_topk_log_probs_from_hidden(h.detach(), weight, 3, layout, invariant=True)
        div = response_distillation_from_hidden(h, weight, [t.detach() for t in top], ids, layout, invariant=True)
        torch.autograd.backward(sum((a.sum() + b.sum() + d.sum() for a, b, d in zip(lp, ent, div)), h.sum() * 0))
        assert h.grad is not None
        starts = [0, *torch.tensor([total[i] for i in order]).cumsum(0).tolist()]
        return {i: [lp[k].detach(), ent[k].detach(), top[k], ids[k], div[k].detach(),
                    h.grad[starts[k] : starts[k + 1]]] for k, i in enumerate(order)}

    whole = call([0, 1, 2])
    for order in ([2, 0], [1, 2]):
        for i, parts in call(order).items():
            assert all(torch.equal(a, b) for a, b in zip(parts, whole[i])), (order, i)


def test_a_planted_merge_order_is_caught() -> None:
    # rows whose S is near 1, where a change in the sums' last bit shows in log S
    logits, targets = peaked(256, V, 9)
    want = spec()(logits, targets, 0.9)

    def run() -> tuple[Tensor, Tensor]:
        lp, h = log_probs_and_entropy(logits, targets, with_entropy=True, temperature=0.9, invariant=True)
        return lp, h

    assert all(torch.equal(a, b) for a, b in zip(run(), want))
    real = _spec.merge_tiles

    def rotated(m: Tensor, s: Tensor, a: Tensor | None, tau: _softmax.Tau) -> tuple[Tensor, Tensor, Tensor | None]:
        return real(m.roll(1, 0), s.roll(1, 0), None if a is None else a.roll(1, 0), tau)  # from the 2nd tile

    for plant in (rotated, shard_first):
        with _probe.substitute("merge_tiles", plant):
            assert not all(torch.equal(a, b) for a, b in zip(run(), want)), plant
    assert all(torch.equal(a, b) for a, b in zip(run(), want))  # the real order back


@pytest.mark.parametrize("value", [1, "yes", None, 1.0])
def test_invariant_must_be_a_bool(value: object) -> None:
    # beartype's own TypeError where the tests run the debug wrappers, else cpslice's
    with pytest.raises(TypeError, match="invariant"):
        bad: dict[str, Any] = {"invariant": value}
        log_probs_and_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64), **bad)


def test_every_layout_cp_and_tp_size_gives_decode_times_bits() -> None:
    # one task on a world of 4: TP 4, TP 2 (x CP 1 and CP 2, cp rank = rank // 2) and
    # CP 4 x TP 1, each layout kind, float32 (soft cap, padded vocabulary) and bfloat16,
    # against one-row calls at TP 1 and the spec's function; then a planted merge order
    results = run_distributed(worker, 4, timeout=240)
    seen = results[0]["seen"]
    assert len(seen) == 2 * (5 + 5 + 6 + 6) + 2 and all(n > 0 for n in seen.values()), seen
    assert all(r["planted"] == {4: "caught", 2: "caught"} for r in results), [r["planted"] for r in results]
    assert math.isfinite(sum(seen.values()))


def test_top_k_ties_across_tp_shards_go_to_the_smaller_id() -> None:
    # a world of 4, TP 4 and TP 2: ties straddling tiles and shards (and NaN, and -inf),
    # the spec's ids and TP 1's bits in invariant mode; in the default mode a valid
    # top-k, the same ids on every rank of a TP group
    results = run_distributed(topk_ties_worker, 4, timeout=120)
    for tp in (4, 2):
        for rank, got in enumerate(results):
            assert torch.equal(got[tp], results[rank - rank % tp][tp]), (tp, rank)
