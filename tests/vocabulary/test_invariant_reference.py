"""Invariant mode (``invariant=True``, docs/invariance.md) against a float64 reference and
against the spec's own steps, where tests/vocabulary/test_invariant.py compares it with itself:

- a soft cap with the compiled kernels on (``CPSLICE_BACKEND=compiled``: the merged ``row_kernel``
  without TP, the per-tile ``tile_kernel`` under TP), at TP 1 and TP 2 on gloo: the eager
  bits and, within rounding, float64;
- the hidden-state path over several 1024-column blocks, the last one partial, at TP 1
  and TP 2: float64, and the same bits at both TP sizes;
- repeated ids (``log_probs_at`` with an id two and three times in a row) and shared
  prefixes whose branches start with the same token: values and gradients against float64;
- float64 logits: the spec's float64 ``exp`` (degree 13, ``ln2_hi = 0.6931471803691238``,
  ``2^n`` from ``(max(n, -1022) + 1023) << 52``, 0 below -708) and steps 1 to 5 written
  here from the page, and the library's results and gradient equal to them bit for bit."""

import math
from decimal import Context, Decimal
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpslice import (
    Layout,
    log_probs_and_entropy,
    log_probs_and_entropy_from_hidden,
    log_probs_at,
    log_probs_at_from_hidden,
    pack,
    response_log_probs,
    response_log_probs_from_hidden,
    topk_log_probs_from_hidden,
)
from cpslice._vocab import spec as _spec
from cpslice._vocab.backends import compiled as _compiled
from cpslice._vocab.backends import selection as _backend

from ..support._dist import run_distributed
from ..support.invariant_cases import edge_rows, peaked
from ..support.reference import grad_close, tolerance, value_atol

# --- 1. a soft cap with the compiled kernels on, TP 1 and TP 2

CAP, CAP_V, CAP_VOCAB = 12.0, 768, 740  # TP 2: 384 columns a shard; the distribution's last tile partial
CAP_ROWS = 24


