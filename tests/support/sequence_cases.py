"""Sequence parallelism on real gloo TP groups, run by test_logprob_tp.py on every rank of
a world of 4: TP 4 on the world group, TP 2 on its two subgroups (``tp_groups``).

Each TP rank passes its contiguous ``[T / tp, H]`` shard of the hidden states, as
Megatron's output layer receives it under ``--sequence-parallel``, and its ``[V_local,
H]`` shard of the LM-head weight. Every rank must get the float64 reference's values for
all ``T`` rows, its own rows of the hidden gradient and its vocabulary rows of the weight
gradient; forward enters one all-gather of the hidden states and the usual one of the
statistics, backward exactly one reduce-scatter and no all-reduce (counted), empty
shards included. The length errors that name sequence parallelism come before any
collective.

``sequence_worker`` returns ``[(tp size, cases checked), ...]`` per TP group."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor

from cpslice import (
    Layout,
    LayoutError,
    _probe,
    entropy_from_hidden,
    log_probs_and_entropy_from_hidden,
    log_probs_at_from_hidden,
    pack,
    response_distillation_from_hidden,
    response_log_probs_from_hidden,
    response_topk_log_probs_from_hidden,
    shard_responses,
    topk_log_probs_from_hidden,
)

from . import distill_reference as ref
from ._dist import tp_groups
from .reference import grad_close, value_atol

H, V_LOCAL, TEMPERATURE = 6, 5, 0.8
NAMES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all_single")


def _calls(seen: _probe.Seen) -> dict[str, int]:
    """The collectives ``seen`` so far, by name (no other kind entered)."""
    counts = {name: seen.count("collective", name=name) for name in NAMES}
    assert sum(counts.values()) == seen.count("collective"), seen.of("collective")
    return counts


def _more(before: dict[str, int], **added: int) -> dict[str, int]:
    return {name: before[name] + added.get(name, 0) for name in NAMES}


class _Rank(NamedTuple):
    """This process in one TP group: the group, its size and this rank in it; and the
    collectives watched."""

    group: Any
    tp: int
    rank: int
    seen: _probe.Seen

    def rows(self, t: int) -> slice:
        """This rank's contiguous shard of ``t`` rows (Megatron's sequence parallelism)."""
        return slice(self.rank * t // self.tp, (self.rank + 1) * t // self.tp)

    @property
    def vocab(self) -> slice:
        return slice(self.rank * V_LOCAL, (self.rank + 1) * V_LOCAL)


Tested = Callable[[Tensor, Tensor], Sequence[Tensor]]
"""A call under test: this rank's hidden shard and weight shard in, its differentiable
float outputs out (every row's: the same on every TP rank)."""
Reference = Callable[[Tensor, Tensor], Sequence[Tensor]]
"""The float64 reference: the whole ``[T, H]`` hidden states and ``[V, H]`` weight (leaves)
in, the outputs aligned with the tested call's out."""


def _loss(outputs: Sequence[Tensor], weights: Sequence[Tensor]) -> Tensor:
    """``sum(weights . outputs)`` in float64, through every output (empty ones too)."""
    return torch.stack([(y.double() * c).sum() for y, c in zip(outputs, weights)]).sum()


def _check(at: _Rank, hidden: Tensor, weight: Tensor, tested: Tested, reference: Reference) -> None:
    """``tested`` on this rank's shards against ``reference`` on the whole float64 tensors:
    the values, this rank's rows of the hidden gradient, its vocabulary rows of the weight
    gradient (to a few roundings of the inputs' dtype), and the collectives: two
    all-gathers forward (the hidden states first), one reduce-scatter backward, nothing
    else."""
    rows = at.rows(hidden.shape[0])
    x = hidden[rows].clone().requires_grad_(True)
    w = weight[at.vocab].clone().requires_grad_(True)
    before = _calls(at.seen)
    got = tested(x, w)
    forward = [e for e in at.seen.of("collective")[sum(before.values()):]]
    assert [e.name for e in forward] == ["all_gather", "all_gather"], forward
    assert forward[0].elements == x.numel()  # the hidden shard, first
    gen = torch.Generator().manual_seed(77)
    weights = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in got]
    torch.autograd.backward(_loss(got, weights))
    assert _calls(at.seen) == _more(before, all_gather=2, reduce_scatter=1)
    assert at.seen.of("collective")[-1].elements == hidden.shape[0] * H  # the [T, H] gradient

    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    want = reference(h64, w64)
    torch.autograd.backward(_loss(want, weights))
    bf16 = hidden.dtype == torch.bfloat16
    atol, rel = value_atol(hidden, weight, TEMPERATURE, 2.0**-7 if bf16 else 2.0**-18), 3e-2 if bf16 else 1e-5
    assert [y.shape for y in got] == [y.shape for y in want]
    for y, z in zip(got, want):
        torch.testing.assert_close(y.double(), z.detach(), rtol=0.0, atol=atol)
    assert h64.grad is not None and w64.grad is not None
    grad_close(x.grad, h64.grad[rows], rel)
    grad_close(w.grad, w64.grad[at.vocab], rel)
    assert torch.equal(x.detach(), hidden[rows])


