"""The batches ``cpslice verify`` checks, and their float64 reference.

Every process builds the same batches from the seed: ``edge_lengths`` (random samples,
the edge cases first) and, under context parallelism, ``sparse_lengths`` (a few short
samples that leave some CP ranks without any response); a padded case gives each
sample its own width (``padded_widths``), a left-padded case each bshd row its offset
(``left_padding``), an order case its token order and the widths it needs
(``order_of``), a shared-prefix case its groups (``shared_lengths``: the samples of a
group share their prompt's tokens and logits). A ``Batch`` holds each
sample's whole logits and loss weights and the float64 ``torch.log_softmax``
reference of its log-probs, entropy and logits' gradient; ``reference`` computes it,
and the same under per-token top-p / top-k sets (``response_sets``); a teacher's top-k
(``teacher_top_k``) and the divergence from it (``distill_reference``).
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._cli.balancers import block_order, per_document_head_tail_order, random_order
from .._types import LayoutMode
from .cases import Case, Config

VOCAB_PER_RANK = 8
"""Vocabulary columns of each TP rank's shard; the vocabulary is ``8 * tp_size``."""
TEMPERATURE = 0.8
LOGIT_SCALE = 3.0


@dataclass(frozen=True)
class Batch:
    """Samples with their whole logits and the float64 reference of the loss.

    ``logits[i]`` is ``[L_i, V]`` float32 over the whole vocabulary; ``w_lp``, ``w_ent``
    are ``[R_i]`` float32 loss weights; ``ref_lp``, ``ref_ent`` are ``[R_i]`` and
    ``ref_grad`` is ``[L_i, V]``, d(sum w_lp * lp + w_ent * ent) / d logits, in float64
    (``reference`` without sets). ``padded``: each sample's width ``W_i`` for a padded
    case (``padded_widths``), else None; ``offsets``: each bshd row's first token for a
    left-padded case (``left_padding``), else None; ``order``: an order case's token
    order (thd one row over the stream, bshd a row per sample), else None; ``groups``: a
    shared-prefix case's group sizes (each group's samples have equal prompt tokens and
    prompt logits, as a model computes them once), else None.
    """

    total: tuple[int, ...]
    response: tuple[int, ...]
    tokens: list[Tensor]
    logits: list[Tensor]
    w_lp: list[Tensor]
    w_ent: list[Tensor]
    ref_lp: list[Tensor]
    ref_ent: list[Tensor]
    ref_grad: list[Tensor]
    padded: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None
    order: tuple[tuple[int, ...], ...] | None = None
    groups: tuple[int, ...] | None = None


def edge_lengths(n: int, cp_size: int, seed: int) -> tuple[list[int], list[int]]:
    """``n`` random (total, response) lengths; the first five cover, in order, a
    single-token sample, a sample shorter than ``2 * cp_size``, an empty response, a
    long whole response (crossing every chunk), and a long random one; then shuffled."""
    rng = random.Random(seed)
    long_max = 6 * cp_size + 3
    total, response = [], []
    for i in range(n):
        kind = i if i < 5 else rng.randrange(5)
        if kind == 0:
            t, r = 1, 0
        elif kind == 1:
            t = rng.randint(2, max(2, 2 * cp_size - 1))
            r = rng.randint(0, t - 1)
        elif kind == 2:
            t, r = rng.randint(2, long_max), 0
        elif kind == 3:
            t = rng.randint(max(2, 4 * cp_size), long_max)
            r = t - 1
        else:
            t = rng.randint(2, long_max)
            r = rng.randint(1, t - 1)
        total.append(t)
        response.append(r)
    order = list(range(n))
    rng.shuffle(order)
    return [total[i] for i in order], [response[i] for i in order]


def sparse_lengths(mode: LayoutMode, cp_size: int) -> tuple[list[int], list[int]]:
    """Samples that leave context-parallel ranks without any response.

    zigzag: samples of at most 2 tokens sit in chunks of one position, so every
    response is position 0, on rank 0. allgather: one sample of ``4 * cp_size``
    tokens with a one-token response at its end, on one late piece. order: one
    response token in all, on one rank whatever the order.
    """
    if mode == "allgather":
        return [4 * cp_size], [1]
    if mode == "order":
        return [2, 1, 3], [1, 0, 0]
    return [2, 1, 2], [1, 0, 1]