def _capped_data(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(21)
    targets = torch.randint(0, CAP_VOCAB, (CAP_ROWS,), generator=gen)
    targets[5:8] = torch.tensor([3, 400, CAP_VOCAB - 1])  # a target in each shard, one in the partial tile
    logits = edge_rows(targets, CAP_V, dtype, 22)  # logits up to ~60: the cap bends them
    return (logits, targets, torch.rand(CAP_ROWS, generator=gen) + 0.5, torch.randn(CAP_ROWS, generator=gen),
            torch.randn(CAP_ROWS, generator=gen))


def _capped_reference(logits: Tensor, targets: Tensor, temps: Tensor, g_lp: Tensor,
                      g_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 log-probs, entropies and logits' gradient of ``cap * tanh(x / cap) / tau``
    over the first ``CAP_VOCAB`` columns (a -inf logit caps to ``-cap``, and the cap's
    derivative there is 0)."""
    x = logits.double().requires_grad_(True)
    z = torch.tanh(x[:, :CAP_VOCAB] / CAP) * CAP / temps.double()[:, None]
    lp = torch.log_softmax(z, -1)
    logp = lp.gather(1, targets[:, None])[:, 0]
    entropy = -(lp.exp() * lp).sum(-1)
    torch.autograd.backward((logp * g_lp.double()).sum() + (entropy * g_h.double()).sum())
    assert x.grad is not None
    return logp.detach(), entropy.detach(), x.grad


def _capped_worker(rank: int, world: int) -> dict[str, Any]:
    """Each dtype at TP 1 (no group) and TP 2 (the world), eager then compiled, with a cap:
    every result the bits of eager TP 1, and within rounding of float64; the compiled
    kernels open to these tiles (``compiled_ok``) and none caught differing."""
    assert world == 2
    v_local = CAP_V // world
    cols = slice(rank * v_local, (rank + 1) * v_local)
    compared: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets, temps, g_lp, g_h = _capped_data(dtype)
        ref_lp, ref_h, ref_grad = _capped_reference(logits, targets, temps, g_lp, g_h)
        runs: dict[tuple[str, int], tuple[Tensor, Tensor, Tensor]] = {}
        for mode in ("0", "1"):
            with _backend.using("eager" if mode == "0" else "compiled", fresh=True) as state:
                for tp, group, part in ((1, None, slice(None)), (2, dist.group.WORLD, cols)):
                    x = logits[:, part].clone().requires_grad_(True)
                    valid = min(x.shape[1], max(0, CAP_VOCAB - (rank * v_local if tp == 2 else 0)))
                    # the compiled kernels would take these rows uncapped: the cap alone keeps them eager
                    assert _compiled.compiled_ok(x[:, :valid]) is (mode == "1")
                    lp, h = log_probs_and_entropy(x, targets, with_entropy=True, temperature=temps, softcap=CAP,
                                                  vocab_size=CAP_VOCAB, tp_group=group, invariant=True)
                    torch.autograd.backward((lp * g_lp).sum() + (h * g_h).sum())
                    assert x.grad is not None
                    runs[mode, tp] = (lp.detach(), h.detach(), x.grad)
                assert state.disagree is None, state.disagree
        want = runs["0", 1]
        for (mode, tp), (lp, h, grad) in runs.items():
            assert torch.equal(lp, want[0]), (dtype, mode, tp, (lp - want[0]).abs().max())
            assert torch.equal(h, want[1]), (dtype, mode, tp, (h - want[1]).abs().max())
            assert torch.equal(grad, want[2] if tp == 1 else want[2][:, cols]), (dtype, mode, tp)
        atol = tolerance(logits.float()[:, :CAP_VOCAB].clamp(-CAP, CAP), float(temps.min()))
        torch.testing.assert_close(want[0].double(), ref_lp, rtol=0.0, atol=atol)
        torch.testing.assert_close(want[1].double(), ref_h, rtol=0.0, atol=atol)
        grad_close(want[2], ref_grad, 1e-5 if dtype == torch.float32 else 1e-2)
        compared[str(dtype)] = len(runs)
    return compared


def test_a_soft_cap_with_the_compiled_kernels_on_gives_the_eager_bits_at_tp_1_and_2() -> None:
    # CPSLICE_BACKEND=compiled opens the compiled kernels to every tile (the size no bar): a
    # capped row must still get the capped statistics, the eager ones, bit for bit
    results = run_distributed(_capped_worker, 2, timeout=200)
    assert results == [{"torch.float32": 4, "torch.bfloat16": 4}] * 2


# --- 2. the hidden-state path over several column blocks

H_DIM, H_ROWS = 16, 70  # two 64-row blocks


def _head(vocab: int, dtype: torch.dtype, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden, weight, targets (one in the first block, one in the last column, one just
    past the first block), ids ``[rows, 2]`` and upstream gradients ``[rows, 5]``."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(H_ROWS, H_DIM, generator=gen).to(dtype)
    weight = (torch.randn(vocab, H_DIM, generator=gen) / 2).to(dtype)
    targets = torch.randint(0, vocab, (H_ROWS,), generator=gen)
    targets[:3] = torch.tensor([5, vocab - 1, 1030])
    ids = torch.randint(0, vocab, (H_ROWS, 2), generator=gen)
    ids[0] = torch.tensor([vocab - 1, 7])
    return hidden, weight, targets, ids, torch.randn(H_ROWS, 5, generator=gen)


def _hidden_calls(hidden: Tensor, weight: Tensor, targets: Tensor, ids: Tensor, g: Tensor,
                  group: Any = None) -> list[Tensor]:
    """Log-prob, entropy, log-probs at ids, top-3 and its ids, and the hidden and weight
    gradients of ``g``'s sum of them, in invariant mode."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = log_probs_and_entropy_from_hidden(h, w, targets, with_entropy=True, temperature=0.8, tp_group=group,
                                                invariant=True)
    at = log_probs_at_from_hidden(h, w, ids, temperature=0.8, tp_group=group, invariant=True)
    top, top_ids = topk_log_probs_from_hidden(h.detach(), weight, 3, temperature=0.8, tp_group=group,
                                              invariant=True)
    torch.autograd.backward((lp * g[:, 0]).sum() + (ent * g[:, 1]).sum() + (at * g[:, 2:4]).sum())
    assert h.grad is not None and w.grad is not None
    return [lp.detach(), ent.detach(), at.detach(), top, top_ids, h.grad, w.grad]


def _hidden_reference(hidden: Tensor, weight: Tensor, targets: Tensor, ids: Tensor,
                      g: Tensor) -> list[Tensor]:
    """The float64 counterparts of ``_hidden_calls`` (the top-3's log-probs and ids as
    ``log_softmax``'s largest), and the whole ``log_softmax`` last."""
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logits = h @ w.t()
    if hidden.dtype == torch.bfloat16:  # the head's matmul rounds its logits
        logits = logits + (logits.to(hidden.dtype).double() - logits).detach()
    lp = torch.log_softmax(logits / 0.8, -1)
    logp = lp.gather(1, targets[:, None])[:, 0]
    entropy = -(lp.exp() * lp).sum(-1)
    at = lp.gather(1, ids)
    top, top_ids = lp.detach().topk(3, -1)
    torch.autograd.backward((logp * g[:, 0]).sum() + (entropy * g[:, 1]).sum() + (at * g[:, 2:4]).sum())
    assert h.grad is not None and w.grad is not None
    return [logp.detach(), entropy.detach(), at.detach(), top, top_ids, h.grad, w.grad, lp.detach()]


def _hidden_close(got: list[Tensor], want: list[Tensor], hidden: Tensor, weight: Tensor,
                  cols: slice = slice(None)) -> None:
    rel = 2.0**-7 if hidden.dtype == torch.bfloat16 else 2.0**-18
    atol = value_atol(hidden, weight, 0.8, rel)
    for k in (0, 1, 2, 3):  # log-prob, entropy, at the ids, the top-3
        torch.testing.assert_close(got[k].double(), want[k], rtol=0.0, atol=atol)
    # the top-3 ids: float64's where no two logits tie (bfloat16 logits do), else
    # ids whose float64 log-probs are the top-3's
    torch.testing.assert_close(want[7].gather(1, got[4]), got[3].double(), rtol=0.0, atol=atol)
    assert hidden.dtype == torch.bfloat16 or torch.equal(got[4], want[4])
    grad_rel = 1e-2 if hidden.dtype == torch.bfloat16 else 1e-5
    grad_close(got[5], want[5], grad_rel)
    grad_close(got[6], want[6][cols], grad_rel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [2000, 2500])  # blocks 1024 + 976; 1024 + 1024 + 452
def test_the_hidden_state_path_over_several_column_blocks_is_right(dtype: torch.dtype, vocab: int) -> None:
    hidden, weight, targets, ids, g = _head(vocab, dtype, 31)
    got = _hidden_calls(hidden, weight, targets, ids, g)
    _hidden_close(got, _hidden_reference(hidden, weight, targets, ids, g), hidden, weight)
    # and a row's bits whatever the other rows: the first row alone
    alone = _hidden_calls(hidden[:1], weight, targets[:1], ids[:1], g[:1])
    assert all(torch.equal(a, b[:1]) for a, b in zip(alone[:5], got[:5]))


TP_VOCAB = 2560  # TP 2: 1280 columns a shard, blocks of 1024 and 256


def _hidden_tp_worker(rank: int, world: int) -> int:
    """The hidden-state path at TP 2 over two blocks a shard: float64, and the bits of TP 1
    (but the hidden gradient, which sums the shards)."""
    assert world == 2
    hidden, weight, targets, ids, g = _head(TP_VOCAB, torch.float32, 32)
    v_local = TP_VOCAB // world
    cols = slice(rank * v_local, (rank + 1) * v_local)
    whole = _hidden_calls(hidden, weight, targets, ids, g)
    got = _hidden_calls(hidden, weight[cols], targets, ids, g, dist.group.WORLD)
    _hidden_close(got, _hidden_reference(hidden, weight, targets, ids, g), hidden, weight, cols)
    assert all(torch.equal(a, b) for a, b in zip(got[:5], whole[:5]))
    assert torch.equal(got[6], whole[6][cols])  # a shard's weight gradient is its columns' own
    return 5


def test_the_hidden_state_path_over_several_column_blocks_at_tp_2() -> None:
    assert run_distributed(_hidden_tp_worker, 2, timeout=120) == [5, 5]


# --- 3. repeated ids and shared prefixes


def _reference_at(logits: Tensor, ids: Tensor, temps: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    x = logits.double().requires_grad_(True)
    lp = torch.log_softmax(x / temps.double()[:, None], -1).gather(1, ids)
    torch.autograd.backward((lp * g.double()).sum())
    assert x.grad is not None
    return lp.detach(), x.grad


REPEATED = [[9, 9], [130, 9], [700, 700], [0, 0], [699, 3]]  # k = 2: an id twice in a row
REPEATED_3 = [[9, 9, 9], [9, 130, 9], [3, 3, 400], [600, 1, 2], [5, 600, 600]]  # k = 3: twice and three times


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [REPEATED, REPEATED_3], ids=["k2", "k3"])
def test_repeated_ids_against_float64(dtype: torch.dtype, rows: list[list[int]]) -> None:
    gen = torch.Generator().manual_seed(41)
    ids = torch.tensor(rows * 3)
    n = ids.shape[0]
    logits = (torch.randn(n, 701, generator=gen) * 3).to(dtype)
    logits[torch.arange(n), ids[:, 0]] += 6.0  # p of a repeated id near 1: its gradient's terms all count
    temps = torch.rand(n, generator=gen) + 0.5
    g = torch.randn(n, ids.shape[1], generator=gen)
    x = logits.clone().requires_grad_(True)
    lp = log_probs_at(x, ids, temperature=temps, chunk_size=4, invariant=True)
    torch.autograd.backward((lp * g).sum())
    ref_lp, ref_grad = _reference_at(logits, ids, temps, g)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0.0, atol=tolerance(logits.float(), float(temps.min())))
    grad_close(x.grad, ref_grad, 1e-5 if dtype == torch.float32 else 1e-2)
    # the hidden-state path: the same ids through an LM head
    hidden = torch.randn(n, H_DIM, generator=gen)
    weight = torch.randn(701, H_DIM, generator=gen) / 2
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    at = log_probs_at_from_hidden(h, w, ids, temperature=temps, invariant=True)
    torch.autograd.backward((at * g).sum())
    hd, wd = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref_at = torch.log_softmax(hd @ wd.t() / temps.double()[:, None], -1).gather(1, ids)
    torch.autograd.backward((ref_at * g.double()).sum())
    torch.testing.assert_close(at.double(), ref_at.detach(), rtol=0.0,
                               atol=value_atol(hidden, weight, float(temps.min()), 2.0**-18))
    assert hd.grad is not None and wd.grad is not None
    grad_close(h.grad, hd.grad, 1e-5)
    grad_close(w.grad, wd.grad, 1e-5)