def _logits(h: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """The float64 tempered logits, rounded to ``dtype`` where the head's matmul rounds
    them (bfloat16), the gradient passing the rounding unchanged."""
    logits = h @ w.T
    if dtype == torch.bfloat16:
        logits = logits + (logits.to(dtype).double() - logits).detach()
    return logits / TEMPERATURE


def _head(seed: int, t: int, tp: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, H, generator=gen) * 2).to(dtype), torch.randn(tp * V_LOCAL, H, generator=gen).to(dtype)


def _row_cases(at: _Rank) -> int:
    """The row-level functions: log-probs and entropy (float32 and bfloat16, and no rows at
    all), log-probs at ids, the top-k, the entropy alone."""
    vocab = at.tp * V_LOCAL
    gen = torch.Generator().manual_seed(500)
    for t, dtype, chunk in ((8, torch.float32, 3), (8, torch.bfloat16, None), (0, torch.float32, None)):
        hidden, weight = _head(510 + t, t, at.tp, dtype)
        targets = torch.randint(0, vocab, (t,), generator=gen)

        def both(x: Tensor, w: Tensor, targets: Tensor = targets, chunk: int | None = chunk) -> list[Tensor]:
            return list(log_probs_and_entropy_from_hidden(
                x, w, targets, with_entropy=True, temperature=TEMPERATURE, tp_group=at.group, chunk_size=chunk,
                sequence_parallel=True))

        def both64(h: Tensor, w: Tensor, targets: Tensor = targets, dtype: torch.dtype = dtype) -> list[Tensor]:
            lp = torch.log_softmax(_logits(h, w, dtype), -1)
            return [lp.gather(1, targets[:, None])[:, 0], -(lp.exp() * lp).sum(-1)]

        _check(at, hidden, weight, both, both64)

    hidden, weight = _head(520, 8, at.tp)
    ids = ref.spread_ids(8, 3, vocab, gen)
    _check(at, hidden, weight,
           lambda x, w: [log_probs_at_from_hidden(x, w, ids, temperature=TEMPERATURE, tp_group=at.group,
                                                  chunk_size=2, sequence_parallel=True)],
           lambda h, w: [torch.log_softmax(_logits(h, w, torch.float64), -1).gather(1, ids)])

    top: list[Tensor] = []

    def topk(x: Tensor, w: Tensor) -> list[Tensor]:
        values, chosen = topk_log_probs_from_hidden(x, w, 3, temperature=TEMPERATURE, tp_group=at.group,
                                                    sequence_parallel=True)
        top.append(chosen)
        return [values]

    def topk64(h: Tensor, w: Tensor) -> list[Tensor]:
        values, chosen = torch.topk(torch.log_softmax(_logits(h, w, torch.float64), -1), 3)
        top.append(chosen)
        return [values]

    _check(at, hidden, weight, topk, topk64)
    assert torch.equal(top[0], top[1])

    def entropy64(h: Tensor, w: Tensor) -> list[Tensor]:
        lp = torch.log_softmax(_logits(h, w, torch.float64), -1)
        return [-(lp.exp() * lp).sum(-1)]

    _check(at, hidden, weight,
           lambda x, w: [entropy_from_hidden(x, w, temperature=TEMPERATURE, tp_group=at.group, chunk_size=3,
                                             sequence_parallel=True)],
           entropy64)
    return 6


