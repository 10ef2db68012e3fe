"""Invariant mode's Triton kernels (``cpslice._vocab.backends.triton.invariant``) through Triton's
interpreter (``TRITON_INTERPRET=1``: numpy on the CPU, IEEE float32) give the eager
backend's bits (``torch.equal``, and a zero's sign): per-tile statistics (under TP, into the transposed
fields at a tile offset), their merge, merged statistics of a subset of rows by index,
and from them the log-probs, entropy and logits' gradient of ``log_probs_and_entropy(...,
invariant=True)``, in float32 and bfloat16, with a float and a per-row temperature, a
soft cap and a ``vocab_size`` (a partial last tile, -inf padded). Every launch is
counted; a planted wrong tree pairing, ``exp`` coefficient or missing -inf pad, each
substituted into the kernels through ``_probe`` (their ``constexpr`` helpers), fails."""

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, no_type_check

import pytest
import torch
from torch import Tensor

from cpslice import _probe, log_probs_and_entropy
from cpslice._vocab import invariant as _invariant
from cpslice._vocab import spec as _spec
from cpslice._vocab import stats as _stats
from cpslice._vocab.gradient import row_grad
from cpslice._vocab.softmax import Softmax, reciprocals
from cpslice._vocab.stats import RowStats, Stats


@contextmanager
def _interpreting() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for a while: Triton picks its interpreter when ``@triton.jit``
    runs (the kernels' import), so nothing else of the session need see it."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


with _interpreting():
    import triton
    import triton.language as tl

    from cpslice._vocab.backends.triton import invariant as _tri


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` of a planted helper, interpreted as the kernels are."""
    with _interpreting():
        return triton.jit(fn)

# numpy warns of the -inf - -inf of a masked slot (its exp is 0 all the same)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

T, V = 6, 700  # 6 tiles, the last one partial
ROWS = torch.tensor([4, 0, 5, 2])  # a subset, out of order
OPTIONS: dict[str, dict[str, Any]] = {
    "temperature-float": {"temperature": 0.7},
    "temperature-per-row": {"temperature": "per-row"},
    "softcap": {"temperature": "per-row", "softcap": 15.0},
    "vocab_size": {"temperature": 0.9, "vocab_size": 650},
}


def _logits(dtype: torch.dtype, v: int = V, seed: int = 0) -> Tensor:
    """``[T, v]`` logits with the reduction's edges: a peaked row, masked tokens and whole
    masked tiles, subnormal logits with a zero tile max of both signs (the bfloat16
    widening and the max's +0), ties, and logits past a cap's saturation."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, v, generator=gen) * 4
    x[0, 17] += 40.0
    x[1, 3] = -math.inf
    x[1, 128:384] = -math.inf
    x[2] = -(torch.rand(v, generator=gen) * 1e-38)
    x[2, 130], x[2, 131], x[2, 300] = -0.0, 0.0, -0.0  # a tile's max +0 and -0, the next's -0
    x[3] = 1.5
    x[4] *= 40
    x[5, 512:] = -math.inf
    return x.to(dtype)


def _tau(options: dict[str, Any]) -> tuple[Any, Tensor]:
    """The call's temperature and the ``[T]`` float32 one invariant mode makes of it."""
    t = options["temperature"]
    if t == "per-row":
        t = torch.rand(T, generator=torch.Generator().manual_seed(3)) + 0.5
        return t, t
    return t, torch.full((T,), t)


def _same(a: Tensor, b: Tensor) -> bool:
    """``torch.equal``, and the same sign bits: bit for bit where no NaN is (-0 == +0)."""
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def _fields(stats: Stats) -> tuple[Tensor, Tensor, Tensor]:
    """``max``, ``sum`` and ``ent`` of statistics with entropy."""
    assert stats.ent is not None
    return stats.max, stats.sum, stats.ent


def _full(index: Tensor, values: Tensor) -> Tensor:
    """``[T]`` with ``values`` at ``index`` (0 elsewhere)."""
    return torch.zeros(T).index_put_((index,), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_log_probs_entropy_and_gradient_are_the_eager_bits(dtype: torch.dtype, name: str) -> None:
    options = OPTIONS[name]
    temperature, tau = _tau(options)
    cap, valid = options.get("softcap"), options.get("vocab_size", V)
    x = _logits(dtype)
    targets = torch.tensor([17, 5, 130, 600, 64, 300]) % valid
    gen = torch.Generator().manual_seed(1)
    g_lp, g_h = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    # the eager backend: the public function, its internals' merged statistics
    leaf = x.clone().requires_grad_(True)
    want_lp, want_h = log_probs_and_entropy(leaf, targets, with_entropy=True, invariant=True, **{
        **options, "temperature": temperature})
    assert want_h is not None
    torch.autograd.backward((want_lp * g_lp).sum() + (want_h * g_h).sum())
    assert leaf.grad is not None
    eager = _stats.placeholders(T, 0, torch.float32, x.device, True)
    _invariant.merged_stats(x[:, :valid], Softmax(tau, cap, True), eager, None, 2)

    r = reciprocals(tau, T, torch.float32, x.device)
    big, total, ent = _tri.merged_stats(x, ROWS, r, tau, cap, valid)
    assert all(g is not None and _same(g, w[ROWS]) for g, w in zip((big, total, ent), _fields(eager)))
    assert ent is not None
    # the spec's step 5 (torch: the log and the picked logit)
    picked = Softmax(tau, cap, True).logits(x[ROWS].gather(1, targets[ROWS, None]).float())
    got = _stats.totals(RowStats(big, total, picked, ent), tau[ROWS])
    assert got.entropy is not None
    assert _same(got.log_probs[:, 0], want_lp[ROWS]) and _same(got.entropy, want_h[ROWS])
    # the gradient at these rows only, then the picked ids' entries (torch)
    row = row_grad(g_lp[ROWS, None], g_h[ROWS], got.entropy, tau[ROWS], targets[ROWS, None],
                          torch.ones(len(ROWS), 1, dtype=torch.bool), with_hot=True)
    assert row.a is not None and row.hot is not None
    terms = [_full(ROWS, t) for t in (got.max, got.log_sum, row.a, row.b)]
    out = torch.zeros_like(x)
    _tri.grad(x[:, :valid], ROWS, r, terms[0], terms[1], terms[2], terms[3], cap, out[:, :valid])
    hot = row._replace(a=terms[2], b=terms[3], hot=torch.zeros(T, 1).index_put_((ROWS,), row.hot),
                       column=targets[:, None])
    _invariant.picks(x[:, :valid], r, terms[0], terms[1], cap, hot, out[:, :valid],
                     ROWS.sort().values, T)
    assert _same(out[ROWS], leaf.grad[ROWS])
    others = torch.ones(T, dtype=torch.bool).index_fill_(0, ROWS, False)
    assert not out[others].any()  # the rows not asked are left as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cap", [None, 4.0])
def test_per_tile_statistics_under_tp_and_their_merge_are_the_eager_bits(dtype: torch.dtype,
                                                                       cap: float | None) -> None:
    # TP 2: shards of 384 columns (3 tiles) of a 768-row head padded from a vocabulary of
    # 700, so the second shard's last 68 columns are padding; each shard's tiles at a tile
    # offset of 1 in fields one tile wider, [n, T] storage seen transposed
    x = _logits(dtype, 768, seed=2)
    tau = torch.rand(T, generator=torch.Generator().manual_seed(4)) + 0.5
    r = 1.0 / tau
    got, want = [], []
    for shard, valid in ((0, 384), (1, 700 - 384)):
        part = x[:, shard * 384 : (shard + 1) * 384]
        fields = [_invariant.tile_placeholders(4, T, 0, torch.float32, x.device, True) for _ in range(2)]
        _tri.tile_stats(part, ROWS, r, cap, valid, fields[0].max, fields[0].sum, fields[0].ent, first=1)
        runs = [(t, t + 1) for t in sorted(ROWS.tolist())]
        _invariant.stats(part, Softmax(tau, cap, True), valid, fields[1], runs, 2, first=1)
        for g, w in zip(fields[0], fields[1]):
            assert g is not None and w is not None and _same(g, w), shard  # untouched rows and tile too
        got.append(fields[0])
        want.append(fields[1])
    # every shard's tiles in global order, as the all-gather gives them: merge
    m, s, a = (torch.cat([_fields(f)[i][:, 1:] for f in got], 1) for i in range(3))
    big, total, ent = _tri.merge(m[ROWS], s[ROWS], a[ROWS], tau[ROWS])
    w_big, w_total, w_ent = _spec.merge_tiles(m[ROWS].t(), s[ROWS].t(), a[ROWS].t(), tau[ROWS])
    assert ent is not None and w_ent is not None
    assert _same(big, w_big) and _same(total, w_total) and _same(ent, w_ent)
    # the whole row at TP 1 gives the same bits: the shards held whole tiles
    one = _tri.merged_stats(x, ROWS, r, tau, cap, 700)
    assert all(g is not None and _same(g, w) for g, w in zip(one, (big, total, ent)))
    # no entropy: no A
    assert _tri.merge(m, s, None, tau)[2] is None


def test_merge_pads_the_tiles_to_a_power_of_two_and_chunks_the_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    tau = torch.rand(T, generator=gen) + 0.5
    for n in (1, 5, 9):  # 9 tiles pad to 16
        m = torch.randn(T, n, generator=gen) * 3
        m[1, : n // 2 + 1] = -math.inf
        m[2] = -m[2].abs() - 1.0  # no tile above the zeros that pad the tiles
        s = torch.where(m == -math.inf, 0.0, torch.rand(T, n, generator=gen) * 100)
        a = torch.where(m == -math.inf, 0.0, -torch.rand(T, n, generator=gen) * 50)
        got = _tri.merge(m, s, a, tau)
        want = _spec.merge_tiles(m.t(), s.t(), a.t(), tau)
        assert all(g is not None and w is not None and _same(g, w) for g, w in zip(got, want)), n
    # merged_stats two rows at a time: the scratch of a chunk of rows, not of all of them
    x = _logits(torch.float32)
    r = 1.0 / tau
    whole = _tri.merged_stats(x, ROWS, r, tau, None, V)
    with _probe.watch() as seen, _probe.substitute("triton_scratch_rows", lambda tiles: 2):
        chunked = _tri.merged_stats(x, ROWS, r, tau, None, V, with_entropy=False)
    assert [e.rows for e in seen.of("launch", name="invariant_merge")] == [2, 2]
    assert _same(chunked[0], whole[0]) and _same(chunked[1], whole[1]) and chunked[2] is None


def test_every_launch_is_counted(seen: _probe.Seen) -> None:
    x = _logits(torch.bfloat16)
    tau = torch.ones(T)
    big, total, _ = _tri.merged_stats(x, ROWS, tau, tau, 5.0, V)
    out = torch.empty_like(x)
    _tri.grad(x, None, tau, tau, tau, None, tau, None, out)
    _tri.grad(x, ROWS[:0], tau, tau, tau, None, tau, None, out)  # no rows: no launch
    ran = [(e.name, e.rows) for e in seen.of("launch", backend="triton", invariant=True)]
    assert ran == [("invariant_tiles", 4), ("invariant_merge", 4), ("invariant_grad", T)], ran
    assert seen.of("launch") == seen.of("launch", backend="triton")


def test_a_bfloat16_gradient_on_a_rounding_tie_rounds_to_even() -> None:
    """The gradient kernel's own rounding to bfloat16 (by the float's bits) on exact ties, as
    ``.to(torch.bfloat16)`` rounds: to nearest, ties to the even neighbour, whatever the
    sign, subnormals too. A row of logits equal to its ``M``, with ``log S = 0`` and ``r =
    1``, has ``log p = 0`` and ``spec.exp(0) = 1`` in every column, so its value there is
    its ``b`` exactly: a ``b`` halfway between two bfloat16 values is a tie."""
    ties = [1 + 2**-8, -(1 + 2**-8), 3 + 2**-7, 2**-134, -(2**-134)]  # the even neighbour below
    odd = [1 + 3 * 2**-8, -(1 + 3 * 2**-8), 2**-133 + 2**-134]  # the odd one below: away from it
    near = [1 + 2**-8 + 2**-20, 1 + 2**-8 - 2**-20, 7.0]  # no ties
    b = torch.tensor(ties + odd + near)
    rows = b.numel()
    bits = b.view(torch.int32)
    assert bool(((bits & 0xFFFF)[: len(ties) + len(odd)] == 0x8000).all()), "ties: a half of the last bit"
    assert bool((((bits >> 16) & 1)[: len(ties)] == 0).all()) and bool((((bits >> 16) & 1)[len(ties):-3] == 1).all())
    x, zero, one = torch.zeros(rows, 5), torch.zeros(rows), torch.ones(rows)
    out = torch.full((rows, 5), math.nan, dtype=torch.bfloat16)
    _tri.grad(x, None, one, zero, zero, zero, b, None, out)
    want = b.to(torch.bfloat16)[:, None].expand(rows, 5)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (out[:, 0], want[:, 0])


@_jit
@no_type_check
def _adjacent_tree(x, ROWS: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """A planted pairing: neighbours first (``x[2i] + x[2i + 1]``), not the halves."""
    for k in tl.static_range(LOG_W):
        lo, hi = tl.split(tl.reshape(x, [ROWS, W >> (k + 1), 2]))
        x = lo + hi
    return tl.reshape(x, [ROWS])


@_jit
@no_type_check
def _doubled_merge_tree(x, ROWS: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """A planted tree wrong in the merge only: a row's sum over its tiles (``W`` tiles, fewer
    than a tile's 128 columns here) doubled, a tile's own sums right."""
    total = _tri._tree(x, ROWS, W, LOG_W)
    if W != 128:
        total = total * 2.0
    return total


@_jit
@no_type_check
def _off_exp(d):
    """A planted ``exp``: the ``1/2`` of the polynomial off in its last bit."""
    n = tl.floor(d * _tri._LOG2E + 0.5)
    r = (d - n * _tri._LN2_HI) - n * _tri._LN2_LO
    p = r * _tri._C7 + _tri._C6
    p = p * r + _tri._C5
    p = p * r + _tri._C4
    p = p * r + _tri._C3
    p = p * r + 0.50000006
    p = p * r + _tri._C1
    p = p * r + _tri._C0
    scale = ((tl.maximum(n, -126.0).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(d < -87.0, 0.0, p * scale)


@_jit
@no_type_check
def _no_pad(y, inside):
    """A planted missing pad: the columns past ``valid`` read as loaded (0)."""
    return y


@pytest.mark.parametrize(("step", "plant"), [
    pytest.param("triton_tree", _adjacent_tree, id="tree-pairing"),
    pytest.param("triton_tree", _doubled_merge_tree, id="tree-in-the-merge"),  # the merge's site too
    pytest.param("triton_exp", _off_exp, id="exp-coefficient"),
    pytest.param("triton_pad", _no_pad, id="no-inf-pad"),
])
def test_a_planted_kernel_bug_is_caught(step: _probe.Step, plant: Any) -> None:
    # rows with one dominant logit (S near 1: a sum's last bit shows) and a partial tile
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, V, generator=gen) * 2
    x[torch.arange(T), torch.randint(0, 600, (T,), generator=gen)] += 9.0
    tau = torch.rand(T, generator=gen) + 0.5
    r = 1.0 / tau
    want = _stats.placeholders(T, 0, torch.float32, x.device, True)
    _invariant.merged_stats(x[:, :650], Softmax(tau), want, None, T)
    got = _tri.merged_stats(x, ROWS, r, tau, None, 650)
    assert all(g is not None and _same(g, w[ROWS]) for g, w in zip(got, _fields(want)))
    with _probe.substitute(step, plant):
        got = _tri.merged_stats(x, ROWS, r, tau, None, 650)
    assert not all(g is not None and _same(g, w[ROWS]) for g, w in zip(got, _fields(want)))
    got = _tri.merged_stats(x, ROWS, r, tau, None, 650)  # the block closed: the real helper again
    assert all(g is not None and _same(g, w[ROWS]) for g, w in zip(got, _fields(want)))