class Stars(NamedTuple):
    """Groups of samples sharing a prompt (``shared_prefix``), each group's prompt length,
    every sample's response length, and one temperature per group."""

    groups: list[int]
    prompts: list[int]
    response: list[int]
    temps: list[float]

    def prompt(self, i: int) -> int:
        return self.prompts[self.group_of(i)[0]]

    def group_of(self, i: int) -> tuple[int, int]:
        """Sample ``i``'s group and that group's first sample."""
        first = 0
        for j, group in enumerate(self.groups):
            if i < first + group:
                return j, first
            first += group
        raise AssertionError(i)

    @property
    def total(self) -> list[int]:
        return [self.prompt(i) + r for i, r in enumerate(self.response)]

    def rows(self, i: int) -> list[int]:
        """The packed rows (no CP, thd) of sample ``i``'s positions ``0, ..., L_i - 1``
        (docs/layouts.md, "Shared prefixes"): its group's star's prompt rows, then its
        branch's rows after its earlier siblings'."""
        j, first = self.group_of(i)
        offset = sum(self.prompts[g] for g in range(j)) + sum(self.response[:first])
        before = sum(self.response[first:i])
        return [offset + p for p in range(self.prompts[j])] + [
            offset + self.prompts[j] + before + q for q in range(self.response[i])]