# zigzag over 2 CP ranks: padded to [8, 8, 4, 4], 12 rows each; one response empty
TOTAL, RESPONSE = [5, 7, 3, 1], [3, 4, 1, 0]


def _per_sample(h: Tensor, layout: Layout) -> list[Tensor]:
    """Each sample's ``[L_i, H]`` rows of this CP rank's packed stream ``h`` (zero where
    another rank holds them), differentiable: ``pack`` of them gives ``h`` back."""
    position = pack([torch.arange(n) + sum(TOTAL[:i]) for i, n in enumerate(TOTAL)], layout)
    token = pack([torch.ones(n, dtype=torch.bool) for n in TOTAL], layout)
    whole = torch.zeros(sum(TOTAL), h.shape[1], dtype=h.dtype).index_add(0, position[token], h[token])
    return list(torch.split(whole, TOTAL))


def _response_cases(at: _Rank) -> int:
    """``response_log_probs_from_hidden`` (with entropy) on each of 2 zigzag CP ranks, and
    ``response_topk_log_probs_from_hidden`` on one."""
    vocab = at.tp * V_LOCAL
    gen = torch.Generator().manual_seed(600)
    tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in TOTAL]
    samples, weight = [torch.randn(n, H, generator=gen) * 2 for n in TOTAL], torch.randn(vocab, H, generator=gen)
    layouts = [Layout(TOTAL, RESPONSE, cp_mode="zigzag", cp_rank=cp_rank, cp_size=2) for cp_rank in (0, 1)]
    for layout in layouts:
        hidden = pack(samples, layout)

        def response(x: Tensor, w: Tensor, layout: Layout = layout) -> list[Tensor]:
            lp, ent = response_log_probs_from_hidden(x, w, tokens, layout, with_entropy=True, temperature=TEMPERATURE,
                                                     tp_group=at.group, chunk_size=2, sequence_parallel=True)
            return [*lp, *ent]

        def response64(h: Tensor, w: Tensor, layout: Layout = layout) -> list[Tensor]:
            lps, ents = [], []
            for n, r, tok, rows in zip(TOTAL, RESPONSE, tokens, _per_sample(h, layout)):
                span = torch.log_softmax(_logits(rows, w, torch.float64), -1)[n - r - 1 : n - 1]
                lps.append(span.gather(1, tok[n - r :, None])[:, 0])
                ents.append(-(span.exp() * span).sum(-1))
            return [*shard_responses(lps, layout), *shard_responses(ents, layout)]

        _check(at, hidden, weight, response, response64)

    layout = layouts[1]
    hidden = pack(samples, layout)

    def teacher(x: Tensor, w: Tensor) -> list[Tensor]:
        values, _ = response_topk_log_probs_from_hidden(x, w, 2, layout, temperature=TEMPERATURE, tp_group=at.group,
                                                        sequence_parallel=True)
        return values

    def teacher64(h: Tensor, w: Tensor) -> list[Tensor]:
        tops = [torch.topk(torch.log_softmax(_logits(rows, w, torch.float64), -1)[n - r - 1 : n - 1], 2)[0]
                for n, r, rows in zip(TOTAL, RESPONSE, _per_sample(h, layout))]
        return shard_responses(tops, layout)

    _check(at, hidden, weight, teacher, teacher64)
    return 3


def _distillation_case(at: _Rank) -> int:
    """``response_distillation_from_hidden`` without CP, one response empty."""
    total, response = [3, 4, 1], [2, 3, 0]
    vocab = at.tp * V_LOCAL
    gen = torch.Generator().manual_seed(700)
    tops = [ref.teacher_top_k(ref.peaked_logits(r, vocab, gen), 3, 1.0) for r in response]
    lps, ids = [v for v, _ in tops], [i for _, i in tops]
    layout = Layout(total, response)
    hidden, weight = _head(710, sum(total), at.tp)

    def distill(x: Tensor, w: Tensor) -> list[Tensor]:
        return response_distillation_from_hidden(x, w, lps, ids, layout, temperature=TEMPERATURE, tp_group=at.group,
                                                 chunk_size=3, sequence_parallel=True)

    def distill64(h: Tensor, w: Tensor) -> list[Tensor]:
        out = []
        for n, r, rows, lp, i in zip(total, response, torch.split(h, total), lps, ids):
            student = torch.log_softmax(_logits(rows, w, torch.float64), -1)[n - r - 1 : n - 1].gather(1, i)
            out.append(ref.divergence(student, lp, "forward", 0.5, "bin"))
        return out

    _check(at, hidden, weight, distill, distill64)
    return 1


