"""Distillation against a teacher's top-k: the divergence of two ``[..., k]`` log-prob
tensors, and its training-step form per sample, from logits or hidden states; and the
training-step form of the divergence over the full vocabulary (``vocab_divergence``) per
sample, ``response_vocab_distillation``.

The teacher's side is ``k`` ids per token and their log-probs (from the teacher's
forward, ``topk_log_probs``, or from the inference engine); the student's are its own
log-probs at those ids, normalized over its whole vocabulary (``log_probs_at``). Each
side's ``k`` probabilities become categories (``tail``):

- ``"bin"``: ``k + 1`` categories, the ``k`` ids and one bin holding the rest of the mass,
  ``1 - sum(exp(x))``, computed as ``-expm1(logsumexp(x))`` (accurate when the ids hold
  almost everything) and floored at the compute dtype's epsilon (``finfo.eps``: about
  1.2e-7 in float32, 2.2e-16 in float64). Below it the bin's mass is the rounding of the
  ``k`` log-probs, not a mass: a sum of exp that rounds to 1 or above (``k = V``, or ids
  holding all the mass) then gives both sides the same floor, so the bin adds nothing
  and its gradient is 0, where a log of rounding noise (or of a mass <= 0) would make the
  divergence, or its gradient, infinite, NaN or arbitrary. The bin is only as accurate
  as the log-probs given (a bfloat16 teacher's to about 2^-8);
- ``"renormalize"``: ``k`` categories, each side renormalized over its ``k`` ids.

Over the categories, with ``p`` the teacher's and ``q`` the student's distribution:
``"forward"`` is ``KL(p || q)``, ``"reverse"`` ``KL(q || p)``, ``"jsd"`` ``beta KL(p || m) +
(1 - beta) KL(q || m)`` with ``m = beta p + (1 - beta) q``, for ``0 < beta < 1``; at its
ends, as TRL's generalized JSD, ``beta = 0`` is ``"forward"`` and ``beta = 1`` is
``"reverse"``, computed as those kinds (the formula itself is 0 there, ``m`` being one of the
two sides; forward KL is the limit of ``jsd / beta`` as ``beta`` goes to 0). A category of
probability 0 contributes 0 (never ``0 * log 0`` = NaN): a tail of 0 when the ids hold all
the mass.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks as checks
from .._errors import LayoutError
from .._layout.extract import gather_split, picked_ids, picked_values, shard
from .._layout.layout import Layout
from .._layout.pack import temperatures_of
from .._layout.plan import Local, Span
from .._types import (
    ChunkArg,
    DivergenceArg,
    IntArg,
    RealArg,
    SampleTemperatureArg,
    Share1D,
    TailArg,
    TensorArg,
    TopK,
    compute_dtype,
)
from .._vocab import args, dtensor
from .._vocab.call import Options
from .._vocab.divergence import Call, LogitsPair, PairHead, divergence
from .._vocab.head import Head, check_topk, log_probs, options, topk
from .._vocab.hidden import hidden_head
from .._vocab.logits import LogitsHead
from .._vocab.pairs import Plan
from .response import _two_d, on_responses, resolved

TAILS = {"bin": "k + 1 categories, the rest of the mass in one bin", "renormalize": "k categories, renormalized"}
_LN2 = math.log(2.0)


def _log_rest(lse: Tensor) -> Tensor:
    """``log(1 - exp(lse))``, the mass floored at ``finfo.eps``: the log of the mass outside
    ids whose log of summed mass is ``lse`` (``log1p(-exp)`` far from 1, ``log(-expm1)``
    near it; each branch fed only values where it is finite, so no NaN reaches a
    gradient)."""
    floor = torch.finfo(lse.dtype).eps
    far = lse < -_LN2
    from_far = torch.log1p(-torch.exp(torch.minimum(lse, torch.full_like(lse, -_LN2))))
    mass = -torch.expm1(torch.maximum(lse, torch.full_like(lse, -_LN2)))
    return torch.where(far, from_far, torch.log(torch.clamp(mass, min=floor)))


def _categories(x: Tensor, tail: str) -> Tensor:
    """The ``[..., k]`` log-probs ``x`` as the log-probs of ``tail``'s categories."""
    lse = torch.logsumexp(x, -1, keepdim=True)
    if tail == "renormalize":
        return x - lse
    return torch.cat([x, _log_rest(lse)], -1)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """``sum p (log p - log q)`` over the last dimension; a category with ``p = 0`` adds 0."""
    p = torch.exp(log_p)
    counts = p > 0
    zero = torch.zeros_like(log_p)
    term = p * (torch.where(counts, log_p, zero) - torch.where(counts, log_q, zero))
    return torch.where(counts, term, zero).sum(-1)