# stars whose branches all start with the same token: the prompt's last row predicts it
# for every branch (2 ids alike; 3 and 2 alike), beside an unshared sample
STARS = {
    "pair": Stars([2, 1], [4, 3], [3, 2, 4], [0.8, 1.1]),
    "three-and-pair": Stars([3, 2, 1], [4, 4, 3], [2, 4, 1, 3, 5, 3], [0.7, 0.7, 0.7, 0.9, 0.9, 1.2]),
}


def _shared_tokens(case: Stars, vocab: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(51)
    tokens, i = [], 0
    for group, prompt in zip(case.groups, case.prompts):
        head = torch.randint(0, vocab, (prompt,), generator=gen)
        first = int(torch.randint(0, vocab, (), generator=gen))
        for _ in range(group):
            reply = torch.randint(0, vocab, (case.response[i],), generator=gen)
            reply[0] = first  # every branch of the group starts with the same token
            tokens.append(torch.cat([head, reply]))
            i += 1
    return tokens


def _shared_reference(case: Stars, rows: Tensor, tokens: list[Tensor], w_lp: list[Tensor],
                      w_h: list[Tensor]) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """float64 per-sample log-probs and entropies, each sample read from its own rows of the
    stars (as if unshared), and the packed rows' gradient: a shared row's the sum over the
    branches that read it."""
    x = rows.double().requires_grad_(True)
    lps, hs, loss = [], [], x.sum() * 0
    for i, (tok, r, t) in enumerate(zip(tokens, case.response, case.total)):
        temp = case.temps[case.group_of(i)[0]]
        lp = torch.log_softmax(x[case.rows(i)[t - r - 1 : t - 1]] / temp, -1)
        logp = lp.gather(1, tok[t - r :, None])[:, 0]
        ent = -(lp.exp() * lp).sum(-1)
        loss = loss + (logp * w_lp[i]).sum() + (ent * w_h[i]).sum()
        lps.append(logp.detach())
        hs.append(ent.detach())
    torch.autograd.backward(loss)
    assert x.grad is not None
    return lps, hs, x.grad


@pytest.mark.parametrize("head", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("name", list(STARS))
def test_shared_prefix_branches_starting_with_the_same_token_against_float64(name: str, head: bool) -> None:
    case, vocab = STARS[name], 300
    layout = Layout(case.total, case.response, shared_prefix=case.groups)
    tokens = _shared_tokens(case, vocab)
    temps = [case.temps[case.group_of(i)[0]] for i in range(len(tokens))]
    gen = torch.Generator().manual_seed(52)
    w_lp = [torch.randn(r, generator=gen, dtype=torch.float64) for r in case.response]
    w_h = [torch.randn(r, generator=gen, dtype=torch.float64) for r in case.response]
    n = pack([torch.zeros(t) for t in case.total], layout).shape[0]
    hidden = torch.randn(n, H_DIM, generator=gen)
    weight = torch.randn(vocab, H_DIM, generator=gen) / 2
    x = (hidden.clone() if head else (hidden @ weight.t()).detach()).requires_grad_(True)
    if head:
        lp, h = response_log_probs_from_hidden(x, weight, tokens, layout, with_entropy=True, temperature=temps,
                                               invariant=True)
    else:
        lp, h = response_log_probs(x, tokens, layout, with_entropy=True, temperature=temps, invariant=True)
    loss = sum(((a.double() * u).sum() + (b.double() * v).sum() for a, b, u, v in zip(lp, h, w_lp, w_h)),
               x.sum() * 0)
    torch.autograd.backward(loss)
    assert x.grad is not None
    packed = pack(tokens, layout)
    assert all(torch.equal(packed[case.rows(i)], tok) for i, tok in enumerate(tokens))  # the rows read right
    rows = hidden.double() @ weight.double().t() if head else x.detach().double()
    ref_lp, ref_h, ref_grad = _shared_reference(case, rows, tokens, w_lp, w_h)
    if head:
        ref_grad = ref_grad @ weight.double()
    atol = tolerance(rows.float(), min(temps))
    for got, want in zip([*lp, *h], [*ref_lp, *ref_h]):
        torch.testing.assert_close(got.double(), want, rtol=0.0, atol=atol)
    grad_close(x.grad, ref_grad, 1e-5)


# --- 5. float64: the spec's steps, bit for bit

TILE, FLOOR = 128, -1.0e4
LOG2E = 1.4426950408889634
LN2_HI_64 = 0.6931471803691238
# ln 2 - ln2_hi to 40 digits, then rounded (math.log(2) - ln2_hi would carry log(2)'s rounding)
LN2_LO_64 = float(Decimal(2).ln(Context(prec=40)) - Decimal(LN2_HI_64))


def exp64(d: Tensor) -> Tensor:
    """The spec's exp of float64 ``d <= 0``: ``n = floor(d * log2(e) + 0.5)``, ``r' = (d - n
    * ln2_hi) - n * ln2_lo``, the degree-13 Taylor polynomial of ``e^r'`` by Horner's rule
    (``p = r' / 13! + 1 / 12!``, then ``p = p * r' + 1 / k!`` for ``k = 11`` down to 0),
    times ``2^n`` from its bits ``(max(n, -1022) + 1023) << 52``; 0 below -708."""
    n = torch.floor(d * LOG2E + 0.5)
    r = (d - n * LN2_HI_64) - n * LN2_LO_64
    p = r * (1 / math.factorial(13)) + 1 / math.factorial(12)
    for k in range(11, -1, -1):
        p = p * r + 1 / math.factorial(k)
    scale = ((n.clamp(min=-1022).to(torch.int64) + 1023) << 52).view(torch.float64)
    return torch.where(d < -708.0, 0.0, p * scale)


def tree(x: Tensor) -> Tensor:
    """Pairwise halving over the last dimension, zero-padded to a power of two."""
    w = 1 << (x.shape[-1] - 1).bit_length()
    x = torch.nn.functional.pad(x, (0, w - x.shape[-1]))
    while w > 1:
        w //= 2
        x = x[..., :w] + x[..., w:]
    return x[..., 0]


def spec64(logits: Tensor, targets: Tensor, tau: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Steps 1 to 5 on float64 ``[B, V]`` logits with per-row temperatures ``tau`` and no
    cap: ``(log p, H, M, log S)``."""
    b, v = logits.shape
    n = -(-v // TILE)
    y = torch.cat([logits, logits.new_full((b, n * TILE - v), -math.inf)], 1).view(b, n, TILE)
    m = y.amax(-1)
    r = 1.0 / tau
    d = ((y - torch.where(m == -math.inf, 0.0, m)[..., None]) * r[:, None, None]).clamp(min=FLOOR)
    e = exp64(d)
    s, a = tree(e), tree(d * e)
    big = m.amax(-1)
    delta = (m - torch.where(big == -math.inf, 0.0, big)[:, None]) / tau[:, None]
    scale = exp64(delta)
    total = tree(scale * s)
    ent = tree(torch.where(s > 0, scale * (a + delta * s), 0.0))
    log_s = torch.log(total)
    y_t = logits.gather(1, targets[:, None])[:, 0]
    return (y_t - big) / tau - log_s, log_s - ent / total, big, log_s


def spec64_grad(logits: Tensor, targets: Tensor, tau: Tensor, g_lp: Tensor, g_h: Tensor) -> Tensor:
    """The spec's gradient of ``g_lp . log p + g_h . H`` w.r.t. float64 logits: ``p * (a *
    log p + b)`` with ``log p = max((y - M) * r - log S, -1e4)``, ``p`` its spec exp, ``a =
    -g_h / tau``, ``b = -(g_lp + g_h * H) / tau``, and ``g_lp / tau`` added at the target."""
    _, h, big, log_s = spec64(logits, targets, tau)
    log_p = ((logits - big[:, None]) * (1.0 / tau)[:, None] - log_s[:, None]).clamp(min=FLOOR)
    a, b = -g_h / tau, -(g_lp + g_h * h) / tau
    grad = exp64(log_p) * (a[:, None] * log_p + b[:, None])
    rows = torch.arange(logits.shape[0])
    grad[rows, targets] = grad[rows, targets] + g_lp / tau
    return grad


def test_the_float64_exp_is_the_specs() -> None:
    gen = torch.Generator().manual_seed(61)
    d = torch.cat([-torch.rand(20000, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -8, 3, (20000,), generator=gen), torch.tensor([0.0, -0.0, -0.5 * math.log(2), -0.3465735902799727,
                                                       -707.99, -708.0, -708.0001, -745.0, -1e4, -math.inf])])
    got, want = _spec.exp(d), exp64(d)
    assert torch.equal(got, want), int((got != want).sum())
    assert torch.equal(exp64(torch.tensor([-708.5, -1e4], dtype=torch.float64)), torch.zeros(2, dtype=torch.float64))
    normal = d > -700.0
    torch.testing.assert_close(want[normal], d[normal].exp(), rtol=2.0**-51, atol=0.0)  # within 2 ulp


def test_float64_invariant_mode_is_the_specs_steps_bit_for_bit() -> None:
    # peaked rows: S near 1, so that log S shows a sum's last bit
    x, targets = peaked(256, 700, 62)
    logits = x.double() * 1.5
    logits[3, :300] = -math.inf  # whole tiles of masked tokens
    logits[7] = logits[7, 0]  # every logit tied
    gen = torch.Generator().manual_seed(63)
    tau = torch.rand(256, generator=gen, dtype=torch.float64) + 0.5
    g_lp, g_h = torch.randn(256, generator=gen, dtype=torch.float64), torch.randn(256, generator=gen,
                                                                                 dtype=torch.float64)
    want_lp, want_h, _, _ = spec64(logits, targets, tau)
    want_grad = spec64_grad(logits, targets, tau, g_lp, g_h)
    for chunk in (None, 7):
        x64 = logits.clone().requires_grad_(True)
        lp, h = log_probs_and_entropy(x64, targets, with_entropy=True, temperature=tau, chunk_size=chunk,
                                      invariant=True)
        torch.autograd.backward((lp * g_lp).sum() + (h * g_h).sum())
        assert lp.dtype == torch.float64
        assert torch.equal(lp, want_lp), int((lp != want_lp).sum())
        assert torch.equal(h, want_h), int((h != want_h).sum())
        grad = x64.grad
        assert grad is not None
        assert torch.equal(grad, want_grad), int(torch.ne(grad, want_grad).sum())
    # and the spec is right: float64 log_softmax, within a few float64 roundings
    ref = torch.log_softmax(logits / tau[:, None], -1)
    torch.testing.assert_close(want_lp, ref.gather(1, targets[:, None])[:, 0], rtol=0.0, atol=1e-12)
