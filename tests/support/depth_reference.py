"""The float64 single-process reference of depth-``d`` targets (docs/layouts.md,
"Depth-``d`` targets"), and the per-rank computation the tests compare with it.

The reference rolls the *whole* sample: position ``p`` of sample ``i`` predicts token
``p + 1 + d`` when ``p + 1 + d < L_i``, and the depth-``d`` response is the log-softmax
at the span ``[max(0, P_i - 1 - d), L_i - 1 - d)``. Where each position sits on a rank
is read from an independent, loop-by-loop transcription of the layout rules
(``place``: extents or shared-prefix stars, laid out without CP, as zigzag chunks, as
allgather pieces or by a token order), which shares no code with cpslice's plan.

``compute`` is what one rank runs (in-process or on a gloo rank: it returns plain
tensors), ``check`` compares its result with the reference and returns the failures.
"""

from dataclasses import dataclass, field
from functools import cache
from typing import cast

import torch
from torch import Tensor

from cpslice import (
    Layout,
    extract_responses,
    response_log_probs,
    response_log_probs_from_hidden,
    response_rows,
    shard_responses,
    shifted_targets,
)
from cpslice._types import CpMode, QkvFormat

from .oracle import Config
from .oracle import widths as oracle_widths

Entry = tuple[tuple[int, int], ...]
"""What one local row holds: the ``(sample, position)`` pairs (none: padding; several: a
shared prefix's prompt row, one pair per branch)."""

FILL = -7
VOCAB, HIDDEN = 11, 5


@dataclass(frozen=True)
class Case:
    """One micro-batch's layout family, every rank of it; ``order`` a token order
    (``Layout.from_order``: thd, of the stream; bshd, of every row's columns), ``cu`` the
    extents given as ``Layout.from_cu_seqlens`` boundaries, ``extra`` padding rows past
    the layout's need, declared as ``local_length`` (allgather: in its piece length ``T``)."""

    name: str
    total: tuple[int, ...]
    response: tuple[int, ...]
    mode: str = "none"
    cp: int = 1
    fmt: str = "thd"
    seq: int | None = None
    padded: tuple[int, ...] | None = None
    align: int | None = None
    offsets: tuple[int, ...] | None = None
    shared: tuple[int, ...] | None = None
    order: tuple[int, ...] | None = None
    cu: bool = False
    extra: int = 0
    seed: int = 0
    scalar_temperature: bool = False

    def layout(self, rank: int) -> Layout:
        local = length(self) if self.mode == "allgather" or self.extra else None
        if self.order is not None:
            return Layout.from_order(list(self.order), list(self.total), list(self.response), cp_rank=rank,
                                     cp_size=self.cp, qkv_format=self.fmt,  # type: ignore[arg-type]
                                     max_seq_len=self.seq, padded_lengths=_list(self.padded), align=self.align,
                                     row_offsets=_list(self.offsets), shared_prefix=_list(self.shared))
        if self.cu:
            bounds = [0]
            for w in widths(self):
                bounds.append(bounds[-1] + w)
            return Layout.from_cu_seqlens(bounds, list(self.total), list(self.response),
                                          cp_mode=self.mode,  # type: ignore[arg-type]
                                          cp_rank=rank, cp_size=self.cp, local_length=local,
                                          shared_prefix=_list(self.shared))
        return Layout(list(self.total), list(self.response), qkv_format=self.fmt,  # type: ignore[arg-type]
                      max_seq_len=self.seq, cp_mode=self.mode, cp_rank=rank,  # type: ignore[arg-type]
                      cp_size=self.cp, local_length=local, padded_lengths=_list(self.padded),
                      align=self.align, row_offsets=_list(self.offsets), shared_prefix=_list(self.shared))


def _list(x: tuple[int, ...] | None) -> list[int] | None:
    return None if x is None else list(x)


def groups(case: Case) -> list[list[int]]:
    """The samples of each extent: one each, or a shared prefix's groups."""
    sizes = case.shared if case.shared is not None else (1,) * len(case.total)
    out, first = [], 0
    for g in sizes:
        out.append(list(range(first, first + g)))
        first += g
    return out


