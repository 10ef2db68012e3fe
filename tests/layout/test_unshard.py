"""``unshard``: every CP rank's local tensor, concatenated in rank order, back into the
packed stream without CP. Against the oracle of docs/layouts.md (each rank's rows built
position by position, the stream of extents written out), against ``pack`` without CP
(every closed form, thd and bshd, padded samples, left-padded rows, shared-prefix stars,
any token order), and against AReaL's and verl's reassembly rules written out below as
the plain loops those frameworks run after their own all-gather; gradients, dtypes,
trailing dimensions, and every refusal."""

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from cpslice import Layout, LayoutError, pack, unshard

from ..support.checked import refused
from ..support.oracle import Config, encode, local_length, local_values, widths
from ..support.stars import Stars, stars
from ..support.strategies import configs, samples

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _without_cp(layout: Layout) -> Layout:
    """The same samples and extents with ``cp_mode="none"``: what ``unshard`` returns is
    this layout's packing (a bshd row is the layout's extent ``W``)."""
    if layout.qkv_format == "bshd":
        width = layout.padded_lengths[0] if layout.padded_lengths else layout.max_seq_len
        return Layout(layout.total_lengths, layout.response_lengths, qkv_format="bshd", max_seq_len=width,
                      row_offsets=layout.row_offsets)
    return Layout(layout.total_lengths, layout.response_lengths, padded_lengths=layout.padded_lengths,
                  shared_prefix=layout.shared_prefix)


def _oracle_stream(cfg: Config) -> list[float]:
    """The stream of extents without CP, position by position: ``encode(i, p)`` where
    sample ``i``'s token ``p`` sits (``o_i`` columns into its extent), -1 at padding."""
    out: list[float] = []
    for i, w in enumerate(widths(cfg)):
        o = cfg.row_offsets[i] if cfg.row_offsets is not None else 0
        out += [encode(i, q - o) if o <= q < o + cfg.total[i] else -1.0 for q in range(w)]
    return out


@PROPS
@given(configs(max_cp=4), st.data())
def test_unshard_inverts_the_oracle_split_and_pack(cfg: Config, data: st.DataObject) -> None:
    """Each rank's local tensor written position by position from docs/layouts.md (no
    cpslice code), concatenated, is unsharded with any rank's layout into the stream the
    oracle writes out, which is ``pack`` without CP; the same through ``pack`` per rank."""
    rank = data.draw(st.integers(0, cfg.cp - 1))
    layout = cfg.layout(rank)
    gathered = torch.cat([local_values(cfg, r, (2,)) for r in range(cfg.cp)])
    before = gathered.clone()
    got = unshard(gathered, layout)
    want = torch.tensor(_oracle_stream(cfg), dtype=torch.float64)
    assert torch.equal(got, want[:, None].expand(-1, 2))
    assert torch.equal(gathered, before)
    per_sample = [torch.tensor([encode(i, p) for p in range(t)]) for i, t in enumerate(cfg.total)]
    assert torch.equal(got[:, 0].float(), pack(per_sample, _without_cp(layout), fill=-1))
    # the same through cpslice's own split: pack on every rank, any dtype
    tokens = [torch.arange(t) + 1000 * i for i, t in enumerate(cfg.total)]
    fixed = [cfg.layout(r).with_local_length(local_length(cfg)) for r in range(cfg.cp)]
    split = torch.cat([pack(tokens, f, fill=-1) for f in fixed])
    assert torch.equal(unshard(split, layout), pack(tokens, _without_cp(layout), fill=-1))


def _star_value(entry: tuple[int, int] | None) -> float:
    return -1.0 if entry is None else encode(*entry)


@settings(PROPS, max_examples=60)
@given(stars(), st.data())
def test_unshard_of_shared_prefix_stars_and_orders(case: Stars, data: st.DataObject) -> None:
    """Shared-prefix stars in every mode, a random token order included: each rank's rows
    from the stars' own oracle, unsharded into the stars back to back."""
    rank = data.draw(st.integers(0, case.cp - 1))
    gathered = torch.cat([torch.tensor([_star_value(e) for e in case.local_map(r)]) for r in range(case.cp)])
    got = unshard(gathered, case.layout(rank))
    assert got.tolist() == [_star_value(e) for e in case.stream()]