def shared_lengths(n: int, cp_size: int, seed: int) -> tuple[list[int], list[int], tuple[int, ...]]:
    """``n`` (total, response) lengths in shared-prefix groups, and the group sizes. The
    first groups cover, in order, a star shorter than ``2 * cp_size`` (a prompt of 1, two
    single-token responses: the prompt's row predicts both), a group whose first response
    is empty (the next starts where it would have) before a single-token one, a group of
    4 whose first response crosses every chunk, and a sample alone; then random groups of
    1 to 4; the last group cut to fit ``n``."""
    rng = random.Random(seed)
    long_max = 6 * cp_size + 3
    total: list[int] = []
    response: list[int] = []
    groups: list[int] = []
    while len(total) < n:
        kind = len(groups)
        if kind == 0:
            prompt, rs = 1, [1, 1]
        elif kind == 1:
            prompt, rs = rng.randint(2, 2 * cp_size + 1), [0, 1, rng.randint(2, long_max)]
        elif kind == 2:
            prompt = rng.randint(1, long_max)
            rs = [rng.randint(4 * cp_size, long_max), rng.randint(0, long_max), rng.randint(1, 3), 0]
        else:
            prompt = rng.randint(1, long_max)
            rs = [rng.randint(0, long_max) for _ in range(1 if kind == 3 else rng.randint(1, 4))]
        rs = rs[: n - len(total)]
        total += [prompt + r for r in rs]
        response += rs
        groups.append(len(rs))
    return total, response, tuple(groups)


SPARSE_SHARED = ([2, 2, 1], [1, 1, 0], (2, 1))
"""A star of 3 (a prompt of 1, two single-token responses) and a lone token: every
response is predicted by star position 0, on CP rank 0 (chunks of one position)."""


def _share_prompts(groups: Sequence[int], total: Sequence[int], response: Sequence[int],
                   per_sample: list[Tensor]) -> None:
    """Each group's prompt rows of ``per_sample`` made its first sample's, in place."""
    first = 0
    for g in groups:
        prompt = total[first] - response[first]
        for i in range(first + 1, first + g):
            per_sample[i][:prompt] = per_sample[first][:prompt]
        first += g


def make_batch(total: Sequence[int], response: Sequence[int], vocab: int, seed: int,
               groups: Sequence[int] | None = None) -> Batch:
    """Random tokens, logits and loss weights for these lengths (the samples of each of
    ``groups`` sharing their prompt's tokens and logits), and their reference."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (t,), generator=gen) for t in total]
    logits = [LOGIT_SCALE * torch.randn(t, vocab, generator=gen) for t in total]
    w_lp = [torch.randn(r, generator=gen) for r in response]
    w_ent = [torch.randn(r, generator=gen) for r in response]
    if groups is not None:
        _share_prompts(groups, total, response, tokens)
        _share_prompts(groups, total, response, logits)
    batch = Batch(tuple(total), tuple(response), tokens, logits, w_lp, w_ent, [], [], [],
                  groups=None if groups is None else tuple(groups))
    unrestricted: list[list[list[int]]] = [[[] for _ in range(r)] for r in response]
    ref_lp, ref_ent, ref_grad = reference(batch, unrestricted)
    return replace(batch, ref_lp=ref_lp, ref_ent=ref_ent, ref_grad=ref_grad)


def padded_widths(total: Sequence[int], mode: LayoutMode, cp_size: int, seed: int) -> tuple[int, ...]:
    """Random widths ``W_i >= L_i``: the least a sample needs (zigzag: a multiple of
    ``2 * cp_size``; else ``L_i`` plus 0 to 2), then 0 to 3 chunks of ``2 * cp_size``
    more, the last sample stretched by 1 to 8 chunks (so that some ranks hold samples
    that are padding only)."""
    rng = random.Random(seed)
    chunk = 2 * cp_size
    widths = [
        (-(-t // chunk) * chunk if mode == "zigzag" else t + rng.randint(0, 2))
        + chunk * rng.randint(0, 3)
        for t in total
    ]
    if widths:
        widths[-1] += chunk * rng.randint(1, 8)
    return tuple(widths)


def left_padding(total: Sequence[int], response: Sequence[int], multiple: int = 1) -> tuple[int, ...]:
    """Each row's offset when every prompt is left-padded to the longest one (a Hugging
    Face batch: the prompts end at one column, the responses start there), shifted right
    so that the rows' last token ends at a multiple of ``multiple`` (the row length a
    zigzag split needs): the longest response then ends at its row's last column."""
    prompt = [t - r for t, r in zip(total, response)]
    end = max(prompt) + max(response, default=0)
    shift = -end % multiple
    return tuple(max(prompt) - p + shift for p in prompt)