def _check_divergence(kind: object, beta: object, tail: object) -> float:
    checks.divergence_kind(kind)
    if tail not in TAILS:
        choices = "; ".join(f"{k!r} ({v})" for k, v in TAILS.items())
        raise LayoutError(f"tail={tail!r} is not one of {choices}")
    return checks.mixture_beta(beta)


def _log_probs_arg(name: str, value: object) -> Tensor:
    """``topk_divergence``'s argument ``name``: floating-point ``[..., k]`` log-probs, ``k >= 1``."""
    x = checks.tensor(name, value, "a torch.Tensor [..., k] of log-probs")
    if not x.is_floating_point():
        raise TypeError(f"{name} has dtype {x.dtype}; pass floating-point log-probs")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise LayoutError(f"{name} has shape {tuple(x.shape)}; it must be [..., k] with k >= 1")
    return x


def topk_divergence(
    student: TensorArg,
    teacher: TensorArg,
    *,
    kind: DivergenceArg = "forward",
    beta: RealArg = 0.5,
    tail: TailArg = "bin",
) -> Tensor:
    """Per-row divergence between a student's and a teacher's log-probs at the same ``k``
    ids (the module docstring gives the categories and kinds).

    Args:
        student: ``[..., k]`` the student's log-probs at the ids, normalized over its full
            vocabulary (``log_probs_at``).
        teacher: ``[..., k]`` the teacher's, normalized over its full vocabulary
            (``topk_log_probs``, or the inference engine's).
        kind: ``"forward"`` (``KL(teacher || student)``), ``"reverse"`` or ``"jsd"``.
        beta: the teacher's weight in ``"jsd"``'s mixture, ``0 <= beta <= 1``: 0 is
            ``"forward"`` and 1 ``"reverse"`` (TRL's generalized JSD), the same values and
            gradients.
        tail: ``"bin"`` (``k + 1`` categories) or ``"renormalize"`` (``k``).

    Returns:
        ``[...]``, float32 (float64 when either input is float64), differentiable w.r.t.
        both arguments where they require grad (frameworks pass the teacher detached). No
        NaN from a category of probability 0, and no infinity from a tail bin that rounds
        to 0 or below (its mass is floored at the compute dtype's epsilon).

    Raises:
        TypeError: an argument not a floating-point tensor; ``beta`` not a real number.
        LayoutError: the shapes differ (``k`` or the leading dimensions), a 0-d tensor or
            ``k = 0``; ``kind`` or ``tail`` not one of the above; ``beta`` outside [0, 1].
    """
    s, t = _log_probs_arg("student", student), _log_probs_arg("teacher", teacher)
    if s.shape != t.shape:
        raise LayoutError(
            f"student has shape {tuple(s.shape)} but teacher has {tuple(t.shape)}: both are "
            "[..., k] log-probs at the same k ids per row"
        )
    b = _check_divergence(kind, beta, tail)
    cdt = compute_dtype(torch.promote_types(s.dtype, t.dtype))
    log_q, log_p = _categories(s.to(cdt), str(tail)), _categories(t.to(cdt), str(tail))
    computed = checks.kind_at(str(kind), b)
    if computed == "forward":
        return _kl(log_p, log_q)
    if computed == "reverse":
        return _kl(log_q, log_p)
    return b * _kl(log_p, _log_mix(log_p, log_q, b)) + (1.0 - b) * _kl(log_q, _log_mix(log_p, log_q, b))