@st.composite
def orders(draw: st.DrawFn) -> dict[str, Any]:
    """``Layout.from_order``'s arguments for a random token order: thd over padded
    samples, or bshd rows all permuted alike (as torch applies its balancer's index)."""
    total, response = draw(samples(max_n=5, max_len=12))
    cp = draw(st.integers(1, 4))
    rng = draw(st.randoms(use_true_random=False))
    if draw(st.booleans()):
        seq = cp * (-(-max(total, default=1) // cp) + draw(st.integers(0, 1)))
        perm = list(range(seq))
        rng.shuffle(perm)
        return {"order": perm, "total_lengths": total, "response_lengths": response, "cp_size": cp,
                "qkv_format": "bshd", "max_seq_len": seq}
    padded = [t + rng.randint(0, 2) for t in total]
    if padded:
        padded[-1] += -sum(padded) % cp
    perm = list(range(sum(padded)))
    rng.shuffle(perm)
    return {"order": perm, "total_lengths": total, "response_lengths": response, "cp_size": cp,
            "padded_lengths": padded}


@settings(PROPS, max_examples=60)
@given(orders())
def test_unshard_inverts_an_order_by_hand(kw: dict[str, Any]) -> None:
    """What AReaL's glue did by hand: row ``j`` of rank ``r`` holds stream position
    ``order[r*T + j]`` (bshd: row ``b``'s columns ``order[r*S/c:(r+1)*S/c]``), so the
    stream is the gathered rows written at those positions."""
    order = torch.tensor(kw["order"], dtype=torch.int64)
    layout = Layout.from_order(order, **{k: v for k, v in kw.items() if k != "order"}, cp_rank=0)
    tokens = [torch.arange(n) + 100 * i for i, n in enumerate(layout.total_lengths)]
    gathered = torch.cat([pack(tokens, layout.for_rank(r), fill=-1) for r in range(layout.cp_size)])
    if layout.qkv_format == "bshd":  # stream position b*S + column: rank-major, then row, then column
        s, c, b = kw["max_seq_len"], layout.cp_size, layout.num_samples
        order = (order.view(1, c, s // c) + s * torch.arange(b).view(b, 1, 1)).transpose(0, 1)
    assert gathered.shape[0] == order.numel()
    by_hand = torch.full((sum(layout.padded_lengths),), -7, dtype=gathered.dtype)
    by_hand[order.reshape(-1)] = gathered
    assert torch.equal(unshard(gathered, layout), by_hand)
    assert torch.equal(by_hand, pack(tokens, _without_cp(layout), fill=-1))


# AReaL's and verl's reassembly, written out as the frameworks' own plain loops over
# samples and ranks (no cpslice code): the all-gathered local tensors of every rank in,
# the stream out.


def areal_zigzag_split(stream: Tensor, cu_seqlens: list[int], cp: int, rank: int) -> Tensor:
    """AReaL's packed-CP preprocessing of one rank: each sample, padded to a multiple of
    ``2 * cp``, split into ``2 * cp`` chunks; the rank keeps chunks ``rank`` and
    ``2 * cp - 1 - rank``, at ``cu_seqlens[i] / cp`` of its local tensor."""
    out = torch.zeros((cu_seqlens[-1] // cp, *stream.shape[1:]), dtype=stream.dtype)
    for i in range(len(cu_seqlens) - 1):
        seq_len = cu_seqlens[i + 1] - cu_seqlens[i]
        half = seq_len // cp // 2
        start = cu_seqlens[i] // cp
        d = stream[cu_seqlens[i]:cu_seqlens[i + 1]]
        out[start:start + half] = d[half * rank:half * (rank + 1)]
        out[start + half:start + 2 * half] = d[seq_len - half * (rank + 1):seq_len - half * rank]
    return out


def areal_zigzag_merge(outputs: list[Tensor], cu_seqlens: list[int]) -> Tensor:
    """AReaL's packed-CP postprocessing after its all-gather: for each sample, rank
    ``j``'s first half-chunk is chunk ``j`` and its second chunk ``2 * cp - 1 - j``."""
    cp = len(outputs)
    out = torch.empty((cu_seqlens[-1], *outputs[0].shape[1:]), dtype=outputs[0].dtype)
    for i in range(len(cu_seqlens) - 1):
        seq_len = cu_seqlens[i + 1] - cu_seqlens[i]
        split = seq_len // cp
        half = split // 2
        tmp = torch.empty((seq_len, *outputs[0].shape[1:]), dtype=outputs[0].dtype)
        for j in range(cp):
            start = cu_seqlens[i] // cp
            tmp[j * half:(j + 1) * half] = outputs[j][start:start + half]
            tmp[seq_len - (j + 1) * half:seq_len - j * half] = outputs[j][start + half:start + split]
        out[cu_seqlens[i]:cu_seqlens[i + 1]] = tmp
    return out


def ulysses_split(stream: Tensor, sp: int, rank: int) -> Tensor:
    """AReaL's (and verl's) Ulysses slicing: the stream padded to a multiple of ``sp``,
    cut into ``sp`` contiguous pieces."""
    pad = -stream.shape[0] % sp
    padded = torch.cat([stream, torch.zeros((pad, *stream.shape[1:]), dtype=stream.dtype)])
    part = padded.shape[0] // sp
    return padded[rank * part:(rank + 1) * part]


def ulysses_merge(outputs: list[Tensor], total: int) -> Tensor:
    """After the gather over the sequence-parallel group: the pieces back to back, the
    padding cut off."""
    return torch.cat(outputs)[:total]


def verl_postprocess(outputs: list[Tensor], cu_padded: list[int], attention_mask: Tensor) -> Tensor:
    """verl's ``postprocess_packed_seqs`` after its all-gather: each sample's padded
    sequence reassembled from every rank's two half-chunks, its first ``L_i`` positions
    written at the ones of its attention-mask row of ``[B, S]``."""
    cp = len(outputs)
    batch, seq = attention_mask.shape
    out = torch.zeros((batch, seq, *outputs[0].shape[1:]), dtype=outputs[0].dtype)
    lengths = attention_mask.sum(1).tolist()
    for i in range(batch):
        if cp <= 1:
            start = cu_padded[i]
            out[i, attention_mask[i]] = outputs[0][start:start + lengths[i]]
            continue
        chunk = (cu_padded[i + 1] - cu_padded[i]) // cp
        half = chunk // 2
        padded = chunk * cp
        tmp = torch.empty((padded, *outputs[0].shape[1:]), dtype=outputs[0].dtype)
        for j in range(cp):
            start = cu_padded[i] // cp
            tmp[j * half:(j + 1) * half] = outputs[j][start:start + half]
            tmp[padded - (j + 1) * half:padded - j * half] = outputs[j][start + half:start + chunk]
        out[i, attention_mask[i]] = tmp[:lengths[i]]
    return out


def _grads(y: Tensor, g: Tensor, xs: list[Tensor]) -> Tensor:
    """The gradient of ``(y * g).sum()`` w.r.t. every one of ``xs``, concatenated (zeros
    for a ``y`` none of them reaches: a batch of no samples)."""
    loss = (y * g).sum()
    if not loss.requires_grad:
        return torch.cat([torch.zeros_like(x) for x in xs])
    return torch.cat(torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True))


def _cu(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@settings(PROPS, max_examples=50)
@given(samples(max_n=5, max_len=20), st.integers(1, 4), st.integers(1, 2), st.integers(0, 2**31 - 1))
def test_areal_zigzag_reassembly(lengths: tuple[Any, Any], cp: int, tp: int, seed: int) -> None:
    """AReaL pads each sample to a multiple of ``tp * cp * 2`` (its ``cu_seqlens``),
    splits it zigzag; its reassembly and ``unshard`` agree, values and gradients."""
    total, response = lengths
    align = tp * cp * 2
    cu = _cu([-(-t // align) * align for t in total])
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randn(cu[-1], 3, generator=gen, dtype=torch.float64)
    outputs = [areal_zigzag_split(stream, cu, cp, r).requires_grad_(True) for r in range(cp)]
    layout = Layout.from_cu_seqlens(cu, total, response, cp_mode="zigzag" if cp > 1 else "none",
                                    cp_rank=cp - 1, cp_size=cp)
    for r in range(cp if total else 0):  # cpslice places the rows where AReaL's split does
        assert torch.equal(pack([stream[cu[i]:cu[i] + t] for i, t in enumerate(total)], layout.for_rank(r)),
                           _zero_padding(outputs[r].detach(), layout.for_rank(r)))
    want = areal_zigzag_merge(outputs, cu)
    got = unshard(torch.cat(outputs), layout)
    assert torch.equal(got, want) and torch.equal(got, stream)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    assert torch.equal(_grads(got, g, outputs), _grads(want, g, outputs))


def _zero_padding(local: Tensor, layout: Layout) -> Tensor:
    """``local`` with the rows that hold no token zeroed (``pack``'s fill)."""
    held = pack([torch.ones(t) for t in layout.total_lengths], layout).bool()
    return torch.where(held[:, None], local, torch.zeros_like(local))


@settings(PROPS, max_examples=50)
@given(samples(max_n=5, max_len=20), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_ulysses_reassembly(lengths: tuple[Any, Any], sp: int, seed: int) -> None:
    """Ulysses (AReaL, verl): the stream padded to a multiple of ``sp`` and cut in
    contiguous pieces is the allgather layout; gathered and cut back, as ``unshard``."""
    total, response = lengths
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randn(sum(total), 2, generator=gen, dtype=torch.float64)
    outputs = [ulysses_split(stream, sp, r).requires_grad_(True) for r in range(sp)]
    layout = Layout(total, response, cp_mode="allgather", cp_rank=0, cp_size=sp)
    want = ulysses_merge(outputs, len(stream))
    got = unshard(torch.cat(outputs), layout)
    assert torch.equal(got, want) and torch.equal(got, stream)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    assert torch.equal(_grads(got, g, outputs), _grads(want, g, outputs))


def verl_preprocess(rows: Tensor, attention_mask: Tensor, cp: int, tp: int, rank: int) -> tuple[Tensor, list[int]]:
    """verl's ``preprocess_packed_seqs`` of one rank: each row's tokens (its mask's ones),
    padded to a multiple of ``tp * cp * 2`` (``tp`` without CP), zigzag over the ranks;
    the rank's local tensor and the padded boundaries."""
    align = tp * cp * 2 if cp > 1 else tp
    lengths = attention_mask.sum(1).tolist()
    cu = _cu([n + (align - n % align) % align for n in lengths])
    out = torch.zeros((cu[-1] // cp, *rows.shape[2:]), dtype=rows.dtype)
    for i, n in enumerate(lengths):
        d = rows[i, attention_mask[i]]
        if cp <= 1:
            out[cu[i]:cu[i] + n] = d
            continue
        padded = cu[i + 1] - cu[i]
        half = padded // cp // 2
        start = cu[i] // cp
        first = d[half * rank:half * (rank + 1)]  # short where the sample ends in the chunk (verl's slice would raise)
        out[start:start + first.shape[0]] = first
        end = min(padded - half * rank, n)
        begin = padded - half * (rank + 1)
        if end > begin:
            out[start + half:start + half + end - begin] = d[begin:end]
    return out, cu


@settings(PROPS, max_examples=50)
@given(samples(max_n=5, max_len=16), st.integers(1, 4), st.integers(1, 2), st.booleans(), st.integers(0, 2**31 - 1))
def test_verl_postprocess_packed_seqs(lengths: tuple[Any, Any], cp: int, tp: int, left: bool, seed: int) -> None:
    """verl packs a ``[B, S]`` batch's rows (right- or left-padded) into samples aligned to
    ``tp * cp * 2``, zigzag; after its all-gather, ``postprocess_packed_seqs`` writes each
    sample's tokens back at its mask's ones. ``unshard`` of the same gathered rows gives
    each sample at ``cu_seqlens_padded[i]``: the same values, the same gradients."""
    total, response = lengths
    seq = max(total, default=1) + 2
    mask = torch.zeros(len(total), seq, dtype=torch.bool)
    for i, t in enumerate(total):
        start = seq - t if left else 0
        mask[i, start:start + t] = True
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(total), seq, 2, generator=gen, dtype=torch.float64)
    parts = [verl_preprocess(rows, mask, cp, tp, r) for r in range(cp)]
    cu = parts[0][1]
    outputs = [p.requires_grad_(True) for p, _ in parts]
    align = tp * cp * 2 if cp > 1 else tp
    layout = Layout(total, response, cp_mode="zigzag" if cp > 1 else "none", cp_rank=0, cp_size=cp, align=align)
    want = verl_postprocess(outputs, cu, mask)
    stream = unshard(torch.cat(outputs), layout)
    got = torch.zeros_like(want)
    for i, t in enumerate(total):
        got = got.index_put((torch.tensor([i]), mask[i].nonzero()[:, 0]), stream[cu[i]:cu[i] + t])
    assert torch.equal(got, want)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    assert torch.equal(_grads(got, g, outputs), _grads(want, g, outputs))


def test_gradient_reaches_every_gathered_row_that_holds_a_position() -> None:
    """The gradient of a row is the stream's at the position it holds, 0 where it holds
    none (an allgather's tail, rows past what a zigzag layout needs); float64 in, float64
    out, any trailing shape, and bool and integer tensors too."""
    layout = Layout([10, 3, 1], [4, 1, 0], cp_mode="allgather", cp_size=3, local_length=6)
    gathered = torch.randn(18, 2, 3, dtype=torch.float64, requires_grad=True)
    out = unshard(gathered, layout)
    assert out.shape == (14, 2, 3) and out.dtype == torch.float64
    w = torch.randn(14, 2, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((out * w).sum(), gathered)
    assert torch.equal(grad[:14], w) and not bool(grad[14:].any())
    # W = 8, 4: the layout needs T = 6; T = 7 declared: one padding row past it on each rank
    zigzag = Layout([5, 2], [2, 1], cp_mode="zigzag", cp_size=2, cp_rank=1, local_length=7)
    rows = torch.arange(14.0, requires_grad=True)
    out = unshard(rows, zigzag)
    # rank 0's rows 0-5: sample 0's positions 0, 1 | 6, 7, sample 1's 0 | 3 (chunks 0 and 3);
    # rank 1's rows 7-12: sample 0's 2, 3 | 4, 5, sample 1's 1 | 2 (chunks 1 and 2)
    assert out.tolist() == [0, 1, 7, 8, 9, 10, 2, 3, 4, 11, 12, 5]
    (grad,) = torch.autograd.grad(out.sum(), rows)
    assert grad.tolist() == [1.0] * 6 + [0.0] + [1.0] * 6 + [0.0]
    assert unshard(torch.tensor([True, False] * 7), zigzag).dtype == torch.bool
    assert unshard(torch.arange(14, dtype=torch.int32), zigzag).dtype == torch.int32


def test_edges() -> None:
    """No samples; a rank that holds nothing; cp 1 (the local tensor, its declared tail cut)."""
    empty = Layout([], [], cp_mode="zigzag", cp_size=2)
    assert unshard(torch.zeros(0, 3), empty).shape == (0, 3)
    assert unshard(torch.zeros(4, 3), empty.with_local_length(2)).shape == (0, 3)  # 2 rows of padding per rank
    sparse = Layout([2, 1], [1, 0], cp_mode="allgather", cp_size=4, cp_rank=2)  # the last ranks hold nothing
    assert unshard(torch.arange(4), sparse).tolist() == [0, 1, 2]  # T = 1: rank 3 holds nothing
    assert unshard(torch.arange(8), sparse.with_local_length(2)).tolist() == [0, 1, 2]  # T = 2: ranks 2 and 3
    alone = Layout([3, 2], [1, 1])
    assert unshard(torch.arange(7), alone.with_local_length(7)).tolist() == [0, 1, 2, 3, 4]


REFUSALS = [
    (lambda: unshard([1.0, 2.0], Layout([2], [1])), TypeError,  # type: ignore[arg-type]
     r"gathered must be a torch.Tensor \[cp_size \* T, \.\.\.\], got a list"),
    (lambda: unshard(torch.tensor(1.0), Layout([2], [1])), TypeError, r"gathered is 0-d"),
    (lambda: unshard(torch.zeros(7), Layout([3, 2], [1, 1], cp_mode="zigzag", cp_size=2)), LayoutError,
     r"gathered has 7 rows, which cp_size 2 does not divide \(every CP rank's local tensor of T rows, "
     r"concatenated in rank order: cp_size \* T rows\)"),
    (lambda: unshard(torch.zeros(10), Layout([7], [1], cp_mode="allgather", cp_size=2, local_length=4)), LayoutError,
     r"gathered has 10 rows but cp_size \* local_length = 2 \* 4 = 8 \(every CP rank's local tensor"),
    (lambda: unshard(torch.zeros(6), Layout([7], [1], cp_mode="allgather", cp_size=2)), LayoutError,
     r"each CP rank's piece of gathered \(gathered.shape\[0\] / cp_size\) has length 3, which is too short: "
     r"cp_size \* T = 2 \* 3 = 6 < sum\(total_lengths\) = 7"),
    (lambda: unshard(torch.zeros(6), Layout([3, 2], [1, 1], cp_mode="zigzag", cp_size=2)), LayoutError,
     r"has length 3, which is too short: the layout needs at least 4 positions \(zigzag layout\)"),
]


@pytest.mark.parametrize(("call", "error", "match"), REFUSALS)
def test_refusals(call: Any, error: type[Exception], match: str) -> None:
    with refused(error, match):
        call()