BLOCK = 3
"""Positions per block of the block order: odd, so that blocks cross the samples' and
the ranks' boundaries at every offset."""


def _stretched(widths: list[int], multiple: int) -> tuple[int, ...]:
    """``widths``, the last one stretched so that their sum is a multiple of ``multiple``."""
    widths[-1] += -sum(widths) % multiple
    return tuple(widths)


def order_of(case: Case, total: Sequence[int], cp_size: int, seed: int) -> tuple[tuple[int, ...] | None, Tensor]:
    """An order case's thd widths (None for bshd) and its token order: thd ``[1, N]``
    over the stream of padded samples, bshd ``[B, S]``, ``S`` the least multiple of
    ``cp_size`` above the longest sample.

    - random: each sample's random padded width (``padded_widths``), the last one
      stretched to a multiple of ``cp_size``; a random permutation (bshd: of every row);
    - block: the samples unpadded but the last, stretched to a multiple of
      ``BLOCK * cp_size``; the stream in blocks of ``BLOCK``, shuffled;
    - per-document head-tail: each sample padded to a multiple of ``2 * cp_size``;
      torch's ``_PerDocumentHeadTailLoadBalancer`` index (``TorchBalancerMissing``
      where that private module moved).
    """
    if case.fmt == "bshd":
        seq = -(-(max(total) + 1) // cp_size) * cp_size
        return None, random_order(seq, seed, len(total))
    if case.order == "random":
        widths = _stretched(list(padded_widths(total, "allgather", cp_size, seed)), cp_size)
        return widths, random_order(sum(widths), seed)
    if case.order == "block":
        widths = _stretched(list(total), BLOCK * cp_size)
        return widths, block_order(sum(widths), BLOCK, seed)
    chunk = 2 * cp_size
    widths = tuple(-(-t // chunk) * chunk for t in total)
    return widths, per_document_head_tail_order(widths, cp_size)


Lengths = tuple[list[int], list[int], tuple[int, ...] | None]
"""A batch's total and response lengths, and its shared-prefix groups (None: none)."""


def _lengths(case: Case, config: Config) -> list[Lengths]:
    """The batches' lengths: the random one, and under CP the sparse one (not for none,
    where every rank holds every response); for a shared case, in groups."""
    if case.shared:
        lengths: list[Lengths] = [shared_lengths(config.samples, config.cp_size, config.seed)]
        sparse: Lengths = SPARSE_SHARED
    else:
        lengths = [(*edge_lengths(config.samples, config.cp_size, config.seed), None)]
        sparse = (*sparse_lengths(case.mode, config.cp_size), None)
    if config.cp_size > 1 and case.mode != "none":
        lengths.append(sparse)
    return lengths


def batches_for(case: Case, config: Config) -> list[Batch]:
    """The random batch (the same for every layout) and the case's sparse batch, each
    with the case's padded widths or row offsets."""
    vocab = VOCAB_PER_RANK * config.tp_size
    out = []
    for k, (t, r, groups) in enumerate(_lengths(case, config)):
        batch = make_batch(t, r, vocab, config.seed + k, groups)
        if case.padded:
            batch = replace(batch, padded=padded_widths(t, case.mode, config.cp_size,
                                                        config.seed + 202 + k))
        if case.left_padded:
            multiple = 2 * config.cp_size if case.mode == "zigzag" else 1
            batch = replace(batch, offsets=left_padding(t, r, multiple))
        if case.order is not None:
            widths, order = order_of(case, t, config.cp_size, config.seed + 404 + k)
            rows: list[list[int]] = order.tolist()
            batch = replace(batch, padded=widths, order=tuple(tuple(row) for row in rows))
        out.append(batch)
    return out


def batch_samples(case: Case, config: Config) -> int:
    """How many samples ``batches_for`` checks for this case."""
    return sum(len(t) for t, _, _ in _lengths(case, config))


MAX_SET = 4
"""Each response token keeps 0 to ``MAX_SET`` random ids (0: unrestricted)."""


def response_sets(batch: Batch, vocab: int, seed: int) -> list[list[list[int]]]:
    """Per sample, per response token, the kept ids: some empty, some a single id,
    some holding the target, some not. A shared-prefix group's first response tokens, all
    predicted by its prompt's last row, keep one set (that row's rollout kept one)."""
    rng = random.Random(seed)
    sets = [
        [rng.sample(range(vocab), rng.randint(0, min(MAX_SET, vocab))) for _ in range(r)]
        for r in batch.response
    ]
    first = 0
    for g in batch.groups or ():
        branches = [i for i in range(first, first + g) if batch.response[i]]
        for i in branches[1:]:
            sets[i][0] = list(sets[branches[0]][0])
        first += g
    return sets


def reference(
    batch: Batch, sets: list[list[list[int]]]
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per sample, float64: log-probs and entropy ``[R_i]`` and the gradient ``[L_i, V]``
    of ``sum w_lp * lp + w_ent * ent``, each response token's distribution restricted
    to its set in ``sets`` plus its target (an empty set: the whole vocabulary)."""
    ref_lp, ref_ent, ref_grad = [], [], []
    for i, (t, r) in enumerate(zip(batch.total, batch.response)):
        x = batch.logits[i].double().requires_grad_()
        z = (x / TEMPERATURE)[t - r - 1 : t - 1]
        targets = batch.tokens[i][t - r :]
        keep = torch.ones(z.shape, dtype=torch.bool)
        for k, kept in enumerate(sets[i]):
            if kept:
                keep[k] = False
                keep[k, kept + [int(targets[k])]] = True
        logq = torch.log_softmax(z.masked_fill(~keep, -torch.inf), -1)
        lp = logq.gather(1, targets[:, None])[:, 0]
        ent = -torch.where(keep, logq.exp() * torch.where(keep, logq, 0.0), 0.0).sum(-1)
        loss = (batch.w_lp[i].double() * lp).sum() + (batch.w_ent[i].double() * ent).sum()
        (grad,) = torch.autograd.grad(loss, x)
        ref_lp.append(lp.detach())
        ref_ent.append(ent.detach())
        ref_grad.append(grad)
    return ref_lp, ref_ent, ref_grad


TEACHER_K = 4
"""Ids per response token of the teacher's top-k (``teacher_top_k``)."""


def teacher_top_k(batch: Batch, vocab: int, seed: int) -> tuple[list[Tensor], list[Tensor]]:
    """Per sample, a teacher's ``[R_i, TEACHER_K]`` float32 log-probs and int64 ids: the
    top-k of a random teacher's ``log_softmax`` over the whole vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    lps, ids = [], []
    for r in batch.response:
        top = torch.log_softmax(LOGIT_SCALE * torch.randn(r, vocab, generator=gen, dtype=torch.float64), -1)
        values, at = torch.topk(top, TEACHER_K, dim=1)
        lps.append(values.float())
        ids.append(at)
    return lps, ids


def distill_reference(
    batch: Batch, teacher_lp: Sequence[Tensor], teacher_ids: Sequence[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """Per sample, float64: each response token's Jensen-Shannon divergence (beta 0.5:
    bounded, so float32's rounding stays far below the tolerance) from the teacher over
    the ``k`` ids and one bin of the rest of the mass (``1 - sum p``, floored at
    float32's epsilon as the library floors a float32 bin), and the gradient ``[L_i,
    V]`` of ``sum w_lp * divergence``, written out over probabilities."""
    floor = torch.finfo(torch.float32).eps
    ref_div, ref_grad = [], []
    for i, (t, r) in enumerate(zip(batch.total, batch.response)):
        x = batch.logits[i].double().requires_grad_()
        student = torch.log_softmax(x / TEMPERATURE, -1)[t - r - 1 : t - 1].gather(1, teacher_ids[i])
        q, p = student.exp(), teacher_lp[i].double().exp()
        q = torch.cat([q, (1 - q.sum(1, keepdim=True)).clamp(min=floor)], 1)
        p = torch.cat([p, (1 - p.sum(1, keepdim=True)).clamp(min=floor)], 1)
        m = (p + q) / 2
        div = ((p * (p.log() - m.log())).sum(1) + (q * (q.log() - m.log())).sum(1)) / 2
        (grad,) = torch.autograd.grad((batch.w_lp[i].double() * div).sum(), x)
        ref_div.append(div.detach())
        ref_grad.append(grad)
    return ref_div, ref_grad