def _log_mix(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    """``log(beta p + (1 - beta) q)``; -inf, with no NaN gradient, where both are 0."""
    a, c = math.log(beta) + log_p, math.log(1.0 - beta) + log_q
    none = (a == -math.inf) & (c == -math.inf)
    zero = torch.zeros_like(a)
    mixed = torch.logaddexp(torch.where(none, zero, a), torch.where(none, zero, c))
    return torch.where(none, torch.full_like(a, -math.inf), mixed)


def _teacher(
    teacher_log_probs: object, teacher_ids: object, response: tuple[int, ...], total: int
) -> tuple[list[Tensor], list[Tensor]]:
    """The teacher's per-sample ``[R_i, k]`` log-probs and int64 ids, one ``k`` for all,
    ids (on the CPU, where it costs no sync) inside the vocabulary."""
    lps = checks.per_sample("teacher_log_probs", dtensor.replicated_each("teacher_log_probs", teacher_log_probs),
                            response, "response_length", floating=True)
    ids = checks.per_sample("teacher_ids", dtensor.replicated_each("teacher_ids", teacher_ids), response,
                            "response_length")
    k = None
    for i, (lp, tid) in enumerate(zip(lps, ids)):
        if tid.dtype != torch.int64:
            raise TypeError(f"sample {i}: teacher_ids[{i}] has dtype {tid.dtype}; pass int64 ids (.long())")
        k = _width(i, "teacher_ids", tid, _width(i, "teacher_log_probs", lp, k))
        if tid.device.type == "cpu" and tid.numel():
            bad = ((tid < 0) | (tid >= total)).nonzero()
            if bad.numel():
                r, j = (int(v) for v in bad[0])
                raise LayoutError(
                    f"sample {i}: teacher_ids[{i}][{r}, {j}] = {int(tid[r, j])} is outside the "
                    f"student's vocabulary [0, {total}) ({bad.shape[0]} such ids in the sample)"
                )
    return lps, ids


def _width(i: int, name: str, x: Tensor, k: int | None) -> int:
    """The ``k`` of sample ``i``'s ``[R_i, k]`` tensor ``x`` (``name``), the one of those
    before it (``k``, None for the first)."""
    if x.dim() != 2 or x.shape[1] < 1:
        raise LayoutError(
            f"sample {i}: {name}[{i}] has shape {tuple(x.shape)}; it must be [R_i, k] "
            "(k >= 1 ids per response token)"
        )
    if k is not None and x.shape[1] != k:
        raise LayoutError(
            f"sample {i}: {name}[{i}] has k = {x.shape[1]} ids per token but sample 0's "
            f"teacher has {k}; one k for every sample and both tensors"
        )
    return int(x.shape[1])


def _rows(parts: list[Tensor], k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[r, k]``: this rank's shares of per-sample ``[R_i, k]`` tensors, in extraction
    order, on ``device`` (``[0, k]`` for a layout of no samples)."""
    return torch.cat(parts).to(device) if parts else torch.zeros((0, k), dtype=dtype, device=device)


class _Student(NamedTuple):
    """A per-sample call's layout and the student's keywords, as given (``_checked``
    checks them): ``response_distillation``'s and ``response_topk_log_probs``' (and their
    hidden-state twins') arguments beside the head, the teacher and ``k``."""

    layout: Layout
    temperature: SampleTemperatureArg
    tp_group: dist.ProcessGroup | None
    chunk_size: ChunkArg
    softcap: RealArg | None
    vocab_size: IntArg | None
    invariant: bool


class _Teacher(NamedTuple):
    """A distillation call's teacher, as given (``_prepare`` checks it): its per-sample
    top-k log-probs and ids, and the divergence's ``kind``, ``beta`` and ``tail``."""

    log_probs: Sequence[TopK]
    ids: Sequence[TopK]
    kind: DivergenceArg
    beta: RealArg
    tail: TailArg


class _Step(NamedTuple):
    """A distillation step's checked arguments: this rank's layout resolved once (its
    response rows), the vocabulary engine's ``Options`` over every local row, and this
    rank's shares of the teacher's per-sample log-probs and ids, and their ``k``."""

    local: Local
    options: Options
    lps: list[Tensor]
    ids: list[Tensor]
    k: int


def _checked(head: Head, call: _Student) -> tuple[Local, Options]:
    """The call's one resolution of its layout (``T`` from ``head``, the response rows)
    and the engine's ``Options`` over every local row, the temperature one per row."""
    per_sample = checks.sample_temperatures(dtensor.replicated("temperature", call.temperature),
                                           call.layout.num_samples, call.layout.shared_prefix)
    spans: tuple[Span, ...] = ("response", "sample") if isinstance(per_sample, Tensor) else ("response",)
    local = resolved(head, call.layout, spans, call.tp_group)
    return local, options(
        head, None, temperature=temperatures_of(per_sample, local), tp_group=call.tp_group,
        chunk_size=call.chunk_size, softcap=call.softcap, vocab_size=call.vocab_size, invariant=call.invariant,
    )


def _prepare(head: Head, call: _Student, teacher: _Teacher) -> _Step:
    """Every check of a distillation step, in order, before any collective."""
    local, checked = _checked(head, call)
    assert checked.vocab_size is not None
    lps, ids = _teacher(teacher.log_probs, teacher.ids, call.layout.response_lengths, checked.vocab_size)
    _check_divergence(teacher.kind, teacher.beta, teacher.tail)
    return _Step(local, checked, shard(lps, local), shard(ids, local), lps[0].shape[1] if lps else 1)


def _distillation(head: Head, call: _Student, teacher: _Teacher) -> list[Share1D]:
    """``response_distillation`` over any head: every argument checked (the tensors
    before, by the caller), then the student's log-probs at the teacher's ids on the
    response rows (``on_responses``) and the divergence per token, split per sample."""
    step = _prepare(head, call, teacher)
    read = step.local.reads["response"]
    part, on_rows = on_responses(head, read, step.options)
    device = head.x.device
    # each element's k teacher ids, a shared row's branches side by side (``picked_ids``)
    picked = picked_ids(read, _rows(step.ids, step.k, torch.int64, device),
                        int(head.x.shape[0]) if head.in_place else None)
    student, _ = log_probs(part, picked, on_rows)
    div = topk_divergence(
        picked_values(read, student, step.k, local=head.in_place), _rows(step.lps, step.k, student.dtype, device),
        kind=teacher.kind, beta=teacher.beta, tail=teacher.tail,
    )
    return list(torch.split(div, read.selection.counts))


def response_distillation(
    logits: TensorArg, teacher_log_probs: Sequence[TopK], teacher_ids: Sequence[TopK], layout: Layout, *,
    kind: DivergenceArg = "forward", beta: RealArg = 0.5, tail: TailArg = "bin",
    temperature: SampleTemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None,
    softcap: RealArg | None = None, vocab_size: IntArg | None = None, invariant: bool = False,
) -> list[Share1D]:
    """This rank's share of each sample's per-token divergence from its teacher's top-k.

    ``logits`` is the rank's local ``[T, V_local]`` logits in its layout (its TP
    shard), or a DTensor sharded ``Shard(-1)`` on the TP mesh dimension (as
    ``log_probs_at`` takes it); ``teacher_log_probs[i]`` and ``teacher_ids[i]`` are sample ``i``'s whole
    ``[R_i, k]`` tensors, aligned with its response tokens and the same on every rank (as
    tokens are): the logit that predicts response token ``j`` is compared with the
    teacher's row ``j``. The student's log-probs at the teacher's ids
    (``log_probs_at``) are computed on the response rows only (no copy of the logits
    selects them), then ``topk_divergence`` per token. The loss is then, e.g.,
    ``sum_of_sample_means(div, masks, layout)``.

    ``temperature`` (one real, or one per sample: ``n`` reals or an ``[n]`` tensor),
    ``softcap``, ``vocab_size`` and ``invariant`` are the student's, as
    ``response_log_probs``'s; a teacher id ``>= vocab_size`` is refused (the teacher's
    vocabulary is the student's).

    Returns:
        One ``[r_i]`` float32 share per sample (float64 for float64 logits), aligned
        sample by sample, never None; an empty share a zero-length view in the graph.
        Differentiable w.r.t. ``logits`` (and the teacher's log-probs where they
        require grad).

    Collectives: those of ``log_probs_at`` (one all-gather over ``tp_group``, entered by
    every rank, one that holds no response included); no CP communication.

    Raises:
        TypeError, LayoutError: as ``log_probs_at`` and ``topk_divergence``; the teacher's
            tensors not one ``[R_i, k]`` per sample with one ``k`` (named by sample), a
            CPU teacher id outside the vocabulary; logits of another length than the
            layout's (``extract_responses``). Raised before any collective.
    """
    x, tp = args.logits(logits, tp_group)
    call = _Student(layout, temperature, tp, chunk_size, softcap, vocab_size, invariant)
    return _distillation(LogitsHead(x), call, _Teacher(teacher_log_probs, teacher_ids, kind, beta, tail))


def response_distillation_from_hidden(
    hidden: TensorArg, weight: TensorArg, teacher_log_probs: Sequence[TopK], teacher_ids: Sequence[TopK],
    layout: Layout, *, kind: DivergenceArg = "forward", beta: RealArg = 0.5, tail: TailArg = "bin",
    temperature: SampleTemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None,
    softcap: RealArg | None = None, vocab_size: IntArg | None = None, invariant: bool = False,
    sequence_parallel: bool = False,
) -> list[Share1D]:
    """``response_distillation`` from the hidden states and the LM-head weight: the
    response rows of ``hidden`` (an ``[R, H]`` copy) through ``log_probs_at_from_hidden``, the
    logits never built; ``weight`` may be a DTensor sharded ``Shard(0)`` on the TP mesh
    dimension, as there, and ``hidden`` with ``sequence_parallel`` this TP rank's ``[T / tp,
    H]`` shard of the rows (Megatron's ``--sequence-parallel``), as there.

    Returns, collectives and raises as ``response_distillation`` (with
    ``log_probs_at_from_hidden``'s: one all-gather forward, one all-reduce of the hidden
    gradient backward under TP; with ``sequence_parallel`` one all-gather of ``[T / tp,
    H]`` more forward, one reduce-scatter of ``[T, H]`` backward instead of the
    all-reduce); differentiable w.r.t. ``hidden`` and ``weight``.
    """
    h, w, tp = args.head(hidden, weight, tp_group)
    x = hidden_head(h, w, args.sequence(sequence_parallel, tp))
    call = _Student(layout, temperature, tp, chunk_size, softcap, vocab_size, invariant)
    return _distillation(x, call, _Teacher(teacher_log_probs, teacher_ids, kind, beta, tail))


def _vocab_distillation(head: Head, pair: PairHead, call: _Student, kind: object, beta: object) -> list[Share1D]:
    """``response_vocab_distillation`` over any pair head: every argument checked (the
    tensors before, by the caller), ``head`` the student's side as a ``Head`` (its rows, as
    the layout resolves them, and the options' checks), then the pair's divergence on the
    response rows alone (``Options.rows``: each block's kernels read those rows where they
    are, any pair head's, no copy of either side) and each element's row split per sample
    (a shared prefix's prompt row once, its value to each branch it predicts)."""
    local, checked = _checked(head, call)
    computed = checks.kind_at(checks.divergence_kind(kind), b := checks.mixture_beta(beta))
    read = local.reads["response"]
    div = divergence(pair, Call(Plan.of(computed, b), checked._replace(rows=read.mask)))
    return gather_split(div, read.rows, read.selection.counts)


def response_vocab_distillation(
    logits: TensorArg, teacher_logits: TensorArg, layout: Layout, *, kind: DivergenceArg = "forward",
    beta: RealArg = 0.5, temperature: SampleTemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None, softcap: RealArg | None = None, vocab_size: IntArg | None = None,
    invariant: bool = False,
) -> list[Share1D]:
    """This rank's share of each sample's per-token divergence from its teacher over the
    full vocabulary (``vocab_divergence``): GKD and on-policy distillation with the
    teacher's logits at hand, per sample.

    ``logits`` is the rank's local ``[T, V_local]`` logits in its layout (its TP shard),
    or a DTensor sharded ``Shard(-1)`` on the TP mesh dimension; ``teacher_logits`` the
    teacher's local logits in the *same* layout and TP shard (the teacher run on the same
    packed micro-batch: the same shape; a DTensor as the student's). The logit that
    predicts response token ``j`` of a sample is compared with the teacher's logit of the
    same row; the divergence is computed on the response rows only (no copy of either
    side selects them: the kernels read those rows where they are), with ``p`` the
    student's ``softmax(logits / temperature)`` and ``q`` the teacher's: ``"forward"`` is
    ``KL(q || p)``, ``"reverse"`` ``KL(p || q)``, ``"jsd"`` ``beta KL(q || m) + (1 - beta)
    KL(p || m)``, ``m = beta q + (1 - beta) p`` (``beta`` 0 is ``"forward"``, 1
    ``"reverse"``). The loss is then, e.g., ``sum_of_sample_means(div, masks, layout)``.

    ``temperature`` (one real, or one per sample: ``n`` reals or an ``[n]`` tensor, both
    models' at that sample's rows), ``softcap``, ``vocab_size`` and ``invariant`` apply to
    both models, as ``vocab_divergence``'s (``invariant``: each response token's
    divergence the same bits whatever the layout, CP rank, batch, chunking or TP size).
    With a shared prefix, a prompt row that predicts the first response token of several
    branches is computed once, its divergence each branch's (its gradient the sum).

    Returns:
        One ``[r_i]`` float32 share per sample (float64 where either input is float64),
        aligned sample by sample, never None; an empty share a zero-length view in the
        graph. Differentiable w.r.t. ``logits``, and ``teacher_logits`` where it requires
        grad; a row outside the responses gets a zero gradient.

    Collectives: those of ``vocab_divergence`` (over ``tp_group``: one all-gather for
    ``"forward"`` and ``"reverse"``, two for ``"jsd"``, entered by every rank, one that
    holds no response included; none backward); no CP communication.

    Raises:
        TypeError, LayoutError: as ``vocab_divergence`` (naming ``logits`` and
            ``teacher_logits``; both 2-D, one shape, one device); logits of another length
            than the layout's (``extract_responses``); a temperature per sample not one per
            sample, or differing within a shared-prefix group. Raised before any
            collective.
    """
    s = _two_d("logits", logits, "[T, V_local]", "logits.reshape(-1, logits.shape[-1])")
    t = _two_d("teacher_logits", teacher_logits, "[T, V_local]", "teacher_logits.reshape(-1, teacher_logits.shape[-1])")
    student, teacher, tp, _ = args.logits_pair(s, t, tp_group, names=("logits", "teacher_logits"))
    call = _Student(layout, temperature, tp, chunk_size, softcap, vocab_size, invariant)
    return _vocab_distillation(LogitsHead(student), LogitsPair(student, teacher), call, kind, beta)


def _response_topk(head: Head, k: object, call: _Student) -> tuple[list[TopK], list[TopK]]:
    """``response_topk_log_probs`` over any head: ``k`` checked, then every other argument
    (the tensors before, by the caller), ``k`` against the vocabulary (``check_topk``: before
    any collective, a sequence-parallel gather's in ``on_responses`` included), then the
    top-k of the response rows (``on_responses``), each element's share per sample."""
    k_ = args.k_best(k)
    local, checked = _checked(head, call)
    check_topk(head, k_, checked)
    read = local.reads["response"]
    part, on_rows = on_responses(head, read, checked)
    values, ids = topk(part, k_, on_rows)
    # the computed rows' results, back to the elements (a shared row's to each of its branches)
    at, counts = (read.rows if head.in_place else read.picks.element), read.selection.counts
    return gather_split(values, at, counts), gather_split(ids, at, counts)


def response_topk_log_probs(
    logits: TensorArg, k: IntArg, layout: Layout, *, temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None, softcap: RealArg | None = None,
    vocab_size: IntArg | None = None, invariant: bool = False,
) -> tuple[list[TopK], list[TopK]]:
    """The teacher's side of ``response_distillation``, per sample: each response
    token's ``k`` most likely ids over the whole (tensor-parallel) vocabulary and their
    log-probs, this rank's share of every sample.

    ``logits`` is the rank's local ``[T, V_local]`` logits in its layout (its TP shard),
    or a DTensor sharded ``Shard(-1)`` on the TP mesh dimension (as ``topk_log_probs``
    takes it); only the response rows are computed (``topk_log_probs`` of those rows, no copy of
    the logits selects them). ``temperature`` (one real, or one per sample), ``softcap``,
    ``vocab_size`` and ``invariant`` as ``response_log_probs``'s: no padded id is ever
    chosen (in invariant mode ties go to the smaller id).

    Returns:
        ``(log_probs, ids)``: per sample, ``[r_i, k]`` float32 log-probs (float64 for
        float64 logits), descending, and ``[r_i, k]`` int64 global ids, aligned with
        ``extract_responses``' shares and the same on every rank of ``tp_group``; an
        empty share is a zero-length view, in the graph. Differentiable w.r.t.
        ``logits`` as ``topk_log_probs``. A teacher's whole ``[R_i, k]`` tensors for
        ``response_distillation`` are these shares gathered (``gather_responses``) or,
        without CP, these.

    Collectives: those of ``topk_log_probs`` (one all-gather over ``tp_group``, entered
    by every rank, one that holds no response included); no CP communication.

    Raises:
        TypeError, LayoutError: as ``topk_log_probs``; logits of another length than
            the layout's (``extract_responses``). Raised before any collective.
    """
    x, tp = args.logits(logits, tp_group)
    call = _Student(layout, temperature, tp, chunk_size, softcap, vocab_size, invariant)
    return _response_topk(LogitsHead(x), k, call)


def response_topk_log_probs_from_hidden(
    hidden: TensorArg, weight: TensorArg, k: IntArg, layout: Layout, *, temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None, chunk_size: ChunkArg = None, softcap: RealArg | None = None, vocab_size:
    IntArg | None = None, invariant: bool = False, sequence_parallel: bool = False,
) -> tuple[list[TopK], list[TopK]]:
    """``response_topk_log_probs`` from the hidden states and the LM-head weight: the
    response rows of ``hidden`` (an ``[R, H]`` copy) through ``topk_log_probs_from_hidden``,
    the logits never built; ``weight`` may be a DTensor sharded ``Shard(0)`` on the TP
    mesh dimension, and ``hidden`` with ``sequence_parallel`` this TP rank's ``[T / tp,
    H]`` shard of the rows, as there.

    Returns, collectives and raises as ``response_topk_log_probs`` (with
    ``topk_log_probs_from_hidden``'s: with ``sequence_parallel`` one all-gather of ``[T /
    tp, H]`` more forward, one reduce-scatter of ``[T, H]`` backward instead of the
    all-reduce); differentiable w.r.t. ``hidden`` and ``weight``.
    """
    h, w, tp = args.head(hidden, weight, tp_group)
    x = hidden_head(h, w, args.sequence(sequence_parallel, tp))
    call = _Student(layout, temperature, tp, chunk_size, softcap, vocab_size, invariant)
    return _response_topk(x, k, call)