def _refusals(at: _Rank) -> int:
    """The length errors, each raised before any collective: without
    ``sequence_parallel``, a shard whose rows times the TP size are what the targets or
    the layout need names sequence parallelism; with it, the gathered length is named."""
    t, shard = 8, 8 // at.tp
    hidden, weight = _head(800, t, at.tp)
    x, w = hidden[at.rows(t)], weight[at.vocab]
    targets = torch.zeros(t, dtype=torch.int64)
    layout = Layout([t], [2])
    before = _calls(at.seen)
    hint = (rf"{shard} \* tp {at.tp} = {t} is what {{}} needs: if hidden is this TP rank's shard of the sequence, "
            r"pass sequence_parallel=True with tp_group \(Megatron's --sequence-parallel\)")
    with pytest.raises(LayoutError, match=rf"targets has shape \({t},\) but hidden has {shard} rows.*; "
                       + hint.format("targets")):
        log_probs_and_entropy_from_hidden(x, w, targets, tp_group=at.group)
    with pytest.raises(LayoutError, match=rf"ids has shape \({t}, 2\) but hidden .*" + hint.format("ids")):
        log_probs_at_from_hidden(x, w, torch.zeros(t, 2, dtype=torch.int64), tp_group=at.group)
    tokens = [torch.zeros(t, dtype=torch.int64)]
    with pytest.raises(LayoutError, match=rf"hidden has length {shard}, which is too short: .*; "
                       + hint.format("the layout")):
        response_log_probs_from_hidden(x, w, tokens, layout, tp_group=at.group)
    with pytest.raises(LayoutError, match=rf"hidden has length {shard}, which is too short: .*; "
                       + hint.format("the layout")):
        response_distillation_from_hidden(x, w, [torch.zeros(2, 1)], [torch.zeros(2, 1, dtype=torch.int64)], layout,
                                          tp_group=at.group)
    gathered = rf"hidden gathered over tp_group \({shard} rows x tp {at.tp}\)"
    with pytest.raises(LayoutError, match=rf"targets has shape \({t - 1},\) but {gathered} has {t} rows"):
        log_probs_and_entropy_from_hidden(x, w, targets[1:], tp_group=at.group, sequence_parallel=True)
    short = Layout([t + at.tp], [2])
    with pytest.raises(LayoutError, match=rf"{gathered} has length {t}, which is too short") as caught:
        response_log_probs_from_hidden(x, w, [torch.zeros(t + at.tp, dtype=torch.int64)], short, tp_group=at.group,
                                       sequence_parallel=True)
    assert "sequence_parallel=True with" not in str(caught.value)  # already on
    with pytest.raises(LayoutError, match=rf"k={at.tp * V_LOCAL + 1} is larger than the vocabulary"):
        topk_log_probs_from_hidden(x, w, at.tp * V_LOCAL + 1, tp_group=at.group, sequence_parallel=True)
    with pytest.raises(LayoutError, match=rf"k={at.tp * V_LOCAL + 1} is larger than the vocabulary"):
        response_topk_log_probs_from_hidden(x, w, at.tp * V_LOCAL + 1, layout, tp_group=at.group,
                                            sequence_parallel=True)
    # rows times the TP size other than the targets': the plain error
    with pytest.raises(LayoutError, match=rf"but hidden has {shard} rows; targets must be \[T\] = \[{shard}\], one "
                       r"token id per row$"):
        log_probs_and_entropy_from_hidden(x, w, targets[1:], tp_group=at.group)
    assert _calls(at.seen) == before
    return 1


def sequence_worker(rank: int, world: int) -> list[tuple[int, int]]:
    done = []
    with _probe.watch() as seen:
        for group, tp, tp_rank in tp_groups(rank, world):
            at = _Rank(group, tp, tp_rank, seen)
            done.append((tp, _row_cases(at) + _response_cases(at) + _distillation_case(at) + _refusals(at)))
    return done
