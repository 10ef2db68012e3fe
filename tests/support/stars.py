"""Shared-prefix stars (``shared_prefix=``) for the tests: a loop-by-loop oracle of
docs/layouts.md's star rules that shares no code with ``cpslice._layout.plan``, random star
batches, and their float64 reference: the SAME samples packed without sharing, each
sample's full tokens (its group's prompt, then its response) with its own copy of the
star's rows.

A star's rows are the "model's" output once; sample ``i`` (branch ``g`` of group ``j``)
reads the rows of its prompt ``[0, P_j)`` and of its branch ``[P_j + D_g, P_j + D_g +
R_g)``. The unshared reference computes every sample on its own copy of those rows; the
gradient a shared layout must give a star row is the sum of the copies' gradients
(``star_grads``): the prompt's last row sums over the branches, each of which predicts
its own first response token there."""

import functools
import math
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from hypothesis import strategies as st
from torch import Tensor

from cpslice import Layout
from cpslice._types import CpMode

Entry = tuple[int, int] | None
"""What a local row holds: ``(group, star position)``, or None for padding."""
Sets = list[list[list[int]]]
"""Per sample, per response token, the ids of its token set (empty: unrestricted)."""


@dataclass(frozen=True)
class Stars:
    """Groups of samples sharing a prompt, laid out over ``cp`` ranks.

    ``mode`` is a closed form or ``"order"`` (then ``order`` is the rearranged stream);
    ``padded`` one extent per group, ``align`` the stars' rounding, ``cu`` builds the
    layout through ``Layout.from_cu_seqlens``; ``extra`` rows past an allgather piece."""

    groups: tuple[int, ...]
    prompts: tuple[int, ...]  # P_j per group
    response: tuple[int, ...]  # R_i per sample
    mode: str = "none"  # a CpMode, or "order"
    cp: int = 1
    padded: tuple[int, ...] | None = None
    align: int | None = None
    cu: bool = False
    extra: int = 0
    order: tuple[int, ...] | None = None

    @property
    def n(self) -> int:
        return len(self.response)

    def group_of(self, i: int) -> int:
        first = 0
        for j, g in enumerate(self.groups):
            if i < first + g:
                return j
            first += g
        raise AssertionError(i)

    def members(self, j: int) -> range:
        first = sum(self.groups[:j])
        return range(first, first + self.groups[j])

    @property
    def total(self) -> tuple[int, ...]:
        return tuple(self.prompts[self.group_of(i)] + r for i, r in enumerate(self.response))

    @property
    def star_lengths(self) -> tuple[int, ...]:
        return tuple(self.prompts[j] + sum(self.response[i] for i in self.members(j)) for j in range(len(self.groups)))

    def star_rows(self, i: int) -> list[int]:
        """The star positions of sample ``i``'s positions ``0, 1, ..., L_i - 1``."""
        return list(_star_rows(self, i))

    def holders(self, j: int, s: int) -> list[tuple[int, int]]:
        """Every ``(sample, position)`` that star position ``s`` of group ``j`` holds."""
        if s < self.prompts[j]:
            return [(i, s) for i in self.members(j)]
        return [(i, rows.index(s)) for i in self.members(j) if s in (rows := _star_rows(self, i))]

    @property
    def widths(self) -> list[int]:
        """Each star's extent ``W*_j``, from the rules (not from the Layout)."""
        if self.padded is not None:
            return list(self.padded)
        step = self.align or (2 * self.cp if self.mode == "zigzag" else 1)
        return [-(-t // step) * step for t in self.star_lengths]

    @property
    def length(self) -> int:
        """This batch's local length ``T`` on every rank."""
        w = self.widths
        if self.mode == "zigzag":
            return sum(2 * (x // (2 * self.cp)) for x in w)
        return -(-sum(w) // self.cp) + (self.extra if self.mode == "allgather" else 0)

    def layout(self, rank: int) -> Layout:
        """This rank's shared layout, through the constructor the batch names."""
        groups, cp = list(self.groups), self.cp
        if self.order is not None:
            return Layout.from_order(list(self.order), self.total, self.response, cp_rank=rank, cp_size=cp,
                                     padded_lengths=self.padded, shared_prefix=groups)
        mode = self.closed
        local = self.length if mode == "allgather" else None
        if self.cu:
            bounds = [0]
            for w in self.widths:
                bounds.append(bounds[-1] + w)
            return Layout.from_cu_seqlens(bounds, self.total, self.response, cp_mode=mode, cp_rank=rank,
                                          cp_size=cp, local_length=local, shared_prefix=groups)
        return Layout(self.total, self.response, cp_mode=mode, cp_rank=rank, cp_size=cp, local_length=local,
                      padded_lengths=self.padded, align=self.align, shared_prefix=groups)

    @property
    def closed(self) -> CpMode:
        assert self.mode in ("none", "zigzag", "allgather"), self.mode
        return cast(CpMode, self.mode)

    def unshared(self) -> Layout:
        """The same samples packed without sharing, without CP: the reference's."""
        return Layout(self.total, self.response)

    def stream(self) -> list[Entry]:
        """The stars back to back, each padded to its extent."""
        return [(j, s) if s < t else None for j, (w, t) in enumerate(zip(self.widths, self.star_lengths))
                for s in range(w)]

    def local_map(self, rank: int) -> list[Entry]:
        """What each of the rank's ``length`` local rows holds."""
        t, c = self.length, self.cp
        if self.order is not None:
            stream = self.stream()
            return [stream[q] for q in self.order[rank * t:(rank + 1) * t]]
        if self.mode == "zigzag":
            rows: list[Entry] = []
            for j, (w, n) in enumerate(zip(self.widths, self.star_lengths)):
                chunk = w // (2 * c)
                for k in (rank, 2 * c - 1 - rank):
                    rows += [(j, s) if s < n else None for s in range(k * chunk, (k + 1) * chunk)]
            return rows
        stream = self.stream()
        stream += [None] * (c * t - len(stream))
        return stream[rank * t:(rank + 1) * t]

    def span(self, i: int, depth: int = 0) -> range:
        """Sample ``i``'s response span at ``depth``: the positions predicting its response."""
        p = self.prompts[self.group_of(i)]
        return range(max(0, p - 1 - depth), p + self.response[i] - 1 - depth)

    def shares(self, rank: int, depth: int = 0) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per sample, ``(local row, response element)`` of the rank's share, ascending."""
        return _shares(self, rank, depth)

    def mask(self) -> Tensor:
        """The brute-force attention rule without CP: a token row attends the token rows of
        its star at or before it that are its prompt or its own branch; padding itself."""
        entries = self.local_map(0)
        t = len(entries)
        out = torch.eye(t, dtype=torch.bool)
        for q, eq in enumerate(entries):
            for k, ek in enumerate(entries[: q + 1]):
                if eq is None or ek is None or eq[0] != ek[0]:
                    continue
                prompt = self.prompts[eq[0]]
                mine = {i for i, _ in self.holders(*eq)}
                if ek[1] < prompt or {i for i, _ in self.holders(*ek)} == mine:
                    out[q, k] = True
        return out


@functools.lru_cache(maxsize=1024)
def _star_rows(case: Stars, i: int) -> tuple[int, ...]:
    j = case.group_of(i)
    p = case.prompts[j]
    before = sum(case.response[k] for k in case.members(j) if k < i)
    return (*range(p), *(p + before + t for t in range(case.response[i])))


@functools.lru_cache(maxsize=256)
def _shares(case: Stars, rank: int, depth: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    held: list[list[tuple[int, int, int]]] = [[] for _ in range(case.n)]
    for row, entry in enumerate(case.local_map(rank)):
        if entry is not None:
            for i, p in case.holders(*entry):
                if p in case.span(i, depth):
                    held[i].append((p, row, p + 1 + depth - case.prompts[case.group_of(i)]))
    return tuple(tuple((row, e) for _, row, e in sorted(h)) for h in held)


@st.composite
def stars(draw: st.DrawFn, max_groups: int = 3, max_cp: int = 4,
          modes: tuple[str, ...] = ("none", "zigzag", "allgather", "order")) -> Stars:
    """Random star batches: groups of 1 to 4, prompts from 1 token, responses of 0 and 1
    tokens among longer ones, stars shorter than ``2 * cp``, given extents (``padded``,
    ``align``, ``from_cu_seqlens``), ranks that hold nothing, any token order."""
    m = draw(st.integers(1, max_groups))
    groups = tuple(draw(st.lists(st.integers(1, 4), min_size=m, max_size=m)))
    prompts = tuple(draw(st.lists(st.sampled_from((1, 1, 2, 3, 5)), min_size=m, max_size=m)))
    response = tuple(draw(st.lists(st.sampled_from((0, 1, 1, 2, 3, 6)), min_size=sum(groups),
                                   max_size=sum(groups))))
    mode = draw(st.sampled_from(modes))
    cp = 1 if mode == "none" else draw(st.integers(2 if mode == "zigzag" else 1, max_cp))  # zigzag: cp >= 2
    case = Stars(groups, prompts, response, "none" if mode == "order" else mode, cp)
    step = 2 * cp if mode == "zigzag" else 1
    kind = draw(st.sampled_from(("default", "default", "align", "padded", "cu")))
    if kind == "align":
        case = replace(case, align=step * draw(st.integers(1, 3)))
    elif kind in ("padded", "cu"):
        more = draw(st.lists(st.integers(0, 2), min_size=m, max_size=m))
        case = replace(case, padded=tuple(-(-t // step) * step + step * k for t, k in zip(case.star_lengths, more)),
                       cu=kind == "cu" and mode != "order")
    if mode == "allgather":
        case = replace(case, extra=draw(st.integers(0, 2)))
    if mode == "order":  # a random permutation of a stream cp divides
        widths = case.widths
        widths[-1] += -sum(widths) % cp
        perm = draw(st.permutations(range(sum(widths))))
        case = replace(case, mode="order", padded=tuple(widths), align=None, order=tuple(perm))
    return case


@dataclass
class Data:
    """One star batch's inputs: tokens per sample, the star rows (logits ``[L*_j, V]``, or
    hidden states ``[L*_j, H]`` with a ``weight`` ``[V, H]``), loss weights and masks."""

    tokens: list[Tensor]
    star_x: list[Tensor]
    weight: Tensor | None
    w_lp: list[Tensor]
    w_ent: list[Tensor]
    masks: list[Tensor]
    junk: Tensor = field(default_factory=lambda: torch.zeros(0))  # a padding row's value


def make_data(case: Stars, vocab: int, seed: int, hidden: int | None = None, scale: float = 3.0,
              ids: int | None = None) -> Data:
    """Random tokens of ``[0, ids)`` (default the whole ``vocab``; each branch's first
    response token different from its siblings' where that allows), star rows (logits of
    ``vocab`` columns, or ``hidden`` states and a ``[vocab, hidden]`` head), weights and
    masks."""
    gen = torch.Generator().manual_seed(seed)
    top = ids or vocab
    tokens: list[Tensor] = []
    for j, p in enumerate(case.prompts):
        prompt = torch.randint(0, top, (p,), generator=gen)
        first = int(torch.randint(0, top, (), generator=gen))
        for g, i in enumerate(case.members(j)):
            reply = torch.randint(0, top, (case.response[i],), generator=gen)
            if reply.numel():
                reply[0] = (first + g) % top
            tokens.append(torch.cat([prompt, reply]))
    width = hidden or vocab
    star_x = [scale * torch.randn(t, width, generator=gen, dtype=torch.float64) for t in case.star_lengths]
    weight = None if hidden is None else torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    w_lp = [torch.randn(r, generator=gen, dtype=torch.float64) for r in case.response]
    w_ent = [torch.randn(r, generator=gen, dtype=torch.float64) for r in case.response]
    masks = [torch.rand(r, generator=gen) > 0.3 for r in case.response]
    junk = 100 * torch.randn(width, generator=gen, dtype=torch.float64)
    return Data(tokens, star_x, weight, w_lp, w_ent, masks, junk)


def per_sample(case: Stars, data: Data) -> list[Tensor]:
    """Each sample's own copy of its star rows ``[L_i, *]``: the unshared packing's input."""
    return [data.star_x[case.group_of(i)][case.star_rows(i)].clone() for i in range(case.n)]


def local_input(case: Stars, data: Data, rank: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """The rank's local rows of the star rows; padding rows hold ``data.junk``."""
    rows = [data.junk if e is None else data.star_x[e[0]][e[1]] for e in case.local_map(rank)]
    width = data.junk.shape[0]
    return (torch.stack(rows) if rows else torch.zeros(0, width, dtype=torch.float64)).to(dtype)


@dataclass
class Ref:
    """The unshared reference: per sample the float64 log-probs and entropy of its
    response and its span rows' full log-softmax ``[R_i, V]`` (in the graph of
    ``leaves``, one copy of its rows per sample, and of ``weight``)."""

    lp: list[Tensor]
    ent: list[Tensor]
    full: list[Tensor]
    leaves: list[Tensor]
    weight: Tensor | None


def distribution(z: Tensor, tau: float, softcap: float | None, vocab_size: int | None) -> Tensor:
    """Soft-capped, tempered logits, ``-inf`` at the padded vocabulary's ids."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / tau
    if vocab_size is not None:
        z = z.masked_fill(torch.arange(z.shape[1]) >= vocab_size, -math.inf)
    return z


def entropy(log_p: Tensor) -> Tensor:
    """``-sum p log p``, 0 at ids of probability 0 (in the gradient too)."""
    live = log_p > -math.inf
    safe = torch.where(live, log_p, 0.0)
    return -torch.where(live, safe.exp() * safe, 0.0).sum(-1)


def reference(
    case: Stars, data: Data, tau: list[float] | None = None, softcap: float | None = None,
    vocab_size: int | None = None, sets: Sets | None = None, over: str = "full", depth: int = 0,
) -> Ref:
    """The unshared samples in float64: each sample's response span rows (at ``depth``: its
    position ``p`` predicts token ``p + 1 + depth``) of its own copy (through the head
    ``weight`` when the data has one), under its temperature; the log-probs restricted to
    each non-empty set plus the target, the entropy over the full distribution or
    (``over="support"``) the same restricted one. At a depth, the response tokens no
    position predicts (a prompt shorter than ``depth + 1``) hold 0 in ``lp`` and ``ent``."""
    assert depth == 0 or sets is None
    weight = None if data.weight is None else data.weight.clone().requires_grad_(True)
    ref = Ref([], [], [], [], weight)
    for i, x in enumerate(per_sample(case, data)):
        leaf = x.requires_grad_(True)
        logits = leaf if weight is None else leaf @ weight.T
        span = torch.tensor(case.span(i, depth), dtype=torch.int64)
        targets = data.tokens[i][span + 1 + depth]
        z = distribution(logits[span], 1.0 if tau is None else tau[i], softcap, vocab_size)
        keep = z > -math.inf
        for t, s in enumerate([] if sets is None else sets[i]):
            if s:
                row = torch.zeros(z.shape[1], dtype=torch.bool)
                row[s + [int(targets[t])]] = True
                keep[t] &= row
        restricted = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)
        full = torch.log_softmax(z, -1)
        lost = torch.zeros(case.response[i] - len(span), dtype=torch.float64)
        ref.lp.append(torch.cat([lost, restricted.gather(1, targets[:, None])[:, 0]]))
        ref.ent.append(torch.cat([lost, entropy(full if over == "full" else restricted)]))
        ref.full.append(full)
        ref.leaves.append(leaf)
    return ref


def star_grads(case: Stars, ref: Ref) -> list[Tensor]:
    """Per group, the gradient the shared star rows get: the sum of the unshared copies'."""
    out = [torch.zeros_like(x, dtype=torch.float64) for x in _stars_like(case, ref)]
    for i, leaf in enumerate(ref.leaves):
        if leaf.grad is not None:
            out[case.group_of(i)].index_add_(0, torch.tensor(case.star_rows(i), dtype=torch.int64), leaf.grad)
    return out


def _stars_like(case: Stars, ref: Ref) -> list[Tensor]:
    width = ref.leaves[0].shape[1] if ref.leaves else 1
    return [torch.zeros(t, width, dtype=torch.float64) for t in case.star_lengths]


def local_grad(case: Stars, grads: list[Tensor], rank: int) -> Tensor:
    """The rank's rows of the star gradients (padding rows: zero)."""
    width = grads[0].shape[1] if grads else 1
    zero = torch.zeros(width, dtype=torch.float64)
    rows = [zero if e is None else grads[e[0]][e[1]] for e in case.local_map(rank)]
    return torch.stack(rows) if rows else torch.zeros(0, width, dtype=torch.float64)


def pick(whole: list[Tensor], case: Stars, rank: int, depth: int = 0) -> list[Tensor]:
    """The rank's shares of whole per-sample response tensors ``[R_i, *]`` (the oracle's)."""
    return [w[torch.tensor([e for _, e in s], dtype=torch.int64)] for w, s in zip(whole, case.shares(rank, depth))]


def weighted(ref_or_shares: tuple[list[Tensor], list[Tensor]], data: Data, case: Stars, rank: int | None,
             depth: int = 0) -> Tensor:
    """``sum w_lp * lp + w_ent * ent``: of whole responses (``rank`` None) or of the rank's
    shares (at ``depth``), with the loss weights picked at its elements."""
    lp, ent = ref_or_shares
    a = data.w_lp if rank is None else pick(data.w_lp, case, rank, depth)
    b = data.w_ent if rank is None else pick(data.w_ent, case, rank, depth)
    total = torch.zeros((), dtype=torch.float64)
    for x, y, u, v in zip(lp, ent, a, b, strict=True):
        total = total + (x.double() * u).sum() + (y.double() * v).sum()
    return total


def response_sets(case: Stars, seed: int, ids: int, shared: bool) -> Sets:
    """Random sets of ``[0, ids)`` per response token (some empty). Token 0 of every
    branch is predicted by the group's shared prompt row: with ``shared`` its set is the
    group's first branch's (in another order), else empty (sets on unshared rows only)."""
    gen = torch.Generator().manual_seed(seed)
    out: Sets = []
    first: dict[int, list[int]] = {}
    for i, r in enumerate(case.response):
        sets = [torch.randperm(ids, generator=gen)[: int(torch.randint(0, 5, (), generator=gen))].tolist()
                for _ in range(r)]
        if sets:
            j = case.group_of(i)
            if not shared:
                sets[0] = []
            elif j in first:
                sets[0] = first[j][::-1]
            else:
                first[j] = sets[0]
        out.append(sets)
    return out


def csr(sets: Sets) -> tuple[list[Tensor], list[Tensor]]:
    """``Support.from_responses``' ``(ids, offsets)`` of per-sample sets."""
    flat = [torch.tensor([k for s in sample for k in s], dtype=torch.int64) for sample in sets]
    offsets = [torch.tensor([0] + [len(s) for s in sample], dtype=torch.int64).cumsum(0) for sample in sets]
    return flat, offsets