def _star(case: Case, members: list[int]) -> list[Entry]:
    """The positions of one extent's tokens: a sample's, or a star (the prompt once, every
    position of it held by every branch, then each branch's response back to back)."""
    if len(members) == 1:
        i = members[0]
        return [((i, p),) for p in range(case.total[i])]
    prompt = case.total[members[0]] - case.response[members[0]]
    star: list[Entry] = [tuple((i, p) for i in members) for p in range(prompt)]
    for i in members:
        star += [((i, prompt + k),) for k in range(case.response[i])]
    return star


def widths(case: Case) -> list[int]:
    """Each extent's ``W`` (docs/layouts.md, "The extent W_i of a sample"): the oracle's
    rule (tests/support/oracle.py) over the extents' tokens, a star's for a shared prefix."""
    tokens = tuple(len(_star(case, members)) for members in groups(case))
    rule = Config(tokens, (0,) * len(tokens), cast(QkvFormat, case.fmt), case.seq, cast(CpMode, case.mode),
                  case.cp, None, 0, case.padded, case.align)
    return oracle_widths(rule)


def extents(case: Case) -> list[list[Entry]]:
    """Each extent's positions, its padding (before: a left-padded row; after) included."""
    out = []
    for j, (members, w) in enumerate(zip(groups(case), widths(case))):
        lead = case.offsets[j] if case.offsets is not None else 0
        star = _star(case, members)
        out.append([()] * lead + star + [()] * (w - lead - len(star)))
    return out


def length(case: Case) -> int:
    """The rank's local length ``T``: the least the layout needs, plus ``extra``."""
    w = widths(case)
    if case.order is not None:
        return sum(w) // case.cp
    if case.mode == "zigzag":
        return sum(x // case.cp for x in w) + case.extra
    return -(-sum(w) // case.cp) + case.extra


@cache
def place(case: Case, rank: int) -> tuple[Entry, ...]:
    """What each of the rank's ``T`` local rows holds."""
    t, ext, c = length(case), extents(case), case.cp
    stream = [e for x in ext for e in x]
    if case.order is not None and case.fmt == "bshd":  # one order of every row's columns
        cut = len(case.order) // c
        rows = [x[k] for x in ext for k in case.order[rank * cut:(rank + 1) * cut]]
    elif case.order is not None:
        rows = [stream[k] for k in case.order[rank * t:(rank + 1) * t]]
    elif case.mode == "zigzag":
        rows = []
        for x in ext:
            chunk = len(x) // (2 * c)
            rows += x[rank * chunk:(rank + 1) * chunk] + x[(2 * c - 1 - rank) * chunk:(2 * c - rank) * chunk]
    elif case.mode == "allgather":
        stream += [()] * (c * t - len(stream))
        rows = stream[rank * t:(rank + 1) * t]
    else:
        rows = stream
    assert len(rows) <= t
    return tuple(rows + [()] * (t - len(rows)))


def span(case: Case, i: int, depth: int) -> range:
    """Sample ``i``'s response span at ``depth``: ``[max(0, P_i - 1 - d), L_i - 1 - d)``."""
    prompt = case.total[i] - case.response[i]
    return range(max(0, prompt - 1 - depth), case.total[i] - 1 - depth)


def elements(case: Case, rank: int, depth: int) -> list[list[tuple[int, int]]]:
    """Per sample, the ``(row, position)`` of the rank's share at ``depth``, by position."""
    out: list[list[tuple[int, int]]] = [[] for _ in case.total]
    for row, entry in enumerate(place(case, rank)):
        for i, p in entry:
            if p in span(case, i, depth):
                out[i].append((row, p))
    return [sorted(e, key=lambda x: x[1]) for e in out]


def key(case: Case, i: int, p: int) -> tuple[int, int]:
    """The sample whose tensors hold position ``p`` of sample ``i``: its group's first
    for a shared prompt position."""
    members = next(m for m in groups(case) if i in m)
    return (members[0], p) if p < case.total[i] - case.response[i] else (i, p)


@dataclass
class Data:
    """A case's whole per-sample inputs (float64, the same on every rank): tokens, logits,
    hidden states and the LM head, temperatures, the upstream gradients of log p and H at
    every position (``g_lp[i][p]``), and the noise of padding rows."""

    tokens: list[Tensor]
    logits: list[Tensor]
    hidden: list[Tensor]
    weight: Tensor
    temperature: list[float] | float
    g_lp: list[Tensor]
    g_h: list[Tensor]
    noise: Tensor = field(repr=False)


@cache  # the ranks of a case share it (nothing changes it)
def data(case: Case) -> Data:
    gen = torch.Generator().manual_seed(case.seed)
    n = len(case.total)
    tokens = [torch.randint(0, VOCAB, (t,), generator=gen) for t in case.total]
    logits = [torch.randn(t, VOCAB, generator=gen, dtype=torch.float64) * 2 for t in case.total]
    hidden = [torch.randn(t, HIDDEN, generator=gen, dtype=torch.float64) for t in case.total]
    for members in groups(case):  # a group's prompt is one: its first sample's
        prompt = case.total[members[0]] - case.response[members[0]]
        for i in members[1:]:
            for x in (tokens, logits, hidden):
                x[i][:prompt] = x[members[0]][:prompt]
    temperature: list[float] | float = 0.8
    if not case.scalar_temperature:
        temperature = [0.0] * n
        for j, members in enumerate(groups(case)):
            for i in members:
                temperature[i] = (0.6, 1.0, 1.7)[j % 3]
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    g_lp = [torch.randn(t, generator=gen, dtype=torch.float64) for t in case.total]
    g_h = [torch.randn(t, generator=gen, dtype=torch.float64) for t in case.total]
    noise = torch.randn(length(case) + 1, VOCAB + HIDDEN, generator=gen, dtype=torch.float64) * 50
    return Data(tokens, logits, hidden, weight, temperature, g_lp, g_h, noise)


def _tau(d: Data, i: int) -> float:
    return d.temperature if isinstance(d.temperature, float) else d.temperature[i]


@dataclass
class Reference:
    """Per sample, the depth-``d`` log p and H at its whole span, and the gradients of
    ``sum g_lp * log p + g_h * H`` (over every span position of every sample) with
    respect to the whole per-sample logits, hidden states and the weight."""

    lp: list[Tensor]
    ent: list[Tensor]
    grad: list[Tensor]
    lp_h: list[Tensor]
    ent_h: list[Tensor]
    grad_h: list[Tensor]
    grad_w: Tensor


def _roll(case: Case, d: Data, x: list[Tensor], depth: int) -> tuple[list[Tensor], list[Tensor], Tensor]:
    lps, ents, loss = [], [], torch.zeros((), dtype=torch.float64)
    for i in range(len(case.total)):
        s = torch.tensor(list(span(case, i, depth)), dtype=torch.int64)
        rows = torch.stack([x[key(case, i, p)[0]][p] for p in s.tolist()]) if s.numel() else x[i][:0]
        lsm = torch.log_softmax(rows / _tau(d, i), -1)
        lp = lsm.gather(1, d.tokens[i][s + 1 + depth][:, None]).squeeze(1)
        ent = -(lsm.exp() * lsm).sum(-1)
        loss = loss + (lp * d.g_lp[i][s]).sum() + (ent * d.g_h[i][s]).sum()
        lps.append(lp.detach())
        ents.append(ent.detach())
    return lps, ents, loss


def reference(case: Case, d: Data, depth: int, hidden: bool = True) -> Reference:
    """The reference of the logits (and with ``hidden``, of the hidden states and head)."""
    logits = [x.clone().requires_grad_() for x in d.logits]
    lp, ent, loss = _roll(case, d, logits, depth)
    grads = _grads(loss, logits)
    if not hidden:
        return Reference(lp, ent, list(grads), [], [], [], d.weight[:0])
    states = [x.clone().requires_grad_() for x in d.hidden]
    weight = d.weight.clone().requires_grad_()
    lp_h, ent_h, loss_h = _roll(case, d, [h @ weight.T for h in states], depth)
    *grad_h, grad_w = _grads(loss_h, [*states, weight])
    return Reference(lp, ent, list(grads), lp_h, ent_h, list(grad_h), grad_w)


def local_rows(case: Case, rank: int, whole: list[Tensor], noise: Tensor, k: int) -> Tensor:
    """The rank's local ``[T, k]`` tensor of whole per-sample ``[L_i, k]`` rows; padding
    rows noise."""
    rows = [whole[key(case, *e[0])[0]][e[0][1]] if e else noise[j, :k] for j, e in enumerate(place(case, rank))]
    return torch.stack(rows) if rows else noise[:0, :k]


@dataclass
class Out:
    """One rank's results (plain tensors, so a gloo rank can send them)."""

    targets: Tensor | None
    rows: Tensor
    counts: list[int]
    extracted: list[Tensor]
    sharded: list[Tensor]
    lp: list[Tensor]
    ent: list[Tensor]
    grad: Tensor | None
    graph: list[str]  # the empty shares that are not zero-length views in the graph
    lp_h: list[Tensor] = field(default_factory=list)
    ent_h: list[Tensor] = field(default_factory=list)
    grad_h: Tensor | None = None
    grad_w: Tensor | None = None


def _upstream(case: Case, rank: int, depth: int, d: Data, got: list[Tensor], ent: list[Tensor]) -> Tensor | None:
    """This rank's part of the loss, each share's elements weighted at their positions
    (None when a share's length is wrong: ``check`` reports that)."""
    loss = sum((x.sum() * 0 for x in [*got, *ent]), torch.zeros(()))
    for i, share in enumerate(elements(case, rank, depth)):
        pos = torch.tensor([p for _, p in share], dtype=torch.int64)
        if got[i].shape != pos.shape or ent[i].shape != pos.shape:
            return None
        loss = loss + (got[i] * d.g_lp[i][pos].float()).sum() + (ent[i] * d.g_h[i][pos].float()).sum()
    return loss


def _grads(loss: Tensor, inputs: list[Tensor]) -> tuple[Tensor, ...]:
    """d loss / d inputs (zeros where a rank holds no response: nothing reaches them)."""
    if not loss.requires_grad:  # no sample has a span at this depth
        return tuple(torch.zeros_like(x) for x in inputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)


def _views(name: str, shares: list[Tensor], base: Tensor | None) -> list[str]:
    bad = []
    for i, s in enumerate(shares):
        if s.numel() == 0 and (not s.requires_grad or s.grad_fn is None or (base is not None and s._base is not base)):
            bad.append(f"{name}[{i}]")
    return bad


def compute(case: Case, rank: int, depth: int, hidden: bool = False) -> Out:
    """What rank ``rank`` computes at ``depth``: targets (None with a shared prefix,
    which ``shifted_targets`` refuses), response rows, extraction and sharding of
    encoded values, log-probs and entropy with their logits' gradient (and with
    ``hidden``, the same from the hidden states and the LM head)."""
    d, lay = data(case), case.layout(rank)
    targets = None if case.shared is not None else shifted_targets(d.tokens, lay, fill=FILL, depth=depth)
    rows = response_rows(lay, depth=depth)
    values = local_rows(case, rank, [x[:, :3] for x in d.logits], d.noise, 3).float().requires_grad_()
    extracted, _ = extract_responses(values, lay, depth=depth)
    whole = [torch.arange(r, dtype=torch.float64) + 100 * i for i, r in enumerate(case.response)]
    sharded = shard_responses(whole, lay, depth=depth)
    logits = local_rows(case, rank, d.logits, d.noise, VOCAB).float().requires_grad_()
    lp, ent = response_log_probs(logits, d.tokens, lay, with_entropy=True, temperature=d.temperature,
                                 depth=depth)
    graph = _views("extract", extracted, values) + _views("log_probs", lp, None) + _views("entropy", ent, None)
    loss = _upstream(case, rank, depth, d, lp, ent)
    grad = None if loss is None else _grads(loss, [logits])[0]
    out = Out(targets, rows.rows, rows.counts, [x.detach() for x in extracted], sharded,
              [x.detach() for x in lp], [x.detach() for x in ent], grad, graph)
    if hidden:
        h = local_rows(case, rank, d.hidden, d.noise, HIDDEN).float().requires_grad_()
        w = d.weight.float().requires_grad_()
        lp_h, ent_h = response_log_probs_from_hidden(h, w, d.tokens, lay, with_entropy=True,
                                                     temperature=d.temperature, depth=depth)
        out.graph += _views("hidden log_probs", lp_h, None)
        loss = _upstream(case, rank, depth, d, lp_h, ent_h)
        if loss is not None:
            out.grad_h, out.grad_w = _grads(loss, [h, w])
        out.lp_h, out.ent_h = [x.detach() for x in lp_h], [x.detach() for x in ent_h]
    return out


def _close(what: str, got: Tensor, want: Tensor, tol: float = 2e-5) -> list[str]:
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"]
    err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    return [] if err <= tol * (1 + (float(want.abs().max()) if want.numel() else 0.0)) else [
        f"{what}: off by {err:.3g}\n got  {got.tolist()}\n want {want.tolist()}"]


def check(case: Case, rank: int, depth: int, out: Out, ref: Reference) -> list[str]:
    """Every way ``out`` (rank ``rank``'s at ``depth``) differs from the reference."""
    at = f"{case.name} rank {rank} depth {depth}"
    d, places, share = data(case), place(case, rank), elements(case, rank, depth)
    bad = [f"{at}: {g} is no zero-length view in the graph" for g in out.graph]
    if out.targets is not None:
        want = [d.tokens[e[0][0]][e[0][1] + 1 + depth] if e and e[0][1] + 1 + depth < case.total[e[0][0]]
                else FILL for e in places]
        if out.targets.tolist() != [int(w) for w in want]:
            bad.append(f"{at}: targets {out.targets.tolist()}, want {[int(w) for w in want]}")
    want_rows = [r for s in share for r, _ in s]
    if out.rows.tolist() != want_rows or out.counts != [len(s) for s in share]:
        bad.append(f"{at}: response_rows {out.rows.tolist()} {out.counts}, want {want_rows}")
    values = local_rows(case, rank, [x[:, :3] for x in d.logits], d.noise, 3).float()
    for i, s in enumerate(share):
        pos = torch.tensor([p for _, p in s], dtype=torch.int64)
        lo = span(case, i, depth).start
        prompt = case.total[i] - case.response[i]
        bad += _close(f"{at}: extract[{i}]", out.extracted[i], values[[r for r, _ in s]], 0.0)
        whole = torch.arange(case.response[i], dtype=torch.float64) + 100 * i
        bad += _close(f"{at}: shard[{i}]", out.sharded[i], whole[pos + 1 + depth - prompt], 0.0)
        bad += _close(f"{at}: log_probs[{i}]", out.lp[i], ref.lp[i][pos - lo])
        bad += _close(f"{at}: entropy[{i}]", out.ent[i], ref.ent[i][pos - lo])
        if out.lp_h:
            bad += _close(f"{at}: hidden log_probs[{i}]", out.lp_h[i], ref.lp_h[i][pos - lo])
            bad += _close(f"{at}: hidden entropy[{i}]", out.ent_h[i], ref.ent_h[i][pos - lo])
    bad += _grad(f"{at}: logits grad", case, places, out.grad, ref.grad)
    if out.lp_h:
        bad += _grad(f"{at}: hidden grad", case, places, out.grad_h, ref.grad_h)
    return bad


def _grad(what: str, case: Case, places: tuple[Entry, ...], got: Tensor | None, whole: list[Tensor]) -> list[str]:
    """The rank's local gradient against the whole-sample one: a row holding a position
    has its key's gradient, a padding row none."""
    if got is None:
        return [f"{what}: not computed (a share's length is wrong)"]
    zero = torch.zeros(got.shape[1], dtype=torch.float64)
    want = [whole[key(case, *e[0])[0]][e[0][1]] if e else zero for e in places]
    return _close(what, got, torch.stack(want) if want else got[:0].double())


def covers(case: Case, depth: int) -> list[str]:
    """The reference's own rule: over the ranks, each sample's shares are disjoint and
    cover its span at ``depth``."""
    bad = []
    for i in range(len(case.total)):
        held = sorted(p for r in range(case.cp) for _, p in elements(case, r, depth)[i])
        if held != list(span(case, i, depth)):
            bad.append(f"{case.name} depth {depth}: sample {i} held at {held}, span {span(case, i, depth)}")
    return bad
